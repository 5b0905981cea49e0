"""The fused CUDA kernels of a one-token decode step (engine/kernels/decode_step.py), compiled at
run time by MLX (`mx.fast.cuda_kernel`, NVRTC: users need no nvcc).

A decode step of one sequence reads every weight once and does little else, so on a GPU its speed
is the speed of its matrix x vector products plus the cost of launching its kernels. These are the
kernels that step needs besides MLX's RMSNorm, each doing what several MLX ops do:

- `matvec`: y = W x for a bf16/fp16 x of one row, W dense (bf16/fp16) or in MLX's affine 4/8-bit
  layout (a scale and a bias per group of 32/64/128 weights), with an epilogue: none; `+ a` (the
  residual, or a bias), rounded as MLX rounds the product and then the sum; or SwiGLU over W's two
  halves (gate rows 0..N/2, up rows N/2..N, as engine/kernels/gpu_layout.py stacks them):
  silu(gate) * up, rounded op by op as mlx-lm's compiled `swiglu` rounds in x's dtype.
  One warp per R output rows (R pairs for SwiGLU): lane l reads the 128-bit words l, l + 32, ...
  of each row (a warp reads 512 contiguous bytes of a row at a time), all of a lane's loads of a
  round issued before any arithmetic; a 4-bit or 8-bit weight q becomes the float q exactly by
  placing its byte under the exponent of 2^23 (`__byte_perm`) and subtracting 2^23 (no
  integer-to-float conversion, which runs at a quarter of the FMA rate); a word's weights share
  one group, so its share of a row is `s * sum(q x) + b * sum(x)` with `sum(x)` computed once for
  the warp's rows. fp32 sums, the warp's lanes added by butterfly shuffles.
  With `norm`, the RMSNorm before the product is fused in: each block stages x in shared memory,
  normalised as MLX's rms_norm rounds it.
- `attention`: one kernel for a step's attention, from the stacked q/k/v row: Qwen3's per-head
  RMSNorm of q and k (when the model has it), RoPE at the step's position, the new key and value
  written into the KV cache's buffers at that position, in place, and single-query attention over
  the first `pos + 1` positions (grouped-query heads sharing each key and value load): what
  mlx-lm does in ~15 ops. The step's keys are cut into `splits` equal shares, one block each
  (online softmax, flash-decoding; a warp loads a few keys before it scores them); the last
  block of a head group to finish adds the splits up (a counter per kv head, reset by that
  block). The position comes from an array, so the step's
  graph has the same shapes at every position (engine/kernels/decode_step.py compiles it once
  per buffer size).

Numerics: products and attention sum in fp32 in another order than MLX's kernels; every value MLX
rounds to the model's dtype between ops (a product before its residual add, a norm before RoPE,
the SwiGLU's parts) is rounded here too. tests/test_decode_step.py runs the step's structure on
the CPU against mlx-lm (engine/kernels/fused_ref.py, the same functions in MLX ops); `python -m
bench.gpu_step --parts kernels` checks each kernel against that reference on a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .inputs import constant

WARPS = 4  # warps per block of matvec and attend
UNROLL = 4  # 128-bit words of a row a lane loads before it computes
MAX_SPLITS = 64  # blocks a kv head's keys are cut into, at most
SPLIT_KEYS = 0  # keys a split of the one-row attention takes at least (fewer splits at short contexts; 0: S)
ATTENTION_BLOCKS = 256  # an attention's blocks (splits x kv heads x rows) aimed at: ~2 per SM
MAX_GROUP_DIMS = 2048  # query heads per kv head x head dim: the attention's shared memory
IN_PLACE = True  # `attention` writes the cache buffers it is given

MAX_STAGED = 8192  # inputs staged in shared memory (fp32): at most 32 KB a block
MAX_Q8_INPUTS = 16384  # inputs an int8-activation product stages (two limbs each: 32 KB a block)
Q8_WARPS = 8  # warps of an int8-activation product's block (x is quantized once a block)


def _matvec_source(quantized: bool, add: bool, norm: bool) -> str:
    """The kernel body calling matvec_impl with the inputs this variant has (nullptr for others)."""
    w = "w" if quantized else "reinterpret_cast<const uint32_t*>(w)"
    scales = "scales, biases" if quantized else "(const T*)nullptr, (const T*)nullptr"
    return (f"matvec_impl<T, {'ST' if quantized else 'T'}, BITS, GS, K, N, R, E, XN, U, PF, FOLD>(x, {w}, {scales}, "
            f"{'a' if add else '(const T*)nullptr'}, {'nw' if norm else '(const T*)nullptr'}, "
            f"{'ne' if norm else '(const float*)nullptr'}, y);")


# Template: T, D (head dim), G (query heads per kv head), HKV, ROT (rotated dims), TRAD, NORM,
# CAP (cache buffer length), S (splits: each an equal share of the step's keys), KU (keys a warp
# loads at once). Inputs: qkv (one row of the
# stacked product), qn, kn (q/k norm weights; unread without NORM), invf (ROT/2 inverse
# frequencies), fp (q/k norm eps, RoPE position scale, attention scale), pos (1,), kc, vc (the
# cache buffers: the new key and value written in place), cnt (HKV int32 counters, zero between
# launches). Outputs: per (head, split) the largest score pm, the sum of exp(score - pm) pl and
# the values weighted by it pa; y (HQ * D), the attention's output.
_ATTENTION = ("attention_impl<T, D, G, HKV, ROT, TRAD, NORM, CAP, S, KU, WARPS, MK>"
              "(qkv, qn, kn, invf, fp, pos, kc, vc, cnt, pm, pl, pa, y);")

DEVICE_CODE = Path(__file__).parent / "cuda" / "fused_decode.cuh"
_KERNELS: dict[str, Any] = {}
_HEADER: list[str] = []  # what each kernel's header holds: an #include of DEVICE_CODE, or its text


def _header() -> str:
    """`#include` DEVICE_CODE by its absolute path when MLX's NVRTC compiles that (tried once, on a
    one-element kernel), else the file's text inline."""
    if not _HEADER:
        include = f'#include "{DEVICE_CODE}"\n'
        try:
            probe = mx.fast.cuda_kernel(name="mlxchat_include_probe", input_names=["x"], output_names=["y"],
                                        source="y[0] = q_at(x[0], 0);", header=include)
            got = probe(inputs=[mx.array([5], dtype=mx.uint32)], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                        output_shapes=[(1,)], output_dtypes=[mx.float32])[0]
            ok = got.item() == 5.0
        except Exception:  # noqa: BLE001 - NVRTC could not open it: inline the text
            ok = False
        _HEADER.append(include if ok else DEVICE_CODE.read_text())
    return _HEADER[0]


