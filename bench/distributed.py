"""A model sharded over 2 ranks on this host vs one process: decode tok/s and resident memory per
rank, and what the loopback ring costs per token.

    python -m bench.distributed [--tokens 48] [--out FILE]

A ~350M random llama (fp32, mlx-lm folder) is served by our Engine three ways, each greedy from
the same prompt: one process as `mlxchat serve` runs it (CPU layout), one rank through mlx-lm's
sharded layers (the same code path with a one-process group: the baseline for the sharding
itself), and two ranks started by `mlx.launch --backend ring -n 2`. The loopback cost is measured
directly: the time of one small `all_sum` between the two ranks, times the collectives a token
takes (three for the plan, two per layer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 24,
         "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 8,
         "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": 49152, "rope_theta": 10000.0,
         "max_position_embeddings": 8192, "tie_word_embeddings": False}
PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def collective_ms(group, n: int = 300) -> float:
    import mlx.core as mx

    x = mx.zeros((8,), dtype=mx.int32)
    mx.eval(mx.distributed.all_sum(x, group=group, stream=mx.cpu))
    start = time.perf_counter()
    for _ in range(n):
        mx.eval(mx.distributed.all_sum(x, group=group, stream=mx.cpu))
    return (time.perf_counter() - start) / n * 1e3


def worker(folder: str, tokens: int, mode: str) -> None:
    """One rank (or the one process): print a JSON line with what it measured."""
    import mlx.core as mx

    from engine import Cluster, Engine, SamplingParams
    from engine.loading.registry import load_model

    cluster = Cluster.join() if mode == "ranks" else None
    out: dict = {"mode": mode, "rank": cluster.rank if cluster else 0}
    if cluster is not None and cluster.rank != 0:
        out["collective_ms"] = collective_ms(cluster.world.group)
        cluster.follow()
        out["rss_mib"] = rss_mib()
        print(json.dumps(out), flush=True)
        return
    if cluster is not None:
        out["collective_ms"] = collective_ms(cluster.world.group)
        # no snapshot files: every run starts cold, as the one-process runs do
        engine = Engine(folder, **{**cluster.engine_options(), "persist_prefix_cache": False})
        cluster.watch(engine)
    elif mode == "one-sharded":
        group = mx.distributed.init()  # a group of one: mlx-lm's sharded layers, no network
        engine = Engine(folder, prefix_cache=False, batching=False,
                        load=lambda name, **_: load_model(name, group=group))
    else:
        engine = Engine(folder, prefix_cache=False, batching=False)
    engine.start()
    greedy = SamplingParams(temperature=0, max_tokens=tokens)
    for _ in engine.submit(PROMPT, SamplingParams(temperature=0, max_tokens=4)).events():
        pass  # warm up
    handle = engine.submit(PROMPT, greedy)
    events = list(handle.events())
    first, last = handle.times["first_token"], handle.times["last_token"]
    out["decode_tok_s"] = (len(events) - 2) / (last - first)
    out["tokens"] = [e.token for e in events if e.kind == "token"]
    engine.stop()
    if cluster is not None:
        cluster.stop()
    out["rss_mib"] = rss_mib()
    print(json.dumps(out), flush=True)


def run(args: list[str], env: dict[str, str]) -> list[dict]:
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise RuntimeError(f"{args[-4:]} failed:\n{done.stderr[-3000:]}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "distributed-cpu.json")
    parser.add_argument("--worker", nargs=2, metavar=("FOLDER", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.tokens, args.worker[1])
        return
    from bench.shapes import build_folder

    folder = str(build_folder(SHAPE))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    me = [sys.executable, "-m", "bench.distributed", "--tokens", str(args.tokens), "--worker", folder]
    launch = [str(Path(sys.executable).with_name("mlx.launch")), "--backend", "ring", "-n", "2",
              "--starting-port", "43311", "--"]
    rows = run(me + ["one"], env) + run(me + ["one-sharded"], env) + run(launch + me + ["ranks"], env)
    by = {(r["mode"], r["rank"]): r for r in rows}
    one, base, two = by[("one", 0)], by[("one-sharded", 0)], by[("ranks", 0)]
    per_token_collectives = 3 + 2 * SHAPE["num_hidden_layers"]
    loop_ms = two["collective_ms"] * per_token_collectives
    summary = {
        "shape": "llama ~350M fp32 (hidden 1024, 24 layers)", "tokens": args.tokens,
        "decode_tok_s": {"one process": one["decode_tok_s"], "one rank, sharded layers":
                         base["decode_tok_s"], "two ranks": two["decode_tok_s"]},
        "rss_mib": {"one process": one["rss_mib"], "one rank, sharded layers": base["rss_mib"],
                    "two ranks, rank 0": two["rss_mib"], "two ranks, rank 1": by[("ranks", 1)]["rss_mib"]},
        "collective_ms": two["collective_ms"], "collectives_per_token": per_token_collectives,
        "loopback_ms_per_token": loop_ms,
        "same_tokens": one["tokens"] == two["tokens"] == base["tokens"],
    }
    print(json.dumps(summary, indent=2))
    args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
