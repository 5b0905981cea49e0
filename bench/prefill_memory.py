"""Memory and rate of one prompt chunk on the CPU kernels: the peak resident set (VmHWM) and MLX's
peak while a 512-token chunk of a bench model runs (the engine's way: its body over every token,
the head over the last), with each prompt product as shipped (`kernels.prefill_matmul`: a tile of
the weight dequantized at a time, then BLAS) or as before issue 32 (`old`: the whole weight
dequantized to fp32 by `kernels.dequantize`, then one BLAS product, 8094460's path).

    python -m bench.prefill_memory [--models llama-350m,llama-1b] [--products old,new] [--reps 2]
                                   [--rounds 3]

Memory: each (model, product) runs in a process of its own (VmHWM only grows), --reps chunks in a
row (0: no memory rows), and reports its last chunk's peak: the weights plus what the chunk added (the process's own
~90 MB of Python and libraries included), MLX's peak over the weights, its allocator cache, and
the bytes the old path's buffer cache and the new path's tile buffer keep after the chunk. Rate:
then one process per model runs both products alternately, --rounds rounds (0: none), and gives the median
of the per-round ratios (new / old) and the CPU time per token: a ratio taken at one moment
survives a busy machine better than tok/s do. OpenBLAS is preloaded (as `mlxchat` does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHUNK = 512


def _load(name: str):
    from mlx_lm.utils import load_model

    from bench.decode import random_folder
    from engine.kernels import layout

    model, _ = load_model(random_folder(name))
    layout.to_kernel_layout(model)
    if not layout._Run.blas:
        raise SystemExit("no optimised BLAS loaded: prompt products would run on the quantized kernel")
    return model


def _old_product(module, x):
    """8094460's prompt product: the weight dequantized whole, then one BLAS product."""
    from engine.kernels import layout

    k = layout._Run.kernels
    w, s, b = module["weight"], module["scales"], module["biases"]
    if x.size // x.shape[-1] >= layout.BLAS_ROWS:
        return x @ k.dequantize(w, s, b, module.group_size, module.bits).T
    return k.quantized_matmul(x, w, s, b, module.group_size, module.bits)


def _use(product: str) -> None:
    from engine.kernels import layout

    if not hasattr(_use, "new"):
        _use.new = layout.quantized_product
    layout.quantized_product = _old_product if product == "old" else _use.new


def _chunk(model) -> tuple[float, float]:
    """One 512-token chunk from an empty cache: (seconds, CPU seconds of this process)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.kernels.head import last_logits

    tokens = mx.array([[(i * 7919) % 49000 + 10 for i in range(CHUNK)]])
    cache = make_prompt_cache(model)
    t, c = time.perf_counter(), time.process_time()
    mx.eval(last_logits(model, tokens, cache), [x.state for x in cache])
    return time.perf_counter() - t, time.process_time() - c


def memory_row(name: str, product: str, reps: int) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from bench.common import process_memory
    from engine.kernels import native

    model = _load(name)
    _use(product)
    weights = sum(p.nbytes for _, p in tree_flatten(model.parameters())) / 2**20
    loaded = process_memory()["rss_mb"]
    for _ in range(reps):
        mx.reset_peak_memory()
        seconds, _cpu = _chunk(model)
    k, s = native.kernels(), process_memory()
    return {"model": name, "product": product, "weights_mb": round(weights),
            "loaded_over_weights_mb": round(loaded - weights),
            "peak_rss_over_weights_mb": round(s["peak_rss_mb"] - weights),
            "rss_after_over_weights_mb": round(s["rss_mb"] - weights),
            "mlx_peak_over_weights_mb": round(mx.get_peak_memory() / 2**20 - weights),
            "mlx_cache_mb": round(mx.get_cache_memory() / 2**20),
            "dequantize_cache_mb": round(k.dequantize_cache_bytes() / 2**20),
            "tile_buffer_mb": round(k.prefill_buffer_bytes() / 2**20, 1),
            "tok_s": round(CHUNK / seconds, 1), "load": round(os.getloadavg()[0], 2)}


def rate_row(name: str, rounds: int) -> dict:
    model = _load(name)
    _use("new")
    _chunk(model)  # warm: the kernels' buffers, BLAS's threads
    rates: dict[str, list[float]] = {"old": [], "new": []}
    cpu: dict[str, list[float]] = {"old": [], "new": []}
    loads = []
    for r in range(rounds):
        for product in ("old", "new") if r % 2 == 0 else ("new", "old"):
            _use(product)
            seconds, cpu_s = _chunk(model)
            rates[product].append(CHUNK / seconds)
            cpu[product].append(cpu_s / CHUNK * 1e3)
        loads.append(os.getloadavg()[0])
    return {"model": name, "rounds": rounds,
            "tok_s": {p: round(statistics.median(v), 1) for p, v in rates.items()},
            "new_over_old": round(statistics.median(n / o for n, o in zip(rates["new"], rates["old"])), 3),
            "cpu_ms_per_token": {p: round(statistics.median(v), 2) for p, v in cpu.items()},
            "load": [round(min(loads), 2), round(max(loads), 2)]}


def _child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.prefill_memory", *args], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-350m,llama-1b")
    parser.add_argument("--products", default="old,new")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=("memory", "rate"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "memory":
        print(json.dumps(memory_row(args.models, args.products, args.reps)))
        return
    if args.child == "rate":
        print(json.dumps(rate_row(args.models, args.rounds)))
        return
    for name in args.models.split(","):
        for product in args.products.split(",") if args.reps else ():
            row = _child(["--child", "memory", "--models", name, "--products", product,
                          "--reps", str(args.reps)])
            print(f"{name} {product}: peak RSS weights {row['weights_mb']} + "
                  f"{row['peak_rss_over_weights_mb']} MB (just loaded: + {row['loaded_over_weights_mb']}), "
                  f"after + {row['rss_after_over_weights_mb']}; MLX peak weights + "
                  f"{row['mlx_peak_over_weights_mb']}, its cache {row['mlx_cache_mb']} MB; kept: dequantize "
                  f"cache {row['dequantize_cache_mb']} MB, tile buffer {row['tile_buffer_mb']} MB; "
                  f"{row['tok_s']} tok/s; load {row['load']}", flush=True)
        if args.rounds:
            row = _child(["--child", "rate", "--models", name, "--rounds", str(args.rounds)])
            print(f"{name} rate, {row['rounds']} rounds alternating: old {row['tok_s']['old']} / new "
                  f"{row['tok_s']['new']} tok/s, new/old {row['new_over_old']} (median per round); CPU "
                  f"ms/token old {row['cpu_ms_per_token']['old']} / new {row['cpu_ms_per_token']['new']}; "
                  f"load {row['load'][0]}-{row['load'][1]}", flush=True)


if __name__ == "__main__":
    from engine import restart_with_blas

    restart_with_blas("bench.prefill_memory")  # as `mlxchat` does: prompt products go to BLAS
    main()
