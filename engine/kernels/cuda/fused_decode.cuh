// Device functions of mlxchat's fused one-token decode kernels (engine/kernels/fused_cuda.py):
// included by absolute path into each kernel MLX compiles at run time (NVRTC), so that the
// kernel's own source, which MLX hashes at every launch, stays a few hundred bytes.
#pragma once

__device__ __forceinline__ int warp_id() {
  // threadIdx.x / 32, as a value the compiler knows is the same across the warp (lane 0's, by a
  // shuffle): a loop bounded by it keeps its shuffles converged. With threadIdx.x >> 5, nvcc
  // lowered the shuffles in such loops to collective code (WARPSYNC.COLLECTIVE): the one-row
  // attention kernel was 5,297 SASS instructions, 3,169 without (sm_90).
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0);
}

__device__ __forceinline__ void fence_acq_rel() {
  // a GPU-scope acquire-release fence: with a relaxed atomic after it (release) or before it
  // (acquire), it orders one block's stores before another's loads. Lighter than __threadfence(),
  // a sequentially consistent fence (MEMBAR.SC)
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

__device__ __forceinline__ void l2_ahead(const char* p, long long bytes) {
  // this thread's share (128-byte lines, spread over the whole grid's threads) of `bytes` at p
  // prefetched into L2: the next kernel's weights stream from memory while this kernel runs
  const long long threads = (long long)gridDim.x * gridDim.y * blockDim.x;
  const long long t = ((long long)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
  for (long long o = t * 128; o < bytes; o += threads * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
}

template <typename T> __device__ __forceinline__ float2 pair_f(uint32_t u);
template <> __device__ __forceinline__ float2 pair_f<__nv_bfloat16>(uint32_t u) {
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}
template <> __device__ __forceinline__ float2 pair_f<__half>(uint32_t u) {
  return __half22float2(*reinterpret_cast<__half2*>(&u));
}
template <typename T>
__device__ __forceinline__ void unpack8(const uint4 u, float* out) {
  // eight 16-bit values of T (one 128-bit word) as floats
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
  #pragma unroll
  for (int j = 0; j < 4; ++j) { const float2 f = pair_f<T>(w[j]); out[2 * j] = f.x; out[2 * j + 1] = f.y; }
}

template <typename T, int N>
__device__ __forceinline__ void load_f(const T* p, float* out) {
  // N (a multiple of 8) consecutive 16-bit values as floats, through 128-bit loads
  #pragma unroll
  for (int i = 0; i < N / 8; ++i) {
    unpack8<T>(reinterpret_cast<const uint4*>(p)[i], out + 8 * i);
  }
}
__constant__ uint32_t kFloatMagic = 0x4B000000u;  // 2^23's bits (q_at)
__device__ __forceinline__ float q_at(uint32_t bytes, int b) {
  // byte b of `bytes` (0..255) as a float, exactly: 2^23 + byte, less 2^23. The exponent's bytes
  // come from a register and the selector is the instruction's immediate: with 0x4B000000 as the
  // immediate, ptxas put the selector in a register and re-made it (MOV from a uniform
  // register) before nearly every PRMT, one instruction a weight.
  return __uint_as_float(__byte_perm(bytes, kFloatMagic, 0x7540 + b)) - 8388608.0f;
}
__constant__ uint32_t kOneMagic = 0x3F000000u;  // 1.0f's top byte (q_one)
__constant__ uint32_t kExponentBits = 0x80808080u;  // bit 7 of each byte (dot_word's FOLD)
__device__ __forceinline__ float q_one(uint32_t bytes, int b) {
  // 1 + q / 16, exactly, for the 4-bit code q held as byte b = 0x80 | q << 3 of `bytes`: the
  // byte lands in the float's bits 16-23 under 1.0f's top byte (exponent 127, q the mantissa's
  // top four bits), with no subtraction (dot_word's FOLD: the 1s come off once a word)
  return __uint_as_float(__byte_perm(bytes, kOneMagic, 0x7044 + (b << 8)));
}
template <int BITS, typename T, bool FOLD = false>
__device__ __forceinline__ float dot_word(const uint4 w, const float* x) {
  // one 128-bit word of a row (128 / BITS weights) against its x values, fp32. FOLD (4 bits):
  // the sum of (1 + q / 16) x instead of q x, two instructions a weight instead of three (the
  // caller takes the sum of x off and scales by 16: matvec_impl)
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (BITS == 4 && FOLD) {
      // each byte's low and high nibble at bits 3-6 of its byte, under bit 7 (the exponent's
      // lowest bit, set; from a constant, so that each is one LOP3 with the mask as its immediate)
      const uint32_t lo = ((ws[i] << 3) & 0x78787878u) | kExponentBits;
      const uint32_t hi = ((ws[i] >> 1) & 0x78787878u) | kExponentBits;
      #pragma unroll
      for (int b = 0; b < 4; ++b) {
        s[i] = fmaf(q_one(lo, b), x[8 * i + 2 * b], s[i]);
        s[i] = fmaf(q_one(hi, b), x[8 * i + 2 * b + 1], s[i]);
      }
    } else if constexpr (BITS == 4) {
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

template <int THREADS>
__device__ __forceinline__ float block_sum(float v) {
  // the sum of `v` over the block's THREADS threads: each warp's by shuffles, then the warps' in
  // warp order (the same order every launch). Once a kernel: a second call would write the
  // shared sums while a slower warp still reads the first's.
  __shared__ float red[THREADS / 32];
  #pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = 0.f;
  #pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) v += red[w];
  return v;
}

template <typename T, int K, int THREADS, int XN>
__device__ __forceinline__ float load_x(const T* x, const float* ne, float* v) {
  // this thread's values of x (k = threadIdx.x + THREADS i) into v; returns the RMS norm's
  // 1 / rms (XN 2: the whole block's sum of squares; else 1)
  constexpr int PER = (K + THREADS - 1) / THREADS;
  float ss = 0.f;
  #pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int k = threadIdx.x + THREADS * i;
    v[i] = k < K ? static_cast<float>(x[k]) : 0.f;
    ss += v[i] * v[i];
  }
  if constexpr (XN != 2) return 1.f;
  return rsqrtf(block_sum<THREADS>(ss) / K + ne[0]);
}

template <int K, int THREADS>
__device__ __forceinline__ bool chunk_in(int c) {
  // whether 8-value chunk c lies in x of K values (always, where K / 8 chunks divide evenly over
  // THREADS threads: the test folds away)
  return (K / 8) % THREADS == 0 || c < K / 8;
}

template <typename T, int K, int THREADS>
__device__ __forceinline__ void load_chunks(const T* x, uint4 (&u)[(K / 8 + THREADS - 1) / THREADS]) {
  // thread t's 8-value chunks t, t + THREADS, ... of x (K values, a multiple of 8) as 128-bit words,
  // all loads issued before any is used (zeros past the end)
  #pragma unroll
  for (int i = 0; i < (K / 8 + THREADS - 1) / THREADS; ++i) {
    const int c = threadIdx.x + THREADS * i;
    u[i] = chunk_in<K, THREADS>(c) ? reinterpret_cast<const uint4*>(x)[c] : make_uint4(0u, 0u, 0u, 0u);
  }
}

template <typename T, int K, int THREADS = 128>
__device__ __forceinline__ float block_rms(const T* x, const float* ne) {
  // 1 / rms of x (K values, a multiple of 8) and eps ne[0], by the whole block of THREADS threads:
  // thread t sums the squares of its chunks (load_chunks: one round trip for the whole of x) in
  // order, then the warps' sums in warp order. Nothing is held in registers past the barrier.
  uint4 u[(K / 8 + THREADS - 1) / THREADS];
  load_chunks<T, K, THREADS>(x, u);
  float ss = 0.f;
  #pragma unroll
  for (int i = 0; i < (K / 8 + THREADS - 1) / THREADS; ++i) {
    float v[8];
    unpack8<T>(u[i], v);
    #pragma unroll
    for (int j = 0; j < 8; ++j) ss += v[j] * v[j];
  }
  return rsqrtf(block_sum<THREADS>(ss) / K + ne[0]);
}

template <typename T, int K, int XN>
__device__ __forceinline__ void stage_x(const T* x, const T* nw, const float* ne, float* xsh) {
  // x (K values, a multiple of 8) into shared memory as floats, the whole block of 128 threads;
  // XN 2: RMS-normalised as MLX's rms_norm rounds it: T(w * T(x * rsqrt(mean(x^2) + eps))). Two
  // passes over x (the second from L1/L2), each one round trip (load_chunks): no value is held in
  // registers across the block's barrier
  constexpr int PER = (K / 8 + 127) / 128;
  const float rn = XN == 2 ? block_rms<T, K>(x, ne) : 1.f;
  uint4 u[PER], gu[PER];
  load_chunks<T, K, 128>(x, u);
  if constexpr (XN == 2) load_chunks<T, K, 128>(nw, gu);
  #pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = threadIdx.x + 128 * i;
    if (chunk_in<K, 128>(c)) {
      float v[8];
      unpack8<T>(u[i], v);
      if constexpr (XN == 2) {
        float g[8];
        unpack8<T>(gu[i], g);
        #pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = static_cast<float>(static_cast<T>(g[j]) * static_cast<T>(v[j] * rn));
      }
      reinterpret_cast<float4*>(xsh + 8 * c)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(xsh + 8 * c)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
  }
  __syncthreads();
}

template <typename ST, int BITS, int GS, int K, int U, int RR>
struct WordRound {
  // A lane's round of a one-row product (matvec_impl, qdot_impl): word (v0 + u) * 32 + lane (128
  // bits: 128 / BITS weights) of each of RR weight rows for u < U, with its group's scale and bias
  // (4/8 bits; ST), all loaded before any is used.
  static constexpr int VECS = K * BITS / 128, GROUPS = (BITS == 16) ? 1 : K / GS;
  int row[RR];  // the weight rows of a warp's units (RR = 2R for SwiGLU: the gate's, then the up's)
  uint4 w[U][RR];
  ST s[U][RR], b[U][RR];

  template <int R, int OUT>
  __device__ __forceinline__ void aim(int unit0) {
    // units unit0 .. unit0 + R - 1 of OUT (past the end: the last, computed and not written)
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      row[r] = min(unit0 + r, OUT - 1);
      if constexpr (RR == 2 * R) row[R + r] = row[r] + OUT;
    }
  }

  __device__ __forceinline__ void load(const uint4* w4, const ST* scales, const ST* biases, int v0, int lane,
                                       bool live) {
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = (v0 + u) * 32 + lane;
      const bool in = v < VECS && live;
      #pragma unroll
      for (int r = 0; r < RR; ++r) {
        w[u][r] = in ? __ldg(w4 + (size_t)row[r] * VECS + v) : make_uint4(0u, 0u, 0u, 0u);
        if constexpr (BITS != 16) {
          const size_t at = (size_t)row[r] * GROUPS + (in ? (v * (128 / BITS)) / GS : 0);
          s[u][r] = scales[at];
          b[u][r] = biases[at];
        }
      }
    }
  }
};

template <typename T, int R, int E>
__device__ __forceinline__ void write_units(float* acc, int unit0, int out, const T* a, T* y) {
  // a warp's R output units from its lanes' partial sums (acc: R, or 2R for E 2: the gate's, then
  // the up's): summed over the warp, then y = acc (E 0), acc + a (E 1: MLX rounds the product,
  // then the sum) or mlx-lm's swiglu, silu(g) * up, rounded op by op in T (E 2), by lane 0
  constexpr int RR = (E == 2) ? 2 * R : R;
  #pragma unroll
  for (int r = 0; r < RR; ++r) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
  }
  if ((threadIdx.x & 31) != 0) return;
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    const int u = unit0 + r;
    if (u >= out) break;
    if constexpr (E == 0) {
      y[u] = static_cast<T>(acc[r]);
    } else if constexpr (E == 1) {
      y[u] = static_cast<T>(static_cast<float>(static_cast<T>(acc[r])) + static_cast<float>(a[u]));
    } else {
      const float g = static_cast<float>(static_cast<T>(acc[r]));
      const float up = static_cast<float>(static_cast<T>(acc[R + r]));
      const float sig = static_cast<float>(static_cast<T>(1.0f / (1.0f + expf(-g))));
      const float act = static_cast<float>(static_cast<T>(g * sig));
      y[u] = static_cast<T>(act * up);
    }
  }
}

