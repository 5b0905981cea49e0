"""The step loop around the batched model call: 8 concurrent streams on a model whose compute is
tiny (2 layers, hidden 64) but whose vocabulary is a real one's, so that what runs around the
model call (sampling, logits processors, host syncs, handing tokens to readers) is most of a step.

    python -m bench.concurrency_step [--streams 8] [--gen 64] [--reps 5] [--vocab 49152]
                                     [--profile FILE]

Ours (`engine.scheduling.service.Engine`, prefix cache off, greedy) against mlx-lm's
`batch_generate` on the same model object and the same prompt ids, runs interleaved; each side's
aggregate tok/s is all tokens over the wall time from submission (prefill included).
`--profile FILE` also runs ours once under cProfile (the scheduler thread) and writes the
cumulative-time listing to FILE.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import mlx.core as mx

from . import common
from .shapes import Shape, build_module, prompt_ids

CONFIG = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "max_position_embeddings": 8192,
}


def tiny_lm(vocab: int):
    """The 2-layer llama with a `vocab`-token head, fp32, as an engine `LoadedModel`."""
    from pathlib import Path

    from engine.loading.registry import LoadedModel
    from .shapes import IdTokenizer

    config = {**CONFIG, "vocab_size": vocab}
    model = build_module(Shape("tiny-vocab", config), mx.float32)
    return LoadedModel(name=f"random:tiny-vocab-{vocab}", model=model, tokenizer=IdTokenizer(vocab),
                       config=config, path=Path("/nonexistent/tiny-vocab"), extras={})


def mlx_batch(lm, prompts: list[list[int]], gen: int) -> dict:
    from mlx_lm.generate import batch_generate

    t = time.perf_counter()
    batch_generate(lm.model, lm.tokenizer, prompts, max_tokens=gen)
    mx.synchronize()
    return {"aggregate_tps": len(prompts) * gen / (time.perf_counter() - t)}


def profiled(svc: common.EngineService, prompts: list[list[int]], gen: int) -> str:
    """One concurrent run of ours with the scheduler thread under cProfile (switched on and off
    from that thread, between requests)."""
    profile = cProfile.Profile()
    svc.engine._call(profile.enable)  # noqa: SLF001 - the bench profiles the thread it measures
    svc.concurrent(prompts, gen)
    svc.engine._call(profile.disable)  # noqa: SLF001
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(30)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--profile", default=None)
    a = parser.parse_args()

    lm = tiny_lm(a.vocab)
    prompts = [prompt_ids(a.prompt, a.vocab, seed=100 + i) for i in range(a.streams)]
    svc = common.EngineService(lm, max_running=a.streams, prefix_cache=False)
    try:
        svc.concurrent(prompts, 8)  # warm up both sides
        mlx_batch(lm, prompts, 8)
        runs = common.interleave({"ours": lambda: svc.concurrent(prompts, a.gen),
                                  "mlx": lambda: mlx_batch(lm, prompts, a.gen)}, a.reps)
        if a.profile:
            with open(a.profile, "w") as f:
                f.write(profiled(svc, prompts, a.gen))
    finally:
        svc.close()
    tps = {k: [r["aggregate_tps"] for r in v] for k, v in runs.items()}
    ours, theirs = common.median(tps["ours"]), common.median(tps["mlx"])
    print(f"{a.streams} streams x {a.gen} tokens, vocab {a.vocab}, median of {a.reps}:")
    print(f"  ours            {ours:9.1f} tok/s  ({common.spread(tps['ours'])})")
    print(f"  batch_generate  {theirs:9.1f} tok/s  ({common.spread(tps['mlx'])})")
    print(f"  ratio           {ours / theirs:9.3f}x")


if __name__ == "__main__":
    main()
