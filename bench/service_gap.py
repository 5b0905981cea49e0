"""Where batch-1 decode through the Engine service loses against the same generation run in the
caller's thread (bench decode's "direct" column):

    python -m bench.service_gap [--shapes qwen3_5-hybrid,smollm2-135m] [--reps 5] [--gen 128] [--out F]

Per shape, tok/s after the first token, runs interleaved (median and min-max), of
  service_cache    the Engine (scheduler thread, a reader thread) with its prefix cache, as bench
                   decode's "ours";
  service_nocache  the same without a prefix cache;
  direct           engine.decoding.generate in the caller's thread, no prefix cache;
  mlx              mlx_lm.stream_generate on mlx-lm's own copy of the model.
A gap between service_nocache and direct is the hand-off between the threads; one between
service_cache and service_nocache is the prefix cache's work on the way.
"""

from __future__ import annotations

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
            "direct": lambda: common.engine_direct(lm, Prompt(list(prompt), [len(prompt)]), gen),
            "mlx": lambda: common.mlx_lm_stream(lm, prompt, gen)}, reps, warmup=True)
    finally:
        with_cache.close()
        without.close()
    out: dict[str, Any] = {"shape": shape}
    for side, rs in runs.items():
        tps = [r["tps"] for r in rs]
        out[side] = {"median_tps": common.median(tps), "spread": common.spread(tps), "all_tps": tps}
    return out


def report(r: dict[str, Any], gen: int) -> None:
    print(r["shape"] + ": " + ", ".join(f"{side} {common.fmt(v['median_tps'])} tok/s ({v['spread']})"
                                        for side, v in r.items() if side != "shape"), flush=True)


if __name__ == "__main__":
    common.shape_tool(__doc__, "qwen3_5-hybrid,smollm2-135m", RESULTS, measure, report)