template <typename T, typename ST, int BITS, int GS, int K, int N, int R, int E, int XN, int UNROLL, int PF = 1,
          bool FOLD = false>
__device__ __forceinline__ void matvec_impl(const T* x, const uint32_t* w, const ST* scales,
                                            const ST* biases, const T* a, const T* nw,
                                            const float* ne, T* y) {
  // BITS 4/8: W packed (MLX's affine layout, `scales`/`biases` per group of GS); 16: W dense of
  // T. R output units per warp; E 0: y = Wx; 1: y = Wx + a; 2: y = swiglu(W[:N/2] x, W[N/2:] x).
  // XN 0: x read from global memory; 1: staged in shared memory; 2: staged and RMS-normalised
  // with the weight `nw` and eps `ne[0]` (the norm before the product, fused). FOLD (4 bits):
  // each word's dot product as dot_word's sum of (1 + q / 16) x, less the sum of x, times 16:
  // one instruction a weight fewer, its rounding that of a sum of terms up to ~2x |q x| / 16
  // instead of |q x| (the loader's gate and bench.kernel_probe check the outputs).
  static_assert(!FOLD || BITS == 4, "FOLD: 4-bit weights");
  constexpr int VALS = 128 / BITS;
  constexpr int VECS = K / VALS;
  constexpr int PER_LANE = (VECS + 31) / 32;
  constexpr int OUT = (E == 2) ? N / 2 : N;
  constexpr int RR = (E == 2) ? 2 * R : R;
  __shared__ __align__(16) float xsh[XN ? K : 4];
  const int lane = threadIdx.x & 31;
  const int unit0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
  float acc[RR];
  #pragma unroll
  for (int r = 0; r < RR; ++r) acc[r] = 0.f;
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  // the first round's loads go out before x is staged, so the weights' memory latency overlaps
  // the staging (and the RMS norm) instead of following it
  WordRound<ST, BITS, GS, K, UNROLL, RR> rd;
  rd.template aim<R, OUT>(unit0);
  auto load_round = [&](int v0) { rd.load(w4, scales, biases, v0, lane, unit0 < OUT); };
  if constexpr (PF != 0) load_round(0);  // PF 0: after the staging (the bench's comparison)
  if constexpr (XN != 0) stage_x<T, K, XN>(x, nw, ne, xsh);
  if (unit0 >= OUT) return;  // the whole warp: its lanes share the units
  // one round's words times x, into acc
  auto compute = [&](const WordRound<ST, BITS, GS, K, UNROLL, RR>& rw, int v0) {
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
          for (int r = 0; r < RR; ++r) acc[r] += dot_word<BITS, T>(rw.w[u][r], xs);
        } else {
          float sx = 0.f;
          #pragma unroll
          for (int j = 0; j < VALS; ++j) sx += xs[j];
          #pragma unroll
          for (int r = 0; r < RR; ++r) {
            float qx = dot_word<BITS, T, FOLD>(rw.w[u][r], xs);
            if constexpr (FOLD) qx = 16.f * (qx - sx);
            acc[r] += static_cast<float>(rw.s[u][r]) * qx + static_cast<float>(rw.b[u][r]) * sx;
          }
        }
      }
    }
  };
  if constexpr (PF == 2) {
    // two rounds in registers: the next round's words load while this one's are multiplied
    WordRound<ST, BITS, GS, K, UNROLL, RR> rn;
    rn.template aim<R, OUT>(unit0);
    #pragma unroll 1
    for (int v0 = 0; v0 < PER_LANE; v0 += 2 * UNROLL) {
      if (v0 + UNROLL < PER_LANE) rn.load(w4, scales, biases, v0 + UNROLL, lane, true);
      compute(rd, v0);
      if (v0 + UNROLL < PER_LANE) {
        if (v0 + 2 * UNROLL < PER_LANE) load_round(v0 + 2 * UNROLL);
        compute(rn, v0 + UNROLL);
      }
    }
  } else {
    #pragma unroll 1
    for (int v0 = 0; v0 < PER_LANE; v0 += UNROLL) {
      if (v0 > 0 || PF == 0) load_round(v0);
      compute(rd, v0);
    }
  }
  write_units<T, R, E>(acc, unit0, OUT, a, y);
}

// The int8-activation path (lossy, opt-in: `--int8-activations`): x quantized per 32-element block
// as the CPU kernels' prep_x8 does (engine/kernels/csrc/kernels_impl.cpp, Q8Rows in common.h):
// d = max|x| / Q8_LEVELS, v = round(x / d) = 128 hi + lo (two int8 limbs, x to 15 bits of its
// block's largest value); each limb's dot product with the weights' integer codes exact in int32
// (dp4a), then s * d * (128 hi + lo) + b * sum(x) in fp32.
constexpr float Q8_LEVELS = 16192.0f;  // 127 * 128 - 64: v's largest magnitude (kQ8Levels)

__device__ __forceinline__ int dp4a_u8(uint32_t codes, int x, int acc) {
  // four unsigned 8-bit codes times four signed 8-bit limbs, summed into acc
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(codes), "r"(x), "r"(acc));
  return d;
}

