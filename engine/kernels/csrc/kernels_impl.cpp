// The per-ISA kernels: built four times (AVX-512 with VNNI, AVX-512, AVX2+FMA, portable C++)
// with different compiler flags and MLXCHAT_ISA naming the unit; common.h's impl_<isa>() picks
// one at run time.
//
// Exact path, quantized matrix x (1-8 rows): each weight is dequantized exactly
// (q * scale + bias, fp32) and multiplied into an fp32 accumulator. The SIMD units read 4-bit
// weights a byte at a time (low nibble = even element, high nibble = odd element), so prep_x
// stores each block of x as its even elements followed by its odd ones; the weights then need
// no shuffling. One body serves AVX-512 and AVX2: `Vec` below names the register width and the
// few operations that differ.
//
// int8 path (lossy, opt-in): x arrives quantized per 32-element block as two int8 limbs, x ~= d *
// (128 * hi + lo) to 15 bits of the block's largest value (one fp32 scale and the block's exact
// fp32 sum; see Q8Rows). Each limb's dot product with the weights' integer codes is exact in
// int32 (AVX2 maddubs/madd, or AVX-512 VNNI dpbusd), then scaled in fp32:
// sum_k x_k w_k = s_g * sum_blocks d_j * (sum_k v_k q_k) + b_g * sum_k x_k.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef MLXCHAT_ISA
#define MLXCHAT_ISA generic
#endif

#define MLXCHAT_CAT2(a, b) a##b
#define MLXCHAT_CAT(a, b) MLXCHAT_CAT2(a, b)

namespace mlxchat {
namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MLXCHAT_SIMD 512
#define MLXCHAT_Q8_512 1  // the int8 path's 64-byte VNNI kernel (rows_q8 below)
constexpr const char* kName = "avx512-vnni";
#elif defined(__AVX512F__) && defined(__AVX512BW__)
#define MLXCHAT_SIMD 512
constexpr const char* kName = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
#define MLXCHAT_SIMD 256
constexpr const char* kName = "avx2";
#else
#define MLXCHAT_SIMD 0
constexpr const char* kName = "generic";
#endif
#ifndef MLXCHAT_Q8_512
#define MLXCHAT_Q8_512 0
#endif

inline void scale_bias(const QMat& W, int64_t i, float& s, float& b) {
  s = load_scalar(W.scales, W.st, i);
  b = load_scalar(W.biases, W.st, i);
}

float* scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (int64_t(buf.size()) < n) buf.resize(size_t(n));
  return buf.data();
}

void cvt_half(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

// Row n's G scales and biases as fp32, in s[0..G) and b[0..G).
inline void row_scales(const QMat& W, int64_t n, int64_t G, float* s, float* b) {
  if (W.st == SType::F16) {
    cvt_half(static_cast<const uint16_t*>(W.scales) + n * G, s, G);
    cvt_half(static_cast<const uint16_t*>(W.biases) + n * G, b, G);
  } else {
    for (int64_t g = 0; g < G; ++g) scale_bias(W, n * G + g, s[g], b[g]);
  }
}

#if MLXCHAT_SIMD
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if MLXCHAT_SIMD == 512

// A group's 16 possible 4-bit weights (q * scale + bias, q = 0..15) fit one register: the
// nibbles index it with a permute instead of being converted and scaled one by one.
struct Vec {
  using F = __m512;
  static constexpr int n = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float a) { return _mm512_set1_ps(a); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static float sum(F a) { return _mm512_reduce_add_ps(a); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
  static F round(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F n) {  // 2^n for whole n in [-126, 127]
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static F u8(const uint8_t* p) {  // n bytes -> n floats
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  struct Group4 {
    __m512 lut;
  };
  static Group4 group4(float s, float b) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return {_mm512_fmadd_ps(iota, _mm512_set1_ps(s), _mm512_set1_ps(b))};
  }
  // 2n 4-bit weights from n bytes: the even elements into lo, the odd ones into hi. The
  // permute reads only an index's low 4 bits, so one widening of the bytes serves both nibbles.
  static void nibbles(const Group4& g, const uint8_t* p, F& lo, F& hi) {
    const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_permutexvar_ps(raw, g.lut);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), g.lut);
  }
  // 2n 4-bit codes from n bytes, in their natural order, as floats: a = first n, b = next n.
  static void codes4(const uint8_t* p, F& a, F& b) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
    a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
    b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));
  }
};

#elif MLXCHAT_SIMD == 256

struct Vec {
  using F = __m256;
  static constexpr int n = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float a) { return _mm256_set1_ps(a); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static float sum(F v) { return hsum256(v); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
  static F round(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F n) {  // 2^n for whole n in [-126, 127]
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static F u8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  struct Group4 {
    __m256 s, b;
  };
  static Group4 group4(float s, float b) { return {_mm256_set1_ps(s), _mm256_set1_ps(b)}; }
  static void nibbles(const Group4& g, const uint8_t* p, F& lo, F& hi) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(raw, m4))), g.s, g.b);
    hi = _mm256_fmadd_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), m4))), g.s, g.b);
  }
  static void codes4(const uint8_t* p, F& a, F& b) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i c = _mm_unpacklo_epi8(_mm_and_si128(raw, m4), _mm_and_si128(_mm_srli_epi16(raw, 4), m4));
    a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));
    b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c, 8)));
  }
};

#endif

#if MLXCHAT_SIMD

constexpr int kBlock4 = 2 * Vec::n;  // 4-bit elements per nibbles() call

