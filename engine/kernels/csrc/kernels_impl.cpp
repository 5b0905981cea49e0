// The per-ISA kernels: built three times (AVX-512, AVX2+FMA, portable C++) with different
// compiler flags and MLXCHAT_ISA naming the unit; common.h's impl_<isa>() picks one at run time.
//
// Quantized matrix x (1-8 rows): each weight is dequantized exactly (q * scale + bias, fp32)
// and multiplied into an fp32 accumulator. The SIMD units read 4-bit weights a byte at a time
// (low nibble = even element, high nibble = odd element), so prep_x stores each block of x as
// its even elements followed by its odd ones; the weights then need no shuffling.
#include <cmath>

#include <cmath>
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int kBlock4 = 32;  // 4-bit elements per 16-byte load
constexpr const char* kName = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kBlock4 = 16;  // 4-bit elements per 8-byte load
constexpr const char* kName = "avx2";
#else
constexpr int kBlock4 = 0;  // natural order
constexpr const char* kName = "generic";
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

#if defined(__AVX512F__) && defined(__AVX512BW__)

// A group's 16 possible weights (q * scale + bias, q = 0..15) fit one register: the nibbles
// index it with a permute instead of being converted and scaled one by one.
template <int M>
void rows4(const QMat& W, const float* xp, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t K = W.K, G = K / W.gs;
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  float* sc = scratch(2 * G);
  float* bi = sc + G;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = reinterpret_cast<const uint8_t*>(W.w) + n * (K / 2);
    row_scales(W, n, G, sc, bi);
    __m512 a0[M], a1[M];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const __m512 lut = _mm512_fmadd_ps(iota, _mm512_set1_ps(sc[g]), _mm512_set1_ps(bi[g]));
      for (int64_t k = g * W.gs, e = k + W.gs; k < e; k += 32) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k / 2));
        const __m128i lo = _mm_and_si128(raw, m4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
        const __m512 wl = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(lo), lut);
        const __m512 wh = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(hi), lut);
        for (int m = 0; m < M; ++m) {
          a0[m] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xp + m * K + k), a0[m]);
          a1[m] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xp + m * K + k + 16), a1[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
  }
}

template <int M>
void rows8(const QMat& W, const float* xp, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t K = W.K, G = K / W.gs;
  float* sc = scratch(2 * G);
  float* bi = sc + G;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = reinterpret_cast<const uint8_t*>(W.w) + n * K;
    __m512 a0[M], a1[M];
    row_scales(W, n, G, sc, bi);
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const __m512 vs = _mm512_set1_ps(sc[g]), vb = _mm512_set1_ps(bi[g]);
      for (int64_t k = g * W.gs, e = k + W.gs; k < e; k += 32) {
        const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k));
        const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k + 16));
        const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(r0)), vs, vb);
        const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(r1)), vs, vb);
        for (int m = 0; m < M; ++m) {
          a0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp + m * K + k), a0[m]);
          a1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + m * K + k + 16), a1[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
  }
}

float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float r = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

void axpy(float a, const float* x, float* y, int64_t n) {
  const __m512 va = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

#elif defined(__AVX2__) && defined(__FMA__)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int M>
void rows4(const QMat& W, const float* xp, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t K = W.K, G = K / W.gs;
  const __m128i m4 = _mm_set1_epi8(0x0F);
  float* sc = scratch(2 * G);
  float* bi = sc + G;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = reinterpret_cast<const uint8_t*>(W.w) + n * (K / 2);
    __m256 a0[M], a1[M];
    row_scales(W, n, G, sc, bi);
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const __m256 vs = _mm256_set1_ps(sc[g]), vb = _mm256_set1_ps(bi[g]);
      for (int64_t k = g * W.gs, e = k + W.gs; k < e; k += 16) {
        const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + k / 2));
        const __m128i lo = _mm_and_si128(raw, m4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
        const __m256 wl = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vs, vb);
        const __m256 wh = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vs, vb);
        for (int m = 0; m < M; ++m) {
          a0[m] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xp + m * K + k), a0[m]);
          a1[m] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xp + m * K + k + 8), a1[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) y[m * ldy + n] = hsum(_mm256_add_ps(a0[m], a1[m]));
  }
}

template <int M>
void rows8(const QMat& W, const float* xp, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t K = W.K, G = K / W.gs;
  float* sc = scratch(2 * G);
  float* bi = sc + G;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = reinterpret_cast<const uint8_t*>(W.w) + n * K;
    __m256 a0[M], a1[M];
    row_scales(W, n, G, sc, bi);
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const __m256 vs = _mm256_set1_ps(sc[g]), vb = _mm256_set1_ps(bi[g]);
      for (int64_t k = g * W.gs, e = k + W.gs; k < e; k += 16) {
        const __m128i r0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + k));
        const __m128i r1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + k + 8));
        const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(r0)), vs, vb);
        const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(r1)), vs, vb);
        for (int m = 0; m < M; ++m) {
          a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp + m * K + k), a0[m]);
          a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + m * K + k + 8), a1[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) y[m * ldy + n] = hsum(_mm256_add_ps(a0[m], a1[m]));
  }
}

float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float r = hsum(acc);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

void axpy(float a, const float* x, float* y, int64_t n) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

#else  // portable C++

template <int M, int BITS>
void rows_generic(const QMat& W, const float* xp, int64_t n0, int64_t n1, float* y, int64_t ldy) {
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
template <int M>
void rows4(const QMat& W, const float* xp, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  rows_generic<M, 4>(W, xp, n0, n1, y, ldy);
}
template <int M>
void rows8(const QMat& W, const float* xp, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  rows_generic<M, 8>(W, xp, n0, n1, y, ldy);
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

#endif

template <int BITS>
void dequant(const QMat& W, int64_t n0, int64_t n1, float* out) {
  constexpr int per_word = 32 / BITS;
  constexpr uint32_t mask = (1u << BITS) - 1;
  const int64_t K = W.K, G = K / W.gs;
  float* sc = scratch(2 * G);
  float* bi = sc + G;
  for (int64_t n = n0; n < n1; ++n) {
    row_scales(W, n, G, sc, bi);
    const uint32_t* wr = W.w + n * (K / per_word);
    float* o = out + n * K;
    for (int64_t g = 0; g < G; ++g) {
      const float s = sc[g], b = bi[g];
      for (int64_t k = g * W.gs, e = k + W.gs; k < e; k += per_word) {
        const uint32_t word = wr[k / per_word];
        for (int p = 0; p < per_word; ++p) {
#if defined(__FMA__)
          o[k + p] = std::fma(float((word >> (p * BITS)) & mask), s, b);  // as the matmul kernels
#else
          o[k + p] = float((word >> (p * BITS)) & mask) * s + b;
#endif
        }
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
    rows4<M>(W, xp, n0, n1, y, ldy);
  else
    rows8<M>(W, xp, n0, n1, y, ldy);
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

const Impl kImpl{kName, prep_x, qmv_rows, dequant_rows, dot, axpy};

}  // namespace

const Impl* MLXCHAT_CAT(impl_, MLXCHAT_ISA)() { return &kImpl; }

}  // namespace mlxchat
