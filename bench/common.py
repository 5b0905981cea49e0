"""What every benchmark shares: result rows (a figure of ours against a baseline measured in the same
run), run metadata, the table, the JSON file, and the shape measurements that run our engine and
mlx-lm side by side on the same model object, interleaved, with the same token ids.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# -- rows ------------------------------------------------------------------------------------------

@dataclass
class Row:
    """One measured figure. `ratio` is ours / baseline (both measured in this run)."""

    suite: str
    shape: str
    metric: str
    unit: str
    ours: float | None
    baseline: float | None
    baseline_name: str
    goal: str = ""  # e.g. ">= 1.0", "<= 0.1"
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.ours is None or not self.baseline:
            return None
        return self.ours / self.baseline

    @property
    def met(self) -> bool | None:
        r = self.ratio
        if r is None or not self.goal:
            return None
        op, _, value = self.goal.partition(" ")
        v = float(value)
        return {">=": r >= v, "<=": r <= v, "<": r < v, ">": r > v}[op]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = self.ratio
        d["goal_met"] = self.met
        return d


def skipped(suite: str, shape: str, why: str) -> Row:
    return Row(suite, shape, "skipped", "", None, None, "", notes=why)


def failed(suite: str, shape: str, why: str) -> Row:
    """A suite that raised or exited non-zero: shown as FAILED in the table and the summary."""
    return Row(suite, shape, "FAILED", "", None, None, "", notes=why)


# -- metadata, table, JSON -------------------------------------------------------------------------

def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent.parent, timeout=5)
        return out.stdout.strip() or None
    except Exception:
        return None


def process_memory() -> dict[str, float]:
    """This process's resident set now (`rss_mb`) and its peak (`peak_rss_mb`: VmHWM, which only
    grows), in MB, from /proc/self/status (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out["rss_mb" if line.startswith("VmRSS") else "peak_rss_mb"] = int(line.split()[1]) / 1024
    return out


def cpu_model() -> str:
    """The CPU the figures came from, as /proc/cpuinfo names it (vendor model, family/model, the
    wide units): hosts of one VM type differ between runs (an AMD EPYC Zen 4 without AMX, an Intel
    Xeon with it), and so do the ratios against llama.cpp. `platform.processor()` elsewhere."""
    try:
        fields: dict[str, str] = {}
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
        units = [u for u in ("avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if u in fields.get("flags", "").split()]
        return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model "
                f"{fields.get('model', '?')}; {' '.join(units) or 'no AVX-512'})")
    except OSError:
        return platform.processor() or platform.machine()


def run_meta(argv: Sequence[str]) -> dict[str, Any]:
    import mlx.core as mx
    import mlx_lm

    from engine import device

    versions = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "python": platform.python_version()}
    try:
        from importlib.metadata import version

        for dist in ("mlx-cuda-13", "mlx-cuda-12", "mlx-metal", "mlx-cpu"):
            try:
                versions[dist] = version(dist)
            except Exception:
                pass
    except Exception:
        pass
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "argv": list(argv), "device": device.report(), "versions": versions,
            "platform": platform.platform(), "cpu": cpu_model(), "git_commit": _git_commit()}


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}g}"


COLUMNS = ("suite", "shape", "metric", "ours", "baseline", "ratio", "goal", "met")


def table_rows(rows: Iterable[Row]) -> list[list[str]]:
    out = []
    for r in rows:
        met = {True: "yes", False: "NO", None: ""}[r.met]
        if r.metric in ("skipped", "FAILED"):
            out.append([r.suite, r.shape, r.metric, "-", "-", "-", "", r.notes])
            continue
        out.append([r.suite, r.shape, f"{r.metric} ({r.unit})", fmt(r.ours),
                    f"{fmt(r.baseline)} {r.baseline_name}".strip(), fmt(r.ratio) + ("x" if r.ratio else ""),
                    r.goal, met])
    return out


def print_table(rows: Sequence[Row], title: str = "") -> None:
    body = table_rows(rows)
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title or None)
        for c in COLUMNS:
            t.add_column(c, overflow="fold")
        for b in body:
            t.add_row(*b)
        Console(width=200).print(t)
        return
    except ImportError:
        pass
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(COLUMNS)]
    if title:
        print(title)
    print("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)))
    for b in body:
        print("  ".join(x.ljust(w) for x, w in zip(b, widths)))


def markdown_table(rows: Sequence[Row]) -> str:
    lines = ["| suite | shape | metric | ours | baseline (same run) | ratio | goal | met |",
             "|---|---|---|---|---|---|---|---|"]
    for b in table_rows(rows):
        lines.append("| " + " | ".join(b) + " |")
    return "\n".join(lines)


def write_json(path: Path, meta: dict[str, Any], rows: Sequence[Row], **more: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "rows": [r.as_dict() for r in rows], **more}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)
    return path