// M rows of x times R rows of W at once (weight rows n, n + step, ..., n + (R - 1) * step), BITS
// 4 or 8. Each (x row, weight row) pair keeps its own two accumulators and sums in exactly the
// order the one-row loop does, so the result is the same bits whatever R and step; with R > 1 the
// R independent chains of fused multiply-adds hide each other's latency (one row alone waits ~4
// cycles on its accumulator per 32 weights), and rows `step` apart are R separate streams for
// the memory's prefetchers (rows next to each other are one stream), each also prefetched
// prefetch_bytes() ahead in software, once per 64 bytes. A step takes 2 * Vec::n weights: 4-bit
// codes through the group's 16-entry table (even elements, then odd: prep_x's order), 8-bit ones
// widened and multiplied-added with the group's scale and bias.
template <int M, int R, int BITS>
void rows_at(const QMat& W, const float* xp, int64_t n, int64_t step, float* sc, float* bi,
             float* y, int64_t ldy) {
  const int64_t K = W.K, G = K / W.gs;
  const uint8_t* wr[R];
  for (int r = 0; r < R; ++r) {
    wr[r] = reinterpret_cast<const uint8_t*>(W.w) + (n + r * step) * (K * BITS / 8);
    row_scales(W, n + r * step, G, sc + r * G, bi + r * G);
  }
  typename Vec::F a0[R][M], a1[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) a0[r][m] = a1[r][m] = Vec::zero();
  const int64_t pf = prefetch_bytes(), gb = W.gs * BITS / 8;  // gb: a group's bytes in a row
  for (int64_t g = 0; g < G; ++g) {
    if (pf)  // the 64-byte lines that start in this group
      for (int64_t at = (g * gb + 63) & ~int64_t(63); at < (g + 1) * gb; at += 64)
        for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(wr[r] + at + pf), _MM_HINT_T0);
    typename Vec::Group4 grp[R];
    typename Vec::F vs[R], vb[R];
    for (int r = 0; r < R; ++r) {
      if constexpr (BITS == 4) {
        grp[r] = Vec::group4(sc[r * G + g], bi[r * G + g]);
      } else {
        vs[r] = Vec::set1(sc[r * G + g]);
        vb[r] = Vec::set1(bi[r * G + g]);
      }
    }
    for (int64_t k = g * W.gs, e = k + W.gs; k < e; k += 2 * Vec::n) {
      const int64_t at = k * BITS / 8;  // the step's first byte in each row
      for (int r = 0; r < R; ++r) {
        typename Vec::F w0, w1;
        if constexpr (BITS == 4) {
          Vec::nibbles(grp[r], wr[r] + at, w0, w1);
        } else {
          w0 = Vec::fma(Vec::u8(wr[r] + at), vs[r], vb[r]);
          w1 = Vec::fma(Vec::u8(wr[r] + at + Vec::n), vs[r], vb[r]);
        }
        for (int m = 0; m < M; ++m) {
          a0[r][m] = Vec::fma(w0, Vec::load(xp + m * K + k), a0[r][m]);
          a1[r][m] = Vec::fma(w1, Vec::load(xp + m * K + k + Vec::n), a1[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) y[m * ldy + n + r * step] = Vec::sum(Vec::add(a0[r][m], a1[r][m]));
}

// Weight rows taken at once for M rows of x: enough independent accumulator chains to hide the
// multiply-add latency, within the registers (32 with AVX-512, 16 with AVX2). Three or four rows
// of x take two weight rows where x's rows outgrow a share of the L1 cache (each step's loads of
// x then serve two weight rows; 4 rows of the 1B shape's down product, K = 8192: 1.6x faster at
// group 64, 1.1x at group 32, bench.cpu_rows),
// one where they fit (two cost 17% on the bundled model's K = 576). At least one: with AVX2 it
// was 2 / M, 0 from three rows on, so rows_bits asked for no scratch and wrote each row's scales
// into whatever its thread's buffer held (a null pointer in a fresh thread: the AVX2 unit, the
// default where AVX-512 is missing, crashed or corrupted memory with three or more streams).
template <int M>
constexpr int weight_rows() {
  return Vec::n == 16 ? (M == 1 ? 4 : M <= 4 ? 2 : 1) : (M == 1 ? 2 : 1);
}
template <int M>
int weight_rows_for(int64_t K) {
  constexpr int64_t kL1Share = 16 * 1024;  // bytes of x that stay in L1 beside the weights
  return M >= 3 && int64_t(sizeof(float)) * M * K <= kL1Share ? 1 : weight_rows<M>();
}

// Rows n0..n1 of a 4- or 8-bit W: the block as R runs of `step` rows read side by side (R
// streams a quarter-block apart; rows next to each other lost 20% on the 8-bit head, K = 576),
// then the rest one row at a time; interleave_rows() off: all one row at a time (the same bits).
template <int M, int BITS>
void rows_bits(const QMat& W, const float* xp, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int R = weight_rows<M>();
  const int64_t G = W.K / W.gs;
  float* sc = scratch(2 * R * G);
  int64_t n = n0;
  if (interleave_rows() && R > 1 && weight_rows_for<M>(W.K) == R) {
    const int64_t step = (n1 - n0) / R;
    for (; n < n0 + step; ++n) rows_at<M, R, BITS>(W, xp, n, step, sc, sc + R * G, y, ldy);
    n = n0 + R * step;
  }
  for (; n < n1; ++n) rows_at<M, 1, BITS>(W, xp, n, 1, sc, sc + G, y, ldy);
}

float dot(const float* a, const float* b, int64_t n) {
  auto acc = Vec::zero();
  int64_t i = 0;
  for (; i + Vec::n <= n; i += Vec::n) acc = Vec::fma(Vec::load(a + i), Vec::load(b + i), acc);
  float r = Vec::sum(acc);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

void axpy(float a, const float* x, float* y, int64_t n) {
  const auto va = Vec::set1(a);
  int64_t i = 0;
  for (; i + Vec::n <= n; i += Vec::n) Vec::store(y + i, Vec::fma(va, Vec::load(x + i), Vec::load(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

// exp(x) for x <= 0 (softmax terms), within a few ulp of std::exp: x = n ln2 + r with |r| <= ln2/2,
// Cephes's degree-6 polynomial for exp(r), times 2^n; below -87.3 (where exp underflows) it
// gives exp(-87.3), about 1e-38.
inline Vec::F exp_neg(Vec::F x) {
  x = Vec::max(x, Vec::set1(-87.33654f));
  const auto n = Vec::round(Vec::mul(x, Vec::set1(1.44269504088896341f)));
  auto r = Vec::fnma(n, Vec::set1(0.693359375f), x);
  r = Vec::fnma(n, Vec::set1(-2.12194440e-4f), r);
  auto p = Vec::set1(1.9875691500e-4f);
  p = Vec::fma(p, r, Vec::set1(1.3981999507e-3f));
  p = Vec::fma(p, r, Vec::set1(8.3334519073e-3f));
  p = Vec::fma(p, r, Vec::set1(4.1665795894e-2f));
  p = Vec::fma(p, r, Vec::set1(1.6666665459e-1f));
  p = Vec::fma(p, r, Vec::set1(5.0000001201e-1f));
  const auto y = Vec::add(Vec::fma(Vec::mul(p, r), r, r), Vec::set1(1.0f));
  return Vec::mul(y, Vec::pow2(n));
}

// The softmax numerators of scores sc[t0..S) (in place) against their maximum `top`, a vector
// of keys at a time; returns their sum.
inline float softmax_exp(float* sc, int64_t t0, int64_t S, float top) {
  const auto vtop = Vec::set1(top);
  auto vsum = Vec::zero();
  int64_t t = t0;
  for (; t + Vec::n <= S; t += Vec::n) {
    const auto e = exp_neg(Vec::sub(Vec::load(sc + t), vtop));
    Vec::store(sc + t, e);
    vsum = Vec::add(vsum, e);
  }
  float sum = Vec::sum(vsum);
  if (t < S) {  // the last keys, through a padded block
    float tail[Vec::n];
    std::fill(tail, tail + Vec::n, top);
    std::copy(sc + t, sc + S, tail);
    Vec::store(tail, exp_neg(Vec::sub(Vec::load(tail), vtop)));
    for (int64_t j = t; j < S; ++j) sum += (sc[j] = tail[j - t]);
  }
  return sum;
}

// R heads sharing one KV head (GQA), D = NV vectors: each key and value is loaded once for all
// R queries; each query's arithmetic is the same, in the same order, as dot() per key and
// axpy() per value, with q and the running output in registers and exp a vector of keys at a
// time. q: R queries (D floats each, already scaled); sc: R * S floats; y: R outputs, ldy apart.
template <int NV, int R>
void attend_nv(const float* q, const float* k, int64_t ks, const float* v, int64_t vs, int64_t t0,
               int64_t S, float* sc, float* y, int64_t ldy) {
  constexpr int64_t D = NV * Vec::n;
  float top[R], inv[R];
  {
    typename Vec::F qv[R][NV];
    for (int r = 0; r < R; ++r) {
      top[r] = -std::numeric_limits<float>::infinity();
      for (int i = 0; i < NV; ++i) qv[r][i] = Vec::load(q + r * D + i * Vec::n);
    }
    for (int64_t t = t0; t < S; ++t) {
      const float* kr = k + t * ks;
      typename Vec::F kv[NV];
      for (int i = 0; i < NV; ++i) kv[i] = Vec::load(kr + i * Vec::n);
      for (int r = 0; r < R; ++r) {
        auto d = Vec::zero();
        for (int i = 0; i < NV; ++i) d = Vec::fma(qv[r][i], kv[i], d);
        sc[r * S + t] = Vec::sum(d);
        top[r] = std::max(top[r], sc[r * S + t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) inv[r] = 1.0f / softmax_exp(sc + r * S, t0, S, top[r]);
  typename Vec::F acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = Vec::zero();
  for (int64_t t = t0; t < S; ++t) {
    const float* vr = v + t * vs;
    typename Vec::F vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = Vec::load(vr + i * Vec::n);
    for (int r = 0; r < R; ++r) {
      const auto a = Vec::set1(sc[r * S + t] * inv[r]);
      for (int i = 0; i < NV; ++i) acc[r][i] = Vec::fma(a, vv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) Vec::store(y + r * ldy + i * Vec::n, acc[r][i]);
}

// One D = NV-vector kernel for R heads, where its queries fit the registers (32 with AVX-512,
// 16 with AVX2) beside a key's vectors; false otherwise (the caller runs heads one at a time).
template <int NV, int R>
bool attend_fit(const float* q, const float* k, int64_t ks, const float* v, int64_t vs, int64_t t0,
                int64_t S, float* sc, float* y, int64_t ldy) {
  if constexpr (R > 1 && NV * (R + 1) > (Vec::n == 16 ? 24 : 12)) {
    return false;
  } else {
    attend_nv<NV, R>(q, k, ks, v, vs, t0, S, sc, y, ldy);
    return true;
  }
}

template <int R>
bool attend_r(const float* q, const float* k, int64_t ks, const float* v, int64_t vs, int64_t t0,
              int64_t S, int64_t D, float* sc, float* y, int64_t ldy) {
  switch (D) {
    case 2 * Vec::n: return attend_fit<2, R>(q, k, ks, v, vs, t0, S, sc, y, ldy);
    case 4 * Vec::n: return attend_fit<4, R>(q, k, ks, v, vs, t0, S, sc, y, ldy);
    case 8 * Vec::n: return attend_fit<8, R>(q, k, ks, v, vs, t0, S, sc, y, ldy);
    default: return false;
  }
}

bool attend(const float* q, int R, const float* k, int64_t ks, const float* v, int64_t vs,
            int64_t t0, int64_t S, int64_t D, float* sc, float* y, int64_t ldy) {
  switch (R) {
    case 1: return attend_r<1>(q, k, ks, v, vs, t0, S, D, sc, y, ldy);
    case 2: return attend_r<2>(q, k, ks, v, vs, t0, S, D, sc, y, ldy);
    case 3: return attend_r<3>(q, k, ks, v, vs, t0, S, D, sc, y, ldy);
    case 4: return attend_r<4>(q, k, ks, v, vs, t0, S, D, sc, y, ldy);
    default: return false;
  }
}

constexpr bool kSplit4 = true;  // 4-bit blocks of x: even elements, then odd (prep_x8)

// x's exact sum over each weight group, gsum[m * G + g], from its 32-element blocks' sums.
inline void group_sums(const QMat& W, const Q8Rows& X, int M, float* gsum) {
  const int64_t G = W.K / W.gs, nb = X.ld / 32, bpg = W.gs / 32;
  for (int m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0;
      for (int64_t j = 0; j < bpg; ++j) s += X.s[m * nb + g * bpg + j];
      gsum[m * G + g] = s;
    }
}

#if MLXCHAT_Q8_512
// The VNNI unit's int8 path: 64 bytes of a weight row a step (4-bit: 128 weights, the low
// nibbles being the even ones, the high the odd ones; 8-bit: 64), u8 codes times the s8 limbs of
// x with vpdpbusd, each 32-bit lane summing its 8 (4) weights' products for each limb exactly;
// v = hi * 128 + lo in int32, then per lane times the lane's weight scale and x block scale
// (dl), in fp32; the biases times x's exact group sums once a row. R weight rows `step` apart
// share each step's x loads (as rows_at); the same arithmetic, in the same order, for every
// (x row, weight row) whatever M and R.
template <int BITS>
constexpr int64_t q8_step() {  // weights a 64-byte step
  return BITS == 4 ? 128 : 64;
}

// sc: R runs of G + 16 floats whose last 16 are zeros (a step's masked load may pass G).
template <int M, int R, int BITS>
void rows_q8_at(const QMat& W, const Q8Rows& X, int64_t n, int64_t step, const float* gsum,
                __m512i gidx, float* sc, float* bi, float* y, int64_t ldy) {
  constexpr int64_t E = q8_step<BITS>();
  const int64_t K = W.K, G = K / W.gs, steps = (K + E - 1) / E;
  const int64_t gps = std::max<int64_t>(1, E / W.gs);  // groups a step
  const __mmask16 gmask = __mmask16((1u << gps) - 1);
  const uint8_t* wr[R];
  for (int r = 0; r < R; ++r) {
    wr[r] = reinterpret_cast<const uint8_t*>(W.w) + (n + r * step) * (K * BITS / 8);
    row_scales(W, n + r * step, G, sc + r * (G + 16), bi + r * G);
  }
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const int64_t pf = prefetch_bytes(), row_bytes = K * BITS / 8;
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < steps; ++c) {
    const int64_t at = c * 64, left = row_bytes - at;
    const __mmask64 bmask = left >= 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
    // x's limbs and lane scales of this step: all M rows kept in registers when they fit
    // (M <= 2), else each row loaded once, used for the R weight rows, then the next
    constexpr bool keep = M <= 2;
    constexpr int MK = keep ? M : 1;
    __m512i xh[MK][2], xl[MK][2];
    __m512 dl[MK];
    auto load_x = [&](int m, int slot) {
      const int8_t* h = X.hi + m * X.ld + c * E;
      const int8_t* l = X.lo + m * X.ld + c * E;
      xh[slot][0] = _mm512_loadu_si512(h);
      xl[slot][0] = _mm512_loadu_si512(l);
      if constexpr (BITS == 4) {
        xh[slot][1] = _mm512_loadu_si512(h + 64);
        xl[slot][1] = _mm512_loadu_si512(l + 64);
      }
      dl[slot] = _mm512_loadu_ps(X.dl + m * (X.ld / 4) + c * 16);
    };
    if constexpr (keep)
      for (int m = 0; m < M; ++m) load_x(m, m);
    const int64_t g0 = c * E / W.gs;
    __m512i wlo[R], whi[R];
    __m512 sv[R];
    for (int r = 0; r < R; ++r) {  // the R weight rows' codes and lane scales of this step
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(wr[r] + at + pf), _MM_HINT_T0);
      const __m512i raw = _mm512_maskz_loadu_epi8(bmask, wr[r] + at);
      sv[r] = _mm512_permutexvar_ps(gidx, _mm512_maskz_loadu_ps(gmask, sc + r * (G + 16) + g0));
      wlo[r] = whi[r] = raw;
      if constexpr (BITS == 4) {
        wlo[r] = _mm512_and_si512(raw, m4);
        whi[r] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
      }
    }
    for (int m = 0; m < M; ++m) {  // each row of x loaded once a step, for all R weight rows
      const int x = keep ? m : 0;
      if constexpr (!keep) load_x(m, 0);
      for (int r = 0; r < R; ++r) {
        __m512i vh, vl;
        if constexpr (BITS == 4) {
          vh = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wlo[r], xh[x][0]), whi[r], xh[x][1]);
          vl = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wlo[r], xl[x][0]), whi[r], xl[x][1]);
        } else {
          vh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wlo[r], xh[x][0]);
          vl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wlo[r], xl[x][0]);
        }
        const __m512i v = _mm512_add_epi32(_mm512_slli_epi32(vh, 7), vl);
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(sv[r], dl[x]), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {  // + the biases times x's group sums, then one reduction
    const float* b = bi + r * G;
    for (int m = 0; m < M; ++m) {
      const float* gs = gsum + m * G;
      __m512 a = acc[r][m];
      for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 k = G - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (G - g)) - 1);
        a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, b + g), _mm512_maskz_loadu_ps(k, gs + g), a);
      }
      y[m * ldy + n + r * step] = _mm512_reduce_add_ps(a);
    }
  }
}

template <int M, int BITS>
void rows_q8(const QMat& W, const Q8Rows& X, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int R = M == 1 ? 4 : M <= 4 ? 2 : 1;  // weight rows a pass (registers: R * M sums)
  constexpr int64_t E = q8_step<BITS>();
  const int64_t G = W.K / W.gs;
  float* sc = scratch(R * (G + 16) + R * G + M * G);
  float* bi = sc + R * (G + 16);
  float* gsum = bi + R * G;
  for (int r = 0; r < R; ++r) std::fill(sc + r * (G + 16) + G, sc + r * (G + 16) + G + 16, 0.0f);
  alignas(64) int32_t idx[16];  // each lane's weight group within a step (lanes of E / 16 weights)
  for (int j = 0; j < 16; ++j) idx[j] = W.gs < E ? int32_t(j * (E / 16) / W.gs) : 0;
  const __m512i gidx = _mm512_load_si512(idx);
  group_sums(W, X, M, gsum);
  int64_t n = n0;
  if (interleave_rows() && R > 1) {
    const int64_t step = (n1 - n0) / R;
    for (; n < n0 + step; ++n) rows_q8_at<M, R, BITS>(W, X, n, step, gsum, gidx, sc, bi, y, ldy);
    n = n0 + R * step;
  }
  for (; n < n1; ++n) rows_q8_at<M, 1, BITS>(W, X, n, 1, gsum, gidx, sc, bi, y, ldy);
}

#else
// ---- int8 activations: one 32-element block per 256-bit integer dot product. The weights'
// codes enter centred (q - 8 for 4 bits, q - 128 for 8), which halves the error the int8
// rounding of x brings; the centre moves into the bias (b + 8s or b + 128s), which multiplies
// x's exact sum. u8 x s8 instructions take |q - c| and the sign moves onto x: products stay
// within 128 * 127, so maddubs's int16 pairs cannot saturate.
inline __m256i dot_block(__m256i w, __m256i x) {
  const __m256i wabs = _mm256_sign_epi8(w, w), xs = _mm256_sign_epi8(x, w);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xs), _mm256_set1_epi16(1));
}

template <int M, int BITS>
void rows_q8(const QMat& W, const Q8Rows& X, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr float centre = BITS == 4 ? 8.0f : 128.0f;
  const int64_t K = W.K, G = K / W.gs, bpg = W.gs / 32, nb = X.ld / 32;
  float* sc = scratch(2 * G + M * G);
  float* bi = sc + G;
  float* gsum = bi + G;
  group_sums(W, X, M, gsum);
  const __m128i m4 = _mm_set1_epi8(0x0F), c4 = _mm_set1_epi8(8);
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  for (int64_t n = n0; n < n1; ++n) {
    row_scales(W, n, G, sc, bi);
    const uint8_t* wr = reinterpret_cast<const uint8_t*>(W.w) + n * (K * BITS / 8);
    __m256 acc[M];
    float bsum[M] = {};
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const float s = sc[g], b = bi[g] + centre * s;
      for (int64_t j = g * bpg; j < (g + 1) * bpg; ++j) {
        __m256i w;
        if constexpr (BITS == 4) {
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + j * 16));
          w = _mm256_set_m128i(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), c4),
                               _mm_sub_epi8(_mm_and_si128(raw, m4), c4));
        } else {
          w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + j * 32)), flip);
        }
        for (int m = 0; m < M; ++m) {
          const auto* h = reinterpret_cast<const __m256i*>(X.hi + m * X.ld + j * 32);
          const auto* l = reinterpret_cast<const __m256i*>(X.lo + m * X.ld + j * 32);
          const __m256i v = _mm256_add_epi32(_mm256_slli_epi32(dot_block(w, _mm256_loadu_si256(h)), 7),
                                             dot_block(w, _mm256_loadu_si256(l)));
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(X.d[m * nb + j] * s), acc[m]);
        }
      }
      for (int m = 0; m < M; ++m) bsum[m] += b * gsum[m * G + g];
    }
    for (int m = 0; m < M; ++m) y[m * ldy + n] = hsum256(acc[m]) + bsum[m];
  }
}
#endif  // MLXCHAT_Q8_512