__device__ __forceinline__ uint32_t pack_s8(int a, int b, int c, int d) {
  return (uint32_t)(a & 0xff) | ((uint32_t)(b & 0xff) << 8) | ((uint32_t)(c & 0xff) << 16) | ((uint32_t)d << 24);
}

template <typename T, int BITS, int K, int XN, int THREADS>
__device__ __forceinline__ void stage_x8(const T* x, const T* nw, const float* ne, uint32_t* xh, uint32_t* xl,
                                         float* xd, float* xs) {
  // x (K values, a multiple of 32; XN 2: RMS-normalised as stage_x does) quantized into shared
  // memory: xh / xl the limbs, four a word (4-bit: per 8 values the even ones, then the odd ones,
  // as a weight word's low and high nibbles; 8-bit: in order), xd the blocks' d, xs their fp32
  // sums. THREADS threads, 8 values a thread a pass (4 threads a block); no value is held across
  // a barrier (see stage_x).
  const float rn = XN == 2 ? block_rms<T, K, THREADS>(x, ne) : 1.f;
  #pragma unroll 2
  for (int i = 0; i < (K / 8 + THREADS - 1) / THREADS; ++i) {
    const int k = 8 * (threadIdx.x + THREADS * i);
    const bool in = k < K;  // the same for the 4 threads of a block (K % 32 == 0)
    float v[8];
    if (in) {
      load_f<T, 8>(x + k, v);
      if constexpr (XN == 2) {
        float g[8];
        load_f<T, 8>(nw + k, g);
        #pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = static_cast<float>(static_cast<T>(g[j]) * static_cast<T>(v[j] * rn));
      }
    } else {
      #pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = 0.f;
    }
    float amax = 0.f, sum = 0.f;
    #pragma unroll
    for (int j = 0; j < 8; ++j) { amax = fmaxf(amax, fabsf(v[j])); sum += v[j]; }
    #pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      sum += __shfl_xor_sync(0xffffffffu, sum, off);
    }
    const float inv = amax > 0.f ? Q8_LEVELS / amax : 0.f;
    int h[8], l[8];
    #pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int q = __float2int_rn(fminf(fmaxf(v[j] * inv, -Q8_LEVELS), Q8_LEVELS));
      h[j] = (q + 64) >> 7;  // floor((q + 64) / 128)
      l[j] = q - 128 * h[j];
    }
    if (in) {
      if constexpr (BITS == 4) {
        xh[k / 4] = pack_s8(h[0], h[2], h[4], h[6]); xh[k / 4 + 1] = pack_s8(h[1], h[3], h[5], h[7]);
        xl[k / 4] = pack_s8(l[0], l[2], l[4], l[6]); xl[k / 4 + 1] = pack_s8(l[1], l[3], l[5], l[7]);
      } else {
        xh[k / 4] = pack_s8(h[0], h[1], h[2], h[3]); xh[k / 4 + 1] = pack_s8(h[4], h[5], h[6], h[7]);
        xl[k / 4] = pack_s8(l[0], l[1], l[2], l[3]); xl[k / 4 + 1] = pack_s8(l[4], l[5], l[6], l[7]);
      }
      if ((threadIdx.x & 3) == 0) { xd[k / 32] = amax / Q8_LEVELS; xs[k / 32] = sum; }
    }
  }
  __syncthreads();
}

template <typename T, typename ST, int BITS, int GS, int K, int N, int R, int E, int XN, int UNROLL, int THREADS>
__device__ __forceinline__ void qdot_impl(const T* x, const uint32_t* w, const ST* scales, const ST* biases,
                                          const T* a, const T* nw, const float* ne, T* y) {
  // matvec_impl's product (the same units, epilogues E and fused norm XN 2) for a 4- or 8-bit W
  // on int8 activations: x staged by stage_x8; a lane's 128-bit word of a row (4-bit: 32 weights,
  // one block of x; 8-bit: 16, half a block) times the block's limbs with dp4a. K <= 16384. Blocks
  // of THREADS threads: x is staged once a block, so wider blocks stage it fewer times.
  constexpr int VALS = 128 / BITS;
  constexpr int VECS = K / VALS;
  constexpr int PER_LANE = (VECS + 31) / 32;
  constexpr int OUT = (E == 2) ? N / 2 : N;
  constexpr int RR = (E == 2) ? 2 * R : R;
  __shared__ __align__(16) uint32_t xh[K / 4];
  __shared__ __align__(16) uint32_t xl[K / 4];
  __shared__ float xd[K / 32], xs[K / 32];
  const int lane = threadIdx.x & 31;
  const int unit0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
  float acc[RR];
  #pragma unroll
  for (int r = 0; r < RR; ++r) acc[r] = 0.f;
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  WordRound<ST, BITS, GS, K, UNROLL, RR> rd;
  rd.template aim<R, OUT>(unit0);
  rd.load(w4, scales, biases, 0, lane, unit0 < OUT);  // in flight while x is staged
  stage_x8<T, BITS, K, XN, THREADS>(x, nw, ne, xh, xl, xd, xs);
  if (unit0 >= OUT) return;
  #pragma unroll 1
  for (int v0 = 0; v0 < PER_LANE; v0 += UNROLL) {
    if (v0 > 0) rd.load(w4, scales, biases, v0, lane, true);
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int v = (v0 + u) * 32 + lane;
      if (v < VECS) {
        constexpr int XW = VALS / 4;  // words of limbs a weight word meets
        uint32_t hv[XW], lv[XW];
        #pragma unroll
        for (int j = 0; j < XW / 4; ++j) {
          const uint4 hq = reinterpret_cast<const uint4*>(xh + v * XW)[j];
          const uint4 lq = reinterpret_cast<const uint4*>(xl + v * XW)[j];
          hv[4 * j] = hq.x; hv[4 * j + 1] = hq.y; hv[4 * j + 2] = hq.z; hv[4 * j + 3] = hq.w;
          lv[4 * j] = lq.x; lv[4 * j + 1] = lq.y; lv[4 * j + 2] = lq.z; lv[4 * j + 3] = lq.w;
        }
        const int blk = v * VALS / 32;
        const float d = xd[blk];
        // the biases meet x's sum once a block: 8-bit words in its first half carry it
        const float sx = (BITS == 4 || (v & 1) == 0) ? xs[blk] : 0.f;
        #pragma unroll
        for (int r = 0; r < RR; ++r) {
          const uint32_t ws[4] = {rd.w[u][r].x, rd.w[u][r].y, rd.w[u][r].z, rd.w[u][r].w};
          int ah = 0, al = 0;
          #pragma unroll
          for (int j = 0; j < 4; ++j) {
            if constexpr (BITS == 4) {
              const int lo = static_cast<int>(ws[j] & 0x0f0f0f0fu), hi = static_cast<int>((ws[j] >> 4) & 0x0f0f0f0fu);
              ah = __dp4a(lo, static_cast<int>(hv[2 * j]), ah);
              ah = __dp4a(hi, static_cast<int>(hv[2 * j + 1]), ah);
              al = __dp4a(lo, static_cast<int>(lv[2 * j]), al);
              al = __dp4a(hi, static_cast<int>(lv[2 * j + 1]), al);
            } else {
              ah = dp4a_u8(ws[j], static_cast<int>(hv[j]), ah);
              al = dp4a_u8(ws[j], static_cast<int>(lv[j]), al);
            }
          }
          const float q = static_cast<float>(128 * ah + al);
          acc[r] += static_cast<float>(rd.s[u][r]) * (d * q) + static_cast<float>(rd.b[u][r]) * sx;
        }
      }
    }
  }
  write_units<T, R, E>(acc, unit0, OUT, a, y);
}

__device__ __forceinline__ float2 sin_cos(float x) {
  // (sin x, cos x) for |x| < 105615, as CUDA's sincosf computes them there: x less j pi/2 in three
  // parts (Cody-Waite), then its minimax polynomials on [-pi/4, pi/4] and the quadrant's signs.
  // Without sincosf's path for larger arguments (Payne-Hanek), which gave the attention kernel a
  // 64-byte stack a thread: a kernel computing a block's angles took 3.2 us on an H100 with
  // sincosf, 2.8 with this (2.5 empty; bench/kernel_probe.py). Positions times frequencies stay
  // far below the bound.
  const float j = rintf(x * 0.636619772f);  // 2 / pi
  float r = fmaf(j, -1.57079601e+00f, x);
  r = fmaf(j, -3.13916473e-07f, r);
  r = fmaf(j, -5.39030253e-15f, r);
  const float r2 = r * r;
  float ps = fmaf(-1.95152959e-4f, r2, 8.33216087e-3f);
  ps = fmaf(ps, r2, -1.66666546e-1f);
  ps = fmaf(ps * r2, r, r);  // sin r
  float pc = fmaf(2.44331571e-5f, r2, -1.38873163e-3f);
  pc = fmaf(pc, r2, 4.16666457e-2f);
  pc = fmaf(pc, r2, -5.00000000e-1f);
  pc = fmaf(pc, r2, 1.0f);  // cos r
  const int q = static_cast<int>(j);
  const float sn = (q & 1) ? pc : ps, cs = (q & 1) ? ps : pc;
  return make_float2((q & 2) ? -sn : sn, ((q + 1) & 2) ? -cs : cs);
}

