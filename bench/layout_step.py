"""The model step alone, mlx-lm's model as `mlx_lm.load` gives it against the same weights in
mlxchat's GPU layout (engine/kernels/gpu_layout.py: q/k/v and gate/up stacked):

    python -m bench.layout_step [--shapes smollm2-135m,qwen3-8b] [--reps 5] [--gen 128] [--out F]

Per shape, runs interleaved, median with the min-max:
  b1       ms per token of a pipelined greedy decode loop (as mlx-lm's generate_step), batch 1;
  b8       the same loop with 8 rows;
  edit336  one 336-token call over a cache of 3,664 tokens (an edited last turn), to its first token;
and how many greedy tokens of the b1 loop the two models share. No engine, no scheduler: what
the layout alone changes. Meant for a GPU (the layout is what the loader gives a model there); on
the CPU it runs too, slowly.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from . import common
from .shapes import SHAPES, build_module, prompt_ids, vocab_size

RESULTS = Path(__file__).resolve().parent / "results" / "layout-step.json"


def _prefill(model, prompt: list[int], rows: int) -> list[Any]:
    cache = make_prompt_cache(model)
    model(mx.array([prompt[:-1]] * rows, dtype=mx.uint32), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def decode_loop(model, prompt: list[int], gen: int, rows: int = 1) -> tuple[float, list]:
    """(ms per token after the first, the greedy tokens), the next step enqueued before the current
    token is read."""
    cache = _prefill(model, prompt, rows)

    def step(y: mx.array) -> mx.array:
        return mx.argmax(model(y.reshape(rows, 1), cache=cache)[:, -1, :], axis=-1)

    nxt = step(mx.array([prompt[-1]] * rows, dtype=mx.uint32))
    mx.async_eval(nxt)
    tokens, t0 = [], 0.0
    for n in range(gen):
        cur = nxt
        if n < gen - 1:
            nxt = step(cur)
            mx.async_eval(nxt)
        tokens.append(cur.tolist())
        if n == 0:
            t0 = time.perf_counter()
    return (time.perf_counter() - t0) / (gen - 1) * 1e3, tokens


def edit_call(model, context: list[int], edited: list[int]) -> float:
    """ms for one call over `edited` after `context` is cached, to its last position's argmax."""
    cache = _prefill(model, context + [0], 1)
    t = time.perf_counter()
    mx.eval(mx.argmax(model(mx.array([edited], dtype=mx.uint32), cache=cache)[:, -1, :], axis=-1))
    return (time.perf_counter() - t) * 1e3


def measure(shape: str, reps: int, gen: int) -> dict[str, Any]:
    from engine.kernels.gpu_layout import to_gpu_layout

    models = {"stock": build_module(SHAPES[shape]), "stacked": to_gpu_layout(build_module(SHAPES[shape]))}
    vocab = vocab_size(shape)
    prompt = prompt_ids(64, vocab, seed=1)
    context, edited = prompt_ids(3664, vocab, seed=2), prompt_ids(336, vocab, seed=3)
    same = common.same_prefix(*(decode_loop(m, prompt, gen)[1] for m in models.values()))
    runs = common.interleave({f"{k} {w}": fn for k, m in models.items() for w, fn in (
        ("b1", lambda m=m: {"ms": decode_loop(m, prompt, gen)[0]}),
        ("b8", lambda m=m: {"ms": decode_loop(m, prompt, 64, rows=8)[0]}),
        ("edit336", lambda m=m: {"ms": edit_call(m, context, edited)}))}, reps, warmup=True)
    out: dict[str, Any] = {"shape": shape, "same_greedy_tokens": same, "of": gen}
    for key, rs in runs.items():
        ms = [r["ms"] for r in rs]
        out[key] = {"median_ms": common.median(ms), "spread_ms": common.spread(ms), "all_ms": ms}
    return out


def report(r: dict[str, Any], gen: int) -> None:
    for w in ("b1", "b8", "edit336"):
        s, t = r[f"stock {w}"], r[f"stacked {w}"]
        print(f"{r['shape']} {w}: stock {s['median_ms']:.2f} ms ({s['spread_ms']}), stacked "
              f"{t['median_ms']:.2f} ms ({t['spread_ms']}): {s['median_ms'] / t['median_ms']:.2f}x",
              flush=True)
    print(f"{r['shape']}: greedy tokens equal for the first {r['same_greedy_tokens']} of {gen}", flush=True)


if __name__ == "__main__":
    common.shape_tool(__doc__, "smollm2-135m,qwen3-8b", RESULTS, measure, report)
