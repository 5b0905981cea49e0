"""How close our one-row 4-bit products come to the memory's limit: for each matrix of a decode
step at bench/decode.py's shapes, the bytes our quantized matrix x vector product reads per
second (codes, scales and biases as stored), against the read bandwidth of the same threads
measured in the same process right before and after (a STREAM-style sum, `kernels.read_bandwidth`).
A ratio taken at one moment survives a busy machine better than tok/s do.

    python -m bench.matvec [--models llama-1b,llama-3b] [--reps 2] [--rounds 3] [--int8]

Matrices: q, k/v, o, gate/up, down and the tied output head of each model (random 4-bit weights,
group 32, fp16 scales, as the bench folders; built here, not loaded), each in distinct copies
totalling --footprint bytes read one after the other, so that every product reads its weights
from memory as a decode step does. Results: a table and JSON in bench/results/matvec-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "matvec-cpu.json"


def _matrices(shape: dict) -> dict[str, tuple[int, int]]:
    """(rows, columns) of each product of a decode step."""
    hidden, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    return {"q": (heads * head_dim, hidden), "k/v": (kv * head_dim, hidden),
            "o": (hidden, heads * head_dim), "gate/up": (shape["intermediate_size"], hidden),
            "down": (hidden, shape["intermediate_size"]), "head": (49152, hidden)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama-1b,llama-3b")
    ap.add_argument("--reps", type=int, default=2, help="passes over the copies per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--footprint", type=int, default=256 * 2**20,
                    help="bytes of distinct copies of each matrix read in turn (past the caches)")
    ap.add_argument("--int8", action="store_true", help="the int8-activation products")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args(argv)

    import mlx.core as mx

    from engine.kernels import native

    from .decode import RANDOM_MODELS, read_bandwidth

    kernels = native.kernels()
    if kernels is None:
        raise SystemExit(f"no CPU kernels: {native.status().reason}")
    rows = []
    print(f"{'model':<10} {'matrix':<8} {'shape':>13} {'MB':>7} {'product GB/s':>12} "
          f"{'read GB/s':>9} {'fraction':>8}")
    for model in a.models.split(","):
        for name, (n, k) in _matrices(RANDOM_MODELS[model]).items():
            w, s, b = mx.quantize(mx.random.normal((n, k)) * 0.02, group_size=32, bits=4)
            s, b = s.astype(mx.float16), b.astype(mx.float16)
            x = mx.random.normal((1, k))
            nbytes = w.nbytes + s.nbytes + b.nbytes
            # distinct copies past any cache, one product each, as a decode step reads its layers
            copies = [(w + 0, s + 0, b + 0) for _ in range(-(-a.footprint // nbytes))]
            mx.eval(x, copies)
            best, limits = 0.0, []
            for _ in range(a.rounds):  # each round: the limit, then the products, then the limit
                limits.append(read_bandwidth())
                mx.eval(kernels.quantized_matmul(x, w, s, b, 32, 4, int8=a.int8))  # warm
                t0 = time.perf_counter()
                for _ in range(a.reps):
                    for cw, cs, cb in copies:
                        mx.eval(kernels.quantized_matmul(x, cw, cs, cb, 32, 4, int8=a.int8))
                best = max(best, a.reps * len(copies) * nbytes / (time.perf_counter() - t0))
                limits.append(read_bandwidth())
            limit = max(limits)
            rows.append(dict(model=model, matrix=name, shape=[n, k], bytes=nbytes,
                             product_bandwidth=best, read_bandwidth=limit, read_all=limits,
                             fraction=best / limit))
            print(f"{model:<10} {name:<8} {f'{n}x{k}':>13} {nbytes / 1e6:>7.1f} {best / 1e9:>12.2f} "
                  f"{limit / 1e9:>9.2f} {best / limit:>8.2f}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(threads=kernels.num_threads(), isa=kernels.isa(), int8=a.int8, reps=a.reps,
                rounds=a.rounds, cpus=os.cpu_count(), load_avg=os.getloadavg(), time=time.time(),
                command="python -m bench.matvec " + " ".join(argv if argv is not None else sys.argv[1:]))
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