template <int D, int ROT, bool TRAD>
struct RopeAngles {
  // RoPE's cos and sin of a lane's elements (lane, lane + 32, ...) at one position: the same for
  // every head, so computed once a block (their frequencies loaded together, not one round trip
  // an element inside the rotation). Elements past ROT get an angle too, unused.
  static constexpr int C = D / 32;
  float cs[C], sn[C];

  __device__ __forceinline__ void at(float position, const float* invf, int lane) {
    // position: already scaled (RoPE's position scale)
    float f[C];
    #pragma unroll
    for (int c = 0; c < C; ++c) {
      const int e = min(lane + 32 * c, ROT - 1);
      f[c] = invf[TRAD ? e >> 1 : (e < ROT / 2 ? e : e - ROT / 2)];
    }
    #pragma unroll
    for (int c = 0; c < C; ++c) {
      const float2 a = sin_cos(position * f[c]);  // one range reduction for both
      sn[c] = a.x;
      cs[c] = a.y;
    }
  }
};

template <typename T, int D, int ROT, bool TRAD, bool NORM>
__device__ __forceinline__ void head_rope(const T* src, const float* wn, float eps,
                                          const RopeAngles<D, ROT, TRAD>& rope, float* dst, T* gout, int lane) {
  // one head (a warp): Qwen3's RMSNorm when NORM (wn: the lane's elements of its weight), then
  // RoPE at the block's position (rope), each rounded to T as MLX rounds them; the result as
  // floats in `dst` (shared) and, when `gout`, in T there (the cache row). Lane l holds elements
  // l, l + 32, ...
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
    for (int c = 0; c < C; ++c) v[c] = static_cast<float>(static_cast<T>(wn[c]) * static_cast<T>(v[c] * rn));
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
      const int partner = TRAD ? (first ? e + 1 : e - 1) : (first ? e + ROT / 2 : e - ROT / 2);
      const float a = dst[partner];
      o[c] = first ? v[c] * rope.cs[c] - a * rope.sn[c] : a * rope.sn[c] + v[c] * rope.cs[c];
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

template <int DPL> struct RowBits;  // DPL (2, 4 or 8) 16-bit values as one 32/64/128-bit word
template <> struct RowBits<2> { using type = uint32_t; };
template <> struct RowBits<4> { using type = uint2; };
template <> struct RowBits<8> { using type = uint4; };

template <typename T, int DPL>
__device__ __forceinline__ void unpack_row(const typename RowBits<DPL>::type u, float* out) {
  // DPL 16-bit values of T as floats
  if constexpr (DPL == 8) {
    unpack8<T>(u, out);
  } else if constexpr (DPL == 4) {
    const float2 a = pair_f<T>(u.x), b = pair_f<T>(u.y);
    out[0] = a.x; out[1] = a.y; out[2] = b.x; out[3] = b.y;
  } else {
    const float2 a = pair_f<T>(u);
    out[0] = a.x; out[1] = a.y;
  }
}

template <typename T, int DPL>
__device__ __forceinline__ void load_row(const T* p, float* out) {
  // DPL (2, 4 or 8) consecutive 16-bit values as floats, in one 32/64/128-bit load
  unpack_row<T, DPL>(*reinterpret_cast<const typename RowBits<DPL>::type*>(p), out);
}

template <typename T, int DPL, int KU, int WARPS>
struct KeyFetch {
  // A warp's next KU keys and values (t0, t0 + WARPS, ... < end, but `fresh`: the block's own new
  // column, not read back), in flight as raw words until attend_keys unpacks them
  using Bits = typename RowBits<DPL>::type;
  Bits kr[KU], vr[KU];

  __device__ __forceinline__ void fetch(const T* kc, const T* vc, size_t base, int t0, int end, int fresh) {
    constexpr int D = DPL * 32;
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int t = t0 + u * WARPS;
      if (t < end && t != fresh) {
        const size_t o = (base + t) * D + lane * DPL;
        kr[u] = *reinterpret_cast<const Bits*>(kc + o);
        vr[u] = *reinterpret_cast<const Bits*>(vc + o);
      }
    }
  }
};

template <typename T, int DPL, int G, int KU, int WARPS>
__device__ __forceinline__ void attend_keys(const float (&qf)[G][DPL], float (&m)[G], float (&l)[G],
                                            float (&acc)[G][DPL], const T* kc, const T* vc, size_t base,
                                            int start, int end, int fresh, const float* fk, const float* fv,
                                            KeyFetch<T, DPL, KU, WARPS>& next) {
  // One warp's keys start + warp, + WARPS, ... (< end) of the rows at kc / vc + (base + t) * D,
  // KU at a time: one online-softmax update for the KU scores of each of the G queries (qf,
  // already scaled), into m / l / acc. The next KU keys' loads go out before this KU's are scored
  // (their latency overlaps the scoring; one round trip to memory a warp, not one a KU). The key
  // at `fresh` (if any) comes from fk / fv (this block's own new key and value, not read back).
  // next: the first KU keys, already fetched by the caller (next.fetch(..., start + warp, ...)
  // where start + warp < end) before its own work, so that their latency overlaps that work.
  constexpr int D = DPL * 32;
  const int lane = threadIdx.x & 31, warp = warp_id();
  auto& kr = next.kr;
  auto& vr = next.vr;
  auto fetch = [&](int t0) { next.fetch(kc, vc, base, t0, end, fresh); };
  for (int t0 = start + warp; t0 < end; t0 += WARPS * KU) {
    float kf[KU][DPL], vf[KU][DPL];
    #pragma unroll
    for (int u = 0; u < KU; ++u) {  // a key past the end: zeros, masked below
      const int t = t0 + u * WARPS;
      if (t == fresh) {
        #pragma unroll
        for (int d = 0; d < DPL; ++d) { kf[u][d] = fk[lane * DPL + d]; vf[u][d] = fv[lane * DPL + d]; }
      } else if (t < end) {
        unpack_row<T, DPL>(kr[u], kf[u]);
        unpack_row<T, DPL>(vr[u], vf[u]);
      } else {
        #pragma unroll
        for (int d = 0; d < DPL; ++d) kf[u][d] = vf[u][d] = 0.f;
      }
    }
    if (t0 + WARPS * KU < end) fetch(t0 + WARPS * KU);
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      float sc[KU];
      #pragma unroll
      for (int u = 0; u < KU; ++u) {
        sc[u] = 0.f;
        #pragma unroll
        for (int d = 0; d < DPL; ++d) sc[u] = fmaf(qf[g][d], kf[u][d], sc[u]);
      }
      #pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        #pragma unroll
        for (int u = 0; u < KU; ++u) sc[u] += __shfl_xor_sync(0xffffffffu, sc[u], off);
      }
      float mn = m[g];
      #pragma unroll
      for (int u = 0; u < KU; ++u) {
        if (t0 + u * WARPS >= end) sc[u] = -INFINITY;
        mn = fmaxf(mn, sc[u]);
      }
      const float corr = expf(m[g] - mn);
      float e[KU], es = 0.f;
      #pragma unroll
      for (int u = 0; u < KU; ++u) { e[u] = expf(sc[u] - mn); es += e[u]; }
      l[g] = l[g] * corr + es;
      #pragma unroll
      for (int d = 0; d < DPL; ++d) {
        float a = acc[g][d] * corr;
        #pragma unroll
        for (int u = 0; u < KU; ++u) a = fmaf(e[u], vf[u][d], a);
        acc[g][d] = a;
      }
      m[g] = mn;
    }
  }
}

template <int G, int D, int WARPS>
struct BlockSums {
  // The block's warps' online-softmax partials, in shared memory, added up per (query, dim).
  float m[WARPS][G], l[WARPS][G], a[WARPS][G][D];