#else  // portable C++

constexpr int kBlock4 = 0;  // natural order
constexpr bool kSplit4 = false;

template <int M, int BITS>
void rows_bits(const QMat& W, const float* xp, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int per_word = 32 / BITS;
  constexpr uint32_t mask = (1u << BITS) - 1;
  const int64_t K = W.K, G = K / W.gs, words = K / per_word;
  float wq[32];
  for (int64_t n = n0; n < n1; ++n) {
    const uint32_t* wr = W.w + n * words;
    float acc[M][8] = {};
    for (int64_t g = 0; g < G; ++g) {
      float s, b;
      scale_bias(W, n * G + g, s, b);
      for (int64_t k = g * W.gs, e = k + W.gs; k < e; k += 32) {
        for (int w = 0; w < 32 / per_word; ++w) {
          uint32_t word = wr[(k / per_word) + w];
          for (int p = 0; p < per_word; ++p) wq[w * per_word + p] = float((word >> (p * BITS)) & mask) * s + b;
        }
        for (int m = 0; m < M; ++m)
          for (int j = 0; j < 32; ++j) acc[m][j & 7] += wq[j] * xp[m * K + k + j];
      }
    }
    for (int m = 0; m < M; ++m) {
      float r = 0;
      for (int j = 0; j < 8; ++j) r += acc[m][j];
      y[m * ldy + n] = r;
    }
  }
}

