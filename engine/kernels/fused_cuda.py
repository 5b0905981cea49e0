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
  mlx-lm does in ~15 ops. The keys are cut into splits of `CH` positions, one block each (online
  softmax, flash-decoding); the last block of a head group to finish adds the splits up (a
  counter per kv head, reset by that block). The position comes from an array, so the step's
  graph has the same shapes at every position (engine/kernels/decode_step.py compiles it once
  per buffer size).

Numerics: products and attention sum in fp32 in another order than MLX's kernels; every value MLX
rounds to the model's dtype between ops (a product before its residual add, a norm before RoPE,
the SwiGLU's parts) is rounded here too. tests/test_decode_step.py runs the step's structure on
the CPU against mlx-lm (engine/kernels/fused_ref.py, the same functions in MLX ops); `python -m
bench.gpu_step --parts kernels` checks each kernel against that reference on a GPU.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

WARPS = 4  # warps per block of matvec and attend
UNROLL = 4  # 128-bit words of a row a lane loads before it computes
MAX_SPLITS = 64  # blocks a head's keys are cut into, at most
MIN_SPLIT = 256  # keys per split, at least
MAX_GROUP_DIMS = 2048  # query heads per kv head x head dim: the attention's shared memory
IN_PLACE = True  # `attention` writes the cache buffers it is given

_HEADER = """
template <typename T> __device__ __forceinline__ float2 pair_f(uint32_t u);
template <> __device__ __forceinline__ float2 pair_f<__nv_bfloat16>(uint32_t u) {
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}
template <> __device__ __forceinline__ float2 pair_f<__half>(uint32_t u) {
  return __half22float2(*reinterpret_cast<__half2*>(&u));
}
template <typename T, int N>
__device__ __forceinline__ void load_f(const T* p, float* out) {
  // N (a multiple of 8) consecutive 16-bit values as floats, through 128-bit loads
  #pragma unroll
  for (int i = 0; i < N / 8; ++i) {
    const uint4 u = reinterpret_cast<const uint4*>(p)[i];
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
    #pragma unroll
    for (int j = 0; j < 4; ++j) { const float2 f = pair_f<T>(w[j]); out[8 * i + 2 * j] = f.x; out[8 * i + 2 * j + 1] = f.y; }
  }
}
__device__ __forceinline__ float q_at(uint32_t bytes, int b) {
  // byte b of `bytes` (0..255) as a float, exactly: 2^23 + byte, less 2^23
  return __uint_as_float(__byte_perm(bytes, 0x4B000000u, 0x7540 + b)) - 8388608.0f;
}
template <int BITS, typename T>
__device__ __forceinline__ float dot_word(const uint4 w, const float* x) {
  // one 128-bit word of a row (128 / BITS weights) against its x values, fp32
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (BITS == 4) {
      const uint32_t lo = ws[i] & 0x0f0f0f0fu, hi = (ws[i] >> 4) & 0x0f0f0f0fu;
      #pragma unroll
      for (int b = 0; b < 4; ++b) {
        s[i] = fmaf(q_at(lo, b), x[8 * i + 2 * b], s[i]);
        s[i] = fmaf(q_at(hi, b), x[8 * i + 2 * b + 1], s[i]);
      }
    } else if constexpr (BITS == 8) {
      #pragma unroll
      for (int b = 0; b < 4; ++b) s[i] = fmaf(q_at(ws[i], b), x[4 * i + b], s[i]);
    } else {  // 16: the word holds 8 values of T
      const float2 f = pair_f<T>(ws[i]);
      s[i] = fmaf(f.x, x[2 * i], s[i]);
      s[i] = fmaf(f.y, x[2 * i + 1], s[i]);
    }
  }
  return (s[0] + s[1]) + (s[2] + s[3]);
}
"""

