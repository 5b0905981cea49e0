"""A bf16/fp16 matrix product for a few rows of x (2 to 32: a batched decode step) as one CUDA
kernel on the tensor cores: the dense analogue of qmv_cuda.py, for the plain `nn.Linear`s of a
bf16 or fp16 model on NVIDIA GPUs.

A decode step of R rows reads every weight once whatever R is, so its matmuls should read the
weights at the device's bandwidth. MLX's CUDA matmul does with one row (2,155 GB/s on an H200 over
a chain of 4096x4096 weights) but not with 8 or 32 (1,208 and 1,173 GB/s: docs/gpu.md), which is
why an 8-row step of an 8B model costs twice a one-row step. This kernel streams the weights with
128-bit loads and lets the tensor cores do the few multiplies per weight (measured: 1.6-1.7x
MLX's rate on 4096x4096 at 2-16 rows, still far from the bandwidth; slower than MLX on a
vocabulary head and at one row: docs/gpu.md):

- a block of `KW` warps owns 16 output rows (one m16 tile of `mma.m16n8k16`, the weights being the
  A operand and x the B operand, whose 8 columns are 8 rows of x; `MT` such tiles of x for up to
  8 * MT rows, every loaded weight serving all of them);
- the input width K is cut into blocks of 32; warp `w` of the block takes the blocks `w`, `w + KW`,
  `w + 2 KW`, ... (at each step the block's warps read 512 contiguous bytes of each of its rows);
- within a 32-block, lane `l` (group `g = l // 4`, `t = l % 4`) loads one 128-bit word (8 values)
  of output row `g` and one of row `g + 8`, at K offsets `8 t .. 8 t + 7`, and the same offsets of
  x row `g` of each x tile. The fragment registers take these words two values at a time: the
  first `mma` of the block takes values 0-3 of each word, the second values 4-7. So the logical
  k index of the mma (0..15) is a permutation of the physical one, the same for A and B, and the
  products are those of `x @ w.T`: logical `2 t + j` is physical `8 t + 4 h + j` and logical
  `2 t + 8 + j` is physical `8 t + 4 h + 2 + j` (h: which mma of the block, j in 0, 1);
- each warp accumulates its blocks in fp32 in the tensor core's accumulator (in block order, two
  mma per block); the warps' partial sums then meet in shared memory and are added in warp order
  0, 1, ..., KW - 1; the sum is written in x's dtype.

`emulate` restates exactly this index math (which word each lane loads, the PTX fragment layout
of `mma.m16n8k16.row.col`, the order of the accumulation and of the warps' sum) in numpy;
tests/test_smallmm_cuda.py checks it on the CPU against `x @ w.T`. The one thing it cannot restate
is the rounding inside one `mma` (16 products and the accumulator, summed by the hardware in an
order PTX leaves open): the emulation adds them in fp32, so the device may differ from it by a few
fp32 ulps of each 16-product partial, far below the bf16 rounding of the output. Against the fp32
product of the same bf16 values, the H200 measured the kernel's largest difference at most 1.007x
MLX's own matmul's (cuBLAS, fp32 sums in another order): the output's rounding, 0.008-0.016 in
bf16 for outputs of scale 3.5-5.3 (`bench.concurrency_step --parts matmul` checks this on the
device before timing: within 2x MLX's difference or 1% of the output's scale). Greedy tokens of a
model may part from MLX's where two logits are within that rounding.

engine/kernels/gpu_layout.py puts `SmallMMLinear` in place of a model's dense linears on CUDA
(`mode`: `MLXCHAT_CUDA_SMALLMM=0` none, `=1` every product of 1 to `MAX_ROWS` rows; unset, the
rows and layers where the H200 measured it faster: `AUTO_ROWS` rows, not vocabulary heads); other
products run MLX's matmul. The launch goes through `mx.compile` (`COMPILED`): a call of an
`mx.fast.cuda_kernel` function costs ~13 us of host time to build, ~3 us replayed.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .qmv_cuda import HEAD_OUTPUTS, rows, switch_mode

SWITCH = "MLXCHAT_CUDA_SMALLMM"
MAX_ROWS = 32  # rows of x one launch serves (4 tiles of 8); more go to MLX's matmul
# The switch unset: products of 2 to 16 rows of a decoder's layers (fewer outputs than a
# vocabulary head), where the H200 measured the kernel faster than MLX's matmul (docs/gpu.md:
# 1.6-1.7x on 4096x4096 at 2-16 rows; 1.08x at 32; 0.5x at one row; 0.89x on a vocabulary head
# at 8 rows, 0.48x at 32).
AUTO_ROWS = (2, 16)
TILE = 16  # output rows per block (the m of mma.m16n8k16)
KBLOCK = 32  # input width per lane-group step (two mma of k16)
MAX_WARPS = 8  # warps per block splitting K
DTYPES = (mx.bfloat16, mx.float16)

_HEADER = """
template <typename T>
__device__ __forceinline__ uint4 load8(const T* p, bool vec) {
  // 8 consecutive 16-bit values as one 128-bit word (two per uint32, the first in the low half).
  if (vec) return __ldg(reinterpret_cast<const uint4*>(p));
  const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
  uint4 u;
  u.x = (uint32_t)s[0] | ((uint32_t)s[1] << 16);
  u.y = (uint32_t)s[2] | ((uint32_t)s[3] << 16);
  u.z = (uint32_t)s[4] | ((uint32_t)s[5] << 16);
  u.w = (uint32_t)s[6] | ((uint32_t)s[7] << 16);
  return u;
}

