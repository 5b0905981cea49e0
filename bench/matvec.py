"""How close our one-row 4-bit products come to the memory's limit: for each matrix of a decode
step at bench/decode.py's shapes, the bytes our quantized matrix x vector product reads per
second (codes, scales and biases as stored), against the read bandwidth of the same threads
over a buffer of the same footprint and the same pages, measured in the same process right before
and after (a STREAM-style sum with the unit's widest loads, `bench.decode.read_bandwidth`), and a
plain numpy sum (one thread; numpy backs large arrays with 2 MB pages) beside it. A ratio taken at
one moment survives a busy machine better than tok/s do.

    python -m bench.matvec [--models llama-1b,llama-3b] [--reps 2] [--rounds 3] [--int8]
                           [--pages 4k,2m] [--loops rows,row,rows-nopf] [--footprint BYTES]

Matrices: q, k/v, o, gate/up, down and the tied output head of each model (random 4-bit weights,
group 32, fp16 scales, as the bench folders; built here, not loaded), each in distinct copies
totalling --footprint bytes read one after the other, so that every product reads its weights
from memory as a decode step does. --pages: the copies (and the read test's buffer) on the
kernel's default 4 KB pages, on 2 MB pages (`kernels.huge_pages`, as the engine backs its
weights), or both; --loops: the 4-bit kernel taking several weight rows at once (`rows`, the
default), one at a time (`row`, the loop before it; the same bits), or several at once without
software prefetching (`rows-nopf`, `kernels.set_prefetch_bytes(0)`). Every variant runs in each
round, in turn. `--models bundled` takes the bundled SmolLM2-135M's shapes (all 4-bit here). Results: a table and JSON in bench/results/matvec-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "matvec-cpu.json"


# The bundled SmolLM2-135M's shapes (its weights are Q4_1 with an 8-bit tied head).
BUNDLED = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)


def model_shape(model: str) -> dict:
    """`bundled` (the bundled model's shapes) or one of bench/decode.py's random models'."""
    if model == "bundled":
        return BUNDLED
    from .decode import RANDOM_MODELS

    return RANDOM_MODELS[model]


def decode_matrices(shape: dict) -> dict[str, tuple[int, int]]:
    """(rows, columns) of each product of a decode step."""
    hidden, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    return {"q": (heads * head_dim, hidden), "k/v": (kv * head_dim, hidden),
            "o": (hidden, heads * head_dim), "gate/up": (shape["intermediate_size"], hidden),
            "down": (hidden, shape["intermediate_size"]), "head": (49152, hidden)}


def numpy_read(nbytes: int) -> float:
    """Bytes/s of numpy's own sum over `nbytes` of 64-bit words (one thread, 2 MB pages where
    numpy's allocator asks for them): a reference that does not go through our pool."""
    import numpy as np

    a = np.ones(max(nbytes, 2**20) // 8, dtype=np.uint64)
    a.sum()
    t0 = time.perf_counter()
    a.sum()
    a.sum()
    return 2 * a.nbytes / (time.perf_counter() - t0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama-1b,llama-3b")
    ap.add_argument("--reps", type=int, default=2, help="passes over the copies per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--footprint", type=int, default=768 * 2**20,
                    help="bytes of distinct copies of each matrix read in turn (a 1B model's size)")
    ap.add_argument("--pages", default="4k", help="4k, 2m or both: the copies' page size")
    ap.add_argument("--loops", default="rows,row",
                    help="rows (weight rows at once), row (one at a time), rows-nopf (rows "
                         "without software prefetching), comma-separated")
    ap.add_argument("--int8", action="store_true", help="the int8-activation products")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args(argv)

    import mlx.core as mx

    from engine.kernels import native

    from .decode import read_bandwidth

    kernels = native.kernels()
    if kernels is None:
        raise SystemExit(f"no CPU kernels: {native.status().reason}")
    pages = a.pages.split(",")
    prefetch = kernels.prefetch_bytes()
    variants = [(p, loop) for p in pages for loop in a.loops.split(",")]
    rows = []
    print(f"{'model':<10} {'matrix':<8} {'shape':>13} {'MB':>7} {'pages':>5} {'loop':>9} "
          f"{'product GB/s':>12} {'read GB/s':>9} {'fraction':>8} {'numpy GB/s':>10}")
    for model in a.models.split(","):
        for name, (n, k) in decode_matrices(model_shape(model)).items():
            w, s, b = mx.quantize(mx.random.normal((n, k)) * 0.02, group_size=32, bits=4)
            s, b = s.astype(mx.float16), b.astype(mx.float16)
            x = mx.random.normal((1, k))
            nbytes = w.nbytes + s.nbytes + b.nbytes
            count = -(-a.footprint // nbytes)
            # distinct copies past any cache, one product each, as a decode step reads its layers
            copies = {p: [(w + 0, s + 0, b + 0) for _ in range(count)] for p in pages}
            mx.eval(x, copies)
            for cw, cs, cb in copies.get("2m", []):
                for arr in (cw, cs, cb):
                    kernels.huge_pages(arr)
            best = {v: 0.0 for v in variants}
            limits = {v: [] for v in variants}
            numpy_all = []
            for i in range(a.rounds):  # each round: per variant, the limit, the products, the limit
                for v in variants if i % 2 == 0 else variants[::-1]:
                    p, loop = v
                    kernels.set_interleave_rows(loop != "row")
                    kernels.set_prefetch_bytes(0 if loop == "rows-nopf" else prefetch)
                    limits[v].append(read_bandwidth(count * nbytes, huge=p == "2m"))
                    mx.eval(kernels.quantized_matmul(x, w, s, b, 32, 4, int8=a.int8))  # warm
                    t0 = time.perf_counter()
                    for _ in range(a.reps):
                        for cw, cs, cb in copies[p]:
                            mx.eval(kernels.quantized_matmul(x, cw, cs, cb, 32, 4, int8=a.int8))
                    best[v] = max(best[v], a.reps * count * nbytes / (time.perf_counter() - t0))
                    limits[v].append(read_bandwidth(count * nbytes, huge=p == "2m"))
                numpy_all.append(numpy_read(count * nbytes))
            kernels.set_interleave_rows(True)
            kernels.set_prefetch_bytes(prefetch)
            del copies
            mx.clear_cache()
            for v in variants:
                p, loop = v
                limit = max(limits[v])
                rows.append(dict(model=model, matrix=name, shape=[n, k], bytes=nbytes, pages=p,
                                 loop=loop, footprint=count * nbytes, product_bandwidth=best[v],
                                 read_bandwidth=limit, read_all=limits[v], fraction=best[v] / limit,
                                 numpy_read=max(numpy_all)))
                print(f"{model:<10} {name:<8} {f'{n}x{k}':>13} {nbytes / 1e6:>7.1f} {p:>5} {loop:>9} "
                      f"{best[v] / 1e9:>12.2f} {limit / 1e9:>9.2f} {best[v] / limit:>8.2f} "
                      f"{max(numpy_all) / 1e9:>10.2f}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(threads=kernels.num_threads(), isa=kernels.isa(), int8=a.int8, reps=a.reps,
                rounds=a.rounds, cpus=os.cpu_count(), load_avg=os.getloadavg(), time=time.time(),
                command="python -m bench.matvec " + " ".join(argv if argv is not None else sys.argv[1:]))
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
