"""Prompts prefilled in one call over mlx-lm's `BatchKVCache` (rows left-padded, as the
scheduler's `prefill_together` merges them) against the same prompts one by one over plain caches,
on the bundled model with our CPU kernels:

    python -m bench.batched_prefill [--lengths 200 200 200 200] [--rounds 7] [--out FILE]

Three ways, alternated round by round in one process (medians, with every round's figure): the
batch through our causal attention (`prefill_attention` with each row's left padding as its
start), the batch through mlx-lm's masked attention (the rule before: `layout._prompt_chunk`
taking plain caches only), and one prompt after another. It also prints the largest difference
between a batched row's last logits and the same prompt's alone, and whether their next tokens
agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[200, 200, 200, 200])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", help="a JSON file for the figures")
    a = ap.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from engine.kernels import layout
    from engine.loading.registry import load_model

    model = load_model(None).model
    prompts = [[(37 * i + 11 * r) % 40000 + 100 for i in range(n)] for r, n in enumerate(a.lengths)]
    padding = [max(a.lengths) - n for n in a.lengths]
    tokens = mx.array([[0] * p + q for p, q in zip(padding, prompts)])
    ours = layout._prompt_chunk

    def before(x, mask, cache, sliding=False):  # plain caches only
        return ours(x, mask, cache, sliding) if layout.plain_kv(cache) else (False, None)

    def batched(rule) -> tuple[float, mx.array]:
        layout._prompt_chunk = rule
        try:
            t = time.perf_counter()
            last = model(tokens, cache=[BatchKVCache(padding) for _ in model.layers])[:, -1]
            mx.eval(last)
            return time.perf_counter() - t, last
        finally:
            layout._prompt_chunk = ours

    def alone() -> tuple[float, list[mx.array]]:
        t, out = time.perf_counter(), []
        for p in prompts:
            out.append(model(mx.array([p]), cache=make_prompt_cache(model))[:, -1])
            mx.eval(out[-1])
        return time.perf_counter() - t, out

    ways = {"batched, ours": lambda: batched(ours)[0], "batched, mlx-lm attention": lambda: batched(before)[0],
            "one by one": lambda: alone()[0]}
    for way in ways.values():  # warm-up
        way()
    times: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(a.rounds):
        for k, way in (list(ways.items()) if r % 2 == 0 else list(ways.items())[::-1]):
            times[k].append(way())
    base = statistics.median(times["one by one"])
    for k, v in times.items():
        m = statistics.median(v)
        print(f"{k:27s} {m * 1e3:7.0f} ms (" + ", ".join(f"{x * 1e3:.0f}" for x in v) + f"), x one by one {m / base:.2f}")
    _, got = batched(ours)
    _, ref = alone()
    diff = max(mx.abs(got[i] - ref[i][0]).max().item() for i in range(len(prompts)))
    same = [got[i].argmax().item() == ref[i][0].argmax().item() for i in range(len(prompts))]
    print(f"largest |batched - alone| of the last logits {diff:.2e}; next tokens equal {same}")
    if a.out:
        Path(a.out).write_text(json.dumps({"lengths": a.lengths, "rounds": a.rounds, "seconds": times,
                                           "max_logit_diff": diff, "same_next_token": same}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
