// The log-softmax of fp32 rows, bit for bit MLX's `x - logsumexp(x, axis=-1, keepdims=True)`.
//
// MLX 0.32's CPU LogSumExp (mlx/backend/cpu/logsumexp.cpp) takes, per row: the maximum (the
// row's last NaN where it holds one), then the sum of exp(x - max) added one element at a time in
// index order, then log(sum) + max (the max itself where it is infinite). Its `exp` is the Cephes
// polynomial of mlx/backend/cpu/simd/math.h, run one element at a time on x86 Linux (its SIMD
// width there is 1): ~0.65 ms for a 49,152-token row. Here the same operations per element run on
// the vectors of the kernels' unit (one copy of the code per instruction set, auto-vectorized),
// and only the sum stays a chain of single adds in MLX's order, so the result is identical: a
// row takes ~0.06 ms, mostly that chain, and a group of 4 rows, whose chains the core overlaps,
// ~0.14 ms (one AVX-512 core; bench/sampling_cost.py times it against MLX's ops).
//
// Identity hinges on the exact operations, so this file is compiled with -ffp-contract=off (no
// multiply-add fused where MLX rounds twice). MLX's `floor(x + 0.5)` adds the double 0.5, so its
// add and floor are double precision; `fma` is exactly rounded on both sides.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common.h"
#include "softmax.h"

namespace mlxchat {
namespace {

constexpr int64_t kBlock = 1024;  // exps computed per vector pass before their in-order adds

// e[i] = MLX's exp(x[i] - m) for i < n, the operations of math.h's `exp` on each element.
[[gnu::always_inline]] inline void exp_shifted(const float* __restrict x, float m,
                                               float* __restrict e, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] - m;
    const float t = v * 1.442695f;
    const float ip = float(std::floor(double(t) + 0.5));
    const float fp = t - ip;
    float p = 1.535336188319500e-4f;
    p = std::fma(p, fp, 1.339887440266574e-3f);
    p = std::fma(p, fp, 9.618437357674640e-3f);
    p = std::fma(p, fp, 5.550332471162809e-2f);
    p = std::fma(p, fp, 2.402264791363012e-1f);
    p = std::fma(p, fp, 6.931472028550421e-1f);
    p = std::fma(p, fp, 1.000000000000000f);
    // 2**ip by the exponent bits (ip out of int range only where a select below wins)
    const float c = ip >= -256.0f ? std::min(ip, 256.0f) : -256.0f;
    const uint32_t bits = (uint32_t(int32_t(c)) + 127u) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    float r = v != v ? v : scale * p;
    r = v > 88.0f ? std::numeric_limits<float>::infinity() : r;
    e[i] = v < -88.0f ? 0.0f : r;
  }
}

// The largest of n floats (`a > m ? a : m` over 16 lanes: MLX's value, but for the sign of a
// zero) and whether any is a NaN. GCC vector types: the scalar loop does not vectorize (its order
// decides which NaN or zero wins).
using F16 = float __attribute__((vector_size(64)));
using I16 = int32_t __attribute__((vector_size(64)));
[[gnu::always_inline]] inline float lane_max(const float* __restrict x, int64_t n, bool* nan) {
  constexpr int W = 16;
  constexpr float lo = -std::numeric_limits<float>::infinity();
  F16 acc = {lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo};
  I16 bad = {};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    F16 v;
    std::memcpy(&v, x + i, sizeof v);
    acc = v > acc ? v : acc;
    bad |= v != v;
  }
  float m = lo;
  int32_t any = 0;
  for (int j = 0; j < W; ++j) {
    m = acc[j] > m ? acc[j] : m;
    any |= bad[j];
  }
  for (; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    any |= x[i] != x[i];
  }
  *nan = any != 0;
  return m;
}

// MLX's row maximum exactly: the vector pass's value, or MLX's own loop (`maximum`: a NaN
// replaces the maximum, `a > m ? a : m` otherwise, from -inf in index order) for a row holding a
// NaN or whose maximum is a zero (its sign is the first zero's).
[[gnu::always_inline]] inline float row_max(const float* x, int64_t n) {
  bool nan = false;
  float m = lane_max(x, n, &nan);
  if (!nan && m != 0.0f) return m;
  m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = x[i] != x[i] ? x[i] : (x[i] > m ? x[i] : m);
  return m;
}

// y = x - logsumexp(x) for R rows of n floats (a group): per row MLX's max, its exps added in
// index order, then log(sum) + max (the max where it is infinite), subtracted from every element.
// Each row's sum is a chain of dependent adds (~4 cycles each: most of a row's time); a group's R
// chains are independent, so the core overlaps them and R rows take about the time of one.
template <int R>
[[gnu::always_inline]] inline void group(const float* __restrict x, float* __restrict y,
                                         int64_t n) {
  float m[R], sum[R];
  for (int r = 0; r < R; ++r) {
    m[r] = row_max(x + r * n, n);
    sum[r] = 0.0f;
  }
  float e[R][kBlock];
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t k = std::min(kBlock, n - i);
    for (int r = 0; r < R; ++r) exp_shifted(x + r * n + i, m[r], e[r], k);
    for (int64_t j = 0; j < k; ++j)
      for (int r = 0; r < R; ++r) sum[r] += e[r][j];
  }
  for (int r = 0; r < R; ++r) {
    const float lse = std::isinf(m[r]) ? m[r] : std::log(sum[r]) + m[r];
    const float* xr = x + r * n;
    float* yr = y + r * n;
    for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] - lse;
  }
}

constexpr int kGroup = 4;  // rows whose sums one core overlaps (8 measured slower per row)

// `rows` (1..kGroup) rows.
[[gnu::always_inline]] inline void rows_group(const float* x, float* y, int64_t rows, int64_t n) {
  static_assert(kGroup == 4);
  switch (rows) {
    case 1: return group<1>(x, y, n);
    case 2: return group<2>(x, y, n);
    case 3: return group<3>(x, y, n);
    default: return group<4>(x, y, n);
  }
}

// The group's code once per instruction set (a vector `fma` needs FMA).
using GroupFn = void (*)(const float*, float*, int64_t, int64_t);
void group_generic(const float* x, float* y, int64_t rows, int64_t n) { rows_group(x, y, rows, n); }
#if defined(__x86_64__)
[[gnu::target("avx512f,avx2,fma")]] void group_avx512(const float* x, float* y, int64_t rows,
                                                     int64_t n) {
  rows_group(x, y, rows, n);
}
[[gnu::target("avx2,fma")]] void group_avx2(const float* x, float* y, int64_t rows, int64_t n) {
  rows_group(x, y, rows, n);
}
#endif

// The copy for the kernels' active unit (ops.cpp's Impl::name), so tests reach every copy this
// CPU can run.
GroupFn group_for(const char* isa) {
#if defined(__x86_64__)
  if (std::strncmp(isa, "avx512", 6) == 0) return &group_avx512;
  if (std::strcmp(isa, "avx2") == 0) return &group_avx2;
#endif
  return &group_generic;
}

}  // namespace

void log_softmax_rows(const float* x, float* y, int64_t rows, int64_t n, const char* isa) {
  const GroupFn fn = group_for(isa);
  const int64_t groups = (rows + kGroup - 1) / kGroup;
  auto run = [&](int64_t g) {
    fn(x + g * kGroup * n, y + g * kGroup * n, std::min<int64_t>(kGroup, rows - g * kGroup), n);
  };
  if (groups == 1)
    run(0);
  else
    parallel_for(groups, run);
}

}  // namespace mlxchat
