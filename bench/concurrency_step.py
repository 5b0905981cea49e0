"""The step loop around the batched model call: 8 concurrent streams on a model whose layers are
tiny (2 layers, hidden 64) but whose vocabulary is a real one's, so that a step is the work that
scales with the vocabulary (output head, log-softmax, sampling) and the host work around the model
call (building the step, host syncs, handing tokens to the readers).

    python -m bench.concurrency_step [--streams 8] [--gen 64] [--reps 5] [--vocab 49152]
                                     [--layers 2] [--hidden 64] [--profile FILE]
                                     [--baseline-engine DIR]

Ours (`engine.scheduling.service.Engine`, prefix cache off, greedy) against mlx-lm's
`batch_generate` on the same model object and the same prompt ids, runs interleaved. Per side:
aggregate tok/s (all tokens over the wall time from submission, prefill included) and the host
CPU time per token of the thread that drives the model (our scheduler thread; the caller of
`batch_generate`): on a GPU that time is what the device waits for when it is not hidden behind
the step in flight. Our reader threads' time (tokens handed to the streams) is not in it.
`--profile FILE` also runs ours once under cProfile (the scheduler thread) and writes the
cumulative-time listing to FILE. JSON goes to bench/results/concurrency-step-cpu.json.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import importlib.util
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import mlx.core as mx

from . import common
from .shapes import Shape, ours_and_mlx_lm, prompt_ids

RESULTS = Path(__file__).resolve().parent / "results" / "concurrency-step-cpu.json"
CONFIG = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "max_position_embeddings": 8192,
}


def tiny_lm(vocab: int, layers: int = 2, hidden: int = 64):
    """A small llama (`layers` layers of width `hidden`) with a `vocab`-token head, fp32, as an
    engine `LoadedModel`."""
    from engine.loading.registry import LoadedModel
    from .shapes import IdTokenizer

    config = {**CONFIG, "vocab_size": vocab, "num_hidden_layers": layers, "hidden_size": hidden,
              "intermediate_size": 2 * hidden}
    model, extras = ours_and_mlx_lm(Shape("tiny-vocab", config), mx.float32)
    return LoadedModel(name=f"random:tiny-vocab-{vocab}", model=model, tokenizer=IdTokenizer(vocab),
                       config=config, path=Path("/nonexistent/tiny-vocab"), extras=extras)


def mlx_batch(lm, prompts: list[list[int]], gen: int) -> dict:
    from mlx_lm.generate import batch_generate

    with common.mlx_lm_paths(lm) as model:
        t, cpu = time.perf_counter(), time.thread_time()
        batch_generate(model, lm.tokenizer, prompts, max_tokens=gen)
        mx.synchronize()
    n = len(prompts) * gen
    return {"aggregate_tps": n / (time.perf_counter() - t),
            "host_us_per_token": (time.thread_time() - cpu) / n * 1e6}


def scheduler_cpu_s(svc: common.EngineService) -> float:
    """CPU time the scheduler thread has used so far (read on that thread, between requests)."""
    out: list[float] = []
    svc.engine._call(lambda: out.append(time.thread_time()))  # noqa: SLF001 - the thread measured
    return out[0]


def ours(svc: common.EngineService, prompts: list[list[int]], gen: int) -> dict:
    cpu = scheduler_cpu_s(svc)
    run = svc.concurrent(prompts, gen)
    run["host_us_per_token"] = (scheduler_cpu_s(svc) - cpu) / run["tokens"] * 1e6
    return run


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


def engine_copy(folder: str, lm, streams: int) -> common.EngineService:
    """An `EngineService` running another copy of the engine package (`folder`/engine, e.g. from
    `git archive main engine`), imported as `engine_base`, so that two versions of the step loop
    run side by side in one process."""
    spec = importlib.util.spec_from_file_location(
        "engine_base", Path(folder) / "engine" / "__init__.py",
        submodule_search_locations=[str(Path(folder) / "engine")])
    package = importlib.util.module_from_spec(spec)
    sys.modules["engine_base"] = package
    spec.loader.exec_module(package)
    service = importlib.import_module("engine_base.scheduling.service")
    svc = common.EngineService.__new__(common.EngineService)
    svc.note, svc.prefix_cache = f"engine from {folder}", False
    svc.engine = service.Engine(load=lambda *a, **k: lm, max_running=streams, max_queued=64,
                                prefix_cache=False).start()
    return svc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--baseline-engine", default=None, metavar="DIR",
                        help="also run the engine package in DIR/engine (e.g. main's), side by side")
    a = parser.parse_args()

    lm = tiny_lm(a.vocab, a.layers, a.hidden)
    prompts = [prompt_ids(a.prompt, a.vocab, seed=100 + i) for i in range(a.streams)]
    svc = common.EngineService(lm, max_running=a.streams, prefix_cache=False)
    base = engine_copy(a.baseline_engine, lm, a.streams) if a.baseline_engine else None
    sides = {"ours": lambda: ours(svc, prompts, a.gen), "mlx": lambda: mlx_batch(lm, prompts, a.gen)}
    if base is not None:
        sides["base"] = lambda: ours(base, prompts, a.gen)
    try:
        runs = common.interleave(sides, a.reps, warmup=True)
        if a.profile:
            with open(a.profile, "w") as f:
                f.write(profiled(svc, prompts, a.gen))
    finally:
        svc.close()
        if base is not None:
            base.close()
    print(f"{a.streams} streams x {a.gen} tokens, vocab {a.vocab}, median of {a.reps}:")
    result = {"command": "python -m bench.concurrency_step " + " ".join(sys.argv[1:]),
              "load_average": os.getloadavg()[0], "streams": a.streams, "gen": a.gen,
              "vocab": a.vocab, "layers": a.layers, "hidden": a.hidden, "reps": a.reps, "runs": runs}
    for key, unit in (("aggregate_tps", "tok/s"), ("host_us_per_token", "us of host CPU per token")):
        got = {k: [r[key] for r in v] for k, v in runs.items()}
        med = {k: common.median(v) for k, v in got.items()}
        result[f"median_{key}"] = med
        print(f"  {unit}: ours {med['ours']:.1f} ({common.spread(got['ours'])}), batch_generate "
              f"{med['mlx']:.1f} ({common.spread(got['mlx'])}), ratio {med['ours'] / med['mlx']:.3f}x")
        if "base" in med:
            print(f"    baseline engine {med['base']:.1f} ({common.spread(got['base'])}), ratio "
                  f"{med['base'] / med['mlx']:.3f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {RESULTS}")

if __name__ == "__main__":
    main()