template <int BF16>
__device__ __forceinline__ void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  if (BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}
"""

_SOURCE = """
    constexpr int KB = K / 32;                   // 32-wide blocks of K
    constexpr int STEPS = (KB + KW - 1) / KW;    // blocks per warp (the last may be short)
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.y * 16;
    const int r_lo = n0 + g, r_hi = n0 + g + 8;
    const bool ok_lo = r_lo < N, ok_hi = r_hi < N;
    const bool vec = ((reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(w)) & 15ull) == 0;
    const T* w_lo = w + (size_t)(ok_lo ? r_lo : 0) * K + 8 * t;
    const T* w_hi = w + (size_t)(ok_hi ? r_hi : 0) * K + 8 * t;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

    float acc[MT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) { acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f; }

    #pragma unroll 1
    for (int i0 = 0; i0 < STEPS; i0 += U) {
      uint4 a_lo[U], a_hi[U], b[U][MT];
      #pragma unroll
      for (int u = 0; u < U; ++u) {         // every load of U blocks issued before any mma
        const int kb = (i0 + u) * KW + warp;
        const bool in = (i0 + u < STEPS) && kb < KB;  // the same for the whole warp
        const int kc = in ? kb : 0;  // loads stay inside the arrays; what is not wanted reads as 0
        const uint4 lo = load8(w_lo + kc * 32, vec), hi = load8(w_hi + kc * 32, vec);
        a_lo[u] = (in && ok_lo) ? lo : zero;
        a_hi[u] = (in && ok_hi) ? hi : zero;
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const int m = mt * 8 + g;
          const uint4 xv = load8(x + (size_t)(m < M ? m : M - 1) * K + kc * 32 + 8 * t, vec);
          b[u][mt] = (in && m < M) ? xv : zero;
        }
      }
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<IS_BF16>(acc[mt], a_lo[u].x, a_hi[u].x, a_lo[u].y, a_hi[u].y, b[u][mt].x, b[u][mt].y);
          mma16816<IS_BF16>(acc[mt], a_lo[u].z, a_hi[u].z, a_lo[u].w, a_hi[u].w, b[u][mt].z, b[u][mt].w);
        }
      }
    }

    // the warps' partial sums: part[warp][row of x][output row of the tile]
    __shared__ float part[KW][MT * 8][16];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      #pragma unroll
      for (int j = 0; j < 2; ++j) {
        part[warp][mt * 8 + 2 * t + j][g] = acc[mt][j];
        part[warp][mt * 8 + 2 * t + j][g + 8] = acc[mt][2 + j];
      }
    }
    __syncthreads();
    for (int i = warp * 32 + lane; i < MT * 8 * 16; i += KW * 32) {
      const int m = i / 16, r = i % 16;
      float s = part[0][m][r];
      #pragma unroll
      for (int v = 1; v < KW; ++v) s += part[v][m][r];
      if (m < M && n0 + r < N) y[(size_t)m * N + n0 + r] = static_cast<T>(s);
    }