def _kernel(name: str, inputs: list[str], outputs: list[str], source: str, bounds: tuple[int, int] | None = None
            ) -> Any:
    """The MLX kernel object `name`, made once (its source is compiled per template on first use).
    `bounds` (threads a block, blocks an SM): the kernel compiled under `__launch_bounds__` with
    them, so that ptxas keeps its registers to what that many blocks leave each thread. MLX writes
    the kernel's declaration itself (`__global__ void ...`, after the header), so the header
    redefines `__global__` as what CUDA defines it to (`__attribute__((global))`) plus the bounds."""
    if name not in _KERNELS:
        consts = f"  constexpr int WARPS = {WARPS};\n"
        header = _header() + ("" if bounds is None else
                              "#undef __global__\n#define __global__ __attribute__((global)) "
                              f"__launch_bounds__({bounds[0]}, {bounds[1]})\n")
        _KERNELS[name] = mx.fast.cuda_kernel(name=f"mlxchat_{name}", input_names=inputs,
                                             output_names=outputs, source=consts + source, header=header)
    return _KERNELS[name]


Ahead = tuple[mx.array, int, int]  # (array, first byte, bytes): a range a kernel prefetches into L2


def _launch(kind: str, names: list[str], arrays: list[mx.array], outputs: list[str], source: str,
            template: list[tuple[str, Any]], ahead: tuple[Ahead, ...], blocks: int = 0,
            **launch: Any) -> list[mx.array]:
    """Kernel `kind` (made once by `_kernel`) run on `arrays`, with `ahead`'s byte ranges added as
    inputs: each of its threads first prefetches its share of them into L2 (l2_ahead in
    cuda/fused_decode.cuh), so the weights of the kernel after this one stream from memory while
    this one runs. `blocks`: compiled for that many resident blocks an SM (`_kernel`'s bounds; 0:
    as ptxas chooses). `launch`: grid, threadgroup, output shapes and dtypes."""
    bounds = None
    if blocks:
        kind, bounds = f"{kind}_b{blocks}", (launch["threadgroup"][0], blocks)
    if ahead:
        source = "".join(f"  l2_ahead(reinterpret_cast<const char*>(l2_{i}) + L2O{i}, L2B{i});\n"
                         for i in range(len(ahead))) + source
        kind, names = f"{kind}_l2{len(ahead)}", names + [f"l2_{i}" for i in range(len(ahead))]
        arrays = arrays + [a for a, _, _ in ahead]
        template = template + [kv for i, (_, lo, n) in enumerate(ahead) for kv in ((f"L2O{i}", lo), (f"L2B{i}", n))]
    return _kernel(kind, names, outputs, source, bounds)(inputs=arrays, template=template, **launch)