  template <int DPL>
  __device__ __forceinline__ void put(const float (&wm)[G], const float (&wl)[G], const float (&wa)[G][DPL]) {
    const int lane = threadIdx.x & 31, warp = warp_id();
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      if (lane == 0) { m[warp][g] = wm[g]; l[warp][g] = wl[g]; }
      #pragma unroll
      for (int d = 0; d < DPL; ++d) a[warp][g][lane * DPL + d] = wa[g][d];
    }
    __syncthreads();
  }

  // query g's largest score M, its sum of exp(score - M) and element d of its weighted values
  __device__ __forceinline__ void get(int g, int d, float& M, float& ls, float& av) const {
    M = -INFINITY;
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) M = fmaxf(M, m[w][g]);
    ls = 0.f;
    av = 0.f;
    if (M != -INFINITY) {
      #pragma unroll
      for (int w = 0; w < WARPS; ++w) { const float e = expf(m[w][g] - M); ls += l[w][g] * e; av += a[w][g][d] * e; }
    }
  }
};

template <int S>
__device__ __forceinline__ float add_splits(const float* pm, const float* pl, const float* pa, int D, int d) {
  // One (row, head)'s S split partials (pm / pl: S values, pa: S x D) added up: element d of the
  // attention's output. __ldcg: other blocks wrote them (L2, not this SM's L1).
  float M = -INFINITY;
  #pragma unroll 8
  for (int s = 0; s < S; ++s) M = fmaxf(M, __ldcg(pm + s));
  float ls = 0.f, a = 0.f;
  #pragma unroll 8
  for (int s = 0; s < S; ++s) {
    const float ms = __ldcg(pm + s);
    const float e = ms == -INFINITY ? 0.f : expf(ms - M);
    ls += __ldcg(pl + s) * e;
    a += __ldcg(pa + (size_t)s * D + d) * e;
  }
  return a / ls;
}

template <typename T, int D, int G, int ROT, bool TRAD, bool NORM, int KU, int WARPS>
__device__ __forceinline__ void rotate_write_attend(const T* q, const T* k, const T* v, const T* qn, const T* kn,
                                                    const float* invf, const float* fp, float position,
                                                    const T* kc, const T* vc, size_t base, int start, int end,
                                                    int col, float (&m)[G], float (&l)[G],
                                                    float (&acc)[G][D / 32]) {
  // An attention block's work before its partial sums: its G query heads (q: G x D) normed
  // (NORM) and rotated at `position` (times fp[1]); where its keys start .. end - 1 hold the new
  // column `col`, the new key (k) normed, rotated and written into the cache at col, and the new
  // value (v) as it is; then its queries, scaled by fp[2], over those keys (the new key and value
  // from shared memory, not read back), into m / l / acc (attend_keys). Warp w takes heads w, w +
  // WARPS, ...; the cache rows are kc / vc + (base + t) * D.
  constexpr int DPL = D / 32;
  const int lane = threadIdx.x & 31, warp = warp_id();
  const bool has_new = start <= col && col < end;
  // the warp's first keys (all but the new column) go out first: their latency overlaps the
  // norms and the rotation
  KeyFetch<T, DPL, KU, WARPS> keys;
  if (start + warp < end) keys.fetch(kc, vc, base, start + warp, end, has_new ? col : -1);
  __shared__ float qs[G][D];
  __shared__ float nk[2][D];
  float qw[DPL], kw[DPL];  // the lane's elements of the q and k norms' weights
  if constexpr (NORM) {
    #pragma unroll
    for (int c = 0; c < DPL; ++c) { qw[c] = static_cast<float>(qn[lane + 32 * c]); kw[c] = static_cast<float>(kn[lane + 32 * c]); }
  }
  RopeAngles<D, ROT, TRAD> rope;
  rope.at(fp[1] * position, invf, lane);
  for (int hh = warp; hh < G + (has_new ? 1 : 0); hh += WARPS) {
    const bool is_k = hh == G;
    T* gout = is_k ? const_cast<T*>(kc) + (base + col) * D : nullptr;
    head_rope<T, D, ROT, TRAD, NORM>(is_k ? k : q + (size_t)hh * D, is_k ? kw : qw, fp[0], rope,
                                     is_k ? nk[0] : qs[hh], gout, lane);
  }
  if (has_new) {  // the new value, as it is, into the cache
    T* vo = const_cast<T*>(vc) + (base + col) * D;
    for (int e = threadIdx.x; e < D; e += WARPS * 32) { vo[e] = v[e]; nk[1][e] = static_cast<float>(v[e]); }
  }
  __syncthreads();
  const float scale = fp[2];
  float qf[G][DPL];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    #pragma unroll
    for (int d = 0; d < DPL; ++d) { qf[g][d] = qs[g][lane * DPL + d] * scale; acc[g][d] = 0.f; }
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  attend_keys<T, DPL, G, KU, WARPS>(qf, m, l, acc, kc, vc, base, start, end, has_new ? col : -1, nk[0], nk[1], keys);
}

template <typename T, int G, int D, int S, int WARPS>
__device__ __forceinline__ void combine_group(const float* pm, const float* pl, const float* pa, int h0, T* y,
                                              int act) {
  // The first `act` (of S) split partials of heads h0 .. h0 + G - 1 added up by one block
  // (add_splits' sum, in another order): every pm and pl loaded at once (one round trip to L2),
  // each split's weight exp(pm - M) / sum(pl exp(pm - M)) from shared memory, then a thread per
  // four output elements loads their values of pa, 16 splits' float4 words in flight together.
  // (One thread a head walking the splits' pl in turn, and a thread per element walking 8 splits
  // at a time, waited on L2 some 40 times at 32 splits.) __ldcg: other blocks wrote them (L2,
  // not this SM's L1).
  __shared__ float wt[G][S];
  __shared__ float ws[G][S];
  __shared__ float inv[G];
  for (int i = threadIdx.x; i < G * S; i += WARPS * 32) {
    if (i % S < act) {
      wt[i / S][i % S] = __ldcg(pm + (size_t)h0 * S + i);
      ws[i / S][i % S] = __ldcg(pl + (size_t)h0 * S + i);
    }
  }
  __syncthreads();
  if (threadIdx.x < G) {
    const int g = threadIdx.x;
    float M = -INFINITY;
    for (int s = 0; s < act; ++s) M = fmaxf(M, wt[g][s]);
    float ls = 0.f;
    for (int s = 0; s < act; ++s) {
      const float e = wt[g][s] == -INFINITY ? 0.f : expf(wt[g][s] - M);
      ls += ws[g][s] * e;
      wt[g][s] = e;
    }
    inv[g] = 1.f / ls;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D / 4; i += WARPS * 32) {
    const int g = 4 * i / D, d = 4 * i % D;
    const float4* p = reinterpret_cast<const float4*>(pa + (size_t)(h0 + g) * S * D + d);
    float a[4] = {0.f, 0.f, 0.f, 0.f};
    #pragma unroll 16
    for (int s = 0; s < act; ++s) {
      const float4 v = __ldcg(p + (size_t)s * (D / 4));
      const float w = wt[g][s];
      a[0] = fmaf(v.x, w, a[0]); a[1] = fmaf(v.y, w, a[1]); a[2] = fmaf(v.z, w, a[2]); a[3] = fmaf(v.w, w, a[3]);
    }
    #pragma unroll
    for (int c = 0; c < 4; ++c) y[(h0 + g) * D + d + c] = static_cast<T>(a[c] * inv[g]);
  }
}

template <typename T, int D, int G, int HKV, int ROT, bool TRAD, bool NORM, int CAP, int S, int KU, int WARPS,
          int MK = 0>
__device__ __forceinline__ void attention_impl(const T* qkv, const T* qn, const T* kn, const float* invf,
                                               const float* fp, const int32_t* pos, const T* kc,
                                               const T* vc, const int32_t* cnt, float* pm, float* pl,
                                               float* pa, T* y) {
  // Grid (S blocks, HKV): block (split, j) takes kv head j's G query heads over its split of the
  // p + 1 positions. Of the S splits, the first act = min(S, ceil((p + 1) / MK)) (MK 0: all S)
  // take an equal share each (ceil((p + 1) / act) keys: every block has work at any length, at
  // least MK keys where there are that many) and the rest end at once, so a short context is
  // added up from a few splits, not S; its WARPS warps take keys start + warp, + WARPS, ..., KU
  // at a time (the KU keys' loads issued before any is used, and one softmax update for the KU
  // scores).
  constexpr int HQ = HKV * G;
  constexpr int DPL = D / 32;
  const int split = blockIdx.x, j = blockIdx.y;
  const int p = pos[0];
  const int act = MK == 0 ? S : min(S, (p + MK) / MK);  // ceil((p + 1) / MK)
  if (split >= act) return;  // the whole block (the new column p lies in a split < act)
  const int ch = (p + act) / act;  // ceil((p + 1) / act)
  const int start = split * ch, end = min(start + ch, p + 1);
  __shared__ int last;
  float m[G], l[G], acc[G][DPL];
  rotate_write_attend<T, D, G, ROT, TRAD, NORM, KU, WARPS>(
      qkv + (size_t)j * G * D, qkv + (size_t)(HQ + j) * D, qkv + (size_t)(HQ + HKV + j) * D, qn, kn, invf, fp,
      static_cast<float>(p), kc, vc, (size_t)j * CAP, start, end, p, m, l, acc);
  __shared__ BlockSums<G, D, WARPS> sums;
  sums.put<DPL>(m, l, acc);
  for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {  // the block's warps, one split's part
    const int g = i / D, d = i % D, h = j * G + g;
    float M, ls, a;
    sums.get(g, d, M, ls, a);
    pa[((size_t)h * S + split) * D + d] = a;
    if (d == 0) { pm[h * S + split] = M; pl[h * S + split] = ls; }
  }
  // the last of the S blocks of this kv head to finish adds the splits up (then resets the count):
  // each block's partials released before its count, acquired by the last block after it
  fence_acq_rel();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(const_cast<int*>(cnt) + j, 1) == act - 1;
  __syncthreads();
  if (!last) return;
  fence_acq_rel();
  combine_group<T, G, D, S, WARPS>(pm, pl, pa, j * G, y, act);
  if (threadIdx.x == 0) const_cast<int*>(cnt)[j] = 0;
}

