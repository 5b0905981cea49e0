"""One entry point for every benchmark:

    python -m bench all|decode|prefix|concurrency|memory|speculative|protocols [--device auto|cpu|gpu]
                        [--shapes qwen3-8b,...] [--out FILE] [--quick]

Suites on random-weight shapes (bench/shapes.py), each figure ours against mlx-lm measured in the
same process, on the same model object, with the same token ids, runs interleaved:
  decode       batch-1 decode tok/s: our Engine service (scheduler thread, streaming, prefix cache
               bookkeeping) vs mlx_lm.stream_generate.                        goal >= 1.0x
  prefix       edited-last-turn TTFT on a ~4,000-token conversation, with our prefix cache:
               vs our own cold TTFT (goal <= 0.1x) and vs mlx_lm.server's prompt-cache behaviour
               emulated (it reuses the longest common prefix when every layer's cache is
               trimmable, else only its end-of-system-prompt snapshot)          goal < 1.0x
  memory       peak MLX memory for a 4,000-token prompt + 256-token answer vs mlx-lm.
  concurrency  aggregate tok/s of 8 concurrent streams vs 1 stream on our Engine (goal >= 4x), and
               mlx-lm's batch_generate of 8 for reference.
Suites from the other bench modules, run when they are present (else skipped with a message):
  decode       bench/decode.py main() on CPU (mlx-lm vs our CPU recipe vs llama.cpp, bundled model)
  prefix, concurrency, speculative: bench/<suite>.py `run_suite(args) -> list[dict]` (rows as
               in bench/common.Row) if defined, else `python -m bench.<suite>` in a subprocess.
  protocols    bench/protocols.py: TTFT and decode tok/s through /v1/messages, /v1/responses and
               /api/chat vs /v1/chat/completions on one server (tiny model; `python -m
               bench.protocols --model bundled` for the bundled one)       goal <= 1.05x / >= 0.95x
Results: a table on stdout and JSON (default bench/results/<device>-<date>.json), written after
every shape so a run cut short keeps what it measured. Like `mlxchat`, it starts again with
Debian's OpenBLAS preloaded where one is installed (MLXCHAT_NO_BLAS=1: not).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from . import common
from .common import Row, failed, skipped

SUITES = ("decode", "prefix", "memory", "concurrency", "speculative", "hybrid", "protocols")
DELEGATED = ("decode", "prefix", "concurrency", "speculative", "protocols")  # bench/<suite>.py
# which suites run on which shapes (ones not listed here would cost device time for no new fact)
SHAPE_SUITES = {
    "decode": None,  # every shape
    "prefix": ("qwen3-8b", "qwen3_5-hybrid", "tiny", "smollm2-135m"),
    "memory": ("qwen3-8b", "tiny"),
    "concurrency": ("qwen3-8b", "tiny"),
    "hybrid": ("qwen3_5-hybrid", "tiny-hybrid"),
}
log = logging.getLogger("bench")


def _module(name: str):
    """bench.<name> if that file exists, else None (and why)."""
    path = Path(__file__).resolve().parent / f"{name}.py"
    if not path.exists():
        return None, f"bench/{name}.py is not there yet"
    try:
        return importlib.import_module(f"bench.{name}"), ""
    except Exception as exc:
        return None, f"bench/{name}.py failed to import: {type(exc).__name__}: {exc}"


# -- shape suites ------------------------------------------------------------------------------------

def suite_decode(lm, shape: str, a) -> list[Row]:
    from .shapes import prompt_ids, vocab_size

    from engine.decoding.chat import Prompt

    prompt = prompt_ids(64, vocab_size(shape), seed=1)
    direct_prompt = Prompt(list(prompt), [len(prompt)])
    n = a.gen
    svc = common.EngineService(lm, max_running=1, prefix_cache=True)
    try:
        with common.progress(3 * a.reps, f"decode {shape}") as bar:
            runs = common.interleave({"ours": lambda: svc.stream(prompt, n),
                                      "mlx": lambda: common.mlx_lm_stream(lm, prompt, n),
                                      "direct": lambda: common.engine_direct(lm, direct_prompt, n)},
                                     a.reps, bar, warmup=True)
    finally:
        svc.close()
    step = common.raw_step_ms(lm, prompt)
    ours = common.median([r["tps"] for r in runs["ours"]])
    base = common.median([r["tps"] for r in runs["mlx"]])
    direct = common.median([r["tps"] for r in runs["direct"]])
    same = common.same_prefix(runs["ours"][0]["tokens"], runs["mlx"][0]["tokens"])
    note = f"median of {a.reps}, {n} tokens after a 64-token prompt; greedy tokens equal to mlx-lm's " \
           f"for the first {same} of {n}; without the scheduler thread " \
           f"(engine.decoding.generate in the caller) {common.fmt(direct)} tok/s; synchronous model step " \
           f"{step:.2f} ms (= {1e3 / step:.0f} tok/s without pipelining)"
    if svc.note:
        note += "; " + svc.note
    return [Row("decode", shape, "decode batch 1", "tok/s", ours, base, "mlx_lm.stream_generate",
                ">= 1.0", note, {"ours_all": [r["tps"] for r in runs["ours"]],
                                 "mlx_all": [r["tps"] for r in runs["mlx"]],
                                 "direct_all": [r["tps"] for r in runs["direct"]], "raw_step_ms": step,
                                 "same_tokens_as_mlx_lm": same})]


def suite_prefix(lm, shape: str, a) -> list[Row]:
    import mlx.core as mx
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

    from engine.decoding.chat import Prompt
    from engine.decoding.generate import default_prefill_chunk
    from engine import device

    try:
        from engine.prefix_cache.store import PrefixCache
    except Exception as exc:
        return [skipped("prefix", shape, f"engine/prefix_cache/store.py not importable: {exc}")]
    from .shapes import conversation, vocab_size

    ctx = a.ctx if shape != "tiny" else 600
    vocab = vocab_size(shape)
    tokens, ends = conversation(ctx, vocab, seed=7)
    edit_start = ends[-2]  # the last user turn starts here
    sys_len = ends[0]
    budget = device.memory_budget(0.25)
    trimmable = can_trim_prompt_cache(make_prompt_cache(lm.model))
    reps = 1 if shape.startswith("qwen3_5") and not a.quick else a.reps

    def edited(i: int) -> list[int]:
        from .shapes import prompt_ids
        return tokens[:edit_start] + prompt_ids(len(tokens) - edit_start, vocab, seed=1000 + i)

    spent = {"fetch": [], "save": [], "cold_save": []}

    def cold_ours() -> dict[str, Any]:
        cold = PrefixCache(lm, budget_bytes=budget)
        cold.save = timed("cold_save", cold.save)  # the snapshot work inside a cold TTFT
        return common.engine_direct(lm, Prompt(list(tokens), list(ends)), 1, cold)

    pc = PrefixCache(lm, budget_bytes=budget)

    def timed(name, fn):
        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                mx.synchronize()
                spent[name].append(time.perf_counter() - t)
        return wrapper

    pc.fetch, pc.save = timed("fetch", pc.fetch), timed("save", pc.save)

    def cold_plain(chunk: int) -> float:
        from engine.decoding.generate import Generation
        from engine.decoding.sampling import SamplingParams

        t = time.perf_counter()
        g = Generation(lm, Prompt(list(tokens), list(ends)), SamplingParams(max_tokens=1),
                       prefix_cache=None, prefill_chunk=chunk)
        while not g.done:
            if any(e.kind == "token" for e in g.step()):
                return time.perf_counter() - t
        return time.perf_counter() - t

    if trimmable:  # warm-up: the cold workload itself, each side once (hybrid prefill is slow)
        cold_ours()
        common.mlx_lm_stream(lm, tokens, 1)
        spent["cold_save"].clear()
    else:
        common.engine_direct(lm, Prompt(tokens[:200], [64, 200]), 4, None)  # warm-up kernels
        common.mlx_lm_stream(lm, tokens[:200], 2)
    with common.progress(None, f"prefix {shape}") as bar:
        colds = []
        for _ in range(reps):
            colds.append(cold_ours())
            bar.update(1)
        first = common.engine_direct(lm, Prompt(list(tokens), list(ends)), 8, pc)  # fills the cache
        bar.update(1)
        warm, server, mlx_cold = [], [], []
        reuse = edit_start if trimmable else sys_len
        for i in range(reps):
            b = edited(i)
            spent["fetch"].clear(), spent["save"].clear()
            warm.append(common.engine_direct(lm, Prompt(b, ends[:-1] + [len(b)]), 1, pc))
            warm[-1]["fetch_ms"] = sum(spent["fetch"]) * 1e3
            warm[-1]["save_ms"] = [round(x * 1e3, 2) for x in spent["save"]]
            bar.update(1)
            # mlx_lm.server: fetch of the longest usable snapshot (untimed) then stream_generate
            with common.mlx_lm_paths(lm) as model:
                cache = make_prompt_cache(model)
                model(mx.array([b[:reuse]], dtype=mx.uint32), cache=cache)
                mx.eval([c.state for c in cache])
            server.append(common.mlx_lm_stream(lm, b[reuse:], 1, prompt_cache=cache))
            bar.update(1)
            mlx_cold.append(common.mlx_lm_stream(lm, b, 1))
            bar.update(1)
    diag = {}
    if trimmable:  # what the cold gap to mlx-lm is made of (cheap here; hybrid prefill is not)
        for chunk in (512, 2048, 4096):
            diag[f"cold_no_cache_chunk{chunk}_ms"] = 1e3 * common.median([cold_plain(chunk) for _ in range(reps)])
    diag["cold_save_ms"] = [round(x * 1e3, 2) for x in spent["cold_save"]]  # every cold rep's saves
    diag["warm_fetch_ms"] = [round(r.get("fetch_ms", 0), 2) for r in warm]
    diag["warm_save_ms"] = [r.get("save_ms") for r in warm]
    c = common.median([r["ttft_s"] for r in colds])
    w = common.median([r["ttft_s"] for r in warm])
    s = common.median([r["ttft_s"] for r in server])
    m = common.median([r["ttft_s"] for r in mlx_cold])
    cached = warm[-1].get("cached_tokens")
    conv = f"{len(tokens)}-token conversation, last user turn of {len(tokens) - edit_start} tokens edited"
    rows = [
        Row("prefix", shape, "TTFT edited last turn vs cold", "ms", w * 1e3, c * 1e3, "ours cold", "<= 0.1",
            f"{conv}; prefix cache reused {cached} tokens; median of {reps}; vs mlx-lm's cold "
            f"{m * 1e3:.0f} ms: {w / m:.2f}x",
            dict(diag, first_run_ttft_s=first["ttft_s"], mlx_cold_ms=m * 1e3,
                 vs_mlx_cold=w / m if m else None)),
        Row("prefix", shape, "TTFT edited last turn vs mlx_lm.server", "ms", w * 1e3, s * 1e3,
            "mlx_lm.server (emulated)", "< 1.0",
            f"server reuses {reuse} tokens ("
            + ("trimmable KV: longest common prefix" if trimmable else
               "non-trimmable linear-attention state: only its end-of-system-prompt snapshot") + ")"),
        Row("prefix", shape, "TTFT cold", "ms", c * 1e3, m * 1e3, "mlx_lm.stream_generate", "",
            f"{len(tokens)} tokens, nothing cached; ours prefills in {default_prefill_chunk(lm)}-token "
            "chunks stopping only where a snapshot is taken, mlx-lm in 2048-token chunks; our snapshot "
            f"saves inside it {common.fmt(common.median(diag['cold_save_ms']))} ms; ours without a "
            "prefix cache by prefill chunk: " + ", ".join(
                f"{k.split('chunk')[1][:-3]}: {v:.0f} ms" for k, v in diag.items() if k.startswith("cold_no_cache")),
            {k: v for k, v in diag.items() if k.startswith("cold")}),
    ]
    return rows


def suite_memory(lm, shape: str, a) -> list[Row]:
    import mlx.core as mx

    from engine.decoding.chat import Prompt
    from engine import device

    try:
        from engine.prefix_cache.store import PrefixCache
    except Exception:
        PrefixCache = None
    from .shapes import prompt_ids, vocab_size

    n_prompt, n_gen = (a.ctx, 256) if shape != "tiny" else (600, 32)
    prompt = prompt_ids(n_prompt, vocab_size(shape), seed=3)
    weights = lm.extras.get("weights_bytes", 0)
    out = {}
    with common.progress(3, f"memory {shape}") as bar:
        common.fresh_memory()
        common.mlx_lm_stream(lm, prompt, n_gen)
        out["mlx"] = mx.get_peak_memory()
        bar.update(1)
        common.fresh_memory()
        common.engine_direct(lm, Prompt(list(prompt), [n_prompt]), n_gen, None)
        out["ours_nocache"] = mx.get_peak_memory()
        bar.update(1)
        if PrefixCache is not None:
            common.fresh_memory()
            pc = PrefixCache(lm, budget_bytes=device.memory_budget(0.25))
            common.engine_direct(lm, Prompt(list(prompt), [n_prompt]), n_gen, pc)
            out["ours_cache"] = mx.get_peak_memory()
            del pc
            bar.update(1)
    baseline = lm.extras.get("mlx_lm_model")
    if baseline is not None:  # both copies of the weights are resident: each side's peak, less the other's
        from .shapes import nbytes

        out = {k: v - nbytes(lm.model if k == "mlx" else baseline) for k, v in out.items()}
    gb = 1e9
    rows = [Row("memory", shape, f"peak, {n_prompt}-token prompt + {n_gen}-token answer", "GB",
                out["ours_nocache"] / gb, out["mlx"] / gb, "mlx_lm.stream_generate", "<= 1.0",
                f"weights {weights / gb:.2f} GB; mx.get_peak_memory(); no prefix cache", out)]
    if "ours_cache" in out:
        rows.append(Row("memory", shape, "peak, same, with prefix cache", "GB", out["ours_cache"] / gb,
                        out["mlx"] / gb, "mlx_lm.stream_generate", "",
                        "includes the snapshots of the prompt and of prompt+answer the cache keeps"))
    return rows


def suite_concurrency(lm, shape: str, a) -> list[Row]:
    import mlx.core as mx
    from mlx_lm.generate import batch_generate

    from .shapes import prompt_ids, vocab_size

    n = 8
    gen = a.gen // 2 if not a.quick else 16
    vocab = vocab_size(shape)
    prompts = [prompt_ids(128, vocab, seed=100 + i) for i in range(n)]

    def mlx_batch() -> dict[str, Any]:
        with common.mlx_lm_paths(lm) as model:
            t = time.perf_counter()
            batch_generate(model, lm.tokenizer, prompts, max_tokens=gen)
            mx.synchronize()
        return {"aggregate_tps": n * gen / (time.perf_counter() - t)}

    def mlx_one(prompt: list[int]) -> dict[str, Any]:  # as ours: all tokens over the wall time
        r = common.mlx_lm_stream(lm, prompt, gen)
        return {"aggregate_tps": r["n"] / r["total_s"]}

    svc = common.EngineService(lm, max_running=n, prefix_cache=False)
    try:  # each side's warm-up is its timed workload run once (every batch size and cache shape)
        with common.progress(4 * a.reps, f"concurrency {shape}") as bar:
            runs = common.interleave({"one": lambda: svc.concurrent(prompts[:1], gen),
                                      "many": lambda: svc.concurrent(prompts, gen),
                                      "mlx_batch": mlx_batch,
                                      "mlx_one": lambda: mlx_one(prompts[0])}, a.reps, bar, warmup=True)
    finally:
        svc.close()
    tps = {k: [r["aggregate_tps"] for r in v] for k, v in runs.items()}
    med = {k: common.median(v) for k, v in tps.items()}
    first_tokens = [r.get("first_token_s") for r in runs["many"]]
    last_first = [f[-1] / f[0] for f in first_tokens if f and f[0] > 0]
    return [
        Row("concurrency", shape, f"aggregate, {n} streams vs mlx-lm batch_generate", "tok/s", med["many"],
            med["mlx_batch"], f"mlx_lm batch_generate of {n}", ">= 1.0",
            f"median of {a.reps}; ours {common.spread(tps['many'])}, batch_generate "
            f"{common.spread(tps['mlx_batch'])}; {gen} tokens per stream after 128-token prompts, wall "
            f"time incl. prefill; last stream's first token / first stream's: median "
            f"{common.fmt(common.median(last_first)) if last_first else '-'}x "
            f"{common.spread(last_first) if last_first else ''}",
            {"all": tps, "first_token_s": first_tokens, "last_over_first_token": last_first}),
        Row("concurrency", shape, f"aggregate, {n} streams vs 1", "tok/s", med["many"], med["one"],
            "ours, 1 stream", ">= 4.0", f"median of {a.reps}; ours 1 stream {common.spread(tps['one'])}; "
            f"mlx-lm 1 stream {common.fmt(med['mlx_one'])} tok/s (both: all tokens over the wall time "
            "from submission, prefill included)"),
    ]


def suite_hybrid(lm, shape: str, a) -> list[Row]:
    from .hybrid import suite_hybrid as run

    return run(lm, shape, a)


SHAPE_FUNCS = {"decode": suite_decode, "prefix": suite_prefix, "memory": suite_memory,
               "concurrency": suite_concurrency, "hybrid": suite_hybrid}


# -- delegated suites (other people's modules) -------------------------------------------------------

def delegated(suite: str, a) -> list[Row]:
    mod, why = _module(suite)
    if mod is None:
        print(f"[bench] {suite}: skipped: {why}", file=sys.stderr)
        return [skipped(suite, "-", why)]
    if a.device == "gpu" and suite in ("prefix", "concurrency"):
        # these modules measure the bundled model (a download when absent) against mlx_lm.server
        # on the CPU; on the device the shape suites above measure the same things offline
        return [skipped(suite, "-", f"bench/{suite}.py is the CPU bundled-model bench; on gpu the "
                        "shape suite covers it")]
    if hasattr(mod, "run_suite"):
        out = []
        for d in mod.run_suite(a):
            out.append(Row(suite, d.get("shape", "-"), d.get("metric", ""), d.get("unit", ""),
                           d.get("ours"), d.get("baseline"), d.get("baseline_name", ""),
                           d.get("goal", ""), d.get("notes", ""), d.get("extra", {})))
        return out
    if suite == "decode" and a.device == "gpu":
        return []  # bench/decode.py measures the CPU build against llama.cpp; GPU decode is above
    if hasattr(mod, "main"):
        import subprocess

        cmd = [sys.executable, "-m", f"bench.{suite}"]
        if "--device" in Path(mod.__file__).read_text():
            cmd += ["--device", a.device]
        print(f"[bench] {suite}: running {' '.join(cmd[1:])} (its own table and JSON)", file=sys.stderr)
        rc = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent).returncode
        if rc:
            return [failed(suite, "-", f"python {' '.join(cmd[1:])} exited with status {rc}")]
        return [Row(suite, "-", f"ran python {' '.join(cmd[1:])}", "", None, None, "",
                    notes="its results are in its own table and JSON file")]
    return [skipped(suite, "-", f"bench/{suite}.py has neither run_suite() nor main()")]


# -- driver ------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("suite", choices=("all",) + SUITES)
    ap.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    ap.add_argument("--shapes", help="comma-separated (bench/shapes.py); default by device")
    ap.add_argument("--gen", type=int, default=128, help="tokens decoded per run")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per row (median, spread)")
    ap.add_argument("--ctx", type=int, default=4000, help="conversation / prompt tokens")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and reps (smoke test)")
    ap.add_argument("--no-delegate", action="store_true", help="only the shape suites")
    ap.add_argument("--out", help="JSON path (default bench/results/<backend>-<date>.json)")
    a = ap.parse_args(argv)
    if a.quick:
        a.gen, a.reps, a.ctx = min(a.gen, 24), 1, min(a.ctx, 1000)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from engine import device

    dev = device.select_device(a.device)
    a.device = "gpu" if dev.type == dev.type.gpu else "cpu"
    from .shapes import CPU_DEFAULT, GPU_DEFAULT, SHAPES

    shapes = a.shapes.split(",") if a.shapes else list(GPU_DEFAULT if a.device == "gpu" else CPU_DEFAULT)
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; known: {', '.join(SHAPES)}")
    suites = list(SUITES) if a.suite == "all" else [a.suite]
    meta = common.run_meta(["python", "-m", "bench"] + argv)
    meta["settings"] = {"gen": a.gen, "reps": a.reps, "ctx": a.ctx, "shapes": shapes}
    print(f"[bench] {device.describe(dev)}; mlx {meta['versions'].get('mlx')}, "
          f"mlx-lm {meta['versions'].get('mlx_lm')}", file=sys.stderr)
    stamp = dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    out = Path(a.out) if a.out else common.RESULTS_DIR / f"{meta['device']['backend']}-{stamp}-{a.suite}.json"
    rows: list[Row] = []

    def save() -> None:
        common.write_json(out, meta, rows)

    for shape in shapes:
        wanted = [s for s in suites if s in SHAPE_FUNCS
                  and (SHAPE_SUITES[s] is None or shape in SHAPE_SUITES[s])]
        if not wanted:
            continue
        t = time.perf_counter()
        try:
            from .shapes import build

            lm = build(shape)
            meta.setdefault("build_s", {})[shape] = time.perf_counter() - t
        except Exception as exc:
            rows.append(failed("build", shape, f"{type(exc).__name__}: {exc}"))
            traceback.print_exc()
            save()
            continue
        for s in wanted:
            t = time.perf_counter()
            try:
                got = SHAPE_FUNCS[s](lm, shape, a)
            except Exception as exc:
                traceback.print_exc()
                got = [failed(s, shape, f"{type(exc).__name__}: {exc}")]
            for r in got:
                r.extra["suite_s"] = round(time.perf_counter() - t, 2)
            rows.extend(got)
            common.print_table(got)
            save()
        del lm
        common.fresh_memory()
    if not a.no_delegate:
        for s in suites:
            if s in DELEGATED:
                try:
                    rows.extend(delegated(s, a))
                except Exception as exc:
                    traceback.print_exc()
                    rows.append(failed(s, "-", f"bench/{s}.py: {type(exc).__name__}: {exc}"))
                save()
    print()
    common.print_table(rows, title=f"mlxchat bench on {device.describe(dev)}")
    failures = [f"{r.suite}/{r.shape}" for r in rows if r.metric == "FAILED"]
    meta["failed"] = failures
    save()
    print(f"\nwrote {out}")
    if failures:
        print(f"FAILED: {', '.join(failures)}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    from engine import restart_with_blas

    restart_with_blas("bench")  # as `mlxchat` does, for both sides' CPU matmuls
    sys.exit(main())