_MATVEC_IMPL = """
template <typename T, int K, int XN>
__device__ __forceinline__ void stage_x(const T* x, const T* nw, const float* ne, float* xsh) {
  // x (K values) into shared memory as floats, the whole block; XN 2: RMS-normalised as MLX's
  // rms_norm rounds it: T(w * T(x * rsqrt(mean(x^2) + eps)))
  constexpr int PER = (K + 127) / 128;
  __shared__ float red[32];
  float v[PER], ss = 0.f;
  #pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int k = threadIdx.x + 128 * i;
    v[i] = k < K ? static_cast<float>(x[k]) : 0.f;
    ss += v[i] * v[i];
  }
  float rn = 1.f;
  if constexpr (XN == 2) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    ss = 0.f;
    #pragma unroll
    for (int w = 0; w < 4; ++w) ss += red[w];
    rn = rsqrtf(ss / K + ne[0]);
  }
  #pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int k = threadIdx.x + 128 * i;
    if (k < K) xsh[k] = XN == 2 ? static_cast<float>(nw[k] * static_cast<T>(v[i] * rn)) : v[i];
  }
  __syncthreads();
}

template <typename T, typename ST, int BITS, int GS, int K, int N, int R, int E, int XN, int UNROLL>
__device__ __forceinline__ void matvec_impl(const T* x, const uint32_t* w, const ST* scales,
                                            const ST* biases, const T* a, const T* nw,
                                            const float* ne, T* y) {
  // BITS 4/8: W packed (MLX's affine layout, `scales`/`biases` per group of GS); 16: W dense of
  // T. R output units per warp; E 0: y = Wx; 1: y = Wx + a; 2: y = swiglu(W[:N/2] x, W[N/2:] x).
  // XN 0: x read from global memory; 1: staged in shared memory; 2: staged and RMS-normalised
  // with the weight `nw` and eps `ne[0]` (the norm before the product, fused).
  constexpr int VALS = 128 / BITS;
  constexpr int VECS = K / VALS;
  constexpr int PER_LANE = (VECS + 31) / 32;
  constexpr int OUT = (E == 2) ? N / 2 : N;
  constexpr int RR = (E == 2) ? 2 * R : R;
  constexpr int GROUPS = (BITS == 16) ? 1 : K / GS;
  __shared__ __align__(16) float xsh[XN ? K : 4];
  if constexpr (XN != 0) stage_x<T, K, XN>(x, nw, ne, xsh);
  const int lane = threadIdx.x & 31;
  const int unit0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
  if (unit0 >= OUT) return;  // the whole warp: its lanes share the units
  int row[RR];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    const int u = min(unit0 + r, OUT - 1);
    row[r] = u;
    if constexpr (E == 2) row[R + r] = u + OUT;
  }
  float acc[RR];
  #pragma unroll
  for (int r = 0; r < RR; ++r) acc[r] = 0.f;
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  #pragma unroll 1
  for (int v0 = 0; v0 < PER_LANE; v0 += UNROLL) {
    uint4 wv[UNROLL][RR];
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int v = (v0 + u) * 32 + lane;
      #pragma unroll
      for (int r = 0; r < RR; ++r)
        wv[u][r] = (v < VECS) ? __ldg(w4 + (size_t)row[r] * VECS + v) : make_uint4(0u, 0u, 0u, 0u);
    }
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int v = (v0 + u) * 32 + lane;
      if (v < VECS) {
        float xs[VALS];
        if constexpr (XN != 0) {
          #pragma unroll
          for (int j = 0; j < VALS / 4; ++j) {
            const float4 f = reinterpret_cast<const float4*>(xsh + v * VALS)[j];
            xs[4 * j] = f.x; xs[4 * j + 1] = f.y; xs[4 * j + 2] = f.z; xs[4 * j + 3] = f.w;
          }
        } else {
          load_f<T, VALS>(x + v * VALS, xs);
        }
        if constexpr (BITS == 16) {
          #pragma unroll
          for (int r = 0; r < RR; ++r) acc[r] += dot_word<BITS, T>(wv[u][r], xs);
        } else {
          float sx = 0.f;
          #pragma unroll
          for (int j = 0; j < VALS; ++j) sx += xs[j];
          const int g = (v * VALS) / GS;
          #pragma unroll
          for (int r = 0; r < RR; ++r) {
            const float qx = dot_word<BITS, T>(wv[u][r], xs);
            const size_t at = (size_t)row[r] * GROUPS + g;
            acc[r] += static_cast<float>(scales[at]) * qx + static_cast<float>(biases[at]) * sx;
          }
        }
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < RR; ++r) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
  }
  if (lane != 0) return;
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    const int u = unit0 + r;
    if (u >= OUT) break;
    if constexpr (E == 0) {
      y[u] = static_cast<T>(acc[r]);
    } else if constexpr (E == 1) {  // MLX rounds the product, then the sum
      y[u] = static_cast<T>(static_cast<float>(static_cast<T>(acc[r])) + static_cast<float>(a[u]));
    } else {  // mlx-lm's swiglu, silu(g) * up, rounded op by op in T
      const float g = static_cast<float>(static_cast<T>(acc[r]));
      const float up = static_cast<float>(static_cast<T>(acc[R + r]));
      const float sig = static_cast<float>(static_cast<T>(1.0f / (1.0f + expf(-g))));
      const float act = static_cast<float>(static_cast<T>(g * sig));
      y[u] = static_cast<T>(act * up);
    }
  }
}
"""