template <int M, int BITS>
void rows_q8(const QMat& W, const Q8Rows& X, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int per_word = 32 / BITS;
  constexpr uint32_t mask = (1u << BITS) - 1;
  constexpr int32_t centre = 1 << (BITS - 1);  // as the SIMD units: see rows_q8 there
  const int64_t K = W.K, G = K / W.gs, bpg = W.gs / 32, nb = X.ld / 32, words = K / per_word;
  for (int64_t n = n0; n < n1; ++n) {
    const uint32_t* wr = W.w + n * words;
    float acc[M] = {};
    for (int64_t g = 0; g < G; ++g) {
      float s, b;
      scale_bias(W, n * G + g, s, b);
      b += float(centre) * s;
      for (int64_t j = g * bpg; j < (g + 1) * bpg; ++j) {
        int32_t q[32];
        for (int w = 0; w < 32 / per_word; ++w) {
          const uint32_t word = wr[j * (32 / per_word) + w];
          for (int p = 0; p < per_word; ++p) q[w * per_word + p] = int32_t((word >> (p * BITS)) & mask) - centre;
        }
        for (int m = 0; m < M; ++m) {
          int32_t isum = 0;
          const int64_t at = m * X.ld + j * 32;
          for (int k = 0; k < 32; ++k) isum += q[k] * (128 * int32_t(X.hi[at + k]) + int32_t(X.lo[at + k]));
          acc[m] += float(isum) * (X.d[m * nb + j] * s) + b * X.s[m * nb + j];
        }
      }
    }
    for (int m = 0; m < M; ++m) y[m * ldy + n] = acc[m];
  }
}