def progress(total: int | None = None, desc: str = "", disable: bool = False):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=disable, file=sys.stderr, leave=False,
                dynamic_ncols=True)


# -- measuring helpers -----------------------------------------------------------------------------

def fresh_memory() -> None:
    import mlx.core as mx

    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()


def arrivals(times: Sequence[float], t0: float) -> dict[str, Any]:
    """What a run's token arrival times say (`t0`: when it was asked for): the first token's time,
    the decode rate, and the median and 90th-percentile gap between tokens in ms (a rate lowered by
    a few long gaps is stalls between steps, not slower steps)."""
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    pick = lambda q: gaps[min(int(q * len(gaps)), len(gaps) - 1)] * 1e3 if gaps else None
    return {"ttft_s": times[0] - t0 if times else None, "tps": rate(times), "n": len(times),
            "total_s": (times[-1] - t0) if times else None,
            "gap_ms_p50": pick(0.5), "gap_ms_p90": pick(0.9)}


def rate(times: Sequence[float]) -> float | None:
    """Tokens/s between the first and last token arrival times (the first token's prefill excluded)."""
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def same_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two greedy answers share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def median(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread(xs: Sequence[float | None], scale: float = 1.0) -> str:
    """'min-max' of the measured values (times `scale`), for a row's notes."""
    xs = [x * scale for x in xs if x is not None]
    return f"{fmt(min(xs))}-{fmt(max(xs))}" if xs else "-"


@contextmanager
def mlx_lm_paths(lm) -> Iterator[Any]:
    """The model of `lm` as plain mlx-lm runs it, while inside: on a GPU mlx-lm's own copy
    (bench.shapes.build keeps one; ours has engine/kernels/gpu_layout.py's stacked projections),
    and the chunked gated-delta prefill that our loader switches on for hybrid models
    (engine/kernels/gated_delta.py) switched off."""
    from engine.kernels.gated_delta import use_chunked_prefill

    model = lm.extras.get("mlx_lm_model", lm.model)
    switched = use_chunked_prefill(model, enabled=False)
    try:
        yield model
    finally:
        if switched:
            use_chunked_prefill(model)


def mlx_lm_stream(lm, prompt: Sequence[int], max_tokens: int,
                  prompt_cache: list[Any] | None = None) -> dict[str, Any]:
    """mlx-lm's own `stream_generate` (greedy): arrival time of each token, from the call."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    t0 = time.perf_counter()
    times, tokens = [], []
    kwargs = {"prompt_cache": prompt_cache} if prompt_cache is not None else {}
    with mlx_lm_paths(lm) as model:
        for response in stream_generate(model, lm.tokenizer, mx.array(list(prompt), dtype=mx.uint32),
                                        max_tokens=max_tokens, **kwargs):
            times.append(time.perf_counter())
            tokens.append(response.token)
    return {**arrivals(times, t0), "tokens": tokens}


def engine_direct(lm, prompt, max_tokens: int, prefix_cache=None) -> dict[str, Any]:
    """Our `engine.decoding.generate.generate` in this thread (no scheduler): token arrival times."""
    from engine.decoding.generate import generate
    from engine.decoding.sampling import SamplingParams

    t0 = time.perf_counter()
    times, done = [], None
    for ev in generate(lm, prompt, SamplingParams(max_tokens=max_tokens), prefix_cache=prefix_cache):
        if ev.kind == "token":
            times.append(time.perf_counter())
        else:
            done = ev
    return {**arrivals(times, t0),
            "cached_tokens": done.usage.cached_tokens if done and done.usage else None}


class EngineService:
    """Our `engine.scheduling.service.Engine` (scheduler thread) serving an already-built model."""

    def __init__(self, lm, max_running: int = 8, prefix_cache: bool = True):
        from engine.scheduling.service import Engine

        self.note = ""
        try:
            self.engine = Engine(load=lambda *a, **k: lm, max_running=max_running, max_queued=64,
                                 prefix_cache=prefix_cache).start()
        except Exception as exc:  # e.g. prefix_cache.py mid-change: measure without it, and say so
            if not prefix_cache:
                raise
            self.note = f"prefix cache off ({type(exc).__name__}: {exc})"
            self.engine = Engine(load=lambda *a, **k: lm, max_running=max_running, max_queued=64,
                                 prefix_cache=False).start()
        self.prefix_cache = prefix_cache and not self.note

    def stream(self, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        return self._read(self._submit(prompt, max_tokens), t0)

    def _submit(self, prompt: Sequence[int], max_tokens: int):
        from engine.decoding.sampling import SamplingParams

        return self.engine.submit(prompt_tokens=list(prompt), params=SamplingParams(max_tokens=max_tokens))

    def _read(self, handle, t0: float) -> dict[str, Any]:
        times, tokens = [], []
        for ev in handle.events(timeout=600):
            if ev.kind == "token":
                times.append(time.perf_counter())
                tokens.append(ev.token)
            elif ev.error:
                raise RuntimeError(ev.error)
        return {**arrivals(times, t0), "tokens": tokens}

    def concurrent(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> dict[str, Any]:
        """The prompts submitted together (as `batch_generate` gets them), each read by its own
        thread."""
        results: list[dict[str, Any] | None] = [None] * len(prompts)
        errors: list[BaseException] = []

        def one(i: int, handle) -> None:
            try:
                results[i] = self._read(handle, t0)
            except BaseException as exc:
                errors.append(exc)

        t0 = time.perf_counter()
        handles = [self._submit(p, max_tokens) for p in prompts]
        threads = [threading.Thread(target=one, args=(i, h)) for i, h in enumerate(handles)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        if errors:
            raise errors[0]
        tokens = sum(r["n"] for r in results if r)
        return {"wall_s": wall, "tokens": tokens, "aggregate_tps": tokens / wall,
                "per_stream_tps": [r["tps"] for r in results if r],
                "first_token_s": sorted(round(r["ttft_s"], 4) for r in results if r and r["ttft_s"])}

    def close(self) -> None:
        self.engine.stop()


def raw_step_ms(lm, prompt: Sequence[int], steps: int = 32) -> float:
    """Milliseconds per synchronous one-token model step (no sampling, no pipelining): the floor."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(lm.model)
    mx.eval(lm.model(mx.array([list(prompt)], dtype=mx.uint32), cache=cache))
    y = mx.array([[int(prompt[-1])]], dtype=mx.uint32)
    for _ in range(4):
        mx.eval(lm.model(y, cache=cache))
    t = time.perf_counter()
    for _ in range(steps):
        mx.eval(lm.model(y, cache=cache))
    return (time.perf_counter() - t) / steps * 1e3


def shape_tool(doc: str, shapes: str, out: Path, measure: Callable[[str, int, int], dict[str, Any]],
               report: Callable[[dict[str, Any], int], None], argv: Sequence[str] | None = None) -> None:
    """The command line of a one-module bench tool (`doc`: its docstring): --shapes (default
    `shapes`), --reps, --gen, --out (default `out`); `measure(shape, reps, gen)` per shape, each
    result printed by `report(result, gen)`, all of them written as one JSON."""
    import argparse

    import mlx.core as mx

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--shapes", default=shapes)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--out", type=Path, default=out)
    a = ap.parse_args(argv)
    results = []
    for shape in a.shapes.split(","):
        results.append(measure(shape, a.reps, a.gen))
        report(results[-1], a.gen)
        mx.clear_cache()
    write_json(a.out, run_meta(sys.argv), [], results=results)
    print(f"wrote {a.out}")


