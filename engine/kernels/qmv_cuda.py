"""A quantized matrix x vector product for one to eight rows as one CUDA kernel: the decode step's
linear layers on NVIDIA GPUs for MLX's affine quantization (bits 4 and 8, groups of 32/64/128).

At batch 1 a decode step is bound by reading the weights, and MLX's CUDA `quantized_matmul` reads
8-bit weights at ~1.5 TB/s and 4-bit at ~0.7 TB/s on an H200 whose bf16 matrix x vector product
reads ~3.7 TB/s (docs/gpu.md). This kernel streams the packed weights with 128-bit loads instead:

- one warp per output row (`ROWS_PER_BLOCK` warps per block); lane `l` reads the row's 128-bit
  words `l`, `l + 32`, `l + 64`, ... (a warp reads 512 contiguous bytes per step, coalesced);
- a 128-bit word holds `128 / bits` consecutive weights (16 at 8 bits, 32 at 4), all in one
  quantization group since every group size is a multiple of that; so one scale `s` and one bias
  `b` per word, and the word's share of the dot product is `s * sum(q_j x_j) + b * sum(x_j)`;
- within a uint32, weight `j` sits at bits `[bits * j, bits * (j + 1))` (MLX's packing, lowest
  first); the word's four uint32 are read in order x, y, z, w;
- each lane sums in fp32 over its words in order; the warp then adds the 32 lanes' sums by
  butterfly shuffles (xor 16, 8, 4, 2, 1) and lane 0 writes the row's output in x's dtype;
- with M rows of x (M <= `MAX_ROWS`) each word, once loaded, serves every row.

`emulate` restates exactly this index math and summation order in numpy; tests/test_qmv_cuda.py
checks it on the CPU against `mx.quantized_matmul` for every bits / group / shape class, so what
the device runs is the math the CPU tested. `python -m bench.qmv` checks the kernel itself
against `mx.quantized_matmul` on a GPU and measures its GB/s.

engine/kernels/gpu_layout.py puts `QMVLinear` in place of the quantized linears `mode` picks:
by default where the H200 measured the kernel faster (4-bit layers and vocabulary heads, one row:
docs/gpu.md has the figures); `MLXCHAT_CUDA_QMV=1` every layer it fits, up to `MAX_ROWS` rows;
`MLXCHAT_CUDA_QMV=0` none. A prompt chunk's products of `DENSE_ROWS` rows or more take the dense
path instead (`dense_bits`): the weight dequantized, then cuBLAS.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import device
from . import qmm_rows_cuda

SWITCH = "MLXCHAT_CUDA_QMV"
MAX_ROWS = 8  # rows of x one launch serves; more go to mx.quantized_matmul
ROWS_PER_BLOCK = 8  # warps (output rows) per block
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.bfloat16, mx.float16, mx.float32)

_HEADER = """
template <typename T, int NV>
__device__ __forceinline__ void load_x(const T* p, bool vec, float* out) {
  // NV consecutive x values as floats; 128-bit loads when p is 16-byte aligned.
  constexpr int PER = 16 / sizeof(T);
  if (vec) {
    #pragma unroll
    for (int i = 0; i < NV / PER; ++i) {
      const uint4 u = reinterpret_cast<const uint4*>(p)[i];
      const T* t = reinterpret_cast<const T*>(&u);
      #pragma unroll
      for (int j = 0; j < PER; ++j) out[i * PER + j] = static_cast<float>(t[j]);
    }
  } else {
    #pragma unroll
    for (int j = 0; j < NV; ++j) out[j] = static_cast<float>(p[j]);
  }
}
"""

_SOURCE = """
    constexpr int PER_WORD = 32 / BITS;            // weights per uint32
    constexpr int VALS = 4 * PER_WORD;             // weights per 128-bit word
    constexpr int VECS = K / VALS;                 // 128-bit words per row
    constexpr int GROUPS = K / GS;
    constexpr uint32_t MASK = (1u << BITS) - 1u;
    const int lane = threadIdx.x;
    const int row = blockIdx.y * blockDim.y + threadIdx.y;
    if (row >= N) return;  // a whole warp leaves together: its lanes share the row

    const uint4* w_row = reinterpret_cast<const uint4*>(w) + (size_t)row * VECS;
    const ST* s_row = scales + (size_t)row * GROUPS;
    const ST* b_row = biases + (size_t)row * GROUPS;
    const bool x_vec = (reinterpret_cast<unsigned long long>(x) & 15ull) == 0;

    float acc[M];
    #pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;

    #pragma unroll 4
    for (int v = lane; v < VECS; v += 32) {
      const uint4 packed = w_row[v];
      const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
      const int k0 = v * VALS;
      const float s = static_cast<float>(s_row[k0 / GS]);
      const float b = static_cast<float>(b_row[k0 / GS]);
      float q[VALS];
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        #pragma unroll
        for (int j = 0; j < PER_WORD; ++j) q[i * PER_WORD + j] = static_cast<float>((words[i] >> (BITS * j)) & MASK);
      }
      #pragma unroll
      for (int m = 0; m < M; ++m) {
        float xs[VALS];
        load_x<T, VALS>(x + (size_t)m * K + k0, x_vec, xs);
        float qx = 0.0f, sx = 0.0f;
        #pragma unroll
        for (int t = 0; t < VALS; ++t) {
          qx += q[t] * xs[t];
          sx += xs[t];
        }
        acc[m] += s * qx + b * sx;
      }
    }
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      float a = acc[m];
      for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
      if (lane == 0) y[(size_t)m * N + row] = static_cast<T>(a);
    }
