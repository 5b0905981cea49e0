"""What sampling costs per token on the CPU beside the model step: top-p, the app's draw and top
logprobs over a real vocabulary, mlx-lm's way against ours (engine/decoding/sampling.py
`apply_top_p`, engine/decoding/nucleus.py `draw`, engine/decoding/logprobs.py `most_likely`), each
result checked equal to mlx-lm's.

    python -m bench.sampling_cost [--vocab 49152] [--rows 1 4] [--reps 15] [--scale 3 8]

Per row count and logit scale (logits ~ N(0, scale^2): the larger, the more peaked the rows; the
bundled model's rows sit between 3 and 8 by the share of the vocabulary near the top): wall ms
(min and median of --reps, the ways taking turns) of
  top_p      mlx-lm's `apply_top_p` (MLX sorts the vocabulary) vs ours (NumPy sorts it, only the
             probabilities that can change the sum are exponentiated)
  greedy     one token per row from the logits, greedy: mlx-lm's log-softmax and argmax vs
             `sample_rows` (its log-softmax split over two CPU streams from two rows up)
  draw       one token per row from the logits with the app's default sampling (top_p 0.9,
             temperature 0.7): mlx-lm's log-softmax, `apply_top_p` and `mx.random.categorical`
             vs `sample_rows` (our path)
  logprobs   the 20 most likely ids: `mx.argsort(-row)[:20]` (one row) vs `most_likely`
  log_softmax  the rows' `logits - logsumexp(logits)`: MLX's ops (`mlx`; `mlx_2streams`: half
             the rows on a second CPU stream, the app's way before the kernel) vs the kernels'
             `log_softmax` (`kernel`: rows over the kernels' threads, what `log_softmax_rows`
             takes; `kernel_2streams`: half the rows on a second stream), each checked bit for
             bit equal to MLX's
The bundled model (vocabulary 49,152) decodes one token in ~12 ms on this CPU.
JSON goes to bench/results/sampling-cost-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).resolve().parent / "results" / "sampling-cost-cpu.json"


def timed(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, dict[str, float]]:
    """Each callable's wall ms over `reps` turns (they take turns), its result evaluated."""
    import mlx.core as mx

    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            out = fn()
            if isinstance(out, mx.array):
                mx.eval(out)
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: {"min_ms": round(min(t), 3), "median_ms": round(statistics.median(t), 3)}
            for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--scale", type=float, nargs="+", default=[3.0, 8.0])
    args = parser.parse_args()

    import mlx.core as mx
    import numpy as np
    from mlx_lm.sample_utils import apply_top_p as mlx_lm_top_p

    from engine.decoding.logprobs import most_likely
    from engine.decoding.sampling import (SamplingParams, TokenSampler, apply_top_p,
                                          log_softmax_rows, sample_rows, side_stream)
    from engine.kernels import native

    kernels = native.kernels()

    app = SamplingParams(temperature=0.7, top_p=0.9, seed=0)

    def mlx_log_softmax(logits: mx.array) -> mx.array:
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def mlx_lm_draw(logits: mx.array) -> mx.array:
        logprobs = mlx_log_softmax(logits)
        key = mx.random.key(0)
        return mx.concatenate([mx.random.categorical(
            mlx_lm_top_p(logprobs[i:i + 1], 0.9) * (1 / 0.7), key=mx.random.split(key)[1])
            for i in range(len(logprobs))])

    def our_draw(logits: mx.array) -> mx.array:
        return sample_rows([TokenSampler(app) for _ in range(len(logits))], [None] * len(logits),
                           logits)[0]

    def two_streams(fn: Callable[[mx.array], mx.array]) -> Callable[[mx.array], mx.array]:
        def run(logits: mx.array) -> mx.array:
            half = max(1, len(logits) // 2)
            with mx.stream(side_stream()):
                first = fn(logits[:half])
            return mx.concatenate([first, fn(logits[half:])]) if half < len(logits) else first
        return run

    softmaxes = {"mlx": mlx_log_softmax, "mlx_2streams": two_streams(mlx_log_softmax)}
    if kernels is not None:
        softmaxes |= {"kernel": log_softmax_rows, "kernel_2streams": two_streams(kernels.log_softmax)}

    rows_out = []
    for rows, scale in [(r, s) for s in args.scale for r in args.rows]:
        logits = mx.random.normal((rows, args.vocab), key=mx.random.key(rows)) * scale
        logprobs = mlx_log_softmax(logits)
        mx.eval(logprobs)
        assert mx.array_equal(apply_top_p(logprobs, 0.9), mlx_lm_top_p(logprobs, 0.9)).item()
        row = logprobs[0]
        assert most_likely(np.array(row), 20).tolist() == mx.argsort(-row)[:20].tolist()
        assert mx.array_equal(mlx_lm_draw(logits), our_draw(logits)).item()
        top_p = timed({"mlx_lm": lambda: mlx_lm_top_p(logprobs, 0.9),
                       "ours": lambda: apply_top_p(logprobs, 0.9)}, args.reps)
        draw = timed({"mlx_lm": lambda: mlx_lm_draw(logits), "ours": lambda: our_draw(logits)},
                     args.reps)
        greedy = [TokenSampler(SamplingParams()) for _ in range(rows)]
        argmax = timed({"mlx_lm": lambda: mx.argmax(mlx_log_softmax(logits), axis=-1),
                        "ours": lambda: sample_rows(greedy, [None] * rows, logits)[0]}, args.reps)
        top_ids = timed({"mx_argsort": lambda: [mx.argsort(-logprobs[i])[:20].tolist()
                                                for i in range(rows)],
                         "ours": lambda: [most_likely(np.array(logprobs[i]), 20).tolist()
                                          for i in range(rows)]}, args.reps)
        want = np.array(logprobs).view(np.uint32)
        for fn in softmaxes.values():  # bit for bit
            assert np.array_equal(np.array(fn(logits)).view(np.uint32), want)
        softmax = timed({name: (lambda f=fn: f(logits)) for name, fn in softmaxes.items()},
                        args.reps)
        rows_out.append({"rows": rows, "scale": scale, "top_p": top_p, "draw_app": draw, "greedy": argmax,
                         "top_logprobs_20": top_ids, "log_softmax": softmax})
        print(f"{rows} row(s), scale {scale}: top_p mlx-lm {top_p['mlx_lm']['median_ms']} ms, ours "
              f"{top_p['ours']['median_ms']} ms; app draw mlx-lm {draw['mlx_lm']['median_ms']} ms, "
              f"ours {draw['ours']['median_ms']} ms; greedy mlx-lm {argmax['mlx_lm']['median_ms']} ms, "
              f"ours {argmax['ours']['median_ms']} ms; top 20 ids mx.argsort "
              f"{top_ids['mx_argsort']['median_ms']} ms, ours {top_ids['ours']['median_ms']} ms; "
              "log-softmax " + ", ".join(f"{name} {t['median_ms']} ms"
                                         for name, t in softmax.items()),
              flush=True)
    result = {"command": "python -m bench.sampling_cost " + " ".join(sys.argv[1:]),
              "load_avg_1m": round(os.getloadavg()[0], 2), "vocab": args.vocab, "rows": rows_out}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