__device__ __forceinline__ uint32_t nib_pair(uint32_t w, uint32_t magic) {
  // the nibbles at bits 0-3 and 16-19 of w under the exponent of `magic` (0x43004300: bf16 128 + q;
  // 0x64006400: fp16 1024 + q), one lop3: (w & 0x000f000f) | magic
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(w), "r"(0x000f000fu), "r"(magic));
  return d;
}

__device__ __forceinline__ int mma_b_order(int k) {
  // where x's value k sits in shared memory laid out as one-row B fragments of mma.m16n8k16: each
  // 8 values j = 0..7 in the order 0 4 1 5 2 6 3 7, so a 32-bit register (values 2h, 2h + 4 or
  // 2h + 1, 2h + 5 of its 8) is one aligned word and a lane's 16 values two 128-bit loads
  const int j = k & 7;
  return (k & ~7) | (j < 4 ? 2 * j : 2 * j - 7);
}

template <bool BF16>
__device__ __forceinline__ void mma_16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

template <typename ST, int GS, int K, int KW, int TPW, int U>
struct TileRound {
  // A warp's round of a 4-bit tensor-core product (qmma4_impl, qmm4_rows_impl): U 64-wide chunks
  // (c0, c0 + KW, ...) of TPW 16-row weight tiles, lane (g, t) holding 16 nibbles of rows g and
  // g + 8 at k = 16 t (lo, hi) and the chunk's group's scale and bias of each (sl / bl, sh / bh),
  // all loaded before any is used.
  uint2 lo[U][TPW], hi[U][TPW];
  ST sl[U][TPW], bl[U][TPW], sh[U][TPW], bh[U][TPW];

  __device__ __forceinline__ void load(const uint32_t* w, const ST* scales, const ST* biases, const int (&rlo)[TPW],
                                       const int (&rhi)[TPW], int c0, int t) {
    constexpr int CHUNKS = K / 64, WORDS = K / 8;
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = min(c0 + u * KW, CHUNKS - 1);
      const int q = c * 64 / GS;  // the quantization group
      #pragma unroll
      for (int i = 0; i < TPW; ++i) {
        lo[u][i] = __ldg(reinterpret_cast<const uint2*>(w + (size_t)rlo[i] * WORDS + c * 8) + t);
        hi[u][i] = __ldg(reinterpret_cast<const uint2*>(w + (size_t)rhi[i] * WORDS + c * 8) + t);
        sl[u][i] = scales[(size_t)rlo[i] * (K / GS) + q];
        bl[u][i] = biases[(size_t)rlo[i] * (K / GS) + q];
        sh[u][i] = scales[(size_t)rhi[i] * (K / GS) + q];
        bh[u][i] = biases[(size_t)rhi[i] * (K / GS) + q];
      }
    }
  }
};

template <typename T, typename ST, bool BF16, int GS, int K, int N, int E, int XN, int KW, int TPW, int U>
__device__ __forceinline__ void qmma4_impl(const T* x, const uint32_t* w, const ST* scales,
                                           const ST* biases, const T* a, const T* nw,
                                           const float* ne, T* y) {
  // y = W x for one row x and a 4-bit W in MLX's affine layout (groups of 64 or 128) on the tensor
  // cores: a block's KW warps split K (64-wide chunks w, w + KW, ...) over TPW tiles of 16 output
  // rows (E 2: rows 0-7 gate units, 8-15 their up rows). Lane (g = lane / 4, t = lane % 4) loads,
  // per 64-chunk, 16 nibbles (a uint2) of rows g and g + 8 at k = 16 t: two uint32, each giving the
  // four A registers of an mma pair as bf16x2 pairs (nibble i, nibble i + 4) = 128 + q exactly
  // (one lop3 each); x row g the B operand at the same k (the same permutation of k for A and B).
  // Each chunk's products are summed in fp32 by the tensor core, then scaled:
  // s * (C - 128 sum(x)) + b * sum(x), sum(x) of the chunk computed once per block.
  constexpr uint32_t MAGIC = BF16 ? 0x43004300u : 0x64006400u;
  constexpr float OFF = BF16 ? 128.f : 1024.f;
  constexpr int CHUNKS = K / 64;
  constexpr int WORDS = K / 8;  // uint32 per row
  constexpr int OUT = (E == 2) ? N / 2 : N;
  constexpr int UNITS = (E == 2) ? 8 : 16;  // output units a tile writes
  constexpr int TILES = (OUT + UNITS - 1) / UNITS;
  __shared__ __align__(16) T xs[K];
  __shared__ float sxs[CHUNKS];
  __shared__ float part[TPW][KW][16];  // [tile][warp][row]: x's row (column 0 of the products)
  const int lane = threadIdx.x & 31, warp = warp_id();
  const int g = lane >> 2, t = lane & 3;
  float acc[TPW][2];  // rows g and g + 8 of each tile, x's row 0 (lanes t == 0 hold it)
  #pragma unroll
  for (int i = 0; i < TPW; ++i) acc[i][0] = acc[i][1] = 0.f;
  int rlo[TPW], rhi[TPW];
  #pragma unroll
  for (int i = 0; i < TPW; ++i) {
    const int tile = min(blockIdx.x * TPW + i, TILES - 1);
    if constexpr (E == 2) {
      const int u = min(tile * 8 + g, OUT - 1);
      rlo[i] = u;
      rhi[i] = u + OUT;
    } else {
      rlo[i] = min(tile * 16 + g, N - 1);
      rhi[i] = min(tile * 16 + g + 8, N - 1);
    }
  }
  // a round's weights (U chunks per warp) and their groups' scales and biases, loaded before any
  // is used (a scale loaded where it is used stalled every chunk on its latency); the first
  // round's loads go out before x is staged, so their latency overlaps the staging and the norm
  TileRound<ST, GS, K, KW, TPW, U> rd;  // the round's weights, scales and biases
  auto load_round = [&](int c0) { rd.load(w, scales, biases, rlo, rhi, c0, t); };
  load_round(warp);
  {  // x into shared memory as T (RMS-normalised as MLX rounds it when XN == 2), its chunk sums
    constexpr int PER = (K + 32 * KW - 1) / (32 * KW);
    float v[PER];
    const float rn = load_x<T, K, 32 * KW, XN>(x, ne, v);
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int k = threadIdx.x + 32 * KW * i;
      if (k < K) xs[mma_b_order(k)] = XN == 2 ? static_cast<T>(nw[k] * static_cast<T>(v[i] * rn)) : static_cast<T>(v[i]);
    }
    __syncthreads();
    // each chunk's sum by one warp: two values a lane, then a butterfly (a thread summing a
    // chunk's 64 alone kept the block waiting on 64 dependent adds)
    #pragma unroll 4
    for (int c = warp; c < CHUNKS; c += KW) {
      float s = static_cast<float>(xs[mma_b_order(c * 64 + lane)]) + static_cast<float>(xs[mma_b_order(c * 64 + 32 + lane)]);
      #pragma unroll
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (lane == 0) sxs[c] = s;
    }
    __syncthreads();
  }
  const uint4* xq = reinterpret_cast<const uint4*>(xs);
  #pragma unroll 1
  for (int c0 = warp; c0 < CHUNKS; c0 += KW * U) {
    if (c0 != warp) load_round(c0);
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * KW;
      if (c >= CHUNKS) break;  // the same for the whole warp
      // [half of the uint2][mma][register]: x at this lane's k in column g, x's one row being
      // column 0 (lanes g == 0; the others' columns are zeros). xs holds x in the registers'
      // order (mma_b_order), so the lane's 16 values are two 128-bit loads.
      uint32_t b[2][2][2] = {{{0u, 0u}, {0u, 0u}}, {{0u, 0u}, {0u, 0u}}};
      if (g == 0) {
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const uint4 q = xq[(c * 64 + 16 * t) / 8 + hh];
          b[hh][0][0] = q.x; b[hh][0][1] = q.y; b[hh][1][0] = q.z; b[hh][1][1] = q.w;
        }
      }
      const float sx = sxs[c];
      #pragma unroll
      for (int i = 0; i < TPW; ++i) {
        // the chunk's two halves into accumulators of their own, so that their mmas do not wait
        // on one another (a chain of four mmas per chunk)
        float cc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const uint32_t wl = hh ? rd.lo[u][i].y : rd.lo[u][i].x, wh = hh ? rd.hi[u][i].y : rd.hi[u][i].x;
          uint32_t al[4], ah[4];
          #pragma unroll
          for (int j = 0; j < 4; ++j) { al[j] = nib_pair(wl >> (4 * j), MAGIC); ah[j] = nib_pair(wh >> (4 * j), MAGIC); }
          #pragma unroll
          for (int h = 0; h < 2; ++h)
            mma_16816<BF16>(cc[hh], al[2 * h], ah[2 * h], al[2 * h + 1], ah[2 * h + 1], b[hh][h][0], b[hh][h][1]);
        }
        const float clo = cc[0][0] + cc[1][0], chi = cc[0][2] + cc[1][2];  // column 0: x's row (lanes t == 0)
        acc[i][0] += static_cast<float>(rd.sl[u][i]) * (clo - OFF * sx) + static_cast<float>(rd.bl[u][i]) * sx;
        acc[i][1] += static_cast<float>(rd.sh[u][i]) * (chi - OFF * sx) + static_cast<float>(rd.bh[u][i]) * sx;
      }
    }
  }
  if (t == 0) {
    #pragma unroll
    for (int i = 0; i < TPW; ++i) { part[i][warp][g] = acc[i][0]; part[i][warp][g + 8] = acc[i][1]; }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < TPW * UNITS; idx += 32 * KW) {
    const int i = idx / UNITS, r = idx % UNITS;
    const int tile = blockIdx.x * TPW + i;
    const int u = tile * UNITS + r;
    if (tile >= TILES || u >= OUT) continue;
    float s = 0.f, s2 = 0.f;
    #pragma unroll
    for (int v = 0; v < KW; ++v) { s += part[i][v][r]; if constexpr (E == 2) s2 += part[i][v][r + 8]; }
    if constexpr (E == 0) {
      y[u] = static_cast<T>(s);
    } else if constexpr (E == 1) {
      y[u] = static_cast<T>(static_cast<float>(static_cast<T>(s)) + static_cast<float>(a[u]));
    } else {
      const float gt = static_cast<float>(static_cast<T>(s)), up = static_cast<float>(static_cast<T>(s2));
      const float sig = static_cast<float>(static_cast<T>(1.0f / (1.0f + expf(-gt))));
      const float act = static_cast<float>(static_cast<T>(gt * sig));
      y[u] = static_cast<T>(act * up);
    }
  }
}

