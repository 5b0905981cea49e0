"""What a product over several rows of x costs against one row, on our CPU kernels: the decode
batch's products (rows = streams decoding together).

    python -m bench.cpu_rows [--models bundled,llama-1b] [--matrices gate/up,down] [--rows 1,2,4]
                             [--threads 1] [--int8] [--reps 5] [--out FILE]

Matrices as bench.matvec builds them (a model's decode-step products, `bench.matvec.
decode_matrices`; random 4-bit weights, group 32, fp16 scales), each in enough distinct copies
(~40 MB) that the caches do not hold them. Per matrix and rows of x: the process's CPU time per
product (all threads; median of `--reps` passes of 10 products over every copy, with the
spread), ns per weight, and its ratio to the one-row product. CPU time rather than wall time:
other load on the machine moves it less. Compare two commits by running it in each checkout,
alternately.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

GROUP_SIZE = 32  # as bench.matvec's and bench/decode.py's random models


def product_us(kernels, x: mx.array, copies: list, int8: bool, reps: int) -> list[float]:
    """CPU µs per product of `x` with each copy in turn, one figure per pass."""
    runs = []
    for _ in range(reps):
        t = time.process_time()
        for _ in range(10):
            mx.eval([kernels.quantized_matmul(x, w, s, b, GROUP_SIZE, 4, int8) for w, s, b in copies])
        runs.append((time.process_time() - t) / (10 * len(copies)) * 1e6)
    return runs


def main() -> None:
    from engine.kernels import native

    from .matvec import decode_matrices, model_shape

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bundled,llama-1b")
    parser.add_argument("--matrices", default="gate/up,down", help="of bench.matvec's: q, k/v, "
                        "o, gate/up, down, head")
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--int8", action="store_true", help="the int8-activation products")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    a = parser.parse_args()
    kernels = native.kernels()
    if kernels is None:
        raise SystemExit(f"our CPU kernels are not available: {native.status().reason}")
    kernels.set_num_threads(a.threads)
    mx.random.seed(0)
    results = []
    print(f"{kernels.isa()}, {a.threads} thread(s), {'int8' if a.int8 else 'exact'} path")
    pairs = [(m, name) for m in a.models.split(",") for name in a.matrices.split(",")]
    for model, matrix in pairs:
        n, k = decode_matrices(model_shape(model))[matrix]
        copies = []
        for _ in range(max(1, int(40e6 / (n * k / 2)))):
            w, scales, biases = mx.quantize(mx.random.normal((n, k)) * 0.02, group_size=GROUP_SIZE,
                                            bits=4)
            copies.append((w, scales.astype(mx.float16), biases.astype(mx.float16)))
        mx.eval(copies)
        one = None
        for rows in (int(r) for r in a.rows.split(",")):
            x = mx.random.normal((rows, k))
            mx.eval(x)
            runs = product_us(kernels, x, copies, a.int8, a.reps)
            us = statistics.median(runs)
            one = us if rows == 1 else one
            row = {"model": model, "matrix": matrix, "n": n, "k": k, "rows": rows,
                   "us": round(us, 1), "spread": [round(min(runs), 1), round(max(runs), 1)],
                   "ns_per_weight": round(us * 1e3 / (n * k), 4),
                   "x_one_row": round(us / one, 3) if one else None}
            results.append(row)
            ratio = f"{row['x_one_row']:.2f}x one row" if one else ""
            print(f"  {model} {matrix:8s} {rows} row(s): {us:9.1f} us ({min(runs):.0f}-{max(runs):.0f}), "
                  f"{row['ns_per_weight']:.4f} ns/weight  {ratio}", flush=True)
    if a.out:
        a.out.write_text(json.dumps({"isa": kernels.isa(), "threads": a.threads, "int8": a.int8,
                                     "group_size": GROUP_SIZE, "results": results}, indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
