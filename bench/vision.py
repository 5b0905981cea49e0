"""Time to first token with an image (issue 31): one image and a short question, cold (nothing
cached) and as a follow-up question about the same image (its prefill reused from the prefix
cache), through our engine's generation (engine/decoding/vision.py) against `mlx_vlm`'s own
`stream_generate` on the same model object, the same rendered prompt and image, in the same run,
interleaved. mlx-vlm's `generate` keeps no cache between calls, so its follow-up prefills the
whole conversation again. Median of `--reps` runs.

    python -m bench.vision [--model qwen2_5_vl|smolvlm] [--side 112] [--reps 5] [--out FILE]

The model is a tiny random-weight VLM (tests/tiny_vlms.py) on whatever device MLX uses.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, Row, median, print_table, run_meta, spread, write_json


QUESTION = "What is in this image?"
FOLLOW_UP = "And what colours does it have?"


def _load(model: str):
    from bench.vlm_shapes import tiny_qwen2_5_vl, tiny_smolvlm

    return {"qwen2_5_vl": tiny_qwen2_5_vl, "smolvlm": tiny_smolvlm}[model]()


def conversations(image: Any) -> tuple[list[dict], list[dict]]:
    """The first question, and the follow-up (after a fixed answer) about the same image."""
    first = [{"role": "user", "content": [{"type": "image", "image": image},
                                          {"type": "text", "text": QUESTION}]}]
    follow = first + [{"role": "assistant", "content": "A picture of noise."},
                      {"role": "user", "content": FOLLOW_UP}]
    return first, follow


def ours_ttft(lm, messages: list[dict], store) -> tuple[float, int]:
    """Seconds from the request to its first token, and the tokens reused from `store`."""
    from engine.decoding.generate import Generation, build_prompt
    from engine.decoding.sampling import SamplingParams

    start = time.perf_counter()
    gen = Generation(lm, build_prompt(lm, messages=messages), SamplingParams(max_tokens=2),
                     prefix_cache=store)
    while gen.first_token_at is None and not gen.done:
        gen.step()
    ttft = (gen.first_token_at or time.perf_counter()) - start
    while not gen.done:
        gen.step()
    return ttft, gen.reused


def mlx_vlm_ttft(lm, messages: list[dict], image: Any) -> float:
    """Seconds from the call to mlx-vlm's first token, on the prompt text we render."""
    from mlx_vlm import stream_generate

    parts = lm.extras["vision"]
    plain = [{**m, "content": [{"type": "image"} if p.get("type") == "image" else p
                               for p in m["content"]]} if isinstance(m["content"], list) else m
             for m in messages]
    text = lm.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    start = time.perf_counter()
    for _ in stream_generate(parts.vlm, parts.processor, text, image=[image.image], max_tokens=2,
                             temperature=0.0):
        return time.perf_counter() - start
    return float("nan")


def measure(model: str, side: int, reps: int) -> tuple[list[Row], dict[str, Any]]:
    from engine.prefix_cache.store import PrefixCache
    from engine.decoding.generate import build_prompt
    from engine.decoding.vision import ImageInput
    from bench.vlm_shapes import random_image

    lm = _load(model)
    times: dict[str, list[float]] = {k: [] for k in ("cold", "follow", "vlm_cold", "vlm_follow",
                                                     "no_cache")}
    reused = []
    for rep in range(reps + 1):  # the first round warms up (compiles, allocates) and is dropped
        image = ImageInput.from_pil(random_image(100 + rep, (side, side)))
        first, follow = conversations(image)
        store = PrefixCache(lm, budget_bytes=2**30)
        bare, _ = ours_ttft(lm, first, None)
        cold, _ = ours_ttft(lm, first, store)
        vlm_cold = mlx_vlm_ttft(lm, first, image)
        warm, hit = ours_ttft(lm, follow, store)
        vlm_follow = mlx_vlm_ttft(lm, follow, image)
        if rep:
            for key, value in zip(times, (cold, warm, vlm_cold, vlm_follow, bare)):
                times[key].append(value)
            reused.append(hit)
    image = ImageInput.from_pil(random_image(100, (side, side)))
    first, follow = conversations(image)
    tokens = {"first": len(build_prompt(lm, messages=first).tokens),
              "follow_up": len(build_prompt(lm, messages=follow).tokens),
              "image": build_prompt(lm, messages=first).tokens.count(lm.extras["vision"].image_token_id)}
    shape = f"{model} tiny, {side}x{side} image"
    rows = [
        Row("vision", shape, "TTFT cold (one image + question)", "ms",
            median(times["cold"]) * 1e3, median(times["vlm_cold"]) * 1e3, "mlx_vlm.stream_generate",
            goal="<= 1.1", notes=f"ours {spread(times['cold'], 1e3)} ms"),
        Row("vision", shape, "TTFT cold, without a prefix cache", "ms",
            median(times["no_cache"]) * 1e3, median(times["vlm_cold"]) * 1e3,
            "mlx_vlm.stream_generate", goal="<= 1.1",
            notes="no snapshot of the prompt is taken before the first token"),
        Row("vision", shape, "TTFT follow-up (same image)", "ms",
            median(times["follow"]) * 1e3, median(times["vlm_follow"]) * 1e3,
            "mlx_vlm.stream_generate", goal="<= 1.0",
            notes=f"reused {min(reused)}-{max(reused)} of {tokens['follow_up']} tokens"),
    ]
    return rows, {"tokens": tokens, "reused": reused, "times_s": times}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("qwen2_5_vl", "smolvlm"), default="qwen2_5_vl")
    ap.add_argument("--side", type=int, default=112, help="the square image's side in pixels")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    rows, extra = measure(a.model, a.side, a.reps)
    print_table(rows, "Vision TTFT")
    out = a.out or RESULTS_DIR / f"vision-{a.model}-cpu.json"
    write_json(out, run_meta(sys.argv if argv is None else argv), rows, **extra)
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