def interleave(fns: dict[str, Callable[[], dict[str, Any]]], reps: int,
               bar=None, warmup: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Run each function `reps` times, alternating, so drift hits every side alike. `warmup`:
    first run each once untimed, the same workload as its timed runs, so every kernel, batch size
    and cache shape they meet is compiled and allocated before the first timed run."""
    if warmup:
        for fn in fns.values():
            fn()
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in fns}
    for i in range(reps):
        order = list(fns) if i % 2 == 0 else list(reversed(fns))
        for k in order:
            out[k].append(fns[k]())
            if bar is not None:
                bar.update(1)
    return out


@contextmanager
def environ(settings: dict[str, str]) -> Iterator[None]:
    """`settings` in os.environ while the block runs (the kernels' switches, read when a kernel
    is built), each variable as it was (or unset) after."""
    import os

    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def served_app(engine, folder: Path) -> Iterator[Any]:
    """The real app on a started `engine`, served by uvicorn in a thread on a free port of
    127.0.0.1 as `mlxchat serve` runs it (its database in `folder`); yields the app with `url` set.
    The server, then the engine, stop on exit. (Benches must not import from tests/.)"""
    import socket
    import threading

    import uvicorn

    from app.server import create_app, uvicorn_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(engine, folder / "db.sqlite")
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the bench server did not start")
        time.sleep(0.05)
    app.url = f"http://127.0.0.1:{port}"
    try:
        yield app
    finally:
        server.should_exit = True
        thread.join(30)
        engine.stop()
