"""A 4-bit quantized product for 2 to 32 rows of x (a batched decode step of a 4-bit model) as one
CUDA kernel on the tensor cores.

MLX's CUDA `quantized_matmul` is slow for a few rows: a Qwen3-8B-shaped 4-bit model decoded 8
streams at 241 tok/s and 32 at 278 on an H100 (2026-12-07, `bench.concurrency_step --shapes
qwen3-8b-4bit`), against 177 for one stream; mlx-lm's `batch_generate` the same. A step of R rows
reads every weight once whatever R is, so its products should cost what one row's does.

`qmm4_rows_impl` (cuda/fused_decode.cuh) is the one-row tensor-core product (`qmma4_impl`) with
x's rows as the B operand's 8 columns: each 16-row tile of weights, dequantized exactly into bf16
or fp16 pairs (128 + q), meets up to 32 rows of x in `mma.m16n8k16`, in fp32; each 64-wide chunk
is then scaled, `s * (C - 128 * sum(x)) + b * sum(x)`, the chunk's sum of each row of x from the
lanes that loaded it. x is read from global memory (L1/L2: every block reads all of it), so a
block takes several tiles (`tiles_per_block`) to share those reads.

`enabled(dtype)` says whether the GPU layout's 4-bit linears take it: on CUDA, once `check` found
it equal to `mx.quantized_matmul` on this device for that dtype (a kernel that does not compile or
differs leaves MLX's product in place, with a warning); `MLXCHAT_CUDA_QMM_ROWS=0` turns it off.
engine/kernels/qmv_cuda.py's `QMVLinear` calls it for products of `MIN_ROWS` to `MAX_ROWS` rows.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import mlx.core as mx

from .. import device
from .device_check import CheckedPerDtype
from .inputs import constant

SWITCH = "MLXCHAT_CUDA_QMM_ROWS"
MIN_ROWS, MAX_ROWS = 2, 32
WARPS = 4  # warps of a block, splitting K
UNROLL = 2  # chunks of 64 a warp loads before it computes
GROUP_SIZES = (64, 128)
TOLERANCE = 2e-2  # of the reference's largest output, the check's bound (16-bit outputs)


def fits(bits: int, group_size: int, k: int, x_rows: int, dtype: mx.Dtype) -> bool:
    """Whether a product takes the kernel: 4-bit, groups of 64 or 128, K a whole number of 64-wide
    chunks, 2-32 rows of bf16/fp16 x."""
    return (bits == 4 and group_size in GROUP_SIZES and k % 64 == 0 and MIN_ROWS <= x_rows <= MAX_ROWS
            and dtype in (mx.bfloat16, mx.float16))


TILES_SWITCH = "MLXCHAT_CUDA_QMM_TILES"  # a fixed tiles_per_block, for the bench to weigh in a service


def tiles_per_block(m: int) -> int:
    """16-row weight tiles a block takes: more where x has few rows (its registers allow), so that
    fewer blocks read x (every block reads all of x: at 32 rows and one tile a block, the 8B
    shape's products read ~7x their weights' bytes of x from L2). `MLXCHAT_CUDA_QMM_TILES=N`
    sets N at every row count (1, 2 or 4; 4 at 32 rows and one chunk ahead compiles to 176
    registers, unspilled), so that a whole batched step can be timed at each."""
    return _fixed_tiles() or (4 if m <= 8 else 2 if m <= 16 else 1)


@functools.cache
def _fixed_tiles() -> int | None:
    """`MLXCHAT_CUDA_QMM_TILES` (1, 2 or 4; else None), read once a process (every batched 4-bit
    product asks): `reset` forgets it."""
    fixed = os.environ.get(TILES_SWITCH, "").strip()
    return int(fixed) if fixed in ("1", "2", "4") else None


def qmm4_rows(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
              tiles: int | None = None, unroll: int | None = None, residual: mx.array | None = None) -> mx.array:
    """`mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits=4)` for x of 2-32
    rows (any leading shape; see `fits`): y (..., N) in x's dtype; with `residual` (y's shape),
    `residual + y` as MLX rounds the two ops, in the same kernel. `tiles` (16-row weight tiles a
    block takes) and `unroll` (chunks a warp loads before it computes) override `tiles_per_block`
    and UNROLL, for the bench."""
    from .fused_cuda import _kernel

    k, n = x.shape[-1], w.shape[0]
    m = x.size // k
    tiles_of_x = -(-m // 8)  # the kernel is compiled per tile of 8 rows, the count read at run time
    tpw = tiles or tiles_per_block(8 * tiles_of_x)
    weight_tiles = -(-n // 16)
    add = residual is not None
    kernel = _kernel("qmm4_rows_add" if add else "qmm4_rows",
                     ["x", "w", "scales", "biases", "rows"] + (["a"] if add else []), ["y"],
                     "qmm4_rows_impl<T, ST, BF16, GS, K, N, MT, KW, TPW, U>(x, w, scales, biases, rows, "
                     f"{'a' if add else '(const T*)nullptr'}, y);")
    return kernel(
        inputs=[x, w, scales, biases, constant(m, mx.int32)] + ([residual] if add else []),
        template=[("T", x.dtype), ("ST", scales.dtype), ("BF16", x.dtype == mx.bfloat16), ("GS", group_size),
                  ("K", k), ("N", n), ("MT", tiles_of_x), ("KW", WARPS), ("TPW", tpw), ("U", unroll or UNROLL)],
        grid=(-(-weight_tiles // tpw) * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(*x.shape[:-1], n)], output_dtypes=[x.dtype])[0]


def mode() -> str:
    """"off" (`MLXCHAT_CUDA_QMM_ROWS=0`, or MLX not on CUDA) or "on", read once a process."""
    if device.backend() != "cuda" or os.environ.get(SWITCH, "").strip() == "0":
        return "off"
    return "on"


def enabled(dtype: mx.Dtype) -> bool:
    """Whether products of `dtype` take the kernel (checked once per dtype on this device)."""
    how = _CHECKED.mode()
    return how != "off" and _CHECKED.passed(dtype)


def reset() -> None:
    """Forget the switches' values and the checks' outcomes."""
    _CHECKED.reset()
    _fixed_tiles.cache_clear()


def check(dtype: mx.Dtype = mx.bfloat16) -> dict[str, Any]:
    """The kernel against `mx.quantized_matmul` on random weights (groups of 64 and 128, an output
    count not a multiple of 16) and 2, 9 and 32 rows of x, alone and plus a residual: the largest
    difference over the reference's largest value, `kept` when within TOLERANCE; a kernel that
    does not compile or run gives the `error`."""
    worst = 0.0
    try:
        key = mx.random.key(11)
        for m, n, k, gs in ((2, 200, 512, 64), (9, 72, 1024, 128), (32, 48, 384, 64)):
            k1, k2, key = mx.random.split(key, 3)
            w, scales, biases = mx.quantize(mx.random.normal((n, k), key=k1).astype(dtype) * 0.05, group_size=gs, bits=4)
            x = mx.random.normal((m, 1, k), key=k2).astype(dtype)
            ref = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=gs, bits=4)
            residual = mx.random.normal(ref.shape, key=k1).astype(dtype)
            for got, want in ((qmm4_rows(x, w, scales, biases, gs), ref),
                              (qmm4_rows(x, w, scales, biases, gs, residual=residual), residual + ref)):
                got, want = got.astype(mx.float32), want.astype(mx.float32)
                worst = max(worst, (mx.abs(got - want).max() / mx.abs(want).max()).item())
    except Exception as exc:  # noqa: BLE001 - a kernel that does not compile or run here
        return {"error": f"{type(exc).__name__}: {exc}"[:2000], "kept": False}
    return {"rel_diff": worst, "kept": worst < TOLERANCE}


_CHECKED = CheckedPerDtype(lambda dtype: check(dtype), "4-bit products of several rows run MLX's quantized_matmul",
                           lambda: mode())
