"""Embedding throughput (issue 28): texts per second for 1, 32 and 256 short texts through
`POST /v1/embeddings` on a real server (the app in uvicorn on 127.0.0.1, the openai SDK's body:
base64 vectors) against the same forward pass called directly (`embed_batch` on the same chunks,
tokenising included, on a second copy of the same weights): the ratio is the serving cost (HTTP,
JSON, queueing on the scheduler thread). Median of `--reps` runs, the two interleaved.

    python -m bench.embeddings [--model chat|embedding|bundled] [--reps 5] [--out FILE]

`chat`: a tiny random llama embedding by mean pooling; `embedding`: a tiny random
Qwen3-Embedding-shaped model (last-token pooling) loaded beside it; `bundled`: the bundled
SmolLM2-135M as the chat-model fallback.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import (RESULTS_DIR, Row, median, print_table, run_meta, served_app, spread,
                          write_json)
from bench.shapes import SHAPES, TINY_QWEN3, build_folder, embedding_folder
from engine import Engine
from engine.decoding.pooling import embed_batch
from engine.loading.embedding_recipe import embedding_recipe
from engine.loading.registry import load_model
from engine.scheduling.embedding_queue import next_chunk

SIZES = (1, 32, 256)
# the bench's tiny llama with the bundled tokenizer's vocabulary (every token it makes is an id)
TINY_CHAT = {**SHAPES["tiny"].config, "vocab_size": 49152}


def short_texts(n: int) -> list[str]:
    return [f"Short text number {i}: a note about topic {i % 7} for retrieval." for i in range(n)]


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("chat", "embedding", "bundled"), default="chat")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results (default: bench/results/embeddings-cpu-<model>.json)")
    args = parser.parse_args(argv)

    chat = None if args.model == "bundled" else str(build_folder(TINY_CHAT))
    embedder = str(embedding_folder(TINY_QWEN3)) if args.model == "embedding" else None
    engine = Engine(chat, max_queued=8).start()
    served_name = embedder or engine.model_name
    direct_lm = load_model(embedder or chat)  # the same weights, a second copy for direct calls
    recipe = embedding_recipe(direct_lm.path)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp, served_app(engine, Path(tmp)) as app:
        url = app.url
        with httpx.Client(timeout=600) as client:
            for n in SIZES:
                texts = short_texts(n)

                def served() -> float:
                    t0 = time.perf_counter()
                    r = client.post(f"{url}/v1/embeddings", json={
                        "model": served_name, "input": texts, "encoding_format": "base64"})
                    r.raise_for_status()
                    return time.perf_counter() - t0

                def direct() -> float:
                    t0 = time.perf_counter()
                    ids = [list(direct_lm.tokenizer.encode(recipe.prompt(False) + t))
                           for t in texts]
                    order = sorted(range(n), key=lambda i: len(ids[i]))
                    while order:
                        picked = next_chunk(ids, order)
                        embed_batch(direct_lm.model, [ids[i] for i in picked], recipe)
                        order = order[len(picked):]
                    return time.perf_counter() - t0

                served(), direct()  # warm-up: the dedicated model loads, kernels compile
                times: dict[str, list[float]] = {"served": [], "direct": []}
                for _ in range(args.reps):
                    times["served"].append(served())
                    times["direct"].append(direct())
                rate = {k: n / median(v) for k, v in times.items()}
                rows.append(Row("embeddings", f"{args.model}:{served_name}", f"texts/s, {n} texts",
                                "texts/s", rate["served"], rate["direct"],
                                "embed_batch called directly",
                                notes=f"served {spread(times['served'], 1e3)} ms, direct "
                                      f"{spread(times['direct'], 1e3)} ms",
                                extra={"reps": args.reps, "seconds": times}))
    print_table(rows, "embeddings: POST /v1/embeddings vs the forward pass called directly")
    out = args.out or RESULTS_DIR / f"embeddings-cpu-{args.model}.json"
    write_json(out, run_meta(sys.argv if argv is None else argv), rows)
    return rows


if __name__ == "__main__":
    main()
