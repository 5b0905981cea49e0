"""Resident memory over rounds of load, beside what the prefix cache holds (issue 54: RSS grew
288 -> 1,983 MB over 10 load rounds, flattening). Each round sends `--requests` chats of ~300
distinct words to the bundled model and prints, after it: the process's RSS, the prefix cache's
bytes and entries, MLX's active and cached memory. With the machine's default memory budget the
cache (and RSS with it) grows by each round's snapshots; with `--budget-mib` it stops at the
budget and RSS flattens there: the growth is the prefix cache filling its budget, not a leak.

    python -m bench.rss_rounds                    # the default budget (most of the memory)
    python -m bench.rss_rounds --budget-mib 256   # the cache stops at ~190 MiB, RSS flattens
"""

import argparse
import random
from pathlib import Path

import mlx.core as mx

from engine import Engine, SamplingParams

WORDS = "sea ship harbour wind sail storm island coast wave tide rope anchor".split()


def rss_mb() -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) // 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mib", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=4)
    args = parser.parse_args()
    engine = Engine(memory_budget=args.budget_mib * 2**20 if args.budget_mib else None).start()
    rng = random.Random(0)
    print(f"memory budget {engine.status().memory_budget // 2**20} MiB, RSS {rss_mb()} MB")
    try:
        for r in range(args.rounds):
            handles = [engine.submit([{"role": "user", "content": f"Round {r}, chat {i}: " + " ".join(
                rng.choice(WORDS) for _ in range(300))}], SamplingParams(max_tokens=24))
                for i in range(args.requests)]
            for handle in handles:
                list(handle.events(timeout=900))
            cache = engine.stats().prefix_cache
            print(f"round {r}: RSS {rss_mb()} MB, prefix cache {cache.bytes / 2**20:.0f} MiB in "
                  f"{cache.entries} entries, MLX active {mx.get_active_memory() / 2**20:.0f} MiB, "
                  f"MLX cache {mx.get_cache_memory() / 2**20:.0f} MiB", flush=True)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
