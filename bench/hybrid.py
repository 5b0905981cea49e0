"""Hybrid (Qwen3.5-style) linear attention: engine/kernels/gated_delta.py (the chunked gated-delta
rule for prefill; one CUDA kernel for a decode step, gated_delta_cuda.py) against mlx-lm's own
path (a Metal kernel on Apple GPUs, else a per-token loop), in the same process.

  operator  one layer's recurrence at the shape's head sizes for T tokens (q/k/v in the model's
            dtype, state fp32), outputs compared; T = 1 is a decode step;
  model     cold prefill of T tokens through the whole model, in 2,048-token steps as
            mlx_lm.stream_generate prefills: ours against mlx-lm's own copy of the model.
Both sides are warmed at the timed length first; runs alternate; each row is the median of --reps
with the spread (min-max) in its notes and JSON.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

from . import common
from .common import Row

PREFILL_STEP = 2048


def _timed(fn: Callable[[], Any]) -> float:
    import mlx.core as mx

    mx.synchronize()
    t = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return time.perf_counter() - t


def _row(shape: str, metric: str, ours: list[float], base: list[float], notes: str,
         extra: dict[str, Any], goal: str = "<= 0.2") -> Row:
    """Times in seconds -> a row in ms, ours vs mlx-lm; the goal for prefill: at most a fifth of
    mlx-lm's time."""
    ms = lambda xs: [round(x * 1e3, 2) for x in xs]  # noqa: E731
    o, b = common.median(ours), common.median(base)
    return Row("hybrid", shape, metric, "ms", o * 1e3, b * 1e3, "mlx-lm's gated_delta_update", goal,
               f"median of {len(ours)}; ours {common.spread(ours, 1e3)} ms, mlx-lm "
               f"{common.spread(base, 1e3)} ms; {notes}",
               dict(extra, ours_ms=ms(ours), mlx_ms=ms(base), speedup=b / o if o else None))


def operator_rows(lm, shape: str, a, lengths: tuple[int, ...]) -> list[Row]:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.gated_delta import gated_delta_update as mlx_update, normalize_qk

    from engine.kernels.gated_delta import MIN_TOKENS, gated_delta_update
    from .shapes import text_config

    cfg = text_config(lm.config)
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    dtype = next(p.dtype for _, p in tree_flatten(lm.model.parameters()) if mx.issubdtype(p.dtype, mx.floating))
    rows = []
    for T in lengths:
        mx.random.seed(T)
        q, k = normalize_qk(mx.random.normal((1, T, hk, dk)).astype(dtype),
                            mx.random.normal((1, T, hk, dk)).astype(dtype), inv_scale=dk ** -0.5, eps=1e-6)
        v = mx.random.normal((1, T, hv, dv)).astype(dtype)
        a_, b_ = mx.random.normal((1, T, hv)).astype(dtype), mx.random.normal((1, T, hv)).astype(dtype)
        A_log, dt_bias = mx.random.uniform(-2, 1, (hv,)), mx.random.normal((hv,))
        mx.eval(q, k, v, a_, b_, A_log, dt_bias)
        args = (q, k, v, a_, b_, A_log, dt_bias)
        ours_out, mlx_out = gated_delta_update(*args), mlx_update(*args)  # warm-up, and the check
        err_y = mx.abs(ours_out[0].astype(mx.float32) - mlx_out[0].astype(mx.float32)).max().item()
        err_s = mx.abs(ours_out[1] - mlx_out[1]).max().item()
        runs = common.interleave({"ours": lambda: _timed(lambda: gated_delta_update(*args)),
                                  "mlx": lambda: _timed(lambda: mlx_update(*args))}, a.reps)
        rows.append(_row(shape, f"gated delta, one layer, {T} tokens", runs["ours"], runs["mlx"],
                         f"{hk}/{hv} key/value heads of {dk}/{dv}, {dtype}; max |diff| y {err_y:.2g}, "
                         f"state {err_s:.2g}", {"tokens": T, "max_abs_diff_y": err_y, "max_abs_diff_state": err_s},
                         goal="<= 0.2" if T >= MIN_TOKENS else "<= 1.0"))
    return rows


def model_row(lm, shape: str, a, T: int) -> Row:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from .shapes import prompt_ids, vocab_size

    tokens = mx.array([prompt_ids(T, vocab_size(shape), seed=5)], dtype=mx.uint32)

    def prefill(ours: bool) -> Callable[[], mx.array]:
        def run() -> mx.array:
            with (contextlib.nullcontext(lm.model) if ours else common.mlx_lm_paths(lm)) as model:
                cache = make_prompt_cache(model)
                for i in range(0, T, PREFILL_STEP):
                    logits = model(tokens[:, i:i + PREFILL_STEP], cache=cache)
                    mx.eval(logits, [c.state for c in cache])
            return logits[:, -1]
        return run

    last = {c: prefill(c)() for c in (True, False)}  # warm-up at the timed length, and the check
    diff = mx.abs(last[True].astype(mx.float32) - last[False].astype(mx.float32)).max().item()
    same_top = bool((last[True].argmax(-1) == last[False].argmax(-1)).item())
    runs = common.interleave({"ours": lambda: _timed(prefill(True)),
                              "mlx": lambda: _timed(prefill(False))}, a.reps)
    return _row(shape, f"cold prefill, {T} tokens, whole model", runs["ours"], runs["mlx"],
                f"{PREFILL_STEP}-token steps; last-token logits max |diff| {diff:.2g}, same argmax: {same_top}",
                {"tokens": T, "max_abs_diff_logits": diff, "same_argmax": same_top})


def suite_hybrid(lm, shape: str, a) -> list[Row]:
    """Operator rows for a decode step (1 token, on CUDA), at 1,024 and at the context length, then
    the whole-model cold prefill."""
    import mlx.core as mx

    from engine import device

    T = 1024 if a.quick else a.ctx
    step = {1} if device.backend() == "cuda" else set()  # elsewhere both sides run mlx-lm's step
    rows = operator_rows(lm, shape, a, tuple(sorted(step | {1024, T})))
    if mx.default_device() == mx.gpu or shape.startswith("tiny"):
        rows.append(model_row(lm, shape, a, T))
    return rows