template <typename T, typename ST, bool BF16, int GS, int K, int N, int MT, int KW, int TPW, int U>
__device__ __forceinline__ void qmm4_rows_impl(const T* x, const uint32_t* w, const ST* scales,
                                               const ST* biases, const int32_t* rows, const T* a, T* y) {
  // y (M x N) = x (M x K) W^T, M = rows[0] <= 8 MT, for a 4-bit W in MLX's affine layout (groups
  // of 64 or 128) on the tensor cores: qmma4_impl's fragments, with x's rows as the B operand's 8
  // columns (MT tiles of 8 rows), so each weight loaded serves every row. (M is read at run time,
  // so one compiled kernel serves every count of rows within its tiles.) A block's KW warps
  // split K (64-wide chunks w, w + KW, ...) over TPW tiles of 16 output rows. Lane (g, t) loads,
  // per chunk, 16 nibbles of weight rows g and g + 8 at k = 16 t (two uint32, each the A
  // registers of two mmas: bf16/fp16 pairs 128 + q, one lop3 each) and x row 8 xt + g at the
  // same k (one 128-bit load per uint32, its values paired as the A nibbles are). A chunk's
  // products are summed in fp32 by the tensor cores, then scaled: s * (C - OFF * sum(x)) + b *
  // sum(x), sum(x) of the chunk's row from the four lanes that loaded it. The warps' sums meet
  // in shared memory, added in warp order. `a` (M x N, or nullptr): a residual added to y.
  constexpr uint32_t MAGIC = BF16 ? 0x43004300u : 0x64006400u;
  constexpr float OFF = BF16 ? 128.f : 1024.f;
  const int M = rows[0];
  constexpr int CHUNKS = K / 64;
  constexpr int WORDS = K / 8;  // uint32 per row
  constexpr int TILES = (N + 15) / 16;
  __shared__ float red[TPW][16][MT * 8];
  const int lane = threadIdx.x & 31, warp = warp_id();
  const int g = lane >> 2, t = lane & 3;
  int rlo[TPW], rhi[TPW];
  #pragma unroll
  for (int i = 0; i < TPW; ++i) {
    const int tile = min(blockIdx.x * TPW + i, TILES - 1);
    rlo[i] = min(tile * 16 + g, N - 1);
    rhi[i] = min(tile * 16 + g + 8, N - 1);
  }
  float acc[TPW][MT][4];
  #pragma unroll
  for (int i = 0; i < TPW; ++i)
    #pragma unroll
    for (int m = 0; m < MT; ++m) acc[i][m][0] = acc[i][m][1] = acc[i][m][2] = acc[i][m][3] = 0.f;
  TileRound<ST, GS, K, KW, TPW, U> rd;  // the round's weights, scales and biases
  auto load_round = [&](int c0) { rd.load(w, scales, biases, rlo, rhi, c0, t); };
  #pragma unroll 1
  for (int c0 = warp; c0 < CHUNKS; c0 += KW * U) {
    load_round(c0);
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * KW;
      if (c >= CHUNKS) break;  // the same for the whole warp
      // x's B registers for this chunk ([tile of x rows][half][mma][register]) and the lanes'
      // share of each row's chunk sum
      uint32_t b[MT][2][2][2];
      float sx[MT][2];
      #pragma unroll
      for (int m = 0; m < MT; ++m) {
        const int r = m * 8 + g;
        float part = 0.f;
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          uint4 v = make_uint4(0u, 0u, 0u, 0u);
          if (r < M) v = __ldg(reinterpret_cast<const uint4*>(x + (size_t)r * K + c * 64 + 16 * t + 8 * hh));
          // values 0..7 as pairs in v.x .. v.w; the mma pairs (2h, 2h + 4) and (2h + 1, 2h + 5)
          b[m][hh][0][0] = __byte_perm(v.x, v.z, 0x5410);
          b[m][hh][0][1] = __byte_perm(v.x, v.z, 0x7632);
          b[m][hh][1][0] = __byte_perm(v.y, v.w, 0x5410);
          b[m][hh][1][1] = __byte_perm(v.y, v.w, 0x7632);
          float f[8];
          const uint32_t vs[4] = {v.x, v.y, v.z, v.w};
          #pragma unroll
          for (int j = 0; j < 4; ++j) { const float2 p2 = pair_f<T>(vs[j]); f[2 * j] = p2.x; f[2 * j + 1] = p2.y; }
          #pragma unroll
          for (int j = 0; j < 8; ++j) part += f[j];
        }
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);  // row 8 m + g's chunk sum, in its four lanes
        sx[m][0] = __shfl_sync(0xffffffffu, part, (2 * t) * 4);  // the rows of this lane's columns
        sx[m][1] = __shfl_sync(0xffffffffu, part, (2 * t + 1) * 4);
      }
      #pragma unroll
      for (int i = 0; i < TPW; ++i) {
        uint32_t al[2][4], ah[2][4];
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const uint32_t wl = hh ? rd.lo[u][i].y : rd.lo[u][i].x, wh = hh ? rd.hi[u][i].y : rd.hi[u][i].x;
          #pragma unroll
          for (int j = 0; j < 4; ++j) { al[hh][j] = nib_pair(wl >> (4 * j), MAGIC); ah[hh][j] = nib_pair(wh >> (4 * j), MAGIC); }
        }
        const float s0 = static_cast<float>(rd.sl[u][i]), b0 = static_cast<float>(rd.bl[u][i]);
        const float s1 = static_cast<float>(rd.sh[u][i]), b1 = static_cast<float>(rd.bh[u][i]);
        #pragma unroll
        for (int m = 0; m < MT; ++m) {
          float cc[4] = {0.f, 0.f, 0.f, 0.f};
          #pragma unroll
          for (int hh = 0; hh < 2; ++hh)
            #pragma unroll
            for (int h = 0; h < 2; ++h)
              mma_16816<BF16>(cc, al[hh][2 * h], ah[hh][2 * h], al[hh][2 * h + 1], ah[hh][2 * h + 1],
                              b[m][hh][h][0], b[m][hh][h][1]);
          // c0, c1: weight row g, x rows 2t, 2t + 1; c2, c3: weight row g + 8
          acc[i][m][0] += s0 * (cc[0] - OFF * sx[m][0]) + b0 * sx[m][0];
          acc[i][m][1] += s0 * (cc[1] - OFF * sx[m][1]) + b0 * sx[m][1];
          acc[i][m][2] += s1 * (cc[2] - OFF * sx[m][0]) + b1 * sx[m][0];
          acc[i][m][3] += s1 * (cc[3] - OFF * sx[m][1]) + b1 * sx[m][1];
        }
      }
    }
  }
  for (int v = 0; v < KW; ++v) {  // the warps' sums, in warp order
    if (warp == v) {
      #pragma unroll
      for (int i = 0; i < TPW; ++i)
        #pragma unroll
        for (int m = 0; m < MT; ++m)
          #pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = g + (e >> 1) * 8, col = m * 8 + 2 * t + (e & 1);
            red[i][row][col] = v == 0 ? acc[i][m][e] : red[i][row][col] + acc[i][m][e];
          }
    }
    __syncthreads();
  }
  for (int idx = threadIdx.x; idx < TPW * 16 * M; idx += 32 * KW) {
    const int i = idx / (16 * M), rest = idx % (16 * M), col = rest / 16, row = rest % 16;  // col < M
    const int n = (blockIdx.x * TPW + i) * 16 + row;
    if (blockIdx.x * TPW + i < TILES && n < N) {
      const size_t at = (size_t)col * N + n;
      if (a == nullptr) {
        y[at] = static_cast<T>(red[i][row][col]);
      } else {  // plus the residual, rounded as MLX rounds the product, then the sum
        y[at] = static_cast<T>(static_cast<float>(static_cast<T>(red[i][row][col])) + static_cast<float>(a[at]));
      }
    }
  }
}