def rows_per_warp(n: int) -> int:
    """Output units per warp: enough warps to fill the device (~2,048), at most 4 units each."""
    return max(1, min(4, n // 2048))


def launch_shape(bits: int, k: int, out: int, epilogue: int, blocks: int = 0) -> tuple[int, int]:
    """(output units per warp, words a lane loads before it computes) by default. 4-bit: 4 units
    and 8 words (4 where rows are longer than 8,192 inputs): the best or within the noise of the
    best of `bench.gpu_step --parts kernels --sweep` on every Qwen3-8B product (H100, 2026-12-07:
    o_proj 375 -> 702 GB/s, q/k/v 561 -> 605, gate/up and down unchanged); else as many units as
    fill the device (pairs for SwiGLU) and UNROLL words. A 4-bit SwiGLU kernel compiled for 3 or
    more `blocks` an SM (`matvec_blocks`) takes 2 units: at 4 its 8 weight rows spill."""
    if bits == 4:
        return (2 if epilogue == 2 and blocks >= 3 else 4), (8 if k <= 8192 else UNROLL)
    return (rows_per_warp(out) if epilogue != 2 else min(2, rows_per_warp(out))), UNROLL


def matvec(x: mx.array, w: mx.array, scales: mx.array | None, biases: mx.array | None,
           bits: int, group_size: int, epilogue: int = 0, a: mx.array | None = None,
           norm: tuple[mx.array, float] | None = None, rows: int | None = None,
           unroll: int | None = None, prefetch: bool | int = True, int8: bool = False,
           ahead: tuple[Ahead, ...] = ()) -> mx.array:
    """y = x @ W.T for one row x (any leading shape of size 1, last dim K), W (N, K) dense
    (`bits` 16) or (N, K * bits / 32) packed (4, 8: MLX's affine layout); `epilogue` 1 adds `a`
    (N,), 2 takes SwiGLU of W's halves (N / 2 outputs); `norm` (weight, eps): x RMS-normalised
    first, as mx.fast.rms_norm(x, weight, eps) would. `rows` (output units per warp), `unroll`
    (words a lane loads before it computes) and `prefetch` (the first words loaded before x is
    staged; False: after; 2: before, and each later round's words while the one before is
    multiplied) override the defaults, for the bench. `int8`: a 4/8-bit W that `q8_fits` takes
    multiplies int8 activations (`qdot`; the lossy path of `--int8-activations`). `ahead`: byte
    ranges of other arrays to prefetch into L2 (`_launch`). Output: x's leading shape, the outputs."""
    k, n = x.shape[-1], w.shape[0]
    if int8:  # where the program gives it (q8_fits)
        return qdot(x, w, scales, biases, bits, group_size, epilogue, a, norm, rows, unroll, ahead)
    if rows is None and mlx_wanted(bits):  # MLX's own kernels for this precision's products
        from . import fused_ref

        return fused_ref.matvec(x, w, scales, biases, bits, group_size, epilogue, a, norm)
    if rows is None and mma_wanted(bits, group_size, k, x.size // k):
        return qmma4(x, w, scales, biases, group_size, epilogue, a, norm)
    out = n // 2 if epilogue == 2 else n
    blocks = matvec_blocks()
    r, u = launch_shape(bits, k, out, epilogue, blocks)
    r, unroll = rows or r, unroll or u
    quantized = bits in (4, 8)
    xn = 2 if norm is not None else (1 if k <= MAX_STAGED else 0)
    names = ["x", "w"] + (["scales", "biases"] if quantized else []) + (["nw", "ne"] if norm else []) \
        + (["a"] if epilogue == 1 else [])
    arrays = [x, w] + ([scales, biases] if quantized else []) + _norm_inputs(norm) \
        + ([a] if epilogue == 1 else [])
    kind = f"matvec_{'q' if quantized else 'd'}{'_add' if epilogue == 1 else ''}{'_norm' if norm else ''}"
    block = WARPS * 32
    threads = -(-out // r) * 32
    template = [("T", x.dtype), ("ST", scales.dtype if quantized else x.dtype),
                ("BITS", bits if quantized else 16), ("GS", group_size if quantized else 8),
                ("K", k), ("N", n), ("R", r), ("E", epilogue), ("XN", xn), ("U", unroll), ("PF", int(prefetch)),
                ("FOLD", fold_wanted(bits))]
    return _launch(kind, names, arrays, ["y"], _matvec_source(quantized, epilogue == 1, norm is not None),
                   template, ahead, blocks=blocks, grid=(-(-threads // block) * block, 1, 1), threadgroup=(block, 1, 1),
                   output_shapes=[(*x.shape[:-1], out)], output_dtypes=[x.dtype])[0]


def _norm_inputs(norm: tuple[mx.array, float] | None) -> list[mx.array]:
    """A fused RMSNorm's kernel inputs `nw` and `ne`: its weight and its eps (made once:
    inputs.constant), or none."""
    return [norm[0], constant(norm[1], mx.float32)] if norm else []


def _quantized_inputs(name: str, x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, epilogue: int,
                      a: mx.array | None, norm: tuple[mx.array, float] | None
                      ) -> tuple[list[str], list[mx.array], str, str]:
    """A quantized product kernel's inputs with its fused norm (`norm`) and residual (`epilogue` 1,
    `a`) where it has them: their names, the arrays, the kernel's name (`name`, then _add, _norm)
    and the device function's arguments (nullptr for what it lacks), y last."""
    names = ["x", "w", "scales", "biases"] + (["nw", "ne"] if norm else []) + (["a"] if epilogue == 1 else [])
    arrays = [x, w, scales, biases] + _norm_inputs(norm) + ([a] if epilogue == 1 else [])
    kind = f"{name}{'_add' if epilogue == 1 else ''}{'_norm' if norm else ''}"
    args = (f"x, w, scales, biases, {'a' if epilogue == 1 else '(const T*)nullptr'}, "
            f"{'nw' if norm else '(const T*)nullptr'}, {'ne' if norm else '(const float*)nullptr'}, y")
    return names, arrays, kind, args


def q8_fits(bits: int, k: int) -> bool:
    """Whether `qdot` takes a product: 4/8-bit weights, whole blocks of 32 inputs, at most
    MAX_Q8_INPUTS of them."""
    return bits in (4, 8) and k % 32 == 0 and k <= MAX_Q8_INPUTS


def qdot(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int,
         epilogue: int = 0, a: mx.array | None = None, norm: tuple[mx.array, float] | None = None,
         rows: int | None = None, unroll: int | None = None, ahead: tuple[Ahead, ...] = ()) -> mx.array:
    """`matvec` on int8 activations (qdot_impl in cuda/fused_decode.cuh): x, normalised first
    where `norm` is given, quantized per 32-element block to two int8 limbs as the CPU kernels'
    int8 path does (fused_ref.int8_product is the same arithmetic in MLX ops), and each 128-bit
    word of W multiplied with them in int32 (dp4a), in blocks of Q8_WARPS warps. `rows` (output
    units per warp, default 2: 4 weight rows for SwiGLU already take ~126 registers, two blocks an
    SM), `unroll` (words a lane loads before it computes, default UNROLL; 2 for an 8-bit SwiGLU)
    override the defaults; `ahead` as `matvec`'s."""
    k, n = x.shape[-1], w.shape[0]
    out = n // 2 if epilogue == 2 else n
    r = rows or 2
    unroll = unroll or (2 if bits == 8 and epilogue == 2 else UNROLL)  # 147 registers at 4, 79 at 2
    names, arrays, kind, tail = _quantized_inputs("qdot", x, w, scales, biases, epilogue, a, norm)
    block = Q8_WARPS * 32
    threads = -(-out // r) * 32
    template = [("T", x.dtype), ("ST", scales.dtype), ("BITS", bits), ("GS", group_size), ("K", k), ("N", n),
                ("R", r), ("E", epilogue), ("XN", 2 if norm else 1), ("U", unroll), ("THREADS", block)]
    return _launch(kind, names, arrays, ["y"], f"qdot_impl<T, ST, BITS, GS, K, N, R, E, XN, U, THREADS>({tail});",
                   template, ahead, grid=(-(-threads // block) * block, 1, 1), threadgroup=(block, 1, 1),
                   output_shapes=[(*x.shape[:-1], out)], output_dtypes=[x.dtype])[0]


MMA_WARPS = 8  # warps of a tensor-core product's block, splitting K
MV_SWITCH = "MLXCHAT_CUDA_MV"


def _mv_choice() -> str:
    """`MLXCHAT_CUDA_MV`'s value (mlx, mlx16 / mlx8 / mlx4, fold or mma; "" unset), read when a
    product is built (the bench's variants set it around a build)."""
    return os.environ.get(MV_SWITCH, "").strip().lower()


def mlx_wanted(bits: int) -> bool:
    """Whether the step's products of `bits` (16: dense) run MLX's own kernels (rms_norm,
    matmul or quantized_matmul, the epilogue as MLX ops: fused_ref.matvec) instead of `matvec`:
    `MLXCHAT_CUDA_MV=mlx` (every precision) or `mlx16` / `mlx8` / `mlx4` (one), for the bench to
    weigh MLX's products, a few more ops a layer, against ours."""
    return _mv_choice() in ("mlx", f"mlx{bits}")


def fold_wanted(bits: int) -> bool:
    """Whether the scalar 4-bit product takes each weight as 1 + q / 16 and the sum of x off once
    a word (matvec_impl's FOLD in cuda/fused_decode.cuh: two instructions a weight instead of
    three, fp32 rounding of terms up to ~2x as large): `MLXCHAT_CUDA_MV=fold`, until the bench
    has timed it on a GPU."""
    return bits == 4 and _mv_choice() == "fold"


BLOCKS_SWITCH = "MLXCHAT_CUDA_MV_BLOCKS"


def matvec_blocks() -> int:
    """Resident blocks an SM the scalar product kernel (`matvec`) is compiled for:
    `MLXCHAT_CUDA_MV_BLOCKS=N` (0 or unset: as ptxas chooses; the 4-bit gate/up kernel takes 255
    registers, two blocks of 4 warps an SM). A bench switch until a GPU has timed it: 3 keeps
    the folded 4-bit kernels at 168 registers, unspilled (gate/up at 2 units a warp:
    `launch_shape`)."""
    value = os.environ.get(BLOCKS_SWITCH, "").strip()
    return int(value) if value.isdigit() else 0


def mma_wanted(bits: int, group_size: int, k: int, rows_of_x: int) -> bool:
    """Whether a product takes the tensor-core kernel (4-bit, groups of 64 or 128, one row of x):
    `MLXCHAT_CUDA_MV=mma` (the scalar kernel otherwise, until the bench picks a default)."""
    return (_mv_choice() == "mma" and bits == 4
            and group_size % 64 == 0 and k % 64 == 0 and rows_of_x == 1 and k <= 16384)


def qmma4(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
          epilogue: int = 0, a: mx.array | None = None, norm: tuple[mx.array, float] | None = None,
          tiles_per_block: int | None = None, unroll: int = 4) -> mx.array:
    """`matvec` for a 4-bit W on the tensor cores (see qmma4_impl in cuda/fused_decode.cuh)."""
    k, n = x.shape[-1], w.shape[0]
    out = n // 2 if epilogue == 2 else n
    tiles = -(-out // (8 if epilogue == 2 else 16))
    tpw = tiles_per_block or max(1, min(2, tiles // 512))
    names, arrays, kind, tail = _quantized_inputs("qmma4", x, w, scales, biases, epilogue, a, norm)
    kernel = _kernel(kind, names, ["y"], f"qmma4_impl<T, ST, BF16, GS, K, N, E, XN, KW, TPW, U>({tail});")
    block = MMA_WARPS * 32
    return kernel(
        inputs=arrays,
        template=[("T", x.dtype), ("ST", scales.dtype), ("BF16", x.dtype == mx.bfloat16), ("GS", group_size),
                  ("K", k), ("N", n), ("E", epilogue), ("XN", 2 if norm else 1), ("KW", MMA_WARPS),
                  ("TPW", tpw), ("U", unroll)],
        grid=(-(-tiles // tpw) * block, 1, 1), threadgroup=(block, 1, 1),
        output_shapes=[(*x.shape[:-1], out)], output_dtypes=[x.dtype])[0]


def emulate_qmma4(x: np.ndarray, w: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                  group_size: int) -> np.ndarray:
    """qmma4_impl's arithmetic in numpy, fragment by fragment: which nibbles and x values each lane
    puts in which register of which mma (PTX's m16n8k16 layout: A row g / g + 8 at k 2t, 2t + 1,
    2t + 8, 2t + 9; B k at the same, column g), the chunk's products summed (in fp32, in an order
    the hardware leaves open), then scaled. x (K,) float, w (N, K / 8) uint32. Returns y (N,)."""
    x = np.asarray(x, np.float32)
    k = x.shape[0]
    n = w.shape[0]
    words = np.asarray(w, np.uint32)
    s_all, b_all = np.asarray(scales, np.float32), np.asarray(biases, np.float32)
    y = np.zeros(n, np.float32)
    for c in range(k // 64):
        sx = np.float32(x[c * 64:(c + 1) * 64].sum(dtype=np.float32))
        halves = np.zeros((2, n), np.float32)  # column 0 of each row's chunk product, per half
        for hh in range(2):
            for h in range(2):
                # logical k (0..15) of this mma -> nibble j of lane t's uint32 (physical k = base + j,
                # base = 64c + 16t + 8hh): 2t -> 2h, 2t+1 -> 2h+4, 2t+8 -> 2h+1, 2t+9 -> 2h+5
                a = np.zeros((n, 16), np.float32)
                b = np.zeros(16, np.float32)
                for t in range(4):
                    base = c * 64 + 16 * t + 8 * hh
                    word = words[:, c * 8 + 2 * t + hh]
                    nib = lambda j: ((word >> np.uint32(4 * j)) & np.uint32(15)).astype(np.float32)  # noqa: E731
                    for logical, j in ((2 * t, 2 * h), (2 * t + 1, 2 * h + 4), (2 * t + 8, 2 * h + 1),
                                       (2 * t + 9, 2 * h + 5)):
                        a[:, logical] = 128.0 + nib(j)
                        b[logical] = x[base + j]
                halves[hh] += (a * b[None, :]).sum(axis=1, dtype=np.float32)
        cc = halves[0] + halves[1]
        q = c * 64 // group_size
        y += s_all[:, q] * (cc - np.float32(128.0) * sx) + b_all[:, q] * sx
    return y


def splits(groups: int, cap: int) -> int:
    """How many splits an attention cuts each of its `groups` (kv heads, times rows in a batched
    step) keys into: enough blocks for the whole device (ATTENTION_BLOCKS over the groups), at
    most MAX_SPLITS and the buffer's length `cap`, rounded down to a power of two (the kernel is
    compiled per split count: a batch growing a row at a time meets a handful of them, not one
    a row count). Each split takes an equal share of the keys the step attends over (the kernel
    divides them by the position), so every block has work at any length."""
    most = max(1, min(MAX_SPLITS, cap, -(-ATTENTION_BLOCKS // groups)))
    return 1 << (most.bit_length() - 1)


SPLIT_KEYS_SWITCH = "MLXCHAT_CUDA_SPLIT_KEYS"


def keys_a_split() -> int:
    """Keys a split of the one-row attention takes at least, so that a short context runs fewer
    splits: `MLXCHAT_CUDA_SPLIT_KEYS`, default SPLIT_KEYS (0: every one of the S splits runs, an
    equal share of the keys each, empty where there are fewer keys than splits)."""
    value = os.environ.get(SPLIT_KEYS_SWITCH, "").strip()
    return int(value) if value.isdigit() else SPLIT_KEYS


def keys_at_once(head_dim: int, group: int) -> int:
    """Keys a warp loads before it scores them (their loads in flight together): 4, or 2 where
    the group's queries and sums take many registers."""
    return 4 if (head_dim // 32) * group <= 32 else 2


def attention(layer: Any, qkv: mx.array, pos: mx.array, keys: mx.array, values: mx.array,
              split: int | None = None, ahead: tuple[Ahead, ...] = (),
              split_keys: int | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """One kernel for a decode step's attention from the stacked q/k/v row `qkv` (1, 1, ...):
    the layer's q/k norms and RoPE at `pos` (1,) int32, the new key and value written into
    `keys`/`values` (1, kv_heads, cap, head_dim) at `pos` in place, attention over the first
    `pos + 1` positions. Returns (out (1, 1, heads * head_dim), keys, values), the buffers
    themselves. `layer`: engine/kernels/decode_step.py's Layer (shapes, norm weights, `inv_freq`,
    `params` = (q/k norm eps, RoPE position scale, attention scale), `counters`). `split`
    overrides the split count (`splits`) and `split_keys` SPLIT_KEYS, for the bench; `ahead` as
    `matvec`'s."""
    heads, kv, dim = layer.heads, layer.kv_heads, layer.head_dim
    cap = keys.shape[2]
    s = split or splits(kv, cap)
    norm = layer.q_norm is not None
    # without NORM they are unread, but typed as the kernel's T (MLX declares each input by its
    # dtype): the layer's input norm weight stands in
    qn = layer.q_norm.weight if norm else layer.norm_in
    kn = layer.k_norm.weight if norm else layer.norm_in
    out = _launch(
        "attention", ["qkv", "qn", "kn", "invf", "fp", "pos", "kc", "vc", "cnt"],
        [qkv, qn, kn, layer.inv_freq, layer.params, pos, keys, values, layer.counters], ["pm", "pl", "pa", "y"],
        _ATTENTION,
        [("T", qkv.dtype), ("D", dim), ("G", heads // kv), ("HKV", kv), ("ROT", layer.rotated),
         ("TRAD", layer.traditional), ("NORM", norm), ("CAP", cap), ("S", s), ("KU", keys_at_once(dim, heads // kv)),
         ("MK", keys_a_split() if split_keys is None else split_keys)],
        ahead, grid=(s * WARPS * 32, kv, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(heads * s,), (heads * s,), (heads * s * dim,), (1, 1, heads * dim)],
        output_dtypes=[mx.float32, mx.float32, mx.float32, qkv.dtype])
    return out[3], keys, values