MAX_STAGED = 8192  # inputs staged in shared memory (fp32): at most 32 KB a block


def _matvec_source(quantized: bool, add: bool, norm: bool) -> str:
    """The kernel body calling matvec_impl with the inputs this variant has (nullptr for others)."""
    w = "w" if quantized else "reinterpret_cast<const uint32_t*>(w)"
    scales = "scales, biases" if quantized else "(const T*)nullptr, (const T*)nullptr"
    return (f"matvec_impl<T, {'ST' if quantized else 'T'}, BITS, GS, K, N, R, E, XN, UNROLL>(x, {w}, {scales}, "
            f"{'a' if add else '(const T*)nullptr'}, {'nw' if norm else '(const T*)nullptr'}, "
            f"{'ne' if norm else '(const float*)nullptr'}, y);")


_ATTENTION_HEADER = """
template <typename T, int D, int ROT, bool TRAD, bool NORM>
__device__ __forceinline__ void head_rope(const T* src, const T* wn, float eps, float at,
                                          const float* invf, float* dst, T* gout, int lane) {
  // one head (a warp): Qwen3's RMSNorm when NORM, then RoPE at position `at` (already scaled),
  // each rounded to T as MLX rounds them; the result as floats in `dst` (shared) and, when
  // `gout`, in T there (the cache row). Lane l holds elements l, l + 32, ...
  constexpr int C = D / 32;
  float v[C], o[C];
  float ss = 0.f;
  #pragma unroll
  for (int c = 0; c < C; ++c) { v[c] = static_cast<float>(src[lane + 32 * c]); ss += v[c] * v[c]; }
  if constexpr (NORM) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float rn = rsqrtf(ss / D + eps);
    #pragma unroll
    for (int c = 0; c < C; ++c) v[c] = static_cast<float>(wn[lane + 32 * c] * static_cast<T>(v[c] * rn));
  }
  #pragma unroll
  for (int c = 0; c < C; ++c) dst[lane + 32 * c] = v[c];
  __syncwarp();
  #pragma unroll
  for (int c = 0; c < C; ++c) {
    const int e = lane + 32 * c;
    o[c] = v[c];
    if (e < ROT) {  // rotated with its partner: (2i, 2i+1) traditional, else (i, i + ROT/2)
      const bool first = TRAD ? (e & 1) == 0 : e < ROT / 2;
      const int i = TRAD ? e >> 1 : (first ? e : e - ROT / 2);
      const int partner = TRAD ? (first ? e + 1 : e - 1) : (first ? e + ROT / 2 : e - ROT / 2);
      const float th = at * invf[i];
      const float cs = cosf(th), sn = sinf(th);
      const float a = dst[partner];
      o[c] = first ? v[c] * cs - a * sn : a * sn + v[c] * cs;
    }
  }
  __syncwarp();
  #pragma unroll
  for (int c = 0; c < C; ++c) {
    const T r = static_cast<T>(o[c]);
    dst[lane + 32 * c] = static_cast<float>(r);
    if (gout != nullptr) gout[lane + 32 * c] = r;
  }
  __syncwarp();
}
"""