float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float r = 0;
  for (int j = 0; j < 8; ++j) r += acc[j];
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

bool attend(const float*, int, const float*, int64_t, const float*, int64_t, int64_t, int64_t,
            int64_t, float*, float*, int64_t) {
  return false;  // the caller's dot/axpy loop
}

#endif

void prep_x(const QMat& W, const float* x, int M, float* xp) {
  const int64_t K = W.K;
  if (W.bits != 4 || kBlock4 == 0) {
    std::memcpy(xp, x, sizeof(float) * M * K);
    return;
  }
  constexpr int half = kBlock4 / 2;
  for (int64_t i = 0; i < M * K; i += kBlock4) {
    for (int j = 0; j < half; ++j) {
      xp[i + j] = x[i + 2 * j];
      xp[i + half + j] = x[i + 2 * j + 1];
    }
  }
}

// x (M rows of K) -> two int8 limbs per value, per 32-element block (Q8Rows): d = max|x| /
// kQ8Levels, v = round(x / d), hi = floor((v + 64) / 128), lo = v - 128 * hi; the block's exact
// fp32 sum. Positions past K (up to X.ld) get zeros. Where each value goes within a row: see
// q8_slot.
inline int64_t q8_slot(int bits, int64_t k) {
#if MLXCHAT_Q8_512
  // 64-byte steps of the VNNI kernel: 4-bit, per 128 values the even ones, then the odd ones
  // (the low and the high nibbles of 64 weight bytes); 8-bit, natural order
  return bits == 4 ? (k & ~int64_t(127)) + (k & 1) * 64 + (k & 127) / 2 : k;
#else
  return kSplit4 && bits == 4 ? (k & ~int64_t(31)) + (k & 1) * 16 + (k & 31) / 2 : k;
#endif
}

