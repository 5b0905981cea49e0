"""What a row joining and a row leaving the decode batch cost: `DecodeBatch.join` and
`DecodeBatch.leave` (engine/scheduling/batch.py) over the engine's cache protocol (`LOCAL`), each
evaluated, on a batch of R rows of about C tokens each.

    python -m bench.batch_rows [--rows 4 8 32] [--contexts 200 2000] [--reps 9]
                               [--layers 30] [--kv-heads 3] [--head-dim 64] [--dtype float32]
                               [--out FILE]

The caches are random keys and values of a model's shape (default: the bundled SmolLM2-135M's
30 layers of 3 KV heads of 64, fp32 as our CPU layout keeps them); no model runs, so the figures
are the cache edits alone. Each round a row of C tokens joins (timed), one decode step's token is
written into every row (the batch's one-token update, untimed), then the middle row leaves
(timed: its cache extracted, as a row that is saved or goes on alone, and the batch filtered):
the batch is back to R rows, in whatever order the batch keeps them. Per (R, C): the median ms of
each edit with its spread, and the MLX memory each edit needed beyond what the batch held before
it (the peak over the active memory before the edit: what a copy of every row shows as).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from . import common


def _row_cache(layers: int, heads: int, dim: int, tokens: int, dtype: mx.Dtype, seed: int) -> list:
    """One request's model cache: `tokens` random keys and values in every layer."""
    mx.random.seed(seed)
    out = []
    for _ in range(layers):
        cache = KVCache()
        kv = mx.random.normal((2, 1, heads, tokens, dim)).astype(dtype)
        cache.update_and_fetch(kv[0], kv[1])
        out.append(cache)
    mx.eval([c.state for c in out])
    return out


def _gen(cache: list) -> SimpleNamespace:
    """What `DecodeBatch.join` and `.leave` read of a generation that saves nothing."""
    return SimpleNamespace(cache=cache, prefix_cache=None, done=False, finish_reason=None)


def _timed(fn) -> tuple[float, float]:
    """(ms, MB beyond the active memory before) of `fn()` (which evaluates what it edits)."""
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    t = time.perf_counter()
    fn()
    mx.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    return ms, (mx.get_peak_memory() - before) / 2**20


def measure(rows: int, context: int, reps: int, layers: int, heads: int, dim: int,
            dtype: mx.Dtype) -> dict:
    from engine.model_cache import LOCAL
    from engine.scheduling.batch import DecodeBatch

    batch = DecodeBatch(nn.Module(), LOCAL)

    def state():
        mx.eval([layer.state for layer in batch.cache])

    # rows of slightly different lengths, as requests admitted at different times are
    batch.join([_gen(_row_cache(layers, heads, dim, context + i, dtype, i)) for i in range(rows)])
    state()
    step = mx.zeros((rows + 1, heads, 1, dim), dtype)
    joins, leaves, join_mb, leave_mb = [], [], [], []
    for r in range(reps + 1):
        joining = _gen(_row_cache(layers, heads, dim, context, dtype, 1000 + r))

        def join():
            batch.join([joining])
            state()

        ms, mb = _timed(join)
        for layer in batch.cache:  # the step every row takes before anything leaves
            layer.update_and_fetch(step[: len(batch)], step[: len(batch)])
        state()
        leaving = batch.rows[rows // 2]

        def leave():
            batch.leave([leaving])
            mx.eval([layer.state for layer in leaving.cache])
            state()

        ms2, mb2 = _timed(leave)
        if r:  # the first round warms up
            joins.append(ms)
            leaves.append(ms2)
            join_mb.append(mb)
            leave_mb.append(mb2)
    kv_mb = sum(layer.nbytes for layer in batch.cache) / 2**20
    out = {"rows": rows, "context": context, "batch_cache_mb": round(kv_mb, 1),
           "join_ms": statistics.median(joins), "join_spread": common.spread(joins),
           "leave_ms": statistics.median(leaves), "leave_spread": common.spread(leaves),
           "join_extra_mb": round(max(join_mb), 1), "leave_extra_mb": round(max(leave_mb), 1)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[200, 2000])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args(argv)
    dtype = getattr(mx, a.dtype)
    results = []
    for context in a.contexts:
        for rows in a.rows:
            row = measure(rows, context, a.reps, a.layers, a.kv_heads, a.head_dim, dtype)
            common.fresh_memory()  # the last batch's memory gone
            results.append(row)
            print(f"{rows:3d} rows x {context:5d} tokens ({row['batch_cache_mb']:7.1f} MB): "
                  f"join {row['join_ms']:8.2f} ms ({row['join_spread']}, +{row['join_extra_mb']} MB)"
                  f"  leave {row['leave_ms']:8.2f} ms ({row['leave_spread']}, "
                  f"+{row['leave_extra_mb']} MB)", flush=True)
    if a.out:
        a.out.write_text(json.dumps({"meta": common.run_meta(argv or []), "results": results},
                                    indent=1))


if __name__ == "__main__":
    main()