# Template: T, D (head dim), G (query heads per kv head), HKV, ROT (rotated dims), TRAD, NORM,
# CAP (cache buffer length), CH (keys per split), S (splits). Inputs: qkv (one row of the
# stacked product), qn, kn (q/k norm weights; unread without NORM), invf (ROT/2 inverse
# frequencies), fp (q/k norm eps, RoPE position scale, attention scale), pos (1,), kc, vc (the
# cache buffers: the new key and value written in place), cnt (HKV int32 counters, zero between
# launches). Outputs: per (head, split) the largest score pm, the sum of exp(score - pm) pl and
# the values weighted by it pa; y (HQ * D), the attention's output.
_ATTENTION = """
  constexpr int HQ = HKV * G;
  constexpr int DPL = D / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int split = blockIdx.x, j = blockIdx.y;
  const int p = pos[0];
  const int start = split * CH, end = min(start + CH, p + 1);
  const bool has_new = start <= p && p < end;
  __shared__ float qs[G][D];
  __shared__ float nk[2][D];
  __shared__ float sm_m[WARPS][G], sm_l[WARPS][G], sm_a[WARPS][G][D];
  __shared__ int last;
  const float at = fp[1] * static_cast<float>(p);
  // the block's queries (and, in the split holding p, the new key) normed and rotated; warp w
  // takes heads w, w + WARPS, ...; the new key is also written into the cache at p
  for (int hh = warp; hh < G + (has_new ? 1 : 0); hh += WARPS) {
    const bool is_k = hh == G;
    const T* src = qkv + (size_t)(is_k ? HQ + j : j * G + hh) * D;
    T* gout = is_k ? const_cast<T*>(kc) + ((size_t)j * CAP + p) * D : nullptr;
    head_rope<T, D, ROT, TRAD, NORM>(src, is_k ? kn : qn, fp[0], at, invf, is_k ? nk[0] : qs[hh], gout, lane);
  }
  if (has_new) {  // the new value, as it is, into the cache at p
    const T* vs = qkv + (size_t)(HQ + HKV + j) * D;
    T* vo = const_cast<T*>(vc) + ((size_t)j * CAP + p) * D;
    for (int e = threadIdx.x; e < D; e += WARPS * 32) { vo[e] = vs[e]; nk[1][e] = static_cast<float>(vs[e]); }
  }
  __syncthreads();
  const float scale = fp[2];
  float qf[G][DPL], m[G], l[G], acc[G][DPL];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    #pragma unroll
    for (int d = 0; d < DPL; ++d) { qf[g][d] = qs[g][lane * DPL + d] * scale; acc[g][d] = 0.f; }
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  for (int t = start + warp; t < end; t += WARPS) {
    float kf[DPL], vf[DPL];
    if (t == p) {
      #pragma unroll
      for (int d = 0; d < DPL; ++d) { kf[d] = nk[0][lane * DPL + d]; vf[d] = nk[1][lane * DPL + d]; }
    } else {
      const size_t o = ((size_t)j * CAP + t) * D + lane * DPL;
      #pragma unroll
      for (int d = 0; d < DPL; ++d) { kf[d] = static_cast<float>(kc[o + d]); vf[d] = static_cast<float>(vc[o + d]); }
    }
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      float sc = 0.f;
      #pragma unroll
      for (int d = 0; d < DPL; ++d) sc = fmaf(qf[g][d], kf[d], sc);
      #pragma unroll
      for (int off = 16; off > 0; off >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, off);
      const float mn = fmaxf(m[g], sc);
      const float corr = expf(m[g] - mn), e = expf(sc - mn);
      l[g] = l[g] * corr + e;
      #pragma unroll
      for (int d = 0; d < DPL; ++d) acc[g][d] = fmaf(e, vf[d], acc[g][d] * corr);
      m[g] = mn;
    }
  }
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
    #pragma unroll
    for (int d = 0; d < DPL; ++d) sm_a[warp][g][lane * DPL + d] = acc[g][d];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {  // the block's warps, one split's part
    const int g = i / D, d = i % D;
    float M = -INFINITY;
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) M = fmaxf(M, sm_m[w][g]);
    float ls = 0.f, a = 0.f;
    if (M != -INFINITY) {
      #pragma unroll
      for (int w = 0; w < WARPS; ++w) { const float e = expf(sm_m[w][g] - M); ls += sm_l[w][g] * e; a += sm_a[w][g][d] * e; }
    }
    const int h = j * G + g;
    pa[((size_t)h * S + split) * D + d] = a;
    if (d == 0) { pm[h * S + split] = M; pl[h * S + split] = ls; }
  }
  // the last of the S blocks of this kv head to finish adds the splits up (then resets the count)
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(const_cast<int*>(cnt) + j, 1) == S - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {
    const int g = i / D, d = i % D, h = j * G + g;
    float M = -INFINITY;
    for (int s = 0; s < S; ++s) M = fmaxf(M, __ldcg(pm + h * S + s));
    float ls = 0.f, a = 0.f;
    for (int s = 0; s < S; ++s) {
      const float ms = __ldcg(pm + h * S + s);
      if (ms == -INFINITY) continue;
      const float e = expf(ms - M);
      ls += __ldcg(pl + h * S + s) * e;
      a += __ldcg(pa + ((size_t)h * S + s) * D + d) * e;
    }
    y[h * D + d] = static_cast<T>(a / ls);
  }
  if (threadIdx.x == 0) const_cast<int*>(cnt)[j] = 0;
"""

