"""Batch-1 decode against the device's memory bandwidth, peak memory by part, and the founding demo's
request, in one process (ours and mlx-lm interleaved, the same model object, the same token ids).

    python -m bench.gpu_step [--shapes qwen3-8b,...] [--parts bw,step,memory,demo] [--reps N]
                             [--gen 128] [--ctx 4000] [--out FILE]

Parts:
  bw      the device's read bandwidth: a sum over a `--bw-gb` bf16 matrix and a matrix x vector
          product with it (bytes read / s), and a copy of it (bytes read + written / s); median and
          best of 10. The larger of the two read medians is the bandwidth the fractions use.
  step    per shape, `--reps` rounds, each side in turn: a synchronous one-token model step (ms,
          mean of 32), decode tok/s of `--gen` tokens after a 64-token prompt through our Engine
          service, through engine.decoding.generate in this thread, and mlx-lm's stream_generate;
          the graph's primitives per step (mx.export_to_dot of one step's logits: what MLX records
          and launches, before any fusion); the fraction of the bandwidth (from `bw`) that a
          decode rate reads: (weights read per token + the KV cache) x tok/s / bandwidth (the
          embedding table counts one row).
  memory  per shape, a `--ctx`-token prompt + 256 generated: peak (mx.get_peak_memory, less the
          other side's copy of the weights) and TTFT of mlx-lm, of ours as it is now, and of ours
          at each of `--chunks`, and of ours as before this change (the final chunk's head on every
          row, a fixed 4,096-token chunk on CUDA); peak = weights + KV + activations by part.
  demo    the founding demonstration on `--demo-shape` (default qwen3_5-9b-8bit): 4,204 prompt
          tokens, 256 generated, through our Engine service (streamed text == final text?),
          its peak, TTFT and decode rate against mlx-lm's stream_generate.
Results: a table on stdout, JSON at --out (default bench/results/<backend>-<date>-gpu-step.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import statistics
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import common

DEMO_PROMPT, DEMO_GEN = 4204, 256


def _best_median(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "best": max(xs), "min": min(xs)}


def bandwidth(gb: float = 4.0, reps: int = 10) -> dict[str, Any]:
    """Bytes/s of reading a `gb`-GB bf16 matrix (a sum over it; a matrix x vector product, which is
    what a decode step's weights see) and of copying it, on the default device."""
    import mlx.core as mx

    cols = 4096
    x = mx.random.uniform(shape=(int(gb * 1e9) // 2 // cols, cols)).astype(mx.bfloat16)
    v = mx.random.uniform(shape=(cols,)).astype(mx.bfloat16)
    mx.eval(x, v)
    out: dict[str, Any] = {"bytes": x.nbytes}
    for name, fn, moved in (("read", lambda: mx.sum(x), x.nbytes), ("gemv", lambda: x @ v, x.nbytes),
                            ("copy", lambda: x + 1, 2 * x.nbytes)):
        mx.eval(fn())
        rates = []
        for _ in range(reps):
            mx.synchronize()
            t = time.perf_counter()
            mx.eval(fn())
            mx.synchronize()
            rates.append(moved / (time.perf_counter() - t))
        out[name] = _best_median(rates)
    mx.clear_cache()
    return out


def graph_ops(model, cache, token: int) -> dict[str, Any]:
    """The primitives of one decode step's graph (MLX records and launches each; before fusion)."""
    import mlx.core as mx

    logits = model(mx.array([[token]], dtype=mx.uint32), cache=cache)
    f = io.StringIO()
    mx.export_to_dot(f, logits)
    labels = Counter(line.split('label ="', 1)[1].split('"', 1)[0]
                     for line in f.getvalue().splitlines() if "shape=rectangle" in line)
    mx.eval(logits)
    return {"total": sum(labels.values()), "top": dict(labels.most_common(12))}


def step_ms(model, prompt, steps: int = 32) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(prompt)], dtype=mx.uint32), cache=cache))
    y = mx.array([[int(prompt[-1])]], dtype=mx.uint32)
    for _ in range(4):
        mx.eval(model(y, cache=cache))
    t = time.perf_counter()
    for _ in range(steps):
        mx.eval(model(y, cache=cache))
    return (time.perf_counter() - t) / steps * 1e3


