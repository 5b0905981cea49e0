"""Batch-1 decode against the device's memory bandwidth, peak memory by part, and the founding demo's
request, in one process (ours and mlx-lm interleaved, the same model object, the same token ids).

    python -m bench.gpu_step [--shapes qwen3-8b,...] [--parts bw,step,memory,demo] [--reps N]
                             [--gen 128] [--ctx 4000] [--out FILE]

Parts:
  llamacpp llama.cpp's CUDA build (bench/setup-llamacpp cuda) on a random llama of the 8B shape's
          sizes as F16, Q8_0 and Q4_0: decode of --gen tokens and a --llama-prompt-token prompt
          (llama-bench, --reps reps), N streams (llama-batched-bench, --streams); with `step`, a
          row per shape puts our decode rate beside llama.cpp's type (bf16 F16, 8-bit Q8_0, 4-bit
          Q4_0), raw and scaled by the bytes each reads per token (bench/llama_cuda.py).
  kernels per shape, each fused CUDA kernel of the one-token step (engine/kernels/fused_cuda.py)
          against its reference in MLX ops (engine/kernels/fused_ref.py): largest difference over
          the reference's largest value; the products' weight-read rate over all layers (GB/s, ours
          and MLX's quantized_matmul / matmul, interleaved, median of 10). Quantized shapes add the
          int8-activation products (fused_cuda.qdot against fused_ref.int8_product, at several
          launch shapes); 4-bit shapes the batched step's products of 8 and 32 rows
          (qmm_rows_cuda.qmm4_rows at several tiles a block, beside MLX's); every shape the
          batched step's attention of 8 and 32 rows at each split count. `--sweep`: each one-row
          product at rows per warp x words ahead x prefetch variants.
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
import json
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
    program = getattr(lm.model, "decode_program", None)
    gate = decode_gate(lm.model, prompt) if program is not None else {"program": False}
    print(f"{shape}: decode program gate {gate}", flush=True)
    svc = common.EngineService(lm, max_running=1, prefix_cache=False)
    with common.mlx_lm_paths(lm) as base_model:
        fns = {
            "service": lambda: svc.stream(prompt, n),
            "direct": lambda: common.engine_direct(lm, Prompt(list(prompt), [len(prompt)]), n),
            "mlx": lambda: common.mlx_lm_stream(lm, prompt, n),
            "ours_step": lambda: {"ms": step_ms(lm.model, prompt)},
            "mlx_step": lambda: {"ms": step_ms(base_model, prompt)},
        }
        if program is not None and program.enabled:
            fns["service_off"] = lambda: program_off(program, lambda: svc.stream(prompt, n))
            fns["off_step"] = lambda: program_off(program, lambda: {"ms": step_ms(lm.model, prompt)})
            fns["profile"] = lambda: step_profile(lm.model, prompt)
            fns["profile_off"] = lambda: program_off(program, lambda: step_profile(lm.model, prompt))
        fns["profile_mlx"] = lambda: step_profile(base_model, prompt)
        try:
            runs = common.interleave(fns, a.reps, warmup=True)
        finally:
            svc.close()
        from mlx_lm.models.cache import make_prompt_cache
        import mlx.core as mx

        ops = {}
        for side, model in (("ours", lm.model), ("mlx", base_model)):
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array([prompt], dtype=mx.uint32), cache=cache))
            try:
                ops[side] = graph_ops(model, cache, prompt[-1])
            except Exception as exc:  # a figure to read, not to fail the part on
                ops[side] = {"total": -1, "error": f"{type(exc).__name__}: {exc}"}
        per_token = bytes_per_token(base_model, len(prompt) + n // 2)
    tps = {k: [r["tps"] for r in runs[k]] for k in ("service", "direct", "mlx", "service_off") if k in runs}
    ms = {k: [r["ms"] for r in runs[k]] for k in ("ours_step", "mlx_step", "off_step") if k in runs}
    frac = {k: [t * per_token / bw for t in v] for k, v in tps.items()} if bw else {}
    profiles = {k: {p: common.median([r[p] for r in runs[k]]) for p in runs[k][0]}
                for k in ("profile", "profile_off", "profile_mlx") if k in runs}
    extra = {"tps": tps, "step_ms": ms, "graph_ops": ops, "bytes_per_token": per_token, "gate": gate,
             "profile_ms": profiles,
             "bandwidth_fraction": frac,
             "same_tokens_as_mlx_lm": common.same_prefix(runs["service"][0]["tokens"], runs["mlx"][0]["tokens"])}
    med = {k: common.median(v) for k, v in tps.items()}
    best = {k: max(v) for k, v in tps.items()}
    rows = [common.Row("gpu_step", shape, "decode batch 1 (service)", "tok/s", med["service"], med["mlx"],
                       "mlx_lm.stream_generate", ">= 1.2",
                       f"median of {a.reps} ({common.spread(tps['service'])}; best {best['service']:.0f} vs "
                       f"{best['mlx']:.0f}); in this thread {med['direct']:.0f}; "
                       f"step {common.median(ms['ours_step']):.2f} ms vs {common.median(ms['mlx_step']):.2f} ms; "
                       f"graph ops/step {ops['ours']['total']} vs {ops['mlx']['total']}"
                       + (f"; program off {med['service_off']:.0f} tok/s, step "
                          f"{common.median(ms['off_step']):.2f} ms" if "service_off" in med else "")
                       + "; step ms build/host/device: " + "; ".join(
                           f"{k} " + "/".join(f"{v:.2f}" for v in p.values()) for k, p in profiles.items()), extra)]
    if bw:
        rows.append(common.Row("gpu_step", shape, "fraction of read bandwidth (service)", "",
                               common.median(frac["service"]), common.median(frac["mlx"]), "mlx-lm", "",
                               f"{per_token / 1e9:.2f} GB/token at {bw / 1e12:.2f} TB/s; best "
                               f"{max(frac['service']):.2f} vs {max(frac['mlx']):.2f}"))
    return rows


def part_variants(lm, shape: str, a) -> list[common.Row]:
    """The compiled step under each of `--variants` (";"-separated; each "default", "off" (the
    model's own forward) or space-separated KEY=VALUE settings of the kernels' switches, "int8" for
    int8 activations), each program built in turn on the same model in this process: its gate
    against the model's own forward, then its synchronous step time and where a step goes (build /
    host / device ms), the variants interleaved over `--reps` rounds. Cheaper than `step` per
    variant (no mlx-lm, no service), and host and device time add up in it: the service overlaps
    them."""
    from engine.kernels import decode_step, fused_cuda

    from .shapes import prompt_ids, vocab_size

    prompt = prompt_ids(64, vocab_size(shape), seed=1)
    model = lm.model
    if getattr(model, "decode_program", None) is None:
        return [common.failed("variants", shape, "the model has no decode program")]
    specs = [v.strip() for v in a.variants.split(";") if v.strip()]

    def settings(spec: str) -> tuple[dict[str, str], bool]:
        words = [] if spec == "default" else spec.split()
        return dict(w.split("=", 1) for w in words if "=" in w), "int8" in words

    programs, gates = {}, {}
    for spec in specs:
        if spec == "off":
            programs[spec], gates[spec] = "off", {"kept": True}
            continue
        env, int8 = settings(spec)
        program = None
        try:  # traced (and its kernels compiled) while the settings hold
            with common.environ(env):
                program = decode_step.DecodeProgram.build(model, fused_cuda, int8=int8)
                object.__setattr__(model, "decode_program", program)
                gates[spec] = decode_step.check(model, program, list(prompt), 8)
                step_ms(model, prompt, steps=4)  # traced, its kernels compiled
        except Exception as exc:  # noqa: BLE001 - one variant that does not compile
            gates[spec] = {"error": f"{type(exc).__name__}: {exc}"[:500], "kept": False}
        programs[spec] = program if gates[spec].get("kept") else None
        print(f"{shape} ({spec}): gate {gates[spec]}", flush=True)

    def measure() -> dict[str, float]:
        return {"ms": step_ms(model, prompt), **step_profile(model, prompt)}

    def timed(spec: str):
        def run():
            if programs[spec] == "off":
                return program_off(model.decode_program, measure)
            object.__setattr__(model, "decode_program", programs[spec])
            return measure()
        return run

    runs = common.interleave({spec: timed(spec) for spec in specs if programs[spec] is not None}, a.reps,
                             warmup=True)
    base = common.median([r["ms"] for r in runs[specs[0]]]) if specs[0] in runs else None
    rows = []
    for spec in specs:
        if spec not in runs:
            rows.append(common.failed("variants", shape, f"({spec}) {gates[spec]}"))
            continue
        ms = [r["ms"] for r in runs[spec]]
        prof = {k: common.median([r[k] for r in runs[spec]]) for k in runs[spec][0] if k != "ms"}
        rows.append(common.Row("variants", shape, f"step ({spec})", "ms", common.median(ms), base,
                               f"({specs[0]})", "", f"{common.spread(ms)}; build/host/device "
                               + "/".join(f"{v:.2f}" for v in prof.values()) + f"; gate {gates[spec].get('rel_diff', 0):.3g}",
                               {"ms": ms, "profile_ms": prof, "gate": gates[spec]}))
    return rows


def program_off(program, fn):
    """`fn()` with the model's compiled decode step turned off (its own forward instead)."""
    program.enabled = False
    try:
        return fn()
    finally:
        program.enabled = True