void prep_x8(const QMat& W, const float* x, int M, const Q8Rows& X) {
  const int64_t K = W.K, ld = X.ld, nb = ld / 32;
  for (int m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    int8_t* hi = X.hi + m * ld;
    int8_t* lo = X.lo + m * ld;
    std::fill(hi, hi + ld, int8_t(0));
    std::fill(lo, lo + ld, int8_t(0));
    for (int64_t j = 0; j < nb; ++j) {
      float amax = 0, sum = 0;
      for (int64_t k = j * 32; k < std::min(K, (j + 1) * 32); ++k) {
        amax = std::max(amax, std::fabs(xr[k]));
        sum += xr[k];
      }
      const float inv = amax > 0 ? kQ8Levels / amax : 0.0f;
      X.d[m * nb + j] = amax / kQ8Levels;
      X.s[m * nb + j] = sum;
      for (int64_t k = j * 32; k < std::min(K, (j + 1) * 32); ++k) {
        const int32_t v = int32_t(std::nearbyint(std::clamp(xr[k] * inv, -kQ8Levels, kQ8Levels)));
        const int32_t h = (v + 64) >> 7;  // floor((v + 64) / 128)
        hi[q8_slot(W.bits, k)] = int8_t(h);
        lo[q8_slot(W.bits, k)] = int8_t(v - 128 * h);
      }
    }
#if MLXCHAT_Q8_512
    // d per 32-bit lane of each 64-byte step: 4-bit, lane j of step c holds values
    // 128c + 8j .. + 7 (block 4c + j / 4); 8-bit, values 64c + 4j .. + 3 (block 2c + j / 8)
    float* dl = X.dl + m * (ld / 4);
    for (int64_t c = 0; c < ld / (W.bits == 4 ? 128 : 64); ++c)
      for (int j = 0; j < 16; ++j)
        dl[c * 16 + j] = X.d[m * nb + (W.bits == 4 ? 4 * c + j / 4 : 2 * c + j / 8)];
#endif
  }
}