"""

_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = mx.fast.cuda_kernel(name="mlxchat_qmv", input_names=["x", "w", "scales", "biases"],
                                      output_names=["y"], source=_SOURCE, header=_HEADER)
    return _KERNEL


def mode() -> str:
    """Which layers take the kernel, from `MLXCHAT_CUDA_QMV`: "off" ("0", or MLX not on CUDA);
    "all" ("1": every layer that fits, products of up to `MAX_ROWS` rows); else "auto", the layers
    and rows where the H200 measured it faster (docs/gpu.md): one-row products of 4-bit layers and
    of heads (`HEAD_OUTPUTS` outputs or more) at either width."""
    return switch_mode(SWITCH)


def switch_mode(switch: str) -> str:
    """A CUDA kernel's mode from its environment switch: "off" ("0", or MLX not on CUDA), "all"
    ("1"), else "auto" (the kernel's measured default)."""
    if device.backend() != "cuda":
        return "off"
    value = os.environ.get(switch, "").strip().lower()
    return {"0": "off", "1": "all"}.get(value, "auto")


HEAD_OUTPUTS = 65536  # a layer this wide is a vocabulary head: the kernel won at 8 bits there too


def wanted(layer: nn.Module, how: str) -> int:
    """The most rows of x `layer` should run on the kernel in mode `how` (0: none)."""
    if how == "off" or not fits_layer(layer):
        return 0
    if how == "all":
        return MAX_ROWS
    return 1 if layer.bits == 4 or layer.weight.shape[0] >= HEAD_OUTPUTS else 0


def fits_layer(layer: nn.Module) -> bool:
    """Whether the kernel can run this layer: an affine-quantized linear with biases (MLX's
    default), 4 or 8 bits, a group size of 32/64/128, and an input width a whole number of groups
    (so of 128-bit words too, every group being a whole number of words)."""
    if not isinstance(layer, nn.QuantizedLinear) or getattr(layer, "mode", "affine") != "affine":
        return False
    if "biases" not in layer or layer.bits not in BITS or layer.group_size not in GROUP_SIZES:
        return False
    k = layer.weight.shape[-1] * 32 // layer.bits
    return layer.weight.ndim == 2 and k % layer.group_size == 0 and k % (128 // layer.bits) == 0


def rows(x: mx.array) -> int:
    """The rows of x one product has (every dimension but the last)."""
    return x.size // x.shape[-1] if x.shape[-1] else 0


def _launch(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """The kernel on x (..., K), row-contiguous: y (..., N) in x's dtype (no reshape in the graph:
    the kernel reads x and writes y as M x K and M x N in memory)."""
    k, n = x.shape[-1], w.shape[0]
    return _kernel()(
        inputs=[x, w, scales, biases],
        template=[("T", x.dtype), ("ST", scales.dtype), ("M", rows(x)), ("K", k), ("N", n), ("BITS", bits),
                  ("GS", group_size)],
        grid=(32, -(-n // ROWS_PER_BLOCK) * ROWS_PER_BLOCK, 1), threadgroup=(32, ROWS_PER_BLOCK, 1),
        output_shapes=[(*x.shape[:-1], n)], output_dtypes=[x.dtype])[0]


def qmv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """`mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits)` for x of at
    most `MAX_ROWS` rows (any leading shape), through the kernel."""
    return _launch(x, w, scales, biases, bits, group_size)


class QMVLinear(nn.QuantizedLinear):
    """An affine-quantized linear whose products of at most `max_rows` rows in a float dtype run
    the kernel, those of a few rows more at 4 bits the tensor-core kernel of qmm_rows_cuda.py
    (where it is enabled); anything else runs `nn.QuantizedLinear` (mx.quantized_matmul)."""

    max_rows: int = MAX_ROWS

    def __call__(self, x: mx.array) -> mx.array:
        kernel = self._kernel(x)
        if kernel is None:
            return super().__call__(x)
        if kernel == "dense":
            y = x @ dense_weight(self["weight"], self["scales"], self["biases"], self.group_size, self.bits).T
        elif kernel == "qmv":
            y = qmv(x, self["weight"], self["scales"], self["biases"], self.bits, self.group_size)
        else:
            y = qmm_rows_cuda.qmm4_rows(x, self["weight"], self["scales"], self["biases"], self.group_size)
        return y + self["bias"] if "bias" in self else y

    def add_product(self, x: mx.array, residual: mx.array) -> mx.array:
        """`residual + self(x)`, the add inside the tensor-core kernel where it takes the product
        (as MLX rounds the two ops: gpu_layout.add_product)."""
        if self._kernel(x) == "rows" and "bias" not in self:
            return qmm_rows_cuda.qmm4_rows(x, self["weight"], self["scales"], self["biases"], self.group_size,
                                           residual=residual)
        return residual + self(x)

    def _kernel(self, x: mx.array) -> str | None:
        """Which kernel takes the product with `x`: "qmv" (at most `max_rows` rows), "rows"
        (qmm_rows_cuda's, where it takes them), "dense" (a prompt chunk of `DENSE_ROWS` rows or
        more through a decoder layer, not a head, at the `dense_bits()`), None
        (mx.quantized_matmul)."""
        m = rows(x)
        if 0 < m <= self.max_rows and x.dtype in DTYPES:
            return "qmv"
        if qmm_rows_cuda.fits(self.bits, self.group_size, x.shape[-1], m, x.dtype) and qmm_rows_cuda.enabled(x.dtype):
            return "rows"
        if (m >= DENSE_ROWS and x.dtype in (mx.bfloat16, mx.float16) and x.dtype == self["scales"].dtype
                and self["weight"].shape[0] < HEAD_OUTPUTS  # a vocabulary head's copy would be ~1 GB
                and self.bits in dense_bits()):
            return "dense"
        return None


DENSE_SWITCH = "MLXCHAT_CUDA_PREFILL_DENSE"
DENSE_ROWS = 256  # rows of x (a prompt chunk) from which a product may take the dense path


def dense_bits() -> tuple[int, ...]:
    """The widths whose prompt chunks dequantize a layer's weight to x's dtype (`mx.dequantize`:
    q * scale + bias, rounded to the scales' dtype) and take the dense product (cuBLAS, tensor
    cores) instead of MLX's quantized one. On CUDA: 4 bits by default; `MLXCHAT_CUDA_PREFILL_DENSE=0`
    none, `=all` 8 bits too (not yet timed). A chunk of R rows computes 2 R N K flops on N K
    weights, so at hundreds of rows the dequantized copy (one layer's, written and read once)
    costs little beside the product. On an H100 (2026-12-08, `bench.gpu_step --parts kernels
    --kernel-groups prefill`) a 2,048-row chunk's products of the Qwen3-8B 4-bit shape ran at
    425-536 TFLOP/s against MLX 0.32.4's quantized_matmul's 106-132 (3.8-4.1x), their outputs equal
    to it bit for bit."""
    if device.backend() != "cuda":
        return ()
    return {"0": (), "all": (4, 8)}.get(os.environ.get(DENSE_SWITCH, "").strip().lower(), (4,))


def dense_weight(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """The layer's weight dequantized (N x K, in the scales' dtype) for the dense path."""
    return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)


def to_qmv(layer: nn.Module, max_rows: int = MAX_ROWS) -> nn.Module:
    """`layer` as a QMVLinear (the same arrays) serving up to `max_rows` rows, when the kernel fits
    it; else `layer`."""
    if not fits_layer(layer) or isinstance(layer, QMVLinear):
        return layer
    out = QMVLinear.__new__(QMVLinear)
    nn.Module.__init__(out)
    out.group_size, out.bits, out.mode, out.max_rows = layer.group_size, layer.bits, layer.mode, max_rows
    for name in ("weight", "scales", "biases", "bias"):
        if name in layer:
            out[name] = layer[name]
    out.freeze()
    return out


def use_qmv(model: nn.Module, how: str = "all") -> int:
    """Put a QMVLinear in place of every quantized linear of `model` that mode `how` wants on the
    kernel, or (unless `how` is "off") whose prompt chunks take the dense path (`dense_bits`; a
    layer only there serves no rows on the kernel), in place; returns how many."""
    swaps = [(parent, key, child, wanted(child, how)) for _, parent in model.named_modules()
             for key, child in parent.items()
             if isinstance(child, nn.QuantizedLinear) and not isinstance(child, QMVLinear)]
    dense = dense_bits() if how != "off" else ()
    swaps = [s for s in swaps if s[3] or (s[2].bits in dense and fits_layer(s[2]))]
    for parent, key, child, most in swaps:
        parent[key] = to_qmv(child, most)
    return len(swaps)


def emulate(x: np.ndarray, w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
            group_size: int) -> np.ndarray:
    """The kernel's arithmetic in numpy, lane by lane: x (M, K) float, w (N, K * bits / 32) uint32,
    scales/biases (N, K / group_size). Returns y (M, N) in fp32 (the kernel then casts to x's
    dtype)."""
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    n = w.shape[0]
    per_word = 32 // bits
    vals = 4 * per_word
    vecs = k // vals
    words = np.asarray(w, dtype=np.uint32).reshape(n, vecs, 4)
    s_all, b_all = np.asarray(scales, np.float32), np.asarray(biases, np.float32)
    acc = np.zeros((m, n, 32), dtype=np.float32)  # [row of x, output row, lane]
    shifts = (bits * np.arange(per_word)).astype(np.uint32)
    for start in range(0, vecs, 32):  # one step of the lanes' loop: lane l reads word start + l
        v = np.arange(start, min(start + 32, vecs))
        lanes = v - start
        q = ((words[:, v, :, None] >> shifts) & np.uint32((1 << bits) - 1)).astype(np.float32)
        q = q.reshape(n, len(v), vals)  # [row, lane, t]: t = i * per_word + j
        xs = x[:, (v * vals)[:, None] + np.arange(vals)]  # [m, lane, t]
        qx = np.zeros((m, n, len(v)), np.float32)
        sx = np.zeros((m, 1, len(v)), np.float32)
        for t in range(vals):  # the kernel's order of the word's sums
            qx += q[None, :, :, t] * xs[:, None, :, t]
            sx += xs[:, None, :, t]
        g = (v * vals) // group_size
        acc[:, :, lanes] += s_all[None, :, g] * qx + b_all[None, :, g] * sx
    for off in (16, 8, 4, 2, 1):  # butterfly shuffles: every lane ends with the warp's sum
        acc = acc + acc[:, :, np.arange(32) ^ off]
    return acc[:, :, 0]
