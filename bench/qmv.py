"""The quantized matrix x vector kernel (engine/kernels/qmv_cuda.py) on the device: correct first,
then its weight-read rate against MLX's `quantized_matmul`, then whole decode steps with it off and
on (`bench.gpu_step --parts bw,step`, ours and mlx-lm interleaved, one process per setting).

    python -m bench.qmv [--device auto] [--sizes 4096:4096,4096:12288,12288:4096,4096:151936]
                        [--bits 4,8] [--group-size 64] [--rows 1] [--reps 20]
                        [--step-shapes qwen3-8b-8bit,qwen3-8b-4bit] [--step-reps 4] [--gen 128]
                        [--out FILE]

Parts:
  kernel  per size (input:output) and bits, bf16 activations and scales: the largest difference
          of ours and of MLX's product from the fp32 product of the same dequantized weights (ours
          is correct when within 2x MLX's own, or 1% of the output's scale), then GB/s (packed
          weights + scales + biases read per second; a chain of distinct weights of >= `--chain-gb`
          in all, so L2 does not hold them; median and best of `--reps`), ours and MLX's
          interleaved. Without CUDA, "ours" is the kernel's numpy emulation (correctness only, no
          rate) and MLX's rate is the CPU's.
  step    `bench.gpu_step --parts bw,step --shapes <step-shapes>` with MLXCHAT_CUDA_QMV=1 (every
          layer), unset (the default layers) and =0 (`--switches`; skipped when the kernel part
          found ours wrong), JSON beside --out.
Results: a table on stdout, JSON at --out (default bench/results/<backend>-<date>-qmv.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import common

SIZES = "4096:4096,4096:12288,12288:4096,4096:151936"


def _quantized(k: int, n: int, bits: int, group_size: int, seed: int):
    import mlx.core as mx

    mx.random.seed(seed)
    w = (mx.random.normal((n, k)) / math.sqrt(k)).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    mx.eval(wq, scales, biases)
    return wq, scales, biases


def _ours(cuda: bool):
    """Our product: the kernel on CUDA, its numpy emulation elsewhere."""
    import mlx.core as mx
    import numpy as np

    from engine.kernels import qmv_cuda

    if cuda:
        return qmv_cuda.qmv

    def emulated(x, w, scales, biases, bits, group_size):
        f32 = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
        y = qmv_cuda.emulate(f32(x.reshape(-1, x.shape[-1])), np.array(w), f32(scales), f32(biases), bits, group_size)
        return mx.array(y).astype(x.dtype).reshape(*x.shape[:-1], -1)  # the kernel writes x's dtype

    return emulated


def check(k: int, n: int, bits: int, group_size: int, rows: int, cuda: bool) -> dict[str, Any]:
    """Ours and MLX's product against the fp32 product of the dequantized weights."""
    import mlx.core as mx

    wq, scales, biases = _quantized(k, n, bits, group_size, seed=k + n + bits)
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731
    exact = f32(x) @ mx.dequantize(wq, f32(scales), f32(biases), group_size=group_size, bits=bits).T
    mlx = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group_size, bits=bits)
    ours = _ours(cuda)(x, wq, scales, biases, bits, group_size)
    err = lambda y: mx.abs(y.astype(mx.float32) - exact).max().item()  # noqa: E731
    scale = mx.abs(exact).max().item()
    e_ours, e_mlx = err(ours), err(mlx)
    return {"err_ours": e_ours, "err_mlx": e_mlx, "scale": scale,
            "ours_vs_mlx": mx.abs(ours.astype(mx.float32) - mlx.astype(mx.float32)).max().item(),
            "ok": e_ours <= max(2 * e_mlx, 0.01 * scale)}


def rates(k: int, n: int, bits: int, group_size: int, rows: int, reps: int, chain_gb: float,
          cuda: bool) -> dict[str, Any]:
    """GB/s of reading a chain of distinct quantized weights, ours and MLX's, interleaved."""
    import mlx.core as mx

    from engine.kernels import qmv_cuda

    first = _quantized(k, n, bits, group_size, seed=1)
    each = sum(a.nbytes for a in first)
    count = max(1, min(64, math.ceil(chain_gb * 1e9 / each)))
    chain = [first] + [_quantized(k, n, bits, group_size, seed=2 + i) for i in range(count - 1)]
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    mx.eval(x)
    sides = {"mlx": lambda w, s, b: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group_size,
                                                         bits=bits)}
    if cuda:
        sides["ours"] = lambda w, s, b: qmv_cuda.qmv(x, w, s, b, bits, group_size)
    got: dict[str, list[float]] = {side: [] for side in sides}
    for rep in range(reps + 1):  # the first round warms up (kernels compiled)
        for side, fn in sides.items():
            mx.synchronize()
            t = time.perf_counter()
            mx.eval([fn(*w) for w in chain])
            mx.synchronize()
            if rep:
                got[side].append(each * count / (time.perf_counter() - t) / 1e9)
    del chain
    mx.clear_cache()
    return {"bytes": each * count, "weights": count,
            **{side: {"median": common.median(v), "best": max(v), "all": v} for side, v in got.items()}}