template <int BITS>
void dequant(const QMat& W, int64_t n0, int64_t n1, float* out) {
  const int64_t K = W.K, G = K / W.gs;
  float* sc = scratch(2 * G);
  float* bi = sc + G;
  for (int64_t n = n0; n < n1; ++n) {
    row_scales(W, n, G, sc, bi);
    float* o = out + n * K;
#if MLXCHAT_SIMD
    const uint8_t* wr = reinterpret_cast<const uint8_t*>(W.w) + n * (K * BITS / 8);
    for (int64_t g = 0; g < G; ++g) {
      const auto vs = Vec::set1(sc[g]), vb = Vec::set1(bi[g]);
      for (int64_t k = g * W.gs, e = k + W.gs; k < e; k += 2 * Vec::n) {
        if constexpr (BITS == 8) {
          Vec::store(o + k, Vec::fma(Vec::u8(wr + k), vs, vb));
          Vec::store(o + k + Vec::n, Vec::fma(Vec::u8(wr + k + Vec::n), vs, vb));
        } else {
          typename Vec::F a, b;
          Vec::codes4(wr + k / 2, a, b);
          Vec::store(o + k, Vec::fma(a, vs, vb));
          Vec::store(o + k + Vec::n, Vec::fma(b, vs, vb));
        }
      }
    }
#else
    constexpr int per_word = 32 / BITS;
    constexpr uint32_t mask = (1u << BITS) - 1;
    const uint32_t* wr = W.w + n * (K / per_word);
    for (int64_t g = 0; g < G; ++g) {
      const float s = sc[g], b = bi[g];
      for (int64_t k = g * W.gs, e = k + W.gs; k < e; k += per_word) {
        const uint32_t word = wr[k / per_word];
        for (int p = 0; p < per_word; ++p) o[k + p] = float((word >> (p * BITS)) & mask) * s + b;
      }
    }
#endif
  }
}

// Two roundings, as MLX's dequantization: the multiply and the add must not fuse into an FMA
// (this file is built with the compiler's default contraction).
__attribute__((optimize("fp-contract=off")))
void dequant_kv(const uint32_t* src, int64_t stride, int64_t t0, int64_t S, int64_t D, int gs,
                float* out) {
  const int64_t groups = D / gs;
  for (int64_t t = t0; t < S; ++t) {
    const uint32_t* row = src + t * stride;
    const uint8_t* code = reinterpret_cast<const uint8_t*>(row);
    const float* sc = reinterpret_cast<const float*>(row + D / 4);
    const float* bi = sc + groups;
    float* o = out + t * D;
    for (int64_t g = 0; g < groups; ++g) {
      int64_t i = g * gs;
      const int64_t e = i + gs;
#if MLXCHAT_SIMD
      const auto vs = Vec::set1(sc[g]), vb = Vec::set1(bi[g]);
      for (; i + Vec::n <= e; i += Vec::n) Vec::store(o + i, Vec::add(Vec::mul(Vec::u8(code + i), vs), vb));
#endif
      for (; i < e; ++i) {
        const float scaled = float(code[i]) * sc[g];
        o[i] = scaled + bi[g];
      }
    }
  }
}

void dequant_rows(const QMat& W, int64_t n0, int64_t n1, float* out) {
  if (W.bits == 4)
    dequant<4>(W, n0, n1, out);
  else
    dequant<8>(W, n0, n1, out);
}

template <int M>
void rows(const QMat& W, const float* xp, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  if (W.bits == 4)
    rows_bits<M, 4>(W, xp, n0, n1, y, ldy);
  else
    rows_bits<M, 8>(W, xp, n0, n1, y, ldy);
}

template <int M>
void rows8bit(const QMat& W, const Q8Rows& X, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  if (W.bits == 4)
    rows_q8<M, 4>(W, X, n0, n1, y, ldy);
  else
    rows_q8<M, 8>(W, X, n0, n1, y, ldy);
}

