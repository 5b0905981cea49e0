// Shared declarations of mlxchat's CPU kernels: the quantized-weight view, the per-ISA kernel
// table (one compilation unit per instruction set, chosen at run time) and the thread pool.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace mlxchat {

enum class SType : int { F32 = 0, F16 = 1, BF16 = 2 };

static inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
    float r = float(mant) * 5.9604644775390625e-8f;
    return sign ? -r : r;
  }
  uint32_t f = exp == 31 ? (sign | 0x7f800000u | (mant << 13))
                         : (sign | ((exp + 112) << 23) | (mant << 13));
  float r;
  std::memcpy(&r, &f, 4);
  return r;
}

static inline float load_scalar(const void* p, SType t, int64_t i) {
  switch (t) {
    case SType::F32:
      return static_cast<const float*>(p)[i];
    case SType::F16:
      return half_to_float(static_cast<const uint16_t*>(p)[i]);
    default: {
      uint32_t f = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
      float r;
      std::memcpy(&r, &f, 4);
      return r;
    }
  }
}

// MLX's affine quantized matrix (N, K): w packs 32/bits values per uint32 (lowest bits first),
// scales and biases are (N, K / gs); element (n, k) = q * scale + bias.
struct QMat {
  const uint32_t* w;
  const void* scales;
  const void* biases;
  SType st;
  int64_t N, K;
  int bits, gs;
};

// M rows of x quantized per 32-element block for the int8 path, as two int8 limbs: within a
// block, d = max|x| / kQ8Levels and v = round(x / d) = hi * 128 + lo (hi in [-127, 127], lo in
// [-64, 63]), so x ~= d * v to 15 bits of the block's largest value, and each limb's dot product
// with the weights' integer codes is exact in int32. hi and lo: ld int8 values a row (K rounded
// up to kQ8Chunk, zeros past K; with 4-bit weights the SIMD units store each block's even
// elements, then its odd ones, the AVX-512 VNNI unit per 128-element chunk); d (the blocks'
// scales) and s (each block's exact fp32 sum, for the weights' biases): ld / 32 floats a row;
// dl (the VNNI unit only, else null): d per 32-bit lane of its 64-byte steps, ld / 4 floats a row.
constexpr int64_t kQ8Chunk = 128;
constexpr float kQ8Levels = 16192.0f;  // 127 * 128 - 64: v's largest magnitude
inline int64_t q8_ld(int64_t K) { return (K + kQ8Chunk - 1) / kQ8Chunk * kQ8Chunk; }
struct Q8Rows {  // prep_x8 writes the buffers, qmv_rows_q8 reads them
  int8_t* hi;
  int8_t* lo;
  float* d;
  float* s;
  float* dl;
  int64_t ld;
};

struct Impl {
  const char* name;
  // Reorders M rows of x (K floats each) into the layout qmv_rows reads (xp: M * K floats).
  void (*prep_x)(const QMat&, const float* x, int M, float* xp);
  // y[m * ldy + n] = sum_k x[m, k] * W[n, k] for n in [n0, n1), m < M (M <= 8).
  void (*qmv_rows)(const QMat&, const float* xp, int M, int64_t n0, int64_t n1, float* y,
                   int64_t ldy);
  // Quantizes M rows of x (K floats each) into X's buffers as Q8Rows describes.
  void (*prep_x8)(const QMat&, const float* x, int M, const Q8Rows& X);
  // As qmv_rows, from int8 activations: integer dot products per block, fp32 scales.
  void (*qmv_rows_q8)(const QMat&, const Q8Rows& x, int M, int64_t n0, int64_t n1, float* y,
                      int64_t ldy);
  // out[n * K + k] = W[n, k] (fp32) for n in [n0, n1).
  void (*dequant_rows)(const QMat&, int64_t n0, int64_t n1, float* out);
  // Positions t0..S-1 of one head's packed 8-bit KV rows (engine/kernels/kv8.py: D codes, then
  // D / gs fp32 scales, then the biases; row t at src + t * stride words) as fp32 rows of D
  // floats at out + t * D: code * scale, rounded, then + bias, rounded (MLX's dequantization).
  void (*dequant_kv)(const uint32_t* src, int64_t stride, int64_t t0, int64_t S, int64_t D, int gs,
                     float* out);
  float (*dot)(const float* a, const float* b, int64_t n);
  void (*axpy)(float a, const float* x, float* y, int64_t n);  // y += a * x
  // Single-query attention of R heads (1-4) sharing one KV head over keys t0..S-1 (t0 < S):
  // q (R queries of D floats, already scaled), key t at k + t * ks, value t at v + t * vs; y
  // (R outputs of D floats, ldy apart) = the softmax-weighted sums of the values; sc: R * S
  // floats of scratch. Each query's arithmetic is dot() per key and axpy() per value, whatever R,
  // with q and y kept in registers and a vectorized exp; false where this unit has no such
  // kernel for R and D.
  bool (*attend)(const float* q, int R, const float* k, int64_t ks, const float* v, int64_t vs,
                 int64_t t0, int64_t S, int64_t D, float* sc, float* y, int64_t ldy);
  // The sum of n 64-bit words (mod 2^64), read with this unit's widest loads into several
  // independent accumulators: the bench's read-bandwidth test (ops.cpp, read_bandwidth).
  uint64_t (*read_sum)(const uint64_t* w, int64_t n);
};

const Impl* impl_generic();
const Impl* impl_avx2();
const Impl* impl_avx512();
const Impl* impl_avx512vnni();

// Whether the exact 4-bit kernels take several weight rows at once (default; the same bits either
// way): a switch for the tests and the bench's A/B of the two loops.
bool interleave_rows();
void set_interleave_rows(bool on);
// How far ahead (bytes; 0 = not at all) the exact 4- and 8-bit kernels prefetch each weight row
// (default 1024): a switch for the bench's A/B.
int64_t prefetch_bytes();
void set_prefetch_bytes(int64_t n);

// A persistent pool: blocks are handed out from one atomic counter, the caller works too.
int num_threads();
void set_num_threads(int n);
void parallel_for(int64_t nblocks, const std::function<void(int64_t)>& fn);
// How long (microseconds) an idle worker spins for the next dispatch before it sleeps.
int spin_us();
void set_spin_us(int us);

// The decode profile (bench.profile_decode --parts): while it is on, each part of our ops adds its
// wall time on the calling thread (a ScopedPart around it), and the pool counts its dispatches.
enum class Part : int { Norm, QKV, Rope, Attention, O, GateUp, SwiGLU, Down, Residual, Product,
                        Dequantize, KVWrite, Count };
bool profiling();
void profile_add(Part p, int64_t ns, int64_t cpu_ns);

// Resets the counters and starts counting; profile_stop stops and returns, per part,
// (name, (calls, wall ns, the calling thread's CPU ns)), then the pool's rows (counts, ns).
using ProfileRows = std::vector<std::pair<std::string, std::tuple<int64_t, int64_t, int64_t>>>;
void profile_start();
ProfileRows profile_stop();

struct ScopedPart {
  Part p;
  int64_t t0, c0;
  explicit ScopedPart(Part part);
  ~ScopedPart();
};

}  // namespace mlxchat