def bytes_per_token(model, context: int) -> int:
    """Weight bytes one decode step reads (the embedding table: one row) plus its KV cache at
    `context` tokens."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    total = 0
    for name, p in tree_flatten(model.parameters()):
        if "embed_tokens" in name:
            total += p.nbytes // p.shape[0]
        else:
            total += p.nbytes
    kv = 0
    for c in make_prompt_cache(model):
        if isinstance(c, KVCache):
            kv += 1
    attn = next((layer.self_attn for layer in model.layers if hasattr(layer, "self_attn")), None)
    k_proj = getattr(attn, "k_proj", None)
    if k_proj is not None and kv:  # a K row per token and layer is k_proj's output width (bf16)
        width = k_proj.weight.shape[0]
        total += kv * 2 * width * context * 2
    return total


def part_step(lm, shape: str, a, bw: float | None) -> list[common.Row]:
    from engine.decoding.chat import Prompt

    from .shapes import prompt_ids, vocab_size

    prompt = prompt_ids(64, vocab_size(shape), seed=1)
    n = a.gen
    svc = common.EngineService(lm, max_running=1, prefix_cache=False)
    with common.mlx_lm_paths(lm) as base_model:
        try:
            runs = common.interleave({
                "service": lambda: svc.stream(prompt, n),
                "direct": lambda: common.engine_direct(lm, Prompt(list(prompt), [len(prompt)]), n),
                "mlx": lambda: common.mlx_lm_stream(lm, prompt, n),
                "ours_step": lambda: {"ms": step_ms(lm.model, prompt)},
                "mlx_step": lambda: {"ms": step_ms(base_model, prompt)},
            }, a.reps, warmup=True)
        finally:
            svc.close()
        from mlx_lm.models.cache import make_prompt_cache
        import mlx.core as mx

        ops = {}
        for side, model in (("ours", lm.model), ("mlx", base_model)):
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array([prompt], dtype=mx.uint32), cache=cache))
            ops[side] = graph_ops(model, cache, prompt[-1])
        per_token = bytes_per_token(base_model, len(prompt) + n // 2)
    tps = {k: [r["tps"] for r in runs[k]] for k in ("service", "direct", "mlx")}
    ms = {k: [r["ms"] for r in runs[k]] for k in ("ours_step", "mlx_step")}
    frac = {k: [t * per_token / bw for t in v] for k, v in tps.items()} if bw else {}
    extra = {"tps": tps, "step_ms": ms, "graph_ops": ops, "bytes_per_token": per_token,
             "bandwidth_fraction": frac,
             "same_tokens_as_mlx_lm": common.same_prefix(runs["service"][0]["tokens"], runs["mlx"][0]["tokens"])}
    med = {k: common.median(v) for k, v in tps.items()}
    best = {k: max(v) for k, v in tps.items()}
    rows = [common.Row("gpu_step", shape, "decode batch 1 (service)", "tok/s", med["service"], med["mlx"],
                       "mlx_lm.stream_generate", ">= 1.2",
                       f"median of {a.reps} ({common.spread(tps['service'])}; best {best['service']:.0f} vs "
                       f"{best['mlx']:.0f}); in this thread {med['direct']:.0f}; "
                       f"step {common.median(ms['ours_step']):.2f} ms vs {common.median(ms['mlx_step']):.2f} ms; "
                       f"graph ops/step {ops['ours']['total']} vs {ops['mlx']['total']}", extra)]
    if bw:
        rows.append(common.Row("gpu_step", shape, "fraction of read bandwidth (service)", "",
                               common.median(frac["service"]), common.median(frac["mlx"]), "mlx-lm", "",
                               f"{per_token / 1e9:.2f} GB/token at {bw / 1e12:.2f} TB/s; best "
                               f"{max(frac['service']):.2f} vs {max(frac['mlx']):.2f}"))
    return rows


def _kv_bytes(cache) -> int:
    return sum(getattr(c, "nbytes", 0) for c in cache)


@contextmanager
def settings(last_row: bool = True, chunk: int | None = None):
    """Our engine with the final chunk's head on every row (`last_row` False) or another prefill
    chunk (`chunk`), while inside."""
    from engine.decoding import generate as gen_mod

    old = gen_mod.LAST_ROW_HEAD, gen_mod.default_prefill_chunk
    gen_mod.LAST_ROW_HEAD = last_row
    if chunk:
        gen_mod.default_prefill_chunk = lambda *_: chunk
    try:
        yield
    finally:
        gen_mod.LAST_ROW_HEAD, gen_mod.default_prefill_chunk = old


def variants(a) -> dict[str, dict[str, Any]]:
    """Our settings to measure: as now, each of `--chunks`, and as before this change (the head
    on every row of the final chunk, CUDA's fixed 4,096-token chunk)."""
    import mlx.core as mx

    out: dict[str, dict[str, Any]] = {"ours": {}}
    for c in (int(x) for x in a.chunks.split(",") if x):
        out[f"ours_chunk{c}"] = {"chunk": c}
    out["ours_before"] = {"last_row": False, "chunk": 4096 if mx.default_device() == mx.gpu else 512}
    return out


def part_memory(lm, shape: str, a) -> list[common.Row]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.decoding.chat import Prompt

    from .shapes import nbytes, prompt_ids, vocab_size

    n_prompt, n_gen = (a.ctx, 256) if not shape.startswith("tiny") else (600, 32)
    prompt = prompt_ids(n_prompt, vocab_size(shape), seed=3)
    base = lm.extras.get("mlx_lm_model")
    ours_w = nbytes(lm.model)
    mlx_w = nbytes(base) if base is not None else ours_w
    out: dict[str, Any] = {}

    def ours(label: str, setting: dict[str, Any]) -> None:
        with settings(**setting):
            common.fresh_memory()
            r = common.engine_direct(lm, Prompt(list(prompt), [n_prompt]), n_gen)
            out.setdefault(label + "_all", []).append(
                {"peak": mx.get_peak_memory() - (mlx_w if base is not None else 0), "ttft_s": r["ttft_s"],
                 "tps": r["tps"]})

    common.mlx_lm_stream(lm, prompt[:600], 4)  # warm-up: kernels compiled before any timed run
    for setting in variants(a).values():
        with settings(**setting):
            common.engine_direct(lm, Prompt(list(prompt[:600]), [600]), 4)
    for rep in range(a.mem_reps):
        common.fresh_memory()
        cache = make_prompt_cache(lm.extras.get("mlx_lm_model", lm.model))
        r = common.mlx_lm_stream(lm, prompt, n_gen, prompt_cache=cache)
        out.setdefault("mlx", []).append({"peak": mx.get_peak_memory() - (ours_w if base is not None else 0),
                                          "ttft_s": r["ttft_s"], "tps": r["tps"], "kv": _kv_bytes(cache)})
        del cache
        for label, setting in variants(a).items():
            ours(label, setting)
    pick = lambda k, f: common.median([x[f] for x in out[k]])  # noqa: E731
    kv = pick("mlx", "kv")
    gb = 1e9
    parts = {k: {"weights": ours_w / gb if k != "mlx" else mlx_w / gb, "kv": kv / gb,
                 "activations": (pick(k, "peak") - (mlx_w if k == "mlx" else ours_w) - kv) / gb}
             for k in ["mlx"] + [v + "_all" for v in variants(a)]}
    extra = {"runs": out, "parts_gb": parts}
    rows = [common.Row("memory", shape, f"peak, {n_prompt}-token prompt + {n_gen}", "GB",
                       pick("ours_all", "peak") / gb, pick("mlx", "peak") / gb, "mlx_lm.stream_generate",
                       "<= 1.0", "parts (weights/KV/activations GB): " + "; ".join(
                           f"{k}: {v['weights']:.2f}/{v['kv']:.2f}/{v['activations']:.2f}" for k, v in parts.items())
                       + "; " + "; ".join(f"{v} {pick(v + '_all', 'peak') / gb:.2f} GB" for v in variants(a)),
                       extra),
            common.Row("memory", shape, f"cold TTFT, {n_prompt}-token prompt", "s",
                       pick("ours_all", "ttft_s"), pick("mlx", "ttft_s"), "mlx_lm.stream_generate", "<= 0.8",
                       "; ".join(f"{v} {pick(v + '_all', 'ttft_s'):.3f} s" for v in variants(a)))]
    return rows


def part_demo(lm, shape: str, a) -> list[common.Row]:
    """The seed's request: 4,204 prompt tokens, 256 generated, streamed text equal to the final
    text; ours through the Engine service (as now, and at each of `--chunks`) against mlx-lm's
    stream_generate, each side warmed up first on a shorter prompt."""
    import mlx.core as mx

    from engine.decoding.sampling import SamplingParams

    from .shapes import nbytes, prompt_ids, vocab_size

    n_prompt, n_gen = (DEMO_PROMPT, DEMO_GEN) if not shape.startswith("tiny") else (300, 24)
    prompt = prompt_ids(n_prompt, vocab_size(shape), seed=5)
    base = lm.extras.get("mlx_lm_model")
    other = {"ours": nbytes(base) if base is not None else 0, "mlx": nbytes(lm.model) if base is not None else 0}
    sides = {k: v for k, v in variants(a).items() if k != "ours_before"}
    runs: dict[str, list] = {k: [] for k in ["mlx", *sides]}

    def ours(svc, ids, label: str | None) -> None:
        common.fresh_memory()
        t0 = time.perf_counter()
        times, streamed, tokens = [], [], []
        h = svc.engine.submit(prompt_tokens=list(ids), params=SamplingParams(max_tokens=n_gen))
        for ev in h.events(timeout=600):
            if ev.kind == "token":
                times.append(time.perf_counter())
                streamed.append(ev.text)
                tokens.append(ev.token)
            elif ev.error:
                raise RuntimeError(ev.error)
        if label:
            final = lm.tokenizer._tokenizer.decode(tokens)
            runs[label].append({**common.arrivals(times, t0), "peak": mx.get_peak_memory() - other["ours"],
                                "streamed_equals_final": "".join(streamed) == final, "n_tokens": len(tokens)})

    svc = common.EngineService(lm, max_running=1, prefix_cache=False)
    try:
        warm = prompt_ids(n_prompt // 4, vocab_size(shape), seed=6)
        common.mlx_lm_stream(lm, warm, 8)
        for setting in sides.values():
            with settings(**setting):
                ours(svc, warm, None)
        for _ in range(a.demo_reps):
            for label, setting in sides.items():
                with settings(**setting):
                    ours(svc, prompt, label)
            common.fresh_memory()
            r = common.mlx_lm_stream(lm, prompt, n_gen)
            r.pop("tokens")
            runs["mlx"].append({**r, "peak": mx.get_peak_memory() - other["mlx"]})
    finally:
        svc.close()
    pick = lambda k, f: common.median([x[f] for x in runs[k]])  # noqa: E731
    gb = 1e9
    ok = all(r["streamed_equals_final"] and r["n_tokens"] == n_gen for k in sides for r in runs[k])
    note = (f"{n_prompt} prompt + {n_gen} tokens, median of {a.demo_reps}; streamed text == final text: {ok}; "
            f"weights {nbytes(lm.model) / gb:.2f} GB")
    each = lambda f, scale=1.0, unit="": "; ".join(  # noqa: E731
        f"{k} {pick(k, f) * scale:.3g}{unit}" for k in sides)
    return [common.Row("demo", shape, "peak", "GB", pick("ours", "peak") / gb, pick("mlx", "peak") / gb,
                       "mlx_lm.stream_generate", "<= 1.0",
                       note + "; goal <= 10.65 GB; " + each("peak", 1 / gb, " GB"), {"runs": runs}),
            common.Row("demo", shape, "TTFT", "s", pick("ours", "ttft_s"), pick("mlx", "ttft_s"),
                       "mlx_lm.stream_generate", "<= 0.8", note + "; " + each("ttft_s", 1, " s")),
            common.Row("demo", shape, "decode", "tok/s", pick("ours", "tps"), pick("mlx", "tps"),
                       "mlx_lm.stream_generate", ">= 1.2", note + "; " + each("tps"))]


def main(argv=None) -> int:
    import mlx.core as mx

    from engine import device

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3-8b")
    ap.add_argument("--parts", default="bw,step,memory")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--mem-reps", type=int, default=1)
    ap.add_argument("--demo-reps", type=int, default=1)
    ap.add_argument("--demo-shape", default="qwen3_5-9b-8bit")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=4000)
    ap.add_argument("--bw-gb", type=float, default=4.0)
    ap.add_argument("--chunks", default="2048,1024", help="other prefill chunks to measure ours at")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    device.select_device(a.device)
    from .shapes import build

    parts = a.parts.split(",")
    meta = common.run_meta(["python", "-m", "bench.gpu_step"] + list(argv if argv is not None else sys.argv[1:]))
    meta["settings"] = vars(a)
    meta["env"] = {k: v for k, v in __import__("os").environ.items() if k.startswith(("MLX_", "MLXCHAT_CUDA_QMV"))}
    stamp = dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    out = Path(a.out) if a.out else common.RESULTS_DIR / f"{meta['device']['backend']}-{stamp}-gpu-step.json"
    rows: list[common.Row] = []
    more: dict[str, Any] = {}
    bw = None
    if "bw" in parts:
        more["bandwidth"] = b = bandwidth(a.bw_gb)
        bw = max(b["read"]["median"], b["gemv"]["median"])
        print(f"read {b['read']['median'] / 1e12:.2f} TB/s (best {b['read']['best'] / 1e12:.2f}); gemv "
              f"{b['gemv']['median'] / 1e12:.2f} (best {b['gemv']['best'] / 1e12:.2f}); copy "
              f"{b['copy']['median'] / 1e12:.2f} TB/s", flush=True)
    shapes = a.shapes.split(",") if a.shapes else []
    if "demo" in parts and a.demo_shape not in shapes:
        shapes.append(a.demo_shape)
    for shape in shapes:
        try:
            lm = build(shape)
        except Exception as exc:
            rows.append(common.failed("build", shape, f"{type(exc).__name__}: {exc}"))
            continue
        todo = [p for p in ("step", "memory") if p in parts and shape in a.shapes.split(",")]
        if "demo" in parts and shape == a.demo_shape:
            todo.append("demo")
        for p in todo:
            try:
                got = {"step": lambda: part_step(lm, shape, a, bw), "memory": lambda: part_memory(lm, shape, a),
                       "demo": lambda: part_demo(lm, shape, a)}[p]()
            except Exception as exc:
                import traceback

                traceback.print_exc()
                got = [common.failed(p, shape, f"{type(exc).__name__}: {exc}")]
            rows.extend(got)
            common.print_table(got)
            common.write_json(out, meta, rows, **more)
        lm = None  # freed before the next shape is built
        common.fresh_memory()
    common.write_json(out, meta, rows, **more)
    print()
    common.print_table(rows, title="bench.gpu_step")
    print(f"wrote {out}")
    mx.synchronize()
    return 1 if any(r.metric == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
