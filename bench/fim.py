"""Editor completion (issue 50): the time to first token of the second `/infill` completion in the
same file, the user having typed on at the cursor, against the same request on a server whose
prefix cache is off (everything before the cursor computed again): the ratio is what the prefix
cache saves between keystrokes. Also the share of the second prompt read from the cache.

    python -m bench.fim [--model PATH] [--file-tokens 2000] [--reps 5] [--out FILE]

Each rep is one file (a different generated source file, ~`--file-tokens` tokens before the
cursor, a short suffix after it): a first completion at the cursor, then the second after typing
a few characters, streamed; TTFT is the time to the first `data:` line. The baseline server runs
the second request cold. `--model`: a model with FIM tokens (a code model's folder or GGUF); by
default a tiny random llama with Qwen2.5-Coder's FIM tokens (bench/shapes.py `fim_folder`).
Median of the reps with their spread; the two servers' requests interleaved.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from bench.common import (RESULTS_DIR, Row, median, print_table, run_meta, served_app, spread,
                          write_json)
from bench.shapes import SHAPES, fim_folder
from engine import Engine

TINY = {**SHAPES["tiny"].config, "vocab_size": 49152, "max_position_embeddings": 8192}
SUFFIX = "\n\nif __name__ == \"__main__\":\n    main()\n"


def source_file(rep: int, lines: int) -> str:
    """A Python file of `lines` functions, different for each rep."""
    return "".join(f"def step_{rep}_{i}(values):\n    return [v * {i + rep} for v in values]\n\n"
                   for i in range(lines))


def ttft(client: httpx.Client, url: str, prefix: str) -> tuple[float, dict]:
    """(seconds to the first streamed line, the final line) of one `/infill` completion."""
    t0 = time.perf_counter()
    first, last = None, {}
    with client.stream("POST", f"{url}/infill", json={
            "input_prefix": prefix, "input_suffix": SUFFIX, "n_predict": 8, "temperature": 0,
            "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: "):
                first = first or time.perf_counter() - t0
                last = json.loads(line[6:])
    return first or 0.0, last


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model with FIM tokens (default: tiny)")
    parser.add_argument("--file-tokens", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results (default: bench/results/fim-cpu-<model>.json)")
    args = parser.parse_args(argv)
    model = args.model or str(fim_folder(TINY, "qwen2.5-coder"))
    lines = max(args.file_tokens // 25, 1)  # ~25 tokens a function
    times: dict[str, list[float]] = {"warm": [], "cold": []}
    shares: list[float] = []
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        (tmp / "a").mkdir()
        (tmp / "b").mkdir()
        warm = stack.enter_context(served_app(Engine(model).start(), tmp / "a"))
        cold = stack.enter_context(served_app(Engine(model, prefix_cache=False).start(), tmp / "b"))
        client = stack.enter_context(httpx.Client(timeout=600))
        name = warm.state.engine.model_name
        ttft(client, warm.url, "def warm_up():\n"), ttft(client, cold.url, "def warm_up():\n")
        for rep in range(args.reps):
            text = source_file(rep, lines)
            ttft(client, warm.url, text)  # the first completion in this file
            typed = text + "def run(values"
            seconds, final = ttft(client, warm.url, typed)
            times["warm"].append(seconds)
            shares.append(final["tokens_cached"] / final["tokens_evaluated"])
            times["cold"].append(ttft(client, cold.url, typed)[0])
            prompt_tokens = final["tokens_evaluated"]
    rows = [Row("fim", Path(name).name, "TTFT, 2nd completion in a file", "ms",
                median(times["warm"]) * 1e3, median(times["cold"]) * 1e3, "prefix cache off",
                goal="< 1.0",
                notes=f"{prompt_tokens} prompt tokens, {median(shares):.1%} from the cache; warm "
                      f"{spread(times['warm'], 1e3)} ms, cold {spread(times['cold'], 1e3)} ms",
                extra={"reps": args.reps, "seconds": times, "cached_share": shares,
                       "prompt_tokens": prompt_tokens}),
            Row("fim", Path(name).name, "its prompt read from the cache", "share", median(shares),
                1.0, "the whole prompt", goal=">= 0.9", notes=f"min {min(shares):.1%}")]
    print_table(rows, "fim: /infill TTFT of the next completion in the same file vs no cache")
    label = "tiny" if args.model is None else Path(name).name
    out = args.out or RESULTS_DIR / f"fim-cpu-{label}.json"
    write_json(out, run_meta(sys.argv if argv is None else argv), rows)
    return rows


if __name__ == "__main__":
    main()