_KERNELS: dict[str, Any] = {}


def _kernel(name: str, inputs: list[str], outputs: list[str], source: str, extra: str = "") -> Any:
    """The MLX kernel object `name`, made once (its source is compiled per template on first use).
    Sources stay short: MLX hashes a kernel's whole source at every launch."""
    if name not in _KERNELS:
        consts = f"  constexpr int WARPS = {WARPS};\n  constexpr int UNROLL = {UNROLL};\n"
        header = _HEADER + (_MATVEC_IMPL if name.startswith("matvec") else extra)
        _KERNELS[name] = mx.fast.cuda_kernel(name=f"mlxchat_{name}", input_names=inputs,
                                             output_names=outputs, source=consts + source,
                                             header=header)
    return _KERNELS[name]


def rows_per_warp(n: int) -> int:
    """Output units per warp: enough warps to fill the device (~2,048), at most 4 units each."""
    return max(1, min(4, n // 2048))


def matvec(x: mx.array, w: mx.array, scales: mx.array | None, biases: mx.array | None,
           bits: int, group_size: int, epilogue: int = 0, a: mx.array | None = None,
           norm: tuple[mx.array, mx.array] | None = None) -> mx.array:
    """y = x @ W.T for one row x (any leading shape of size 1, last dim K), W (N, K) dense
    (`bits` 16) or (N, K * bits / 32) packed (4, 8: MLX's affine layout); `epilogue` 1 adds `a`
    (N,), 2 takes SwiGLU of W's halves (N / 2 outputs); `norm` (weight, eps): x RMS-normalised
    first, as mx.fast.rms_norm(x, weight, eps) would. Output: x's leading shape, the outputs."""
    k, n = x.shape[-1], w.shape[0]
    out = n // 2 if epilogue == 2 else n
    r = rows_per_warp(out) if epilogue != 2 else min(2, rows_per_warp(out))
    quantized = bits in (4, 8)
    xn = 2 if norm is not None else (1 if k <= MAX_STAGED else 0)
    names = ["x", "w"] + (["scales", "biases"] if quantized else []) + (["nw", "ne"] if norm else []) \
        + (["a"] if epilogue == 1 else [])
    norm_arrays = [norm[0], mx.array([norm[1]], dtype=mx.float32)] if norm else []
    arrays = [x, w] + ([scales, biases] if quantized else []) + norm_arrays \
        + ([a] if epilogue == 1 else [])
    kind = f"matvec_{'q' if quantized else 'd'}{'_add' if epilogue == 1 else ''}{'_norm' if norm else ''}"
    kernel = _kernel(kind, names, ["y"], _matvec_source(quantized, epilogue == 1, norm is not None))
    block = WARPS * 32
    threads = -(-out // r) * 32
    return kernel(
        inputs=arrays,
        template=[("T", x.dtype), ("ST", scales.dtype if quantized else x.dtype),
                  ("BITS", bits if quantized else 16), ("GS", group_size if quantized else 8),
                  ("K", k), ("N", n), ("R", r), ("E", epilogue), ("XN", xn)],
        grid=(-(-threads // block) * block, 1, 1), threadgroup=(block, 1, 1),
        output_shapes=[(*x.shape[:-1], out)], output_dtypes=[x.dtype])[0]


def splits(cap: int) -> tuple[int, int]:
    """(splits, keys per split) for a cache buffer of `cap` positions."""
    s = max(1, min(MAX_SPLITS, cap // MIN_SPLIT))
    return s, -(-cap // s)


def attention(layer: Any, qkv: mx.array, pos: mx.array, keys: mx.array, values: mx.array
              ) -> tuple[mx.array, mx.array, mx.array]:
    """One kernel for a decode step's attention from the stacked q/k/v row `qkv` (1, 1, ...):
    the layer's q/k norms and RoPE at `pos` (1,) int32, the new key and value written into
    `keys`/`values` (1, kv_heads, cap, head_dim) at `pos` in place, attention over the first
    `pos + 1` positions. Returns (out (1, 1, heads * head_dim), keys, values), the buffers
    themselves. `layer`: engine/kernels/decode_step.py's Layer (shapes, norm weights, `inv_freq`,
    `params` = (q/k norm eps, RoPE position scale, attention scale), `counters`)."""
    heads, kv, dim = layer.heads, layer.kv_heads, layer.head_dim
    cap = keys.shape[2]
    s, ch = splits(cap)
    norm = layer.q_norm is not None
    qn = layer.q_norm.weight if norm else layer.inv_freq  # unread without NORM
    kn = layer.k_norm.weight if norm else layer.inv_freq
    kernel = _kernel("attention", ["qkv", "qn", "kn", "invf", "fp", "pos", "kc", "vc", "cnt"],
                     ["pm", "pl", "pa", "y"], _ATTENTION, _ATTENTION_HEADER)
    out = kernel(
        inputs=[qkv, qn, kn, layer.inv_freq, layer.params, pos, keys, values, layer.counters],
        template=[("T", qkv.dtype), ("D", dim), ("G", heads // kv), ("HKV", kv), ("ROT", layer.rotated),
                  ("TRAD", layer.traditional), ("NORM", norm), ("CAP", cap), ("CH", ch), ("S", s)],
        grid=(s * WARPS * 32, kv, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(heads * s,), (heads * s,), (heads * s * dim,), (1, 1, heads * dim)],
        output_dtypes=[mx.float32, mx.float32, mx.float32, qkv.dtype])
    return out[3], keys, values