void qmv_rows(const QMat& W, const float* xp, int M, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  switch (M) {
    case 1: return rows<1>(W, xp, n0, n1, y, ldy);
    case 2: return rows<2>(W, xp, n0, n1, y, ldy);
    case 3: return rows<3>(W, xp, n0, n1, y, ldy);
    case 4: return rows<4>(W, xp, n0, n1, y, ldy);
    case 5: return rows<5>(W, xp, n0, n1, y, ldy);
    case 6: return rows<6>(W, xp, n0, n1, y, ldy);
    case 7: return rows<7>(W, xp, n0, n1, y, ldy);
    default: return rows<8>(W, xp, n0, n1, y, ldy);
  }
}

void qmv_rows_q8(const QMat& W, const Q8Rows& X, int M, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  switch (M) {
    case 1: return rows8bit<1>(W, X, n0, n1, y, ldy);
    case 2: return rows8bit<2>(W, X, n0, n1, y, ldy);
    case 3: return rows8bit<3>(W, X, n0, n1, y, ldy);
    case 4: return rows8bit<4>(W, X, n0, n1, y, ldy);
    case 5: return rows8bit<5>(W, X, n0, n1, y, ldy);
    case 6: return rows8bit<6>(W, X, n0, n1, y, ldy);
    case 7: return rows8bit<7>(W, X, n0, n1, y, ldy);
    default: return rows8bit<8>(W, X, n0, n1, y, ldy);
  }
}

// Four 64-byte (AVX-512), 32-byte (AVX2) or 8-byte (portable) loads in flight per step, each into
// its own accumulator, so the adds never wait on one another: the loop is bound by the loads.
uint64_t read_sum(const uint64_t* w, int64_t n) {
  int64_t i = 0;
  uint64_t total = 0;
#if MLXCHAT_SIMD == 512
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(w + i));
    a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(w + i + 8));
    a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(w + i + 16));
    a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(w + i + 24));
  }
  total = uint64_t(_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3))));
#elif MLXCHAT_SIMD == 256
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i + 4)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i + 8)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i + 12)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
  uint64_t acc[4] = {};
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) acc[j] += w[i + j];
  total = acc[0] + acc[1] + acc[2] + acc[3];
#endif
  for (; i < n; ++i) total += w[i];
  return total;
}

// Leaves the SIMD registers' upper halves clean. AVX-512 code that used zmm16-31 (the int8
// kernels do: many accumulators) leaves them dirty, and VZEROUPPER, which the compiler puts at
// every return, clears zmm0-15 only; while any upper half is dirty, every legacy-SSE instruction
// after it on the same thread runs with a merge penalty. That was our own scalar code (SwiGLU's
// expf loop) and MLX's CPU ops on the threads that ran a kernel: after one int8 product, SwiGLU on
// a 200 x 1,536 chunk took 22 ms instead of 0.6 (Sapphire Rapids), a 200-token prompt of the
// bundled model 1.4 s instead of 0.7, and a batched one 11 s. So every kernel entry point below
// zeroes zmm16-31 on its way out (16 zeroing idioms: a few ns against a kernel call's us).
inline void clean_upper() {
#if MLXCHAT_SIMD == 512
  asm volatile(
      "vpxord %%zmm16, %%zmm16, %%zmm16\n\tvpxord %%zmm17, %%zmm17, %%zmm17\n\t"
      "vpxord %%zmm18, %%zmm18, %%zmm18\n\tvpxord %%zmm19, %%zmm19, %%zmm19\n\t"
      "vpxord %%zmm20, %%zmm20, %%zmm20\n\tvpxord %%zmm21, %%zmm21, %%zmm21\n\t"
      "vpxord %%zmm22, %%zmm22, %%zmm22\n\tvpxord %%zmm23, %%zmm23, %%zmm23\n\t"
      "vpxord %%zmm24, %%zmm24, %%zmm24\n\tvpxord %%zmm25, %%zmm25, %%zmm25\n\t"
      "vpxord %%zmm26, %%zmm26, %%zmm26\n\tvpxord %%zmm27, %%zmm27, %%zmm27\n\t"
      "vpxord %%zmm28, %%zmm28, %%zmm28\n\tvpxord %%zmm29, %%zmm29, %%zmm29\n\t"
      "vpxord %%zmm30, %%zmm30, %%zmm30\n\tvpxord %%zmm31, %%zmm31, %%zmm31"
      ::: "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25",
          "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31");
  _mm256_zeroupper();
#endif
}

// F, then clean_upper: what the table hands out for each kernel (dot and axpy, called per key by
// the attention's fallback, stay bare: they use zmm0-15 only and end in VZEROUPPER).
template <auto F> struct Clean;
template <class R, class... A, R (*F)(A...)>
struct Clean<F> {
  static R call(A... a) {
    if constexpr (std::is_void_v<R>) {
      F(a...);
      clean_upper();
    } else {
      R r = F(a...);
      clean_upper();
      return r;
    }
  }
};

const Impl kImpl{kName, Clean<prep_x>::call, Clean<qmv_rows>::call, Clean<prep_x8>::call,
                 Clean<qmv_rows_q8>::call, Clean<dequant_rows>::call, Clean<dequant_kv>::call, dot,
                 axpy, Clean<attend>::call, Clean<read_sum>::call};

}  // namespace

const Impl* MLXCHAT_CAT(impl_, MLXCHAT_ISA)() { return &kImpl; }

}  // namespace mlxchat