"""

_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = mx.fast.cuda_kernel(name="mlxchat_smallmm", input_names=["x", "w"], output_names=["y"],
                                      source=_SOURCE, header=_HEADER)
    return _KERNEL


def mode() -> str:
    """Which products take the kernel, from `MLXCHAT_CUDA_SMALLMM`: "off" ("0", or MLX not on
    CUDA); "all" ("1": every product of 1 to `MAX_ROWS` rows); else "auto" (`AUTO_ROWS`)."""
    return switch_mode(SWITCH)


def row_range(how: str) -> tuple[int, int]:
    """The rows of x (least, most) that mode `how` sends to the kernel; (1, 0) for none."""
    return {"off": (1, 0), "all": (1, MAX_ROWS)}.get(how, AUTO_ROWS)


def fits_layer(layer: nn.Module) -> bool:
    """Whether the kernel can run this layer: a plain `nn.Linear` with a 2-D bf16 or fp16 weight
    whose input width is a whole number of 32-blocks."""
    if type(layer) is not nn.Linear or "weight" not in layer:
        return False
    w = layer.weight
    return w.ndim == 2 and w.dtype in DTYPES and w.shape[1] % KBLOCK == 0 and w.shape[1] > 0


def warps(k: int) -> int:
    """Warps per block for input width k: `MAX_WARPS`, or fewer when K has fewer 32-blocks."""
    return max(1, min(MAX_WARPS, k // KBLOCK))


def x_tiles(m: int) -> int:
    """Tiles of 8 rows of x for m rows."""
    return -(-m // 8)


def unroll(m: int) -> int:
    """32-blocks whose loads a warp issues before their mma: 4, or 2 for more than two x tiles
    (whose registers would otherwise cut the blocks an SM holds)."""
    return 4 if x_tiles(m) <= 2 else 2


def _launch(x: mx.array, w: mx.array, kw: int | None = None, blocks: int | None = None) -> mx.array:
    """The kernel on x (..., K) row-contiguous and w (N, K) of x's dtype: y (..., N); `kw` warps
    per block (default `warps(K)`), `blocks` 32-blocks loaded at once (default `unroll(M)`)."""
    k, n, m = x.shape[-1], w.shape[0], rows(x)
    kw, mt = kw or warps(k), x_tiles(m)
    return _kernel()(
        inputs=[x, w],
        template=[("T", x.dtype), ("IS_BF16", int(x.dtype == mx.bfloat16)), ("M", m), ("MT", mt), ("K", k),
                  ("N", n), ("KW", kw), ("U", blocks or unroll(m))],
        grid=(32, kw * -(-n // TILE), 1), threadgroup=(32, kw, 1),
        output_shapes=[(*x.shape[:-1], n)], output_dtypes=[x.dtype])[0]


# Each call of an `mx.fast.cuda_kernel` function rebuilds the kernel's source text and converts its
# template arguments on the host: building a chain of 4096x4096 products took 13 us a product
# that way against 3 us through `mx.compile` (traced once per shape of x and w, replayed after)
# and 2 us for MLX's matmul; the chain then read the weights at 1,165 GB/s compiled against 852
# uncompiled at 8 rows (bench/results/cuda-h200-2026-issue33-8b-run7.log).
COMPILED = True
_LAUNCHERS: dict = {}


def launcher(kw: int | None = None, blocks: int | None = None, compiled: bool = True):
    """The kernel as a function of (x, w): `kw` warps per block and `blocks` 32-blocks loaded at
    once (None: the defaults; others for `bench.concurrency_step`'s sweep), through `mx.compile`
    when `compiled`."""
    key = (kw, blocks, compiled)
    if key not in _LAUNCHERS:
        def launch(x: mx.array, w: mx.array) -> mx.array:
            return _launch(x, w, kw, blocks)
        _LAUNCHERS[key] = mx.compile(launch) if compiled else launch
    return _LAUNCHERS[key]


def smallmm(x: mx.array, w: mx.array) -> mx.array:
    """`x @ w.T` for x of 1 to `MAX_ROWS` rows (any leading shape) through the kernel."""
    return launcher(compiled=COMPILED)(x, w)


class SmallMMLinear(nn.Linear):
    """A dense linear whose products of `min_rows` to `max_rows` rows in its weight's dtype run the
    kernel; anything else runs `nn.Linear` (MLX's matmul)."""

    min_rows: int = AUTO_ROWS[0]
    max_rows: int = AUTO_ROWS[1]

    def __call__(self, x: mx.array) -> mx.array:
        if self.takes(x):
            y = smallmm(x, self["weight"])
            return y + self["bias"] if "bias" in self else y
        return super().__call__(x)

    def takes(self, x: mx.array) -> bool:
        """Whether the product with `x` runs the kernel (else MLX's matmul)."""
        return self.min_rows <= rows(x) <= self.max_rows and x.dtype == self["weight"].dtype


def to_smallmm(layer: nn.Module, least: int, most: int) -> nn.Module:
    """`layer` as a SmallMMLinear (the same arrays) for products of `least` to `most` rows, when
    the kernel fits it; else `layer`."""
    if not fits_layer(layer):
        return layer
    out = SmallMMLinear.__new__(SmallMMLinear)
    nn.Module.__init__(out)
    out.min_rows, out.max_rows = least, most
    for name in ("weight", "bias"):
        if name in layer:
            out[name] = layer[name]
    return out


def use_smallmm(model: nn.Module, how: str = "all") -> int:
    """Put a SmallMMLinear in place of every dense linear of `model` the kernel fits, for the rows
    mode `how` picks (in place; "auto" leaves vocabulary heads, `HEAD_OUTPUTS` outputs or more, to
    MLX); returns how many."""
    least, most = row_range(how)
    if most < least:
        return 0
    swaps = [(parent, key, child) for _, parent in model.named_modules() for key, child in parent.items()
             if fits_layer(child) and (how != "auto" or child.weight.shape[0] < HEAD_OUTPUTS)]
    for parent, key, child in swaps:
        parent[key] = to_smallmm(child, least, most)
    return len(swaps)


def emulate(x: np.ndarray, w: np.ndarray, kw: int | None = None) -> np.ndarray:
    """The kernel's arithmetic in numpy, lane by lane: x (M, K), w (N, K) (values already in the
    dtype the kernel reads, given as floats), `kw` warps per block (default `warps(K)`; how many
    32-blocks a warp loads at once changes no sum). Returns y (M, N) in fp32 (the kernel then casts to
    x's dtype). Each `mma` is restated from the PTX fragment layout of m16n8k16 (A row-major
    16x16, B 16x8, C 16x8 fp32): a lane's registers are placed into A, B and C by that layout,
    D = A @ B + C in fp32, and D is read back into the lanes' registers the same way."""
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float32)
    m, k = x.shape
    n = w.shape[0]
    kw, mt = kw or warps(k), x_tiles(m)
    tiles = -(-n // TILE)
    xp = np.zeros((mt * 8, k), np.float32)
    xp[:m] = x
    wp = np.zeros((tiles * TILE, k), np.float32)  # rows past N read as zeros, as the kernel loads them
    wp[:n] = w
    wp = wp.reshape(tiles, TILE, k)  # every block (tile of 16 output rows) at once, on axis 0
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    part = np.zeros((kw, tiles, mt * 8, TILE), np.float32)  # [warp, block, row of x, output row]
    for warp in range(kw):
        acc = np.zeros((mt, tiles, 32, 4), np.float32)  # [x tile, block, lane, c0..c3]
        for kb in range(warp, k // KBLOCK, kw):
            cols = kb * KBLOCK + 8 * t[:, None] + np.arange(8)  # [lane, 8]: the lane's word
            a_lo = wp[:, g[:, None], cols]  # [block, lane, 8]: row g of the tile
            a_hi = wp[:, g[:, None] + 8, cols]  # row g + 8
            for h in (0, 1):  # the block's two mma: values 0-3, then 4-7 of each word
                a = _a_fragments(a_lo, a_hi, 4 * h, g, t)
                for tile in range(mt):
                    words = xp[tile * 8 + g[:, None], cols]  # [lane, 8]: x row g of the tile
                    acc[tile] = _mma(a, words, acc[tile], 4 * h, g, t)
        for tile in range(mt):
            for j in (0, 1):
                part[warp][:, tile * 8 + 2 * t + j, g] = acc[tile, :, :, j]
                part[warp][:, tile * 8 + 2 * t + j, g + 8] = acc[tile, :, :, 2 + j]
    s = part[0].copy()
    for v in range(1, kw):  # the warps' sum, in warp order
        s = s + part[v]
    return np.ascontiguousarray(s.transpose(1, 0, 2).reshape(mt * 8, tiles * TILE)[:m, :n])


def _a_fragments(a_lo: np.ndarray, a_hi: np.ndarray, v: int, g: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Every block's A (16x16) of one mma from its lanes' words (values v..v+3 of each): PTX
    m16n8k16 a0,a1 (g, 2t+j); a2,a3 (g+8, 2t+j); a4,a5 (g, 2t+8+j); a6,a7 (g+8, 2t+8+j)."""
    a = np.zeros((a_lo.shape[0], 16, 16), np.float32)
    for j in (0, 1):
        a[:, g, 2 * t + j] = a_lo[:, :, v + j]
        a[:, g + 8, 2 * t + j] = a_hi[:, :, v + j]
        a[:, g, 2 * t + 8 + j] = a_lo[:, :, v + 2 + j]
        a[:, g + 8, 2 * t + 8 + j] = a_hi[:, :, v + 2 + j]
    return a


def _mma(a: np.ndarray, words: np.ndarray, acc: np.ndarray, v: int, g: np.ndarray, t: np.ndarray) -> np.ndarray:
    """One mma for every block on one tile of x: B from the lanes' x words (b0,b1 (k 2t+j, n g);
    b2,b3 (k 2t+8+j, n g)), C from the lanes' accumulators `acc` [block, lane, c0..c3] (c0,c1
    (g, 2t+j); c2,c3 (g+8, 2t+j)), D = A @ B + C in fp32, read back into the lanes' registers."""
    bmat = np.zeros((16, 8), np.float32)
    cmat = np.zeros((a.shape[0], 16, 8), np.float32)
    for j in (0, 1):
        bmat[2 * t + j, g] = words[:, v + j]
        bmat[2 * t + 8 + j, g] = words[:, v + 2 + j]
        cmat[:, g, 2 * t + j] = acc[:, :, j]
        cmat[:, g + 8, 2 * t + j] = acc[:, :, 2 + j]
    d = (a @ bmat).astype(np.float32) + cmat
    out = np.empty_like(acc)
    for j in (0, 1):
        out[:, :, j] = d[:, g, 2 * t + j]
        out[:, :, 2 + j] = d[:, g + 8, 2 * t + j]
    return out