template <typename T, int G, int D, int HQ, int S, int WARPS>
__device__ __forceinline__ void rows_out(const BlockSums<G, D, WARPS>& sums, int r, int j, int split, float* pm,
                                         float* pl, float* pa, T* y) {
  // A batched step's block (split, kv head j, row r) done: S == 1, its G heads' outputs into y
  // (rows x HQ * D, o_proj's layout); else their partial sums into pm / pl / pa (rows x HQ x S)
  // for combine_rows_impl.
  for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {
    const int g = i / D, d = i % D, h = j * G + g;
    float M, ls, a;
    sums.get(g, d, M, ls, a);
    if constexpr (S == 1) {
      y[((size_t)r * HQ + h) * D + d] = static_cast<T>(a / ls);
    } else {
      const size_t at = ((size_t)r * HQ + h) * S + split;
      pa[at * D + d] = a;
      if (d == 0) { pm[at] = M; pl[at] = ls; }
    }
  }
}

template <typename T, int D, int G, int HKV, int S, int KU, int WARPS>
__device__ __forceinline__ void attend_rows_impl(const T* q, const T* kc, const T* vc, const int32_t* lp,
                                                 const int32_t* off, const int32_t* dims, const float* fp,
                                                 float* pm, float* pl, float* pa, T* y) {
  // A batched decode step's attention over a SlotKVCache (engine/slot_cache.py): row r's one
  // query per head (q: rows x HQ x D, after RoPE) against its own keys, buffer columns lp[r] ..
  // lp[r] + off[r] - 1 of slot r (buffers: slots x HKV x dims[0] x D), no mask and no work on
  // the padding. Grid (S, HKV, rows): block (split, j, r) takes kv head j's G query heads over
  // its equal share of row r's keys, as attention_impl does. S == 1: the block writes y (rows x
  // HQ * D, the layout o_proj reads); else its partial sums go to pm / pl / pa (rows x HQ x S)
  // for combine_rows_impl.
  constexpr int HQ = HKV * G;
  constexpr int DPL = D / 32;
  const int lane = threadIdx.x & 31;
  const int split = blockIdx.x, j = blockIdx.y, r = blockIdx.z;
  const int first = lp[r], n = off[r];
  const int ch = (n + S - 1) / S;
  const int start = first + split * ch, end = first + min((split + 1) * ch, n);
  const size_t base = ((size_t)r * HKV + j) * dims[0];
  KeyFetch<T, DPL, KU, WARPS> keys;  // the warp's first keys, in flight while q loads
  if (start + warp_id() < end) keys.fetch(kc, vc, base, start + warp_id(), end, -1);
  const float scale = fp[0];
  float qf[G][DPL], m[G], l[G], acc[G][DPL];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    load_row<T, DPL>(q + ((size_t)r * HQ + j * G + g) * D + lane * DPL, qf[g]);
    #pragma unroll
    for (int d = 0; d < DPL; ++d) { qf[g][d] *= scale; acc[g][d] = 0.f; }
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  attend_keys<T, DPL, G, KU, WARPS>(qf, m, l, acc, kc, vc, base, start, end, -1, nullptr, nullptr, keys);
  __shared__ BlockSums<G, D, WARPS> sums;
  sums.put<DPL>(m, l, acc);
  rows_out<T, G, D, HQ, S>(sums, r, j, split, pm, pl, pa, y);
}

template <typename T, int D, int G, int HKV, int ROT, bool TRAD, bool NORM, int S, int KU, int WARPS>
__device__ __forceinline__ void attention_rows_impl(const T* qkv, const T* qn, const T* kn, const float* invf,
                                                    const float* fp, const int32_t* lp, const int32_t* off,
                                                    const int32_t* dims, const T* kc, const T* vc, float* pm,
                                                    float* pl, float* pa, T* y, int32_t* offn) {
  // attention_impl for a batched decode step over a SlotKVCache (engine/slot_cache.py): row r's
  // stacked q/k/v (qkv: rows x (HQ + 2 HKV) x D, as the product leaves it) normed (NORM) and
  // rotated at the row's position off[r] (its length so far), its new key and value written in
  // place at its next column, lp[r] + off[r] (every row's is the buffers' write index), and its
  // queries attended over columns lp[r] .. lp[r] + off[r] of slot r (buffers: slots x HKV x
  // dims[0] x D), the new key and value from shared memory. Grid (S, HKV, rows): block (split,
  // j, r) takes kv head j's G query heads over its equal share of the row's keys; the block
  // whose share holds the new column writes it. S == 1: y (rows x HQ * D, o_proj's layout);
  // else the partial sums pm / pl / pa (rows x HQ x S) for combine_rows_impl. offn: each row's
  // length after the step, off[r] + 1 (the cache's next offset, without a kernel of its own).
  constexpr int HQ = HKV * G;
  constexpr int DPL = D / 32;
  const int split = blockIdx.x, j = blockIdx.y, r = blockIdx.z;
  const int first = lp[r], p = off[r], col = first + p, n = p + 1;
  if (split == 0 && j == 0 && threadIdx.x == 0) offn[r] = n;
  const int ch = (n + S - 1) / S;
  const int start = first + split * ch, end = first + min((split + 1) * ch, n);
  const T* src = qkv + (size_t)r * (HQ + 2 * HKV) * D;
  float m[G], l[G], acc[G][DPL];
  rotate_write_attend<T, D, G, ROT, TRAD, NORM, KU, WARPS>(
      src + (size_t)j * G * D, src + (size_t)(HQ + j) * D, src + (size_t)(HQ + HKV + j) * D, qn, kn, invf, fp,
      static_cast<float>(p), kc, vc, ((size_t)r * HKV + j) * dims[0], start, end, col, m, l, acc);
  __shared__ BlockSums<G, D, WARPS> sums;
  sums.put<DPL>(m, l, acc);
  rows_out<T, G, D, HQ, S>(sums, r, j, split, pm, pl, pa, y);
}

template <typename T, int D, int HQ, int S>
__device__ __forceinline__ void combine_rows_impl(const float* pm, const float* pl, const float* pa, T* y) {
  // attend_rows_impl's S splits of each (row, head) added up: block (r * HQ + h), thread d
  const size_t rh = blockIdx.x;
  y[rh * D + threadIdx.x] = static_cast<T>(add_splits<S>(pm + rh * S, pl + rh * S, pa + rh * S * D, D, threadIdx.x));
}