def decode_gate(model, prompt, steps: int = 8) -> dict[str, Any]:
    """The compiled decode step's logits against the model's own forward over `steps` greedy
    tokens from `prompt` (engine/kernels/decode_step.py `check`, which the loader runs too);
    turns the step off (for this process) when they part by more than its GATE."""
    from engine.kernels.decode_step import check

    program = model.decode_program
    gate = check(model, program, list(prompt), steps)
    program.enabled = gate["kept"]
    return gate


def _rel(ours, ref) -> dict[str, float]:
    import mlx.core as mx

    d = mx.abs(ours.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    s = mx.abs(ref.astype(mx.float32)).max().item()
    return {"max_diff": d, "ref_scale": s, "rel": d / max(s, 1e-30)}


def part_kernels(lm, shape: str, a) -> list[common.Row]:
    """Each fused CUDA kernel against its MLX reference on this shape's own weights."""
    groups = tuple(a.kernel_groups.split(","))
    rows = []
    if "prefill" in groups:
        try:
            rows = _prefill_products(lm.model.model, shape)
        except Exception as exc:
            rows = [common.failed("kernels", shape, f"prefill: {type(exc).__name__}: {exc}"[:3000])]
    if not set(groups) - {"prefill"}:
        return rows
    program = getattr(lm.model, "decode_program", None)
    if program is None:
        return rows + [common.failed("kernels", shape, "the model has no decode program")]
    try:
        return _kernels(program, shape, a.sweep, groups) + rows
    except Exception as exc:
        import traceback

        traceback.print_exc()
        return [common.failed("kernels", shape, f"{type(exc).__name__}: {exc}"[:3000])]


def _weight_bytes(layers, attr: str) -> int:
    """The bytes of every layer's product `attr` (weights, and scales and biases where quantized)."""
    return sum(t.nbytes for lay in layers for t in (getattr(lay, attr).w, getattr(lay, attr).scales,
                                                     getattr(lay, attr).biases) if t is not None)


def _sweep(layers, products, shape: str, rnd) -> list[common.Row]:
    """The matvec kernel's weight-read rate over all layers at each (rows per warp, words loaded
    before computing, first words loaded before x is staged or after: P; P2, and each later
    round's while the one before is multiplied), against the launch floor of as many trivial
    kernels."""
    import mlx.core as mx

    from engine.kernels import fused_cuda as C

    floor_kernel = mx.fast.cuda_kernel(name="mlxchat_floor", input_names=["x"], output_names=["y"],
                                       source="y[0] = x[0];")
    one = mx.zeros((1,), dtype=mx.float32)
    floor = _timed_eval(lambda: [floor_kernel(inputs=[one], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                                              output_shapes=[(1,)], output_dtypes=[mx.float32])[0]
                                 for _ in layers])
    out, rows = {}, []
    for label, (attr, ep, norm) in products.items():
        p0 = getattr(layers[0], attr)
        x = rnd(1, 1, p0.inputs)
        res = rnd(1, 1, p0.w.shape[0]) if ep == 1 else None
        nbytes = _weight_bytes(layers, attr)
        for r in (1, 2, 4):
            for u in (4, 8):
                for pf in (False, True, 2):
                    def run(r=r, u=u, pf=pf):
                        return [C.matvec(x, q.w, q.scales, q.biases, q.bits, q.group_size, ep, res,
                                         (getattr(lay, norm), lay.eps_in) if norm else None, rows=r, unroll=u,
                                         prefetch=pf)
                                for lay in layers for q in (getattr(lay, attr),)]
                    t = _timed_eval(run, reps=5)
                    out[f"{label} R{r} U{u}{' P2' if pf == 2 else ' P' if pf else ''}"] = {
                        "gbps": nbytes / t / 1e9, "gbps_less_floor": nbytes / max(t - floor, 1e-9) / 1e9}
        best = max((k for k in out if k.startswith(label)), key=lambda k: out[k]["gbps"])
        rows.append(common.Row("kernels", shape, f"{label}: best of the sweep ({best})", "GB/s", out[best]["gbps"],
                               None, "", "", f"less the launch floor ({floor * 1e3:.3f} ms for {len(layers)}): "
                               f"{out[best]['gbps_less_floor']:.0f} GB/s", out))
    return rows


def _int8_products(layers, products, shape: str, rnd) -> list[common.Row]:
    """The int8-activation products (fused_cuda.qdot, `--int8-activations`): each against its
    reference (fused_ref.int8_product, the CPU int8 path's arithmetic) and its weight-read rate
    over all layers at each (output units per warp R, words loaded before computing U)."""
    from engine.kernels import fused_cuda as C
    from engine.kernels import fused_ref as R

    rows = []
    for label, (attr, ep, norm) in products.items():
        p = getattr(layers[0], attr)
        x = rnd(1, 1, p.inputs)
        res = rnd(1, 1, p.w.shape[0]) if ep == 1 else None
        nrm = lambda lay: (getattr(lay, norm), lay.eps_in) if norm else None  # noqa: E731
        got = _rel(C.qdot(x, p.w, p.scales, p.biases, p.bits, p.group_size, ep, res, nrm(layers[0])),
                   R.matvec(x, p.w, p.scales, p.biases, p.bits, p.group_size, ep, res, nrm(layers[0]), int8=True))
        nbytes = _weight_bytes(layers, attr)
        for r in (1, 2, 4):
            for u in (2, 4):
                t = _timed_eval(lambda r=r, u=u: [C.qdot(x, q.w, q.scales, q.biases, q.bits, q.group_size, ep, res,
                                                         nrm(lay), rows=r, unroll=u)
                                                  for lay in layers for q in (getattr(lay, attr),)], reps=5)
                got[f"R{r} U{u}"] = nbytes / t / 1e9
        best = max((k for k in got if k.startswith("R")), key=lambda k: got[k])
        rows.append(common.Row("kernels", shape, f"{label}: weight read on int8 activations ({best})", "GB/s",
                               got[best], None, "", "", f"max diff / int8 ref scale {got['rel']:.2e}", got))
    return rows


def _rows_products(layers, products, shape: str, rnd) -> list[common.Row]:
    """A batched step's 4-bit products of 8 and 32 rows (qmm_rows_cuda.qmm4_rows, as QMVLinear
    calls them: no norm or epilogue) against MLX's quantized_matmul: each one's check and weight-read
    rate over all layers at each (16-row weight tiles a block takes, chunks loaded ahead)."""
    import mlx.core as mx

    from engine.kernels import qmm_rows_cuda as Q

    rows = []
    for m in (8, 32):
        for label, (attr, _, _) in products.items():
            p = getattr(layers[0], attr)
            x = rnd(m, 1, p.inputs)
            qmm = lambda q, x=x: mx.quantized_matmul(x, q.w, q.scales, q.biases, transpose=True,  # noqa: E731
                                                     group_size=q.group_size, bits=4)
            got = _rel(Q.qmm4_rows(x, p.w, p.scales, p.biases, p.group_size), qmm(p))
            nbytes = _weight_bytes(layers, attr)
            got["mlx"] = nbytes / _timed_eval(lambda: [qmm(getattr(lay, attr)) for lay in layers], reps=5) / 1e9
            for tpw in (1, 2, 4):
                for u in (1, 2):
                    t = _timed_eval(lambda tpw=tpw, u=u: [Q.qmm4_rows(x, q.w, q.scales, q.biases, q.group_size, tpw, u)
                                                          for lay in layers for q in (getattr(lay, attr),)], reps=5)
                    got[f"TPW{tpw} U{u}"] = nbytes / t / 1e9
            default = f"TPW{Q.tiles_per_block(m)} U{Q.UNROLL}"
            best = max((k for k in got if k.startswith("TPW")), key=lambda k: got[k])
            rows.append(common.Row("kernels", shape, f"{label}, {m} rows: weight read ({best}; default {default})",
                                   "GB/s", got[best], got["mlx"], "mx.quantized_matmul", "",
                                   f"default {got[default]:.0f} GB/s; max diff / ref scale {got['rel']:.2e}", got))
    return rows


def _rows_attention(layer, shape: str, n_layers: int) -> list[common.Row]:
    """A batched step's attention (batch_attention.attention_rows: norms, RoPE, the new column,
    attention) of 8 and 32 rows at ~300 positions, `n_layers` calls as a step makes them, at each
    split count: ms a step, and the rate it reads the rows' keys and values at."""
    import mlx.core as mx

    from engine.kernels import batch_attention as B
    from engine.kernels.fused_cuda import splits

    heads, kv, dim, dt = layer.heads, layer.kv_heads, layer.head_dim, layer.norm_in.dtype
    rl = B._random_layer(heads, kv, dim, layer.q_norm is not None, dt, mx.random.key(3))
    out = []
    for m in (8, 32):
        length, room = 300, 300 + n_layers + 8
        keys = mx.random.normal((m, kv, room, dim)).astype(dt)
        values = mx.random.normal((m, kv, room, dim)).astype(dt)
        qkv = mx.random.normal((m, 1, (heads + 2 * kv) * dim)).astype(dt)
        padding = [i % 7 for i in range(m)]
        nbytes = 2 * sum(length - p for p in padding) * kv * dim * dt.size * n_layers
        got, default = {}, splits(m * kv, room)
        for s in sorted({1, 2, 4, 8, default}):
            caches = [B._slot_cache(keys, values, padding, length) for _ in range(n_layers)]
            t = _timed_eval(lambda s=s: [B.attention_rows(rl, qkv, c, split=s) for c in caches], reps=3)
            got[f"S{s}"] = {"ms": t * 1e3, "gbps": nbytes / t / 1e9}
        default = f"S{default}"
        best = min(got, key=lambda k: got[k]["ms"])
        out.append(common.Row("kernels", shape, f"batched attention, {m} rows at ~{length} positions, {n_layers} "
                              f"layers ({best}; default {default})", "ms", got[best]["ms"], got[default]["ms"],
                              f"the default's {default}", "", f"{got[best]['gbps']:.0f} GB/s of keys and values", got))
    return out


PREFILL_PRODUCTS = {"q/k/v": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate/up": "mlp.gate_up_proj",
                    "down": "mlp.down_proj"}  # the GPU layout's quantized linears of a decoder layer


def _prefill_products(model, shape: str, m: int = 2048) -> list[common.Row]:
    """A prompt chunk's products (`m` rows) over all decoder layers, as the GPU layout holds them:
    MLX's quantized_matmul against the dense path (qmv_cuda.dense_weight, then the dense product)
    and the dense product alone on weights dequantized beforehand (the dense path's floor), in
    TFLOP/s; and causal attention of the chunk's queries over twice as many keys (MLX's fast
    attention). Needs no decode program: any quantized width."""
    import mlx.core as mx
    import mlx.nn as nn

    from engine.kernels import qmv_cuda as Q

    layers, args = model.layers, model.args
    dt = mx.bfloat16
    mx.random.seed(7)
    rows = []
    for label, path in PREFILL_PRODUCTS.items():
        first, second = path.split(".")
        mods = [lay[first][second] for lay in layers if first in lay and second in lay[first]]
        mods = [q for q in mods if isinstance(q, nn.QuantizedLinear)]  # a hybrid's attention layers only
        if not mods:
            continue
        p = mods[0]
        x = mx.random.normal((m, p.weight.shape[1] * 32 // p.bits)).astype(dt)
        qmm = lambda q: mx.quantized_matmul(x, q.weight, q.scales, q.biases, transpose=True,  # noqa: E731
                                            group_size=q.group_size, bits=q.bits)
        dense = lambda q: x @ Q.dense_weight(q.weight, q.scales, q.biases, q.group_size, q.bits).T  # noqa: E731
        got = _rel(dense(p), qmm(p))
        flops = 2 * m * sum(q.weight.shape[0] * x.shape[1] for q in mods)
        got["mlx"] = flops / _timed_eval(lambda: [qmm(q) for q in mods], reps=5) / 1e12
        got["dense"] = flops / _timed_eval(lambda: [dense(q) for q in mods], reps=5) / 1e12
        ws = [Q.dense_weight(q.weight, q.scales, q.biases, q.group_size, q.bits) for q in mods]
        mx.eval(ws)
        got["predequantized"] = flops / _timed_eval(lambda: [x @ w.T for w in ws], reps=5) / 1e12
        ws = None
        rows.append(common.Row("kernels", shape, f"{label}, a {m}-row chunk over {len(mods)} layers, "
                               f"{p.bits}-bit: dense path", "TFLOP/s", got["dense"], got["mlx"],
                               "mx.quantized_matmul", "", f"weights dequantized beforehand "
                               f"{got['predequantized']:.0f} TFLOP/s; max diff / ref scale {got['rel']:.2e}", got))
    heads, kv = args.num_attention_heads, args.num_key_value_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    q = mx.random.normal((1, heads, m, dim)).astype(dt)
    k = mx.random.normal((1, kv, 2 * m, dim)).astype(dt)
    v = mx.random.normal((1, kv, 2 * m, dim)).astype(dt)
    n_attn = sum(1 for lay in layers if "self_attn" in lay)
    boolean = mx.arange(2 * m)[None] <= (mx.arange(m) + m)[:, None]
    ms = {how: 1e3 * _timed_eval(lambda mask=mask: [
        mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, mask=mask) for _ in range(n_attn)], reps=5)
        for how, mask in (("causal", "causal"), ("boolean", boolean))}
    rows.append(common.Row("kernels", shape, f"attention of a {m}-row chunk over {2 * m} keys, {n_attn} layers",
                           "ms", ms["causal"], ms["boolean"], "the same under a boolean mask", "",
                           "MLX's fast attention, mask=\"causal\" (as mlx-lm's caches make it) against the "
                           "same causal mask as an array", ms))
    return rows


KERNEL_GROUPS = ("products", "int8", "rows", "prefill")  # --kernel-groups: see _kernels


# (layer attribute, epilogue, fused norm's weight attribute) of each one-row product
PRODUCTS = {"norm+qkv": ("qkv", 0, "norm_in"), "o+residual": ("o", 1, None),
            "norm+gate_up+swiglu": ("gate_up", 2, "norm_post"), "down+residual": ("down", 1, None)}


def _kernels(program, shape: str, sweep: bool = False, groups: tuple[str, ...] = KERNEL_GROUPS) -> list[common.Row]:
    """The kernels part by group, each affordable in its own device call: `products` (the one-row
    products and head against MLX's, the tensor-core variant, the one-row attention's checks, time
    and split counts), `int8` (the int8-activation products), `rows` (the batched step's 4-bit
    products and attention); `sweep` adds each one-row product's launch variants. (`prefill`, a
    prompt chunk's products and attention, needs no program: part_kernels runs it.)"""
    import mlx.core as mx

    layers, layer = program.layers, program.layers[0]
    dt = layer.norm_in.dtype
    mx.random.seed(7)
    rnd = lambda *s: mx.random.normal(s).astype(dt)  # noqa: E731
    rows: list[common.Row] = []
    if "products" in groups:
        rows.extend(_one_row(program, shape, rnd))
    if sweep:
        rows.extend(_sweep(layers, PRODUCTS, shape, rnd))
    if "int8" in groups and layer.qkv.bits in (4, 8):
        rows.extend(_int8_products(layers, PRODUCTS, shape, rnd))
    if "rows" in groups:
        if layer.qkv.bits == 4:
            rows.extend(_rows_products(layers, PRODUCTS, shape, rnd))
        rows.extend(_rows_attention(layer, shape, len(layers)))
    return rows


def _one_row(program, shape: str, rnd) -> list[common.Row]:
    """The `products` group: each one-row product (and its tensor-core variant at 4 bits), the
    head and the one-row attention against their MLX references, and a row of every check."""
    import mlx.core as mx

    from engine.kernels import fused_cuda as C
    from engine.kernels import fused_ref as R

    layers, layer = program.layers, program.layers[0]
    dt = layer.norm_in.dtype
    checks: dict[str, Any] = {}
    rows: list[common.Row] = []
    for label, (attr, ep, norm) in PRODUCTS.items():
        p = getattr(layer, attr)
        x = rnd(1, 1, p.inputs)
        res = rnd(1, 1, p.w.shape[0]) if ep == 1 else None
        nrm = lambda lay: (getattr(lay, norm), lay.eps_in) if norm else None  # noqa: E731
        checks[label] = _rel(p(C, x, ep, res, nrm(layer)), p(R, x, ep, res, nrm(layer)))
        nbytes = _weight_bytes(layers, attr)
        # each side's graph built before the clock starts: the eval of 36 products (host recording and GPU)
        t_ours = _timed_eval(lambda: [getattr(lay, attr)(C, x, ep, res, nrm(lay)) for lay in layers])
        t_ref = _timed_eval(lambda: [getattr(lay, attr)(R, x, ep, res, nrm(lay)) for lay in layers])
        checks[label].update(gbps_ours=nbytes / t_ours / 1e9, gbps_mlx=nbytes / t_ref / 1e9)
        if p.bits == 4 and p.group_size % 64 == 0:  # the tensor-core kernel beside the scalar one
            mma = lambda lay, **kw: C.qmma4(x, getattr(lay, attr).w, getattr(lay, attr).scales,  # noqa: E731
                                            getattr(lay, attr).biases, p.group_size, ep, res, nrm(lay), **kw)
            checks[label]["mma"] = _rel(mma(layer), p(R, x, ep, res, nrm(layer)))
            for tpw in (1, 2):
                for u in (4, 8):
                    t = _timed_eval(lambda tpw=tpw, u=u: [mma(lay, tiles_per_block=tpw, unroll=u) for lay in layers])
                    checks[label][f"mma_gbps_tpw{tpw}_u{u}"] = nbytes / t / 1e9
        rows.append(common.Row("kernels", shape, f"{label}: weight read, {len(layers)} layers", "GB/s",
                               nbytes / t_ours / 1e9, nbytes / t_ref / 1e9, "MLX ops (rms_norm, (quantized_)matmul, ...)",
                               ">= 1.0", f"max diff / ref scale {checks[label]['rel']:.2e}", checks[label]))
    head, final = program.head, (program.norm, program.eps)
    x = rnd(1, 1, head.inputs)
    checks["norm+head"] = _rel(head(C, x, norm=final), head(R, x, norm=final))
    hb = sum(t.nbytes for t in (head.w, head.scales, head.biases) if t is not None)
    t_ours, t_ref = _timed_eval(lambda: [head(C, x, norm=final)]), _timed_eval(lambda: [head(R, x, norm=final)])
    rows.append(common.Row("kernels", shape, "norm+head: weight read", "GB/s", hb / t_ours / 1e9, hb / t_ref / 1e9,
                           "MLX ops", ">= 1.0", f"max diff / ref scale {checks['norm+head']['rel']:.2e}",
                           checks["norm+head"]))
    # the attention kernel at several positions: buffers whose rows past the position hold large
    # values (masked), the new key and value written in place, nothing else in the buffers changed
    cap = 2048
    kvshape = (1, layer.kv_heads, cap, layer.head_dim)
    keys, values = rnd(*kvshape), rnd(*kvshape)
    keys = mx.where((mx.arange(cap) > 1500)[None, None, :, None], mx.array(1e4, dt), keys)
    mx.eval(keys, values)
    qkv = rnd(1, 1, layer.qkv.w.shape[0])
    worst: dict[int, Any] = {}
    for at in (0, 5, 255, 256, 1000, 1500):
        pos = mx.array([at], dtype=mx.int32)
        kc, vc = keys + 0, values + 0
        mx.eval(kc, vc)
        o_ours, kc, vc = C.attention(layer, qkv, pos, kc, vc)
        mx.eval(o_ours)
        o_ref, kr, vr = R.attention(layer, qkv, pos, keys, values)
        worst[at] = {"out": _rel(o_ours, o_ref)["rel"], "keys": _rel(kc, kr)["rel"], "values": _rel(vc, vr)["rel"]}
    checks["attention"] = worst
    t_ours = _timed_eval(lambda: [C.attention(lay, qkv, pos, keys, values)[0] for lay in layers])
    t_ref = _timed_eval(lambda: [R.attention(lay, qkv, pos, keys, values)[0] for lay in layers])
    rows.append(common.Row("kernels", shape, f"attention at {at}, {len(layers)} layers", "ms", t_ours * 1e3,
                           t_ref * 1e3, "MLX ops (norms, RoPE, slice updates, SDPA)", "<= 1.0", json.dumps(worst)))
    by_split = {f"{at} S{s}": _timed_eval(lambda at=at, s=s: [
        C.attention(lay, qkv, mx.array([at], dtype=mx.int32), keys, values, split=s)[0] for lay in layers]) * 1e3
        for at in (64, 1500) for s in (1, 4, 8, 16, 32, 64)}
    best = min(by_split, key=by_split.get)
    rows.append(common.Row("kernels", shape, f"attention, {len(layers)} layers, at each split count (best: {best})",
                           "ms", by_split[best], None, "", "", json.dumps(by_split), by_split))
    ok = (all(c["rel"] < 2e-2 for k, c in checks.items() if k != "attention")
          and all(v < 2e-2 for w in worst.values() for v in w.values()))
    rows.append(common.Row("kernels", shape, "all kernels within 2% of the reference", "", float(ok), 1.0, "", "",
                           "", checks))
    return rows


def _timed_eval(build, reps: int = 10) -> float:
    """Median seconds of evaluating the graph `build()` makes, built before the clock starts."""
    import mlx.core as mx

    mx.eval(build())
    out = []
    for _ in range(reps):
        ys = build()
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(ys)
        mx.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def step_profile(model, prompt, steps: int = 32) -> dict[str, float]:
    """Where a synchronous one-token step's time goes (ms, medians): building its graph (Python),
    evaluating it up to the host's return (`mx.async_eval`: recording and launching), and waiting
    for the device after that."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(prompt)], dtype=mx.uint32), cache=cache))
    y = mx.array([[int(prompt[-1])]], dtype=mx.uint32)
    parts: dict[str, list[float]] = {"build": [], "host_eval": [], "device_wait": []}
    for i in range(steps + 4):
        t0 = time.perf_counter()
        logits = model(y, cache=cache)
        t1 = time.perf_counter()
        mx.async_eval(logits)
        t2 = time.perf_counter()
        mx.synchronize()
        t3 = time.perf_counter()
        if i >= 4:
            for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                parts[k].append(v * 1e3)
    return {k: statistics.median(v) for k, v in parts.items()}


def part_llamacpp(a) -> tuple[dict[str, Any], list[common.Row]]:
    """llama.cpp's CUDA build on the 8B shape's sizes (bench/llama_cuda.py)."""
    from . import llama_cuda
    from .shapes import SHAPES

    got = llama_cuda.measure(SHAPES["qwen3-8b"].config, Path(a.llama_work), gen=a.gen,
                             prompt=a.llama_prompt, reps=a.reps, streams=a.streams)
    rows = []
    for kind, v in got["types"].items():
        dec = v.get("decode_tps", [])
        pre = v.get("prompt_tps", [])
        rows.append(common.Row("llama.cpp", kind, f"decode tg{a.gen} (llama-bench)", "tok/s", common.median(dec), None,
                               "", "", f"{len(dec)} reps ({common.spread(dec)}); prompt {a.llama_prompt}: "
                               f"{common.median(pre) or 0:.0f} tok/s; file {v['bytes'] / 1e9:.2f} GB", v))
    for kind, b in got["batched"].items():
        rows.append(common.Row("llama.cpp", kind, "streams (llama-batched-bench)", "tok/s", None, None, "", "",
                               "; ".join(f"{r['streams']}: {r['gen_tps']:.0f}" for r in b), {"rows": b}))
    return got, rows


def against_llamacpp(llama: dict[str, Any], step_rows: list[common.Row]) -> list[common.Row]:
    """Our batch-1 decode (service, median) beside llama.cpp's same-precision type: raw, and ours
    scaled by bytes per token (ours / theirs) where the files' sizes differ."""
    from .llama_cuda import TYPES

    out = []
    for kind, shape in TYPES.items():
        ours = next((r for r in step_rows if r.shape == shape and r.metric.startswith("decode batch 1")), None)
        theirs = llama["types"].get(kind, {})
        if ours is None or not theirs.get("decode_tps"):
            continue
        t = common.median(theirs["decode_tps"])
        per_token = ours.extra.get("bytes_per_token") or 0
        ratio_bytes = per_token / theirs["bytes"] if theirs.get("bytes") else 1.0
        out.append(common.Row("vs llama.cpp", shape, f"decode batch 1 vs {kind}", "tok/s", ours.ours, t,
                              f"llama.cpp CUDA {kind}", ">= 1.0",
                              f"bytes-scaled ratio {ours.ours * ratio_bytes / t:.2f} (ours {per_token / 1e9:.2f} GB/token, "
                              f"theirs {theirs['bytes'] / 1e9:.2f} GB)"))
    return out


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
    # the process's first prompt of this length, as now (other tokens): what a user's first long
    # prompt after loading costs, kept apart from the cold TTFT (no cached prefix) measured after
    def ttft(n: int, seed: int) -> float:  # a prompt of n tokens, as now
        return common.engine_direct(lm, Prompt(list(prompt_ids(n, vocab_size(shape), seed=seed)), [n]), 4)["ttft_s"]

    common.fresh_memory()
    t_first = ttft(n_prompt, 4)
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
    # then, as now, prompts of this length again (other tokens) and of lengths not seen before: a
    # kernel or attention plan built per shape (MLX's cuDNN attention graphs on CUDA) shows as the
    # difference
    again = [ttft(n_prompt, 6 + i) for i in range(2)]
    new_lengths = [ttft(n, 9) for n in (n_prompt - 97, n_prompt - 161)]
    extra = {"runs": out, "parts_gb": parts, "first_long_prompt_ttft_s": t_first,
             "same_length_again_ttft_s": again, "new_length_ttft_s": new_lengths}
    rows = [common.Row("memory", shape, f"peak, {n_prompt}-token prompt + {n_gen}", "GB",
                       pick("ours_all", "peak") / gb, pick("mlx", "peak") / gb, "mlx_lm.stream_generate",
                       "<= 1.0", "parts (weights/KV/activations GB): " + "; ".join(
                           f"{k}: {v['weights']:.2f}/{v['kv']:.2f}/{v['activations']:.2f}" for k, v in parts.items())
                       + "; " + "; ".join(f"{v} {pick(v + '_all', 'peak') / gb:.2f} GB" for v in variants(a)),
                       extra),
            common.Row("memory", shape, f"cold TTFT, {n_prompt}-token prompt", "s",
                       pick("ours_all", "ttft_s"), pick("mlx", "ttft_s"), "mlx_lm.stream_generate", "<= 0.8",
                       "; ".join(f"{v} {pick(v + '_all', 'ttft_s'):.3f} s" for v in variants(a))
                       + f"; the process's first {n_prompt}-token prompt {t_first:.3f} s, that length again "
                       + ", ".join(f"{t:.3f}" for t in again) + " s, new lengths ("
                       + f"{n_prompt - 97}, {n_prompt - 161}) " + ", ".join(f"{t:.3f}" for t in new_lengths) + " s")]
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
    ap.add_argument("--sweep", action="store_true", help="kernels: each product at rows/unroll variants")
    ap.add_argument("--kernel-groups", default=",".join(KERNEL_GROUPS),
                    help="kernels: which groups (products, int8, rows), so that each fits a device call")
    ap.add_argument("--variants", default="default", help="variants: ';'-separated switch settings")
    ap.add_argument("--llama-prompt", type=int, default=4096, help="llama-bench's prompt length")
    ap.add_argument("--llama-work", default="/tmp/llamacpp-gguf", help="where the GGUF files are written")
    ap.add_argument("--streams", default="1,8,32", help="llama-batched-bench's stream counts")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if unknown := set(a.kernel_groups.split(",")) - set(KERNEL_GROUPS):
        ap.error(f"--kernel-groups: unknown {', '.join(sorted(unknown))} (groups: {', '.join(KERNEL_GROUPS)})")
    device.select_device(a.device)
    from .shapes import build

    parts = a.parts.split(",")
    meta = common.run_meta(["python", "-m", "bench.gpu_step"] + list(argv if argv is not None else sys.argv[1:]))
    meta["settings"] = vars(a)
    meta["env"] = {k: v for k, v in __import__("os").environ.items() if k.startswith(("MLX_", "MLXCHAT_CUDA"))}
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
    llama = None
    if "llamacpp" in parts:
        try:
            llama, got = part_llamacpp(a)
            more["llamacpp"] = llama
        except Exception as exc:
            got = [common.failed("llamacpp", "-", f"{type(exc).__name__}: {exc}")]
        rows.extend(got)
        common.print_table(got)
        common.write_json(out, meta, rows, **more)
    shapes = a.shapes.split(",") if a.shapes else []
    if "demo" in parts and a.demo_shape not in shapes:
        shapes.append(a.demo_shape)
    for shape in shapes:
        t0 = time.perf_counter()
        print(f"[{shape}] building", flush=True)  # a run cut off by its time limit shows how far it got
        try:
            lm = build(shape)
            print(f"[{shape}] built in {time.perf_counter() - t0:.0f} s", flush=True)
        except Exception as exc:
            rows.append(common.failed("build", shape, f"{type(exc).__name__}: {exc}"))
            continue
        todo = [p for p in ("kernels", "variants", "step", "memory") if p in parts and shape in a.shapes.split(",")]
        if "demo" in parts and shape == a.demo_shape:
            todo.append("demo")
        for p in todo:
            print(f"[{shape}] part {p} ({time.perf_counter() - t0:.0f} s)", flush=True)
            try:
                got = {"kernels": lambda: part_kernels(lm, shape, a), "variants": lambda: part_variants(lm, shape, a),
                       "step": lambda: part_step(lm, shape, a, bw), "memory": lambda: part_memory(lm, shape, a),
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
    if llama is not None:
        rows.extend(against_llamacpp(llama, rows))
    common.write_json(out, meta, rows, **more)
    print()
    common.print_table(rows, title="bench.gpu_step")
    print(f"wrote {out}")
    mx.synchronize()
    return 1 if any(r.metric == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
