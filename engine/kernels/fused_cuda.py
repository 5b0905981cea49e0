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
- `rope_write`: from the stacked q/k/v row, Qwen3's per-head RMSNorm of q and k (when the model
  has it), RoPE on q and k at the step's position, and the new key and value written into the
  KV cache's buffers at that position, in place: one kernel for what mlx-lm does in ~10 ops (split,
  reshapes, transposes, two norms, two RoPEs, two slice updates). The position comes from an
  array, so the step's graph has the same shapes at every position (engine/kernels/decode_step.py
  compiles it once per buffer size).
- `attend`: single-query attention over the cache's first `pos + 1` keys (the position read from
  the array), grouped-query heads sharing each key and value load; the keys are cut into splits
  of `CH` that run as separate blocks (online softmax in each, flash-decoding), and a second
  kernel combines the splits.

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
MAX_GROUP_DIMS = 2048  # query heads per kv head x head dim: attend's shared memory
IN_PLACE = True  # rope_write writes the cache buffers it is given

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
template <typename T, typename ST, int BITS, int GS, int K, int N, int R, int E, int UNROLL>
__device__ __forceinline__ void matvec_impl(const T* x, const uint32_t* w, const ST* scales,
                                            const ST* biases, const T* a, T* y) {
  // BITS 4/8: W packed (MLX's affine layout, `scales`/`biases` per group of GS); 16: W dense of
  // T. R output units per warp; E 0: y = Wx; 1: y = Wx + a; 2: y = swiglu(W[:N/2] x, W[N/2:] x).
  constexpr int VALS = 128 / BITS;
  constexpr int VECS = K / VALS;
  constexpr int PER_LANE = (VECS + 31) / 32;
  constexpr int OUT = (E == 2) ? N / 2 : N;
  constexpr int RR = (E == 2) ? 2 * R : R;
  constexpr int GROUPS = (BITS == 16) ? 1 : K / GS;
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
        load_f<T, VALS>(x + v * VALS, xs);
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

# The kernels' bodies: template T (x's dtype), ST (scales'), BITS, GS, K, N (W's rows), R, E.
_MATVEC = {
    "q": "matvec_impl<T, ST, BITS, GS, K, N, R, E, UNROLL>(x, w, scales, biases, (const T*)nullptr, y);",
    "q_add": "matvec_impl<T, ST, BITS, GS, K, N, R, 1, UNROLL>(x, w, scales, biases, a, y);",
    "d": "matvec_impl<T, T, 16, 8, K, N, R, E, UNROLL>(x, reinterpret_cast<const uint32_t*>(w), "
         "(const T*)nullptr, (const T*)nullptr, (const T*)nullptr, y);",
    "d_add": "matvec_impl<T, T, 16, 8, K, N, R, 1, UNROLL>(x, reinterpret_cast<const uint32_t*>(w), "
             "(const T*)nullptr, (const T*)nullptr, a, y);",
}

# Template: T, D (head dim), HQ, HKV, ROT (rotated dims), TRAD, NORM, CAP (cache buffer length).
# Inputs: qkv, qn, kn (norm weights, unused without NORM), invf (ROT/2 inverse frequencies),
# fp (eps, rope position scale), pos, kc, vc (the cache buffers, written in place).
_ROPE_WRITE = """
  constexpr int HALF = D / 2;
  __shared__ float sh[D];
  __shared__ float red[(HALF + 31) / 32];
  const int b = blockIdx.x, t = threadIdx.x;
  const bool is_q = b < HQ;
  const int head = is_q ? b : b - HQ;
  const T* src = qkv + (size_t)(is_q ? b : HQ + head) * D;
  const float x0 = static_cast<float>(src[t]), x1 = static_cast<float>(src[t + HALF]);
  if constexpr (NORM) {
    float ss = x0 * x0 + x1 * x1;
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if ((t & 31) == 0) red[t >> 5] = ss;
    __syncthreads();
    float total = 0.f;
    #pragma unroll
    for (int i = 0; i < (HALF + 31) / 32; ++i) total += red[i];
    const float rn = rsqrtf(total / D + fp[0]);
    const T* wn = is_q ? qn : kn;
    sh[t] = static_cast<float>(wn[t] * static_cast<T>(x0 * rn));
    sh[t + HALF] = static_cast<float>(wn[t + HALF] * static_cast<T>(x1 * rn));
  } else {
    sh[t] = x0;
    sh[t + HALF] = x1;
  }
  __syncthreads();
  const int p = pos[0];
  T* out = is_q ? y + (size_t)b * D : const_cast<T*>(kc) + ((size_t)head * CAP + p) * D;
  for (int e = t; e < D; e += HALF) {  // this thread's elements t and t + HALF
    if (e >= ROT) {  // past the rotated dims: as normalised
      out[e] = static_cast<T>(sh[e]);
      continue;
    }
    int e2 = -1, i = 0;  // e's partner in its rotated pair, when e is the pair's first element
    if (TRAD) {
      if ((e & 1) == 0) { e2 = e + 1; i = e / 2; }
    } else if (e < ROT / 2) {
      e2 = e + ROT / 2;
      i = e;
    }
    if (e2 < 0) continue;  // the pair's second element: its first element's thread writes it
    const float th = (fp[1] * static_cast<float>(p)) * invf[i];
    const float c = cosf(th), s = sinf(th);
    const float a1 = sh[e], a2 = sh[e2];
    out[e] = static_cast<T>(a1 * c - a2 * s);
    out[e2] = static_cast<T>(a1 * s + a2 * c);
  }
  if (!is_q) {
    const T* vs = qkv + (size_t)(HQ + HKV + head) * D;
    T* vo = const_cast<T*>(vc) + ((size_t)head * CAP + p) * D;
    vo[t] = vs[t];
    vo[t + HALF] = vs[t + HALF];
  }
"""

# Template: T, D, G (query heads per kv head), CAP, CH (keys per split), S (splits).
# Inputs: q (HQ * D), kc, vc (HKV * CAP * D), pos, sc (scale). Outputs per (head, split): the
# largest score pm, the sum of exp(score - pm) pl, and the values' sum weighted by it pa (D).
_ATTEND = """
  constexpr int DPL = D / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int split = blockIdx.x, j = blockIdx.y;
  const int L = pos[0] + 1;
  const int start = split * CH, end = min(start + CH, L);
  __shared__ float sm_m[WARPS][G], sm_l[WARPS][G], sm_a[WARPS][G][D];
  const float scale = sc[0];
  float qf[G][DPL], m[G], l[G], acc[G][DPL];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    #pragma unroll
    for (int d = 0; d < DPL; ++d) { qf[g][d] = static_cast<float>(q[(j * G + g) * D + lane * DPL + d]) * scale; acc[g][d] = 0.f; }
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  for (int t = start + warp; t < end; t += WARPS) {
    const size_t at = ((size_t)j * CAP + t) * D + lane * DPL;
    float kf[DPL], vf[DPL];
    #pragma unroll
    for (int d = 0; d < DPL; ++d) { kf[d] = static_cast<float>(kc[at + d]); vf[d] = static_cast<float>(vc[at + d]); }
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      float s = 0.f;
      #pragma unroll
      for (int d = 0; d < DPL; ++d) s = fmaf(qf[g][d], kf[d], s);
      #pragma unroll
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      const float mn = fmaxf(m[g], s);
      const float corr = expf(m[g] - mn), p = expf(s - mn);
      l[g] = l[g] * corr + p;
      #pragma unroll
      for (int d = 0; d < DPL; ++d) acc[g][d] = fmaf(p, vf[d], acc[g][d] * corr);
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
  for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {
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
"""

# Template: T, D, S. One block of D threads per query head.
_COMBINE = """
  const int h = blockIdx.y, d = threadIdx.x;
  float M = -INFINITY;
  for (int s = 0; s < S; ++s) M = fmaxf(M, pm[h * S + s]);
  float ls = 0.f, a = 0.f;
  for (int s = 0; s < S; ++s) {
    const float ms = pm[h * S + s];
    if (ms == -INFINITY) continue;
    const float e = expf(ms - M);
    ls += pl[h * S + s] * e;
    a += pa[((size_t)h * S + s) * D + d] * e;
  }
  y[h * D + d] = static_cast<T>(a / ls);
"""

_KERNELS: dict[str, Any] = {}


def _kernel(name: str, inputs: list[str], outputs: list[str], source: str) -> Any:
    """The MLX kernel object `name`, made once (its source is compiled per template on first use).
    Sources stay short: MLX hashes a kernel's whole source at every launch."""
    if name not in _KERNELS:
        consts = f"  constexpr int WARPS = {WARPS};\n  constexpr int UNROLL = {UNROLL};\n"
        header = _HEADER + (_MATVEC_IMPL if name.startswith("matvec") else "")
        _KERNELS[name] = mx.fast.cuda_kernel(name=f"mlxchat_{name}", input_names=inputs,
                                             output_names=outputs, source=consts + source,
                                             header=header)
    return _KERNELS[name]


def rows_per_warp(n: int) -> int:
    """Output units per warp: enough warps to fill the device (~2,048), at most 4 units each."""
    return max(1, min(4, n // 2048))


def matvec(x: mx.array, w: mx.array, scales: mx.array | None, biases: mx.array | None,
           bits: int, group_size: int, epilogue: int = 0, a: mx.array | None = None) -> mx.array:
    """y = x @ W.T for one row x (any leading shape of size 1, last dim K), W (N, K) dense
    (`bits` 16) or (N, K * bits / 32) packed (4, 8: MLX's affine layout); `epilogue` 1 adds `a`
    (N,), 2 takes SwiGLU of W's halves (N / 2 outputs). Output: x's leading shape, the outputs."""
    k, n = x.shape[-1], w.shape[0]
    out = n // 2 if epilogue == 2 else n
    r = rows_per_warp(out) if epilogue != 2 else min(2, rows_per_warp(out))
    quantized = bits in (4, 8)
    kind = ("q" if quantized else "d") + ("_add" if epilogue == 1 else "")
    names = ["x", "w"] + (["scales", "biases"] if quantized else []) + (["a"] if epilogue == 1 else [])
    arrays = [x, w] + ([scales, biases] if quantized else []) + ([a] if epilogue == 1 else [])
    kernel = _kernel(f"matvec_{kind}", names, ["y"], _MATVEC[kind])
    block = WARPS * 32
    threads = -(-out // r) * 32
    return kernel(
        inputs=arrays,
        template=[("T", x.dtype), ("ST", scales.dtype if quantized else x.dtype),
                  ("BITS", bits if quantized else 16), ("GS", group_size if quantized else 8),
                  ("K", k), ("N", n), ("R", r), ("E", epilogue)],
        grid=(-(-threads // block) * block, 1, 1), threadgroup=(block, 1, 1),
        output_shapes=[(*x.shape[:-1], out)], output_dtypes=[x.dtype])[0]


def rope_write(layer: Any, qkv: mx.array, pos: mx.array, keys: mx.array, values: mx.array
               ) -> tuple[mx.array, mx.array, mx.array]:
    """q (1, 1, heads * head_dim) after the layer's q norm and RoPE at `pos` (1,) int32; the new
    key (norm, RoPE) and value written into `keys`/`values` (1, kv_heads, cap, head_dim) at `pos`,
    in place: returns (q, keys, values), the buffers themselves. `layer`: engine/kernels/
    decode_step.py's Layer (shapes, norm weights, `inv_freq`, `params` = (eps, position scale))."""
    norm = layer.q_norm is not None
    kernel = _kernel("rope_write", ["qkv", "qn", "kn", "invf", "fp", "pos", "kc", "vc"], ["y"], _ROPE_WRITE)
    half = layer.head_dim // 2
    qn = layer.q_norm.weight if norm else layer.inv_freq  # not read without NORM
    kn = layer.k_norm.weight if norm else layer.inv_freq
    y = kernel(
        inputs=[qkv, qn, kn, layer.inv_freq, layer.params, pos, keys, values],
        template=[("T", qkv.dtype), ("D", layer.head_dim), ("HQ", layer.heads), ("HKV", layer.kv_heads),
                  ("ROT", layer.rotated), ("TRAD", layer.traditional), ("NORM", norm),
                  ("CAP", keys.shape[2])],
        grid=((layer.heads + layer.kv_heads) * half, 1, 1), threadgroup=(half, 1, 1),
        output_shapes=[(1, 1, layer.heads * layer.head_dim)], output_dtypes=[qkv.dtype])[0]
    return y, keys, values


def splits(cap: int) -> tuple[int, int]:
    """(splits, keys per split) for a cache buffer of `cap` positions."""
    s = max(1, min(MAX_SPLITS, cap // MIN_SPLIT))
    return s, -(-cap // s)


def attend(layer: Any, q: mx.array, keys: mx.array, values: mx.array, pos: mx.array) -> mx.array:
    """Attention of the one query row q (1, 1, heads * head_dim) over the first `pos + 1` rows of
    `keys`/`values` (1, kv_heads, cap, head_dim): (1, 1, heads * head_dim)."""
    heads, dim = layer.heads, layer.head_dim
    cap = keys.shape[2]
    s, ch = splits(cap)
    part = _kernel("attend", ["q", "kc", "vc", "pos", "sc"], ["pm", "pl", "pa"], _ATTEND)
    pm, pl, pa = part(
        inputs=[q, keys, values, pos, layer.scale_array],
        template=[("T", q.dtype), ("D", dim), ("G", heads // layer.kv_heads), ("CAP", cap),
                  ("CH", ch), ("S", s)],
        grid=(s * WARPS * 32, layer.kv_heads, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(heads * s,), (heads * s,), (heads * s * dim,)],
        output_dtypes=[mx.float32, mx.float32, mx.float32])
    combine = _kernel("attend_combine", ["pm", "pl", "pa"], ["y"], _COMBINE)
    return combine(inputs=[pm, pl, pa], template=[("T", q.dtype), ("D", dim), ("S", s)],
                   grid=(dim, heads, 1), threadgroup=(dim, 1, 1),
                   output_shapes=[(1, 1, heads * dim)], output_dtypes=[q.dtype])[0]