def part_kernel(a, cuda: bool) -> list[common.Row]:
    rows: list[common.Row] = []
    for size in a.sizes.split(","):
        k, n = (int(v) for v in size.split(":"))
        for bits in (int(b) for b in a.bits.split(",")):
            label = f"{k}->{n} {bits}-bit g{a.group_size} x{a.rows}"
            try:
                c = check(k, n, bits, a.group_size, a.rows, cuda)
                r = rates(k, n, bits, a.group_size, a.rows, a.reps, a.chain_gb, cuda) if a.reps else {}
            except Exception as exc:
                import traceback

                traceback.print_exc()
                rows.append(common.failed("qmv", label, f"{type(exc).__name__}: {exc}"))
                continue
            what = "kernel" if cuda else "emulation"
            rows.append(common.Row("qmv", label, f"max error vs fp32 ({what})", "", c["err_ours"], c["err_mlx"],
                                   "mx.quantized_matmul", "",
                                   f"correct: {c['ok']}; output scale {c['scale']:.3g}; ours vs MLX "
                                   f"{c['ours_vs_mlx']:.3g}", {"check": c}))
            if "ours" in r:
                rows.append(common.Row("qmv", label, "weight read", "GB/s", r["ours"]["median"], r["mlx"]["median"],
                                       "mx.quantized_matmul", ">= 1.0",
                                       f"median of {a.reps}; best {r['ours']['best']:.0f} vs {r['mlx']['best']:.0f}; "
                                       f"chain of {r['weights']} weights, {r['bytes'] / 1e9:.2f} GB", {"rates": r}))
            elif r:
                rows.append(common.Row("qmv", label, "weight read (MLX only: no CUDA)", "GB/s", r["mlx"]["median"],
                                       r["mlx"]["median"], "mx.quantized_matmul", "",
                                       f"median of {a.reps}; chain of {r['weights']} weights", {"rates": r}))
            common.print_table(rows[-2:] if "ours" in r else rows[-1:])
    return rows


def part_step(a, out: Path) -> dict[str, Any]:
    """bench.gpu_step with each of `--switches` (MLXCHAT_CUDA_QMV=1, unset: the default, =0), each
    in its own process; their JSON paths and exit codes."""
    done: dict[str, Any] = {}
    for switch in a.switches.split(","):
        path = out.with_name(f"{out.stem}-step-qmv{switch}.json")
        cmd = [sys.executable, "-m", "bench.gpu_step", "--device", a.device, "--parts", "bw,step",
               "--shapes", a.step_shapes, "--reps", str(a.step_reps), "--gen", str(a.gen),
               "--bw-gb", str(a.bw_gb), "--out", str(path)]
        env = {k: v for k, v in os.environ.items() if k != "MLXCHAT_CUDA_QMV"}
        if switch != "auto":
            env["MLXCHAT_CUDA_QMV"] = switch
        print(f"\n$ MLXCHAT_CUDA_QMV={switch} {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.run(cmd, env=env).returncode
        done[f"qmv{switch}"] = {"json": str(path), "rc": rc}
    return done


def main(argv=None) -> int:
    import mlx.core as mx

    from engine import device

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--parts", default="kernel,step")
    ap.add_argument("--sizes", default=SIZES, help="input:output widths, comma-separated")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chain-gb", type=float, default=1.0)
    ap.add_argument("--step-shapes", default="qwen3-8b-8bit,qwen3-8b-4bit")
    ap.add_argument("--step-reps", type=int, default=4)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--bw-gb", type=float, default=4.0)
    ap.add_argument("--switches", default="1,auto,0", help="MLXCHAT_CUDA_QMV values for the step part "
                    "(auto: unset, the default layers)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    device.select_device(a.device)
    cuda = device.backend() == "cuda"
    parts = a.parts.split(",")
    meta = common.run_meta(["python", "-m", "bench.qmv"] + list(argv if argv is not None else sys.argv[1:]))
    meta["settings"] = vars(a)
    stamp = dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    out = Path(a.out) if a.out else common.RESULTS_DIR / f"{meta['device']['backend']}-{stamp}-qmv.json"
    rows: list[common.Row] = []
    more: dict[str, Any] = {"cuda": cuda}
    if "kernel" in parts:
        rows = part_kernel(a, cuda)
        common.write_json(out, meta, rows, **more)
    wrong = [r.shape for r in rows if r.metric == "FAILED" or not r.extra.get("check", {"ok": True})["ok"]]
    if "step" in parts:
        if wrong:
            print(f"step part skipped: the kernel is wrong or failed on {wrong}", flush=True)
            more["step"] = {"skipped": wrong}
        else:
            more["step"] = part_step(a, out)
    common.write_json(out, meta, rows, **more)
    print()
    common.print_table(rows, title="bench.qmv")
    print(f"wrote {out}")
    mx.synchronize()
    failed = bool(wrong) or any(v.get("rc") for v in more.get("step", {}).values() if isinstance(v, dict))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
