"""Where batch-1 decode through the Engine service loses against the same generation run in the
caller's thread (bench decode's "direct" column):

    python -m bench.service_gap [--shapes qwen3_5-hybrid,smollm2-135m] [--reps 5] [--gen 128] [--out F]

Per shape, tok/s after the first token, runs interleaved (median and min-max), of
  service_cache    the Engine (scheduler thread, a reader thread) with its prefix cache, as bench
                   decode's "ours";
  service_nocache  the same without a prefix cache;
  service_5ms      the same with Python's default GIL switch interval (5 ms) instead of the one
                   the Engine sets (engine/scheduling/service.py SWITCH_INTERVAL_S);
  direct           engine.decoding.generate in the caller's thread, no prefix cache;
  mlx              mlx_lm.stream_generate on mlx-lm's own copy of the model.
A gap between service_nocache and direct is the hand-off between the threads; one between
service_cache and service_nocache is the prefix cache's work on the way. Each side also gives the
median and 90th-percentile gap between tokens: a low rate with a normal median gap is stalls
(a thread waiting for the GIL, say), not slower steps.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from . import common
from .shapes import build, prompt_ids, vocab_size

RESULTS = Path(__file__).resolve().parent / "results" / "service-gap.json"


def measure(shape: str, reps: int, gen: int) -> dict[str, Any]:
    from engine.decoding.chat import Prompt

    lm = build(shape)
    prompt = prompt_ids(64, vocab_size(shape), seed=1)
    with_cache = common.EngineService(lm, max_running=1, prefix_cache=True)
    without = common.EngineService(lm, max_running=1, prefix_cache=False)
    try:
        runs = common.interleave({
            "service_cache": lambda: with_cache.stream(prompt, gen),
            "service_nocache": lambda: without.stream(prompt, gen),
            "service_5ms": lambda: with_switch_interval(5e-3, lambda: without.stream(prompt, gen)),
            "direct": lambda: common.engine_direct(lm, Prompt(list(prompt), [len(prompt)]), gen),
            "mlx": lambda: common.mlx_lm_stream(lm, prompt, gen)}, reps, warmup=True)
    finally:
        with_cache.close()
        without.close()
    out: dict[str, Any] = {"shape": shape}
    for side, rs in runs.items():
        tps = [r["tps"] for r in rs]
        out[side] = {"median_tps": common.median(tps), "spread": common.spread(tps), "all_tps": tps,
                     "gap_ms_p50": common.median([r["gap_ms_p50"] for r in rs]),
                     "gap_ms_p90": common.median([r["gap_ms_p90"] for r in rs])}
    return out


def with_switch_interval(seconds: float, run):
    """`run()` with the GIL switch interval at `seconds`, then back as it was."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        return run()
    finally:
        sys.setswitchinterval(before)


def report(r: dict[str, Any], gen: int) -> None:
    print(r["shape"] + ": " + ", ".join(
        f"{side} {common.fmt(v['median_tps'])} tok/s ({v['spread']}; gaps p50 {v['gap_ms_p50']:.2f}"
        f" p90 {v['gap_ms_p90']:.2f} ms)" for side, v in r.items() if side != "shape"), flush=True)


if __name__ == "__main__":
    common.shape_tool(__doc__, "qwen3_5-hybrid,smollm2-135m", RESULTS, measure, report)
