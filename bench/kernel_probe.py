"""Single kernels of the one-token step on the Qwen3-8B shape, each launched alone, for Nsight
Compute to time: what a kernel's fixed costs are, apart from its bytes.

    ncu --nvtx --nvtx-include "steps/" --clock-control none --cache-control all --csv \
        --metrics gpu__time_duration.sum python -m bench.kernel_probe > probe.csv
    python -m bench.kernel_probe --summarize probe.csv

`--only "gate/up norm; qkv norm"` runs those cases alone (for ncu's slower sections: `--section
WarpStateStats` and the like, `--reps 1`). The first command launches each case three times inside an NVTX range named "steps" (what ncu
profiles; each kernel alone, caches flushed before each); without ncu it prints each case's wall
time a launch, mostly launch cost. The second prints each kernel's times in launch order (cases
sharing a kernel follow each other, `CASES`' order). The cases:

- the 4-bit q/k/v, o, and gate/up products (random weights, groups of 64) with and without their
  fused RMSNorm, launch shapes of the bench's sweep (units a warp, words a lane loads at once, the
  next words loading while these are multiplied), int8 activations and the tensor-core kernel
  (`qmma4`, `MLXCHAT_CUDA_MV=mma`) and the folded arithmetic (`MLXCHAT_CUDA_MV=fold`);
- the norm's eps as a constant made once (`engine/kernels/inputs.py`) against one the host makes
  for the launch ("fresh eps"), and the attention's position likewise ("fresh pos": a one-element
  array, which MLX keeps in its managed pool of small arrays);
- the one-row attention at 72 and 900 positions: splits, fewer splits at short contexts (MK),
  one split, no q/k norms;
- kernels that only read the position, compute RoPE's angles (ours, `sin_cos`, and CUDA's
  `sincosf`), or do the attention's fence and counter, against an empty one.

On an H100 (2026-12-07; docs/gpu.md): reading a fresh position cost 15 us a kernel, a fresh eps
70-110 us; the angles 0.3-0.7 us; the attention at 72 positions 10 us.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from typing import Any

from . import common
from .step_kernels import profiled, read_ncu

HKV, G, D, CAP, K = 8, 4, 128, 1024, 4096  # Qwen3-8B's attention and hidden size


def cases() -> dict[str, Callable[[], Any]]:
    """Each case: a function launching its kernel once (inputs made here, once)."""
    import mlx.core as mx

    from engine.kernels import fused_cuda as C
    from engine.kernels import inputs

    dt = mx.bfloat16
    qkv = mx.random.normal((1, 1, (HKV * G + 2 * HKV) * D)).astype(dt)
    kc, vc = (mx.random.normal((1, HKV, CAP, D)).astype(dt) for _ in range(2))
    qn = kn = mx.ones((D,), dt)
    invf = mx.array([1e6 ** (-2 * i / D) for i in range(D // 2)], dtype=mx.float32)
    fp = mx.array([1e-6, 1.0, D ** -0.5], dtype=mx.float32)
    cnt = mx.zeros((HKV,), dtype=mx.int32)
    pos = {p: inputs.value(p, mx.int32) for p in (72, 900)}
    x = mx.random.normal((1, 1, K)).astype(dt)
    nw, res = mx.ones((K,), dt), mx.random.normal((K,)).astype(dt)

    def quantized(n: int) -> tuple[mx.array, ...]:
        w, s, b = mx.quantize(mx.random.normal((n, K)).astype(dt) * 0.02, group_size=64, bits=4)
        return w, s.astype(dt), b.astype(dt)

    wq, wo, wg = quantized((HKV * G + 2 * HKV) * D), quantized(K), quantized(2 * 12288)
    mx.eval(qkv, kc, vc, qn, invf, fp, cnt, x, nw, res, *pos.values(), *wq, *wo, *wg)
    norm = (nw, 1e-6)

    def mv(w, **kw):
        return C.matvec(x, *w, 4, 64, **kw)

    def folded(w, **kw):  # MLXCHAT_CUDA_MV=fold's arithmetic (matvec_impl's FOLD)
        with common.environ({C.MV_SWITCH: "fold"}):
            return mv(w, **kw)

    def fresh_eps(w, **kw):  # an eps array made for this launch
        inputs.constant.cache_clear()
        return mv(w, **kw)

    def attn(at: int, s: int, mk: int = 0, qk_norm: bool = True, fresh: bool = False):
        p = mx.array([at], dtype=mx.int32) if fresh else pos[at]
        return C._launch("attention", ["qkv", "qn", "kn", "invf", "fp", "pos", "kc", "vc", "cnt"],
                         [qkv, qn, kn, invf, fp, p, kc, vc, cnt], ["pm", "pl", "pa", "y"], C._ATTENTION,
                         [("T", dt), ("D", D), ("G", G), ("HKV", HKV), ("ROT", D), ("TRAD", False),
                          ("NORM", qk_norm), ("CAP", CAP), ("S", s), ("KU", 4), ("MK", mk)], (),
                         grid=(s * C.WARPS * 32, HKV, 1), threadgroup=(C.WARPS * 32, 1, 1),
                         output_shapes=[(G * HKV * s,), (G * HKV * s,), (G * HKV * s * D,), (1, 1, G * HKV * D)],
                         output_dtypes=[mx.float32, mx.float32, mx.float32, dt])[3]

    def probe(name: str, body: str, fresh: bool = False):
        kernel = C._kernel("probe_" + name, ["invf", "fp", "pos", "cnt"], ["y"], body)
        p = mx.array([72], dtype=mx.int32) if fresh else pos[72]
        return kernel(inputs=[invf, fp, p, cnt], template=[("S", 32)], grid=(32 * 128, HKV, 1),
                      threadgroup=(128, 1, 1), output_shapes=[(32 * HKV * 128,)], output_dtypes=[mx.float32])[0]

    out = "  y[(blockIdx.y * gridDim.x + blockIdx.x) * 128 + threadIdx.x] = "
    angles = ("  RopeAngles<128, 128, false> r; r.at(fp[1] * pos[0], invf, threadIdx.x & 31);\n"
              + out + "r.cs[0] + r.sn[3] + r.cs[2];\n")
    sincosf = ("  float s0, c0, s1, c1; const float a = fp[1] * pos[0];\n"
               "  sincosf(a * invf[threadIdx.x & 31], &s0, &c0); sincosf(a * invf[(threadIdx.x & 31) + 32], &s1, &c1);\n"
               + out + "s0 + c0 + s1 + c1;\n")
    counter = ("  __shared__ int last; fence_acq_rel(); __syncthreads();\n"
               "  if (threadIdx.x == 0) last = atomicAdd(const_cast<int*>(cnt) + blockIdx.y, 1) == S - 1;\n"
               "  __syncthreads(); if (!last) return; fence_acq_rel();\n"
               "  if (threadIdx.x == 0) const_cast<int*>(cnt)[blockIdx.y] = 0;\n" + out + "1.f;\n")
    return {
        "qkv norm": lambda: mv(wq, norm=norm),
        "qkv norm fresh eps": lambda: fresh_eps(wq, norm=norm),
        "qkv": lambda: mv(wq),
        "qkv norm, prefetch after staging": lambda: mv(wq, norm=norm, prefetch=False),
        "qkv norm, 1 unit 4 words": lambda: mv(wq, norm=norm, rows=1, unroll=4),
        "qkv norm, 2 units 4 words": lambda: mv(wq, norm=norm, rows=2, unroll=4),
        "qkv norm, 4 units 1 word, double-buffered": lambda: mv(wq, norm=norm, rows=4, unroll=1, prefetch=2),
        "qkv norm, 4 units 2 words, double-buffered": lambda: mv(wq, norm=norm, rows=4, unroll=2, prefetch=2),
        "qkv norm int8": lambda: mv(wq, norm=norm, int8=True),
        "qkv norm, tensor cores": lambda: C.qmma4(x, *wq, 64, norm=norm),
        "qkv norm, folded": lambda: folded(wq, norm=norm),
        "o + residual": lambda: mv(wo, epilogue=1, a=res),
        "o norm": lambda: mv(wo, norm=norm),
        "o norm fresh eps": lambda: fresh_eps(wo, norm=norm),
        "o + residual, tensor cores": lambda: C.qmma4(x, *wo, 64, 1, res),
        "gate/up norm": lambda: mv(wg, epilogue=2, norm=norm),
        "gate/up norm, 1 unit 4 words": lambda: mv(wg, epilogue=2, norm=norm, rows=1, unroll=4),
        "gate/up norm, 2 units 4 words": lambda: mv(wg, epilogue=2, norm=norm, rows=2, unroll=4),
        "gate/up norm, 4 units 1 word, double-buffered": lambda: mv(wg, epilogue=2, norm=norm, rows=4, unroll=1,
                                                                     prefetch=2),
        "gate/up norm, 2 units 2 words, double-buffered": lambda: mv(wg, epilogue=2, norm=norm, rows=2, unroll=2,
                                                                     prefetch=2),
        "gate/up": lambda: mv(wg, epilogue=2),
        "gate/up norm, tensor cores": lambda: C.qmma4(x, *wg, 64, 2, norm=norm),
        "gate/up norm, folded": lambda: folded(wg, epilogue=2, norm=norm),
        "gate/up norm, folded, 2 units 8 words": lambda: folded(wg, epilogue=2, norm=norm, rows=2, unroll=8),
        "gate/up norm int8": lambda: mv(wg, epilogue=2, norm=norm, int8=True),
        "attention 72, 32 splits": lambda: attn(72, 32),
        "attention 72, 32 splits, fresh pos": lambda: attn(72, 32, fresh=True),
        "attention 72, 32 splits, MK 16": lambda: attn(72, 32, 16),
        "attention 72, 32 splits, MK 128": lambda: attn(72, 32, 128),
        "attention 72, 1 split": lambda: attn(72, 1),
        "attention 72, 32 splits, no q/k norms": lambda: attn(72, 32, qk_norm=False),
        "attention 900, 32 splits": lambda: attn(900, 32),
        "attention 900, 32 splits, MK 128": lambda: attn(900, 32, 128),
        "empty": lambda: probe("empty", out + "1.f;\n"),
        "angles": lambda: probe("angles", angles),
        "angles, fresh pos": lambda: probe("angles", angles, fresh=True),
        "sincosf": lambda: probe("sincosf", sincosf),
        "sincosf, fresh pos": lambda: probe("sincosf", sincosf, fresh=True),
        "read pos": lambda: probe("readpos", out + "pos[0];\n"),
        "read pos, fresh": lambda: probe("readpos", out + "pos[0];\n", fresh=True),
        "fence and counter": lambda: probe("counter", counter),
    }


def run(reps: int = 3, only: list[str] | None = None) -> None:
    import mlx.core as mx

    todo = cases()
    if only:
        unknown = [name for name in only if name not in todo]
        if unknown:
            raise SystemExit(f"no such case: {', '.join(unknown)} (cases: {'; '.join(todo)})")
        todo = {name: todo[name] for name in only}
    for f in todo.values():  # compiled before the profiled range
        mx.eval(f())
    mx.synchronize()
    for name, f in todo.items():
        with profiled():
            for _ in range(reps):
                mx.eval(f())
            mx.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            mx.eval(f())
        mx.synchronize()
        print(f"{name:40s} {(time.perf_counter() - t) / 20 * 1e6:8.1f} us a launch (wall, one evaluation each)",
              file=sys.stderr)


def summarize(path: str) -> None:
    """Each kernel's ncu times (us), in launch order."""
    times: dict[str, list[float]] = collections.defaultdict(list)
    for (_, name), m in read_ncu(path).items():
        times[name.split("(")[0]].append(m.get("gpu__time_duration.sum", 0.0))
    for name, ts in times.items():
        print(f"{name[-72:]:72s} " + " ".join(f"{t:6.1f}" for t in ts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--summarize", help="an ncu --csv report to print")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", help="';'-separated case names to run (for ncu's detailed sections)")
    a = ap.parse_args(argv)
    if a.summarize:
        summarize(a.summarize)
        return 0
    from engine import device

    device.select_device("gpu")
    run(a.reps, [n.strip() for n in a.only.split(";") if n.strip()] if a.only else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
