// mlxchat's CPU primitives for MLX and their Python bindings (module _mlxchat_kernels).
//
// Each op is a CpuPrimitive (an MLX primitive, below): building it only adds a graph node;
// eval_cpu dispatches the work onto the stream's CPU thread through MLX's command encoder, as
// MLX's own CPU ops do, and the kernels there split it over our thread pool. fp32 activations only; the Python side
// (engine/kernels/ops.py) checks inputs and takes MLX's own ops for anything else.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <dlfcn.h>

#if defined(__linux__)
#include <sys/mman.h>
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1+; older headers lack the name
#endif
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "common.h"
#include "softmax.h"
#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace mlxchat {
namespace {

bool has_avx512() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

bool has_avx512vnni() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return has_avx512() && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

bool has_avx2() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

const Impl* g_impl = nullptr;

const Impl* impl() {
  if (!g_impl) {
#if defined(MLXCHAT_HAVE_X86_UNITS)
    g_impl = has_avx512vnni() ? impl_avx512vnni()
             : has_avx512()   ? impl_avx512()
             : has_avx2()     ? impl_avx2()
                              : impl_generic();
#else
    g_impl = impl_generic();
#endif
  }
  return g_impl;
}

// The units this CPU can run, fastest first (the default is the first).
std::vector<const Impl*> supported_impls() {
  std::vector<const Impl*> out;
#if defined(MLXCHAT_HAVE_X86_UNITS)
  if (has_avx512vnni()) out.push_back(impl_avx512vnni());
  if (has_avx512()) out.push_back(impl_avx512());
  if (has_avx2()) out.push_back(impl_avx2());
#endif
  out.push_back(impl_generic());
  return out;
}

std::vector<std::string> isas() {
  std::vector<std::string> names;
  for (const Impl* i : supported_impls()) names.push_back(i->name);
  return names;
}

// Runs the kernels on another supported unit (tests check every unit this CPU can run).
void set_isa(const std::string& name) {
  for (const Impl* i : supported_impls())
    if (name == i->name) {
      g_impl = i;
      return;
    }
  throw std::invalid_argument("this CPU cannot run the " + name + " kernels");
}

// A row-contiguous view of `a`'s data: its own, or a gathered copy in `tmp`, made a last-axis
// run at a time (a prompt chunk's q and k arrive transposed: (B, L, H, D) seen as (B, H, L, D)).
template <class T>
const T* contiguous_as(const mx::array& a, std::vector<T>& tmp) {
  if (a.flags().row_contiguous) return a.data<T>();
  tmp.resize(a.size());
  const T* src = a.data<T>();
  if (a.size() == 0) return tmp.data();
  const int64_t inner = a.ndim() ? a.shape(-1) : 1, step = a.ndim() ? a.strides(-1) : 1;
  for (int64_t r = 0, rows = int64_t(a.size()) / inner; r < rows; ++r) {
    const T* s = src + mx::elem_to_loc(int(r * inner), a.shape(), a.strides());
    T* d = tmp.data() + r * inner;
    if (step == 1)
      std::memcpy(d, s, sizeof(T) * size_t(inner));
    else
      for (int64_t i = 0; i < inner; ++i) d[i] = s[i * step];
  }
  return tmp.data();
}

const float* contiguous_f32(const mx::array& a, std::vector<float>& tmp) {
  return contiguous_as<float>(a, tmp);
}

SType stype(mx::Dtype t) {
  if (t == mx::float16) return SType::F16;
  if (t == mx::bfloat16) return SType::BF16;
  return SType::F32;
}

void alloc(mx::array& out) { out.set_data(mx::allocator::malloc(out.nbytes())); }

mx::Stream cpu_stream() {
  mx::Stream s = mx::to_stream(mx::StreamOrDevice{});
  if (s.device != mx::Device::cpu) throw std::invalid_argument("mlxchat kernels run on the CPU only");
  return s;
}

mx::array weak(const mx::array& a) { return mx::array::unsafe_weak_copy(a); }

// The base of every mlxchat op: an MLX primitive that runs on the CPU only. Building one only
// adds a graph node; eval_cpu allocates the outputs and dispatches the op's `task` onto the
// stream's CPU thread through MLX's command encoder, as MLX's own CPU ops do. The task runs after
// eval_cpu returns, so it gets weak copies of the arrays and captures the op's parameters by
// value (never `this`). Ops of one output shaped like their first input need only `task`,
// `name` and `is_equivalent`.
class CpuPrimitive : public mx::Primitive {
 public:
  using Arrays = std::vector<mx::array>;
  using Task = std::function<void(const Arrays& in, Arrays& out)>;

  explicit CpuPrimitive(mx::Stream s) : mx::Primitive(s) {}

  void eval_cpu(const Arrays& in, Arrays& outs) final {
    allocate_outputs(in, outs);
    auto& enc = mx::cpu::get_command_encoder(stream());
    Arrays ins, os;
    for (auto& a : in) {
      enc.set_input_array(a);
      ins.push_back(weak(a));
    }
    for (auto& a : outs) {
      enc.set_output_array(a);
      os.push_back(weak(a));
    }
    enc.dispatch([ins = std::move(ins), os = std::move(os), run = task()]() mutable { run(ins, os); });
  }
  void eval_gpu(const Arrays&, Arrays&) final {
    throw std::runtime_error("mlxchat kernels run on the CPU only");
  }
  std::vector<mx::Shape> output_shapes(const Arrays& in) override { return {in[0].shape()}; }

 protected:
  // An output's memory: MLX's allocator, unless the op keeps its own (Dequantize).
  virtual void allocate(mx::array& out) const { alloc(out); }
  // Every output's memory (before the task is dispatched): by default each one `allocate`s; an
  // op that writes into an input's buffer takes it over here (DecodeLayer).
  virtual void allocate_outputs(const Arrays& in, Arrays& outs) const {
    (void)in;
    for (auto& o : outs) allocate(o);
  }

  // The work, on the CPU thread: `in` and `out` as eval_cpu got them (outputs allocated).
  virtual Task task() const = 0;
};


// ------------------------------------------------------------------ plain kernels (one thread)

void rms_norm_rows(const float* x, const float* w, float eps, int64_t rows, int64_t D, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    float acc[8] = {};
    int64_t i = 0;
    for (; i + 8 <= D; i += 8)
      for (int j = 0; j < 8; ++j) acc[j] += xr[i + j] * xr[i + j];
    float ss = 0;
    for (int j = 0; j < 8; ++j) ss += acc[j];
    for (; i < D; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / float(D) + eps);
    for (int64_t k = 0; k < D; ++k) y[r * D + k] = (xr[k] * inv) * w[k];
  }
}

struct RopeParams {
  int dims;
  bool trad;
  float base, scale;
  bool operator==(const RopeParams&) const = default;
};

// cos and sin of positions offset + t (t < L) at each of the dims / 2 frequencies: cs and sn
// (L * dims / 2 floats each, position-major). The same fp32 steps as MLX's rope.
void rope_table(const RopeParams& p, int64_t L, int offset, float* cs, float* sn) {
  const int half = p.dims / 2;
  std::vector<float> inv(half);
  const float step = float(std::log(double(p.base)) / half);
  for (int i = 0; i < half; ++i) inv[i] = std::exp(float(-i) * step);
  for (int64_t t = 0; t < L; ++t) {
    const float pos = (float(t) + float(offset)) * p.scale;
    for (int i = 0; i < half; ++i) {
      const float th = pos * inv[i];
      cs[t * half + i] = std::cos(th);
      sn[t * half + i] = std::sin(th);
    }
  }
}

// Rows of D floats; row r takes the table's position r % L.
void rope_apply(const float* x, float* y, int64_t rows, int64_t L, int64_t D, const RopeParams& p,
                const float* cs, const float* sn) {
  const int half = p.dims / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    float* yr = y + r * D;
    const float* c = cs + (r % L) * half;
    const float* s = sn + (r % L) * half;
    for (int i = 0; i < half; ++i) {
      const int64_t a = p.trad ? 2 * i : i, b = p.trad ? 2 * i + 1 : i + half;
      const float x1 = xr[a], x2 = xr[b];
      yr[a] = x1 * c[i] - x2 * s[i];
      yr[b] = x1 * s[i] + x2 * c[i];
    }
    for (int64_t k = p.dims; k < D; ++k) yr[k] = xr[k];
  }
}

// Rows of D floats; row r sits at position offset + r % L.
void rope_rows(const float* x, float* y, int64_t rows, int64_t L, int64_t D, const RopeParams& p,
               int offset) {
  const int half = p.dims / 2;
  std::vector<float> cs(size_t(L) * half), sn(size_t(L) * half);
  rope_table(p, L, offset, cs.data(), sn.data());
  rope_apply(x, y, rows, L, D, p, cs.data(), sn.data());
}

// q and k of B batch rows, `hq` and `hk` heads of D floats each; batch row b sits at position
// offsets[b] (a batched cache's per-row offsets). One table per row serves its q and k.
void rope_qk_at(const float* q, float* qy, int64_t hq, const float* k, float* ky, int64_t hk,
                int64_t B, int64_t D, const RopeParams& p, const int32_t* offsets) {
  const int half = p.dims / 2;
  std::vector<float> cs(half), sn(half);
  for (int64_t b = 0; b < B; ++b) {
    rope_table(p, 1, offsets[b], cs.data(), sn.data());
    rope_apply(q + b * hq * D, qy + b * hq * D, hq, 1, D, p, cs.data(), sn.data());
    rope_apply(k + b * hk * D, ky + b * hk * D, hk, 1, D, p, cs.data(), sn.data());
  }
}

// K or V as (base pointer, strides of batch, head, position); last-axis stride 1. Either fp32
// rows of D floats (p), or the 8-bit KV cache's packed rows (q8, engine/kernels/kv8.py): per
// position D 8-bit codes (D / 4 uint32 words), then D / gs fp32 scales, then D / gs fp32 biases
// (MLX's affine quantization), value i = code[i] * scale[i / gs] + bias[i / gs]. Strides count
// floats or uint32 words.
struct KV {
  const float* p = nullptr;
  const uint32_t* q8 = nullptr;
  int64_t st[3] = {};
  int gs = 0;
};

// The group size of packed rows `width` words wide holding D values (0: not a valid packing).
int packed_group(int64_t width, int64_t D) {
  for (int gs : {32, 64, 128})
    if (D % gs == 0 && width == D / 4 + 2 * (D / gs)) return gs;
  return 0;
}

// One position's D fp32 values of one head as a packed 8-bit row (the KV8 cache's, kv8.py:
// D / 4 words of codes, then D / gs fp32 scales, then the biases), by MLX's affine quantization
// as its CPU `quantize` computes it, step for step (tests/test_kernels_fused_step.py: the whole
// buffers a fused step writes equal kv8.pack's, mx.quantize's, bit for bit):
// per group, the edge of larger magnitude maps to a whole code, scale and bias in fp32.
void pack_kv_row(const float* x, int64_t D, int gs, uint32_t* out) {
  constexpr float n_bins = 255.0f, eps = 1e-7f;
  uint8_t* codes = reinterpret_cast<uint8_t*>(out);
  float* scales = reinterpret_cast<float*>(out + D / 4);
  float* biases = scales + D / gs;
  for (int64_t g = 0; g < D / gs; ++g) {
    const float* w = x + g * gs;
    float w_min = std::numeric_limits<float>::infinity(), w_max = -w_min;
    for (int j = 0; j < gs; ++j) {
      w_max = std::max(w_max, w[j]);
      w_min = std::min(w_min, w[j]);
    }
    const bool mask = std::abs(w_min) > std::abs(w_max);
    float scale = std::max((w_max - w_min) / n_bins, eps);
    scale = mask ? scale : -scale;
    const float edge = mask ? w_min : w_max;
    const float q0 = std::rint(edge / scale);
    float bias = 0;
    if (q0 != 0) {
      scale = edge / q0;
      bias = edge;
    }
    for (int j = 0; j < gs; ++j) {
      const float q = std::rint((w[j] - bias) / scale);
      codes[g * gs + j] = uint8_t(std::min(std::max(q, 0.0f), n_bins));
    }
    scales[g] = scale;
    biases[g] = bias;
  }
}

template <class T>
KV strided_view(const mx::array& a, std::vector<T>& tmp, const T*& base) {
  KV v;
  if (a.strides(3) == 1) {
    base = a.data<T>();
    for (int i = 0; i < 3; ++i) v.st[i] = a.strides(i);
    return v;
  }
  base = contiguous_as<T>(a, tmp);
  v.st[2] = a.shape(3);
  v.st[1] = v.st[2] * a.shape(2);
  v.st[0] = v.st[1] * a.shape(1);
  return v;
}

// `a` (B, Hk, S, D floats or packed rows) as the kernels read it; `D` is the head dim.
KV kv_view(const mx::array& a, std::vector<float>& tmp, std::vector<uint32_t>& tmp8, int64_t D) {
  if (a.dtype() == mx::uint32) {
    const uint32_t* base;
    KV v = strided_view<uint32_t>(a, tmp8, base);
    v.q8 = base;
    v.gs = packed_group(a.shape(3), D);
    return v;
  }
  const float* base;
  KV v = strided_view<float>(a, tmp, base);
  v.p = base;
  return v;
}

// Head (b, hk)'s keys or values from t0 on, as fp32 rows (pointer to position 0, stride): its own
// rows, or packed ones dequantized into `buf`.
std::pair<const float*, int64_t> kv_rows(const KV& a, int64_t b, int64_t hk, int64_t t0, int64_t S,
                                         int64_t D, std::vector<float>& buf) {
  if (!a.q8) return {a.p + b * a.st[0] + hk * a.st[1], a.st[2]};
  if (int64_t(buf.size()) < S * D) buf.resize(size_t(S * D));
  impl()->dequant_kv(a.q8 + b * a.st[0] + hk * a.st[1], a.st[2], t0, S, D, a.gs, buf.data());
  return {buf.data(), D};
}

// K or V with packed rows as fp32 (B, Hk, S, D) in `buf` (split over the pool); fp32 as it is.
KV dense(const KV& a, int64_t B, int64_t Hk, int64_t S, int64_t D, std::vector<float>& buf) {
  if (!a.q8) return a;
  buf.resize(size_t(B * Hk * S * D));
  parallel_for(B * Hk, [&](int64_t r) {
    impl()->dequant_kv(a.q8 + (r / Hk) * a.st[0] + (r % Hk) * a.st[1], a.st[2], 0, S, D, a.gs,
               buf.data() + r * S * D);
  });
  KV v;
  v.p = buf.data();
  v.st[2] = D;
  v.st[1] = S * D;
  v.st[0] = Hk * S * D;
  return v;
}

float* scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (int64_t(buf.size()) < n) buf.resize(size_t(n));
  return buf.data();
}

// `R` queries (R heads sharing one KV head; query r at q + r * qs, not yet scaled) against keys
// t0..S-1 (t0 < S) of that KV head: output r (D floats, at y + r * ldy) = the softmax-weighted
// sum of the values. Decode and prefill attention both run it, so a position's output is the
// same either way, and each query's arithmetic is the same whatever R (common.h, attend).
void attend_heads(const Impl* I, int R, const float* q, int64_t qs, float scale, const float* kb,
                  int64_t ks, const float* vb, int64_t vs, int64_t t0, int64_t S, int64_t D,
                  float* y, int64_t ldy) {
  float* qd = scratch(R * (D + S));
  float* sc = qd + R * D;
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < D; ++i) qd[r * D + i] = q[r * qs + i] * scale;
  if (I->attend(qd, R, kb, ks, vb, vs, t0, S, D, sc, y, ldy)) return;
  for (int r = 0; r < R; ++r) {
    const float* qr = qd + r * D;
    float* yr = y + r * ldy;
    if (I->attend(qr, 1, kb, ks, vb, vs, t0, S, D, sc, yr, D)) continue;
    std::fill(yr, yr + D, 0.0f);
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = t0; t < S; ++t) {
      sc[t] = I->dot(qr, kb + t * ks, D);
      top = std::max(top, sc[t]);
    }
    float sum = 0;
    for (int64_t t = t0; t < S; ++t) sum += (sc[t] = std::exp(sc[t] - top));
    const float inv = 1.0f / sum;
    for (int64_t t = t0; t < S; ++t) I->axpy(sc[t] * inv, vb + t * vs, yr, D);
  }
}

// How many query heads of a GQA group one pass takes: the whole group where it is at most 4
// heads (it then fills the registers' use best), else one head at a time.
int64_t heads_per_pass(int64_t rep) { return rep <= 4 ? rep : 1; }

// Single-query attention: q (B, H, 1, D) contiguous, K/V (B, Hk, S, D; fp32, or packed 8-bit rows
// each pass dequantizes into its thread's buffer); y (B, H, 1, D). With
// `starts`, row b attends to keys starts[b]..S-1 only (a batched cache's left padding hidden, as
// mlx-lm's mask does); a row with no key left gets zeros. Each pass takes a KV head's query
// heads together (heads_per_pass), so its keys and values are read once for all of them.
void attention(const float* q, const KV& k, const KV& v, int64_t B, int64_t H, int64_t Hk,
               int64_t S, int64_t D, float scale, float* y, const int32_t* starts = nullptr) {
  const Impl* I = impl();
  const int64_t rep = H / Hk, R = heads_per_pass(rep), passes = H / R;
  parallel_for(B * passes, [&](int64_t p) {
    const int64_t b = p / passes, h = (p % passes) * R, hk = h / rep;
    const int64_t t0 = starts ? std::clamp<int64_t>(starts[b], 0, S) : 0;
    float* yr = y + (b * H + h) * D;
    if (t0 == S) {
      std::fill(yr, yr + R * D, 0.0f);
      return;
    }
    thread_local std::vector<float> kbuf, vbuf;  // an 8-bit cache's rows, dequantized
    const auto [kb, ks] = kv_rows(k, b, hk, t0, S, D, kbuf);
    const auto [vb, vs] = kv_rows(v, b, hk, t0, S, D, vbuf);
    attend_heads(I, int(R), q + (b * H + h) * D, D, scale, kb, ks, vb, vs, t0, S, D, yr, D);
  });
}

// Causal attention of L query positions (a prompt chunk) over S >= L keys whose last L are the
// chunk's own: q (B, H, L, D) contiguous, K/V (B, Hk, S, D); query i attends keys
// 0..S-L+i (mlx-lm's "causal" mask). y is (B, L, H, D): the layout o_proj reads, no transpose.
// With `starts` (a batched cache's left padding), row b's query i attends keys starts[b]..S-L+i
// (mlx-lm's mask for a BatchKVCache); a query that sees no key (a left-padded position) gets
// the mean of all S values, as MLX's attention gives where the mask hides every key.
// Each position runs attend_heads, as a decode step at that position does; the work is handed
// out in blocks of positions, longest first.
void prefill_attention(const float* q, const KV& k8, const KV& v8, int64_t B, int64_t H,
                       int64_t Hk, int64_t L, int64_t S, int64_t D, float scale, float* y,
                       const int32_t* starts = nullptr) {
  const Impl* I = impl();
  std::vector<float> kbuf, vbuf;  // an 8-bit cache's rows, dequantized once for all positions
  const KV k = dense(k8, B, Hk, S, D, kbuf), v = dense(v8, B, Hk, S, D, vbuf);
  const int64_t rep = H / Hk, R = heads_per_pass(rep), passes = H / R;
  const int64_t rows = 8, nblk = (L + rows - 1) / rows;
  parallel_for(B * passes * nblk, [&](int64_t t) {
    const int64_t blk = nblk - 1 - t % nblk, p = t / nblk, b = p / passes;
    const int64_t h = (p % passes) * R, hk = h / rep;
    const int64_t t0 = starts ? std::clamp<int64_t>(starts[b], 0, S) : 0;
    const float* kb = k.p + b * k.st[0] + hk * k.st[1];
    const float* vb = v.p + b * v.st[0] + hk * v.st[1];
    const float* mean = nullptr;  // the row's mean value, once a hidden position of this block has it
    for (int64_t i = blk * rows, e = std::min(L, i + rows); i < e; ++i) {
      float* yi = y + ((b * L + i) * H + h) * D;
      const int64_t end = S - L + i + 1;
      if (t0 < end) {
        attend_heads(I, int(R), q + ((b * H + h) * L + i) * D, L * D, scale, kb, k.st[2], vb,
                     v.st[2], t0, end, D, yi, D);
        continue;
      }
      if (mean == nullptr) {  // every key hidden: equal weights 1 / S over all of them
        std::fill(yi, yi + D, 0.0f);
        for (int64_t s = 0; s < S; ++s) I->axpy(1.0f / float(S), vb + s * v.st[2], yi, D);
        mean = yi;
      } else {
        std::copy(mean, mean + D, yi);
      }
      for (int64_t r = 1; r < R; ++r) std::copy(mean, mean + D, yi + r * D);
    }
  });
}

// g[i] = silu(g[i]) * u[i] for i < n, split over the pool in large blocks: a llama MLP's
// activation (the fused decode layer and prompt chunks run this same arithmetic).
void swiglu_rows(float* g, const float* u, int64_t n) {
  constexpr int64_t block = 16384;
  const auto body = [&](int64_t b) {
    for (int64_t i = b * block, e = std::min(n, i + block); i < e; ++i)
      g[i] = (g[i] * (1.0f / (1.0f + std::exp(-g[i])))) * u[i];
  };
  const int64_t nblocks = (n + block - 1) / block;
  if (nblocks == 1) body(0); else parallel_for(nblocks, body);
}

// ---------------------------------------------------------------- quantized matmul (x @ W.T)

// A quantized matrix's view; its arrays' gathered copies (if any were needed) live in `keep`.
struct QHold {
  std::vector<uint32_t> w;
  std::vector<uint16_t> s16, b16;
  std::vector<float> s32, b32;
};

QMat qmat(const mx::array& w, const mx::array& s, const mx::array& b, int gs, int bits, QHold& keep) {
  const SType st = stype(s.dtype());
  const void *sp, *bp;
  if (st == SType::F32) {
    sp = contiguous_as<float>(s, keep.s32);
    bp = contiguous_as<float>(b, keep.b32);
  } else {
    sp = contiguous_as<uint16_t>(s, keep.s16);
    bp = contiguous_as<uint16_t>(b, keep.b16);
  }
  return QMat{contiguous_as<uint32_t>(w, keep.w), sp, bp, st, w.shape(0),
              int64_t(w.shape(1)) * (32 / bits), bits, gs};
}

// Storage on 64-byte boundaries. The kernels read x's rows in 64-byte vectors, and one that
// straddles two cache lines costs two reads: with std::vector's 16-byte alignment, 4 rows of x
// through the bundled model's gate/up product (K = 576, one thread, weights in cache) took 5.8
// ns per 32 weights a row, 4.5 with x's rows aligned (one row: 2.2 and 2.1). Elements are left
// uninitialised (construct() with no value does nothing): prep_x / prep_x8 write all that the
// kernels read, and a product's buffers (8 rows of x, up to 48 KB on the bundled model) were
// zeroed at every call.
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    if constexpr (sizeof...(A) > 0) ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
    else ::new (static_cast<void*>(p)) U;
  }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
};
template <class T>
using vec64 = std::vector<T, Aligned64<T>>;

// x's rows (8 by default, the most a kernel call takes) as the kernels read them: fp32
// (reordered by prep_x) or, on the int8 path, two int8 limbs per value, per 32-element block, by
// prep_x8 (Q8Rows; q8(r) views them from row r on). On 64-byte boundaries (Aligned64), and so is
// each row where K is a multiple of 16 (every group size the kernels take).
struct XRows {
  bool int8;
  vec64<float> xp;
  vec64<int8_t> hi, lo;
  vec64<float> d, s, dl;
  int64_t ld = 0;

  XRows(bool int8, int64_t K, int64_t rows = 8) : int8(int8) {
    if (int8) {
      ld = q8_ld(K);
      hi.resize(size_t(rows * ld));
      lo.resize(size_t(rows * ld));
      d.resize(size_t(rows * ld / 32));
      s.resize(size_t(rows * ld / 32));
      dl.resize(size_t(rows * ld / 4));
    } else {
      xp.resize(size_t(rows * K));
    }
  }
  Q8Rows q8(int64_t r = 0) {
    return Q8Rows{hi.data() + r * ld, lo.data() + r * ld, d.data() + r * (ld / 32),
                  s.data() + r * (ld / 32), dl.data() + r * (ld / 4), ld};
  }
  void prep(const Impl* I, const QMat& W, const float* x, int M) {
    if (int8)
      I->prep_x8(W, x, M, q8());
    else
      I->prep_x(W, x, M, xp.data());
  }
  void rows(const Impl* I, const QMat& W, int M, int64_t n0, int64_t n1, float* y, int64_t ldy) {
    if (int8)
      I->qmv_rows_q8(W, q8(), M, n0, n1, y, ldy);
    else
      I->qmv_rows(W, xp.data(), M, n0, n1, y, ldy);
  }
};

// A prompt chunk's product on the int8 path: x's rows quantized once (8 at a time over the pool),
// then each block of W's rows (kQ8WeightBlock bytes, so it stays in L2) meets every 8 rows of x
// in turn, so W is read from memory once, not once per 8 rows. Each (x row, weight row) is the
// same arithmetic as in a decode step's product (qmv_rows_q8), whatever the chunk.
constexpr int64_t kQ8WeightBlock = int64_t(192) << 10;

void run_qmm_q8_chunk(const float* x, int64_t rows, const QMat& W, float* y) {
  const Impl* I = impl();
  const int64_t N = W.N, K = W.K;
  XRows xr(true, K, rows);
  parallel_for((rows + 7) / 8, [&](int64_t g) {
    I->prep_x8(W, x + g * 8 * K, int(std::min<int64_t>(8, rows - g * 8)), xr.q8(g * 8));
  });
  const int64_t per = std::max<int64_t>(16, kQ8WeightBlock / (K * W.bits / 8) / 16 * 16);
  parallel_for((N + per - 1) / per, [&](int64_t b) {
    const int64_t n0 = b * per, n1 = std::min(N, n0 + per);
    for (int64_t r0 = 0; r0 < rows; r0 += 8)
      I->qmv_rows_q8(W, xr.q8(r0), int(std::min<int64_t>(8, rows - r0)), n0, n1, y + r0 * N, N);
  });
}

void run_qmm(const float* x, int64_t rows, const QMat& W, float* y, bool int8) {
  if (int8 && rows > 8) return run_qmm_q8_chunk(x, rows, W, y);
  const Impl* I = impl();
  const int64_t N = W.N, K = W.K;
  const int threads = num_threads();
  const int64_t nblocks = std::max<int64_t>(1, std::min<int64_t>(N / 16, int64_t(threads) * 8));
  const int64_t per = (N + nblocks - 1) / nblocks;
  XRows xr(int8, K);
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const int M = int(std::min<int64_t>(8, rows - r0));
    xr.prep(I, W, x + r0 * K, M);
    float* yr = y + r0 * N;
    parallel_for(nblocks, [&](int64_t b) {
      const int64_t n0 = b * per, n1 = std::min(N, n0 + per);
      if (n0 < n1) xr.rows(I, W, M, n0, n1, yr, N);
    });
  }
}

// y_i = x @ W_i.T for several matrices sharing x (K columns): one parallel_for over all rows.
void run_qmm_multi(const float* x, int64_t rows, const std::vector<QMat>& Ws,
                   const std::vector<float*>& ys, bool int8) {
  const Impl* I = impl();
  const int64_t K = Ws[0].K;
  int64_t total = 0;
  for (auto& W : Ws) total += W.N;
  const int threads = num_threads();
  const int64_t nblocks = std::max<int64_t>(1, std::min<int64_t>(total / 16, int64_t(threads) * 8));
  const int64_t per = (total + nblocks - 1) / nblocks;
  XRows xr(int8, K);
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const int M = int(std::min<int64_t>(8, rows - r0));
    xr.prep(I, Ws[0], x + r0 * K, M);
    parallel_for(nblocks, [&](int64_t b) {
      int64_t n0 = b * per, n1 = std::min(total, n0 + per);
      for (size_t i = 0; i < Ws.size() && n0 < n1; ++i) {  // the block may span two matrices
        const int64_t N = Ws[i].N;
        if (n0 < N) {
          const int64_t e = std::min(N, n1);
          xr.rows(I, Ws[i], M, n0, e, ys[i] + r0 * N, N);
          n0 = e;
        }
        n0 -= N;
        n1 -= N;
      }
    });
  }
}

// The shape of x @ W.T: x's, its last axis W's rows.
mx::Shape product_shape(const mx::array& x, const mx::array& w) {
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return shape;
}

// An op on one quantized matrix (w, scales, biases) of a group size and bit width: equivalent to
// another of its kind with the same two.
class QuantizedPrimitive : public CpuPrimitive {
 public:
  QuantizedPrimitive(mx::Stream s, int gs, int bits) : CpuPrimitive(s), gs_(gs), bits_(bits) {}
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QuantizedPrimitive&>(other);
    return gs_ == o.gs_ && bits_ == o.bits_;
  }

 protected:
  int64_t unpacked(const mx::array& w) const { return w.shape(1) * (32 / bits_); }  // W's columns
  int gs_, bits_;
};

class QMatmul : public QuantizedPrimitive {
 public:
  QMatmul(mx::Stream s, int gs, int bits, bool int8) : QuantizedPrimitive(s, gs, bits), int8_(int8) {}

  Task task() const override {
    return [gs = gs_, bits = bits_, int8 = int8_](const Arrays& in, Arrays& out) {
      const auto &x = in[0];
      std::vector<float> tmp;
      QHold keep;
      const float* xd = contiguous_f32(x, tmp);
      ScopedPart part(Part::Product);
      run_qmm(xd, int64_t(x.size()) / x.shape(-1), qmat(in[1], in[2], in[3], gs, bits, keep),
              out[0].data<float>(), int8);
    };
  }
  const char* name() const override { return int8_ ? "MlxchatQuantizedMatmulInt8" : "MlxchatQuantizedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return QuantizedPrimitive::is_equivalent(other) && int8_ == static_cast<const QMatmul&>(other).int8_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {product_shape(in[0], in[1])};
  }

 private:
  bool int8_;
};

void check_quantized(int64_t K, const mx::array& w, const mx::array& s, const mx::array& b, int gs,
                     int bits) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("bits must be 4 or 8");
  if (gs != 32 && gs != 64 && gs != 128) throw std::invalid_argument("group size must be 32, 64 or 128");
  if (w.dtype() != mx::uint32 || w.ndim() != 2) throw std::invalid_argument("w must be 2-D uint32");
  if (K % gs != 0 || w.shape(1) * (32 / bits) != K)
    throw std::invalid_argument("x's last dimension does not match the packed weight");
  if (s.shape() != b.shape() || s.ndim() != 2 || s.shape(0) != w.shape(0) || s.shape(1) != K / gs)
    throw std::invalid_argument("scales/biases do not match the weight");
  if (s.dtype() != b.dtype() ||
      (s.dtype() != mx::float32 && s.dtype() != mx::float16 && s.dtype() != mx::bfloat16))
    throw std::invalid_argument("scales/biases must be float32, float16 or bfloat16");
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& s,
                           const mx::array& b, int gs, int bits, bool int8) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("x must be float32");
  check_quantized(x.shape(-1), w, s, b, gs, bits);
  return mx::array(product_shape(x, w), mx::float32,
                   std::make_shared<QMatmul>(cpu_stream(), gs, bits, int8), {x, w, s, b});
}

// ------------------------------------------ dequantize (a whole weight to fp32: bench and tests)

// Prompt products ran `x @ dequantize(W).T` until issue 32; they now run prefill_matmul (below),
// which never holds a whole fp32 weight. `dequantize` stays for bench.profile_decode and
// bench.prefill_memory's `old` product.
// Reused output buffers for large, short-lived results (a prompt chunk's dequantized weights: 64 MB
// for a 1B model's MLP matrix). MLX's CPU allocator hands memory back to the OS on free, and
// fresh memory costs a page fault and a zeroed page per 4 KB: ~0.7 ms a MB here, ten times the
// dequantization itself. Buffers come from MLX's allocator and go back into this cache when
// their array dies (exact sizes: a model's layers repeat their shapes), up to kHeld bytes
// kept; never destroyed, so arrays that outlive the module's statics still find it. A decode
// step (AttnIn, DecodeAttention, DecodeLayer) hands them all back (`release`, one atomic read
// when none is kept, as in the engine, whose prompts no longer call `dequantize`): up to 512 MB
// that the resident-memory goal (weights + 0.6 GB) has no room for while tokens are generated.
class BufferCache {
 public:
  static constexpr size_t kHeld = size_t(512) << 20;

  // Frees every kept buffer (cheap when none is kept: one atomic read).
  void release() {
    if (!held_any_.load(std::memory_order_relaxed)) return;
    std::vector<std::pair<size_t, mx::allocator::Buffer>> gone;
    {
      std::lock_guard<std::mutex> lk(mu_);
      gone.swap(free_);
      held_ = 0;
      held_any_.store(false, std::memory_order_relaxed);
    }
    for (auto& [n, b] : gone) mx::allocator::allocator().free(b);
  }

  size_t held() {
    std::lock_guard<std::mutex> lk(mu_);
    return held_;
  }

  void give_to(mx::array& out) {
    const size_t n = out.nbytes();
    mx::allocator::Buffer buf{nullptr};
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (size_t i = 0; i < free_.size(); ++i)
        if (free_[i].first == n) {
          buf = free_[i].second;
          free_.erase(free_.begin() + i);
          held_ -= n;
          break;
        }
    }
    if (!buf.ptr()) buf = mx::allocator::allocator().malloc(n);
    out.set_data(mx::allocator::Data(buf, [this, n](mx::allocator::Buffer b) { take_back(n, b); }));
  }

  static BufferCache& get() {
    static BufferCache* cache = new BufferCache();
    return *cache;
  }

 private:
  void take_back(size_t n, mx::allocator::Buffer b) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (held_ + n <= kHeld) {
        free_.emplace_back(n, b);
        held_ += n;
        held_any_.store(true, std::memory_order_relaxed);
        return;
      }
    }
    mx::allocator::allocator().free(b);
  }

  std::mutex mu_;
  std::vector<std::pair<size_t, mx::allocator::Buffer>> free_;
  size_t held_ = 0;
  std::atomic<bool> held_any_{false};
};

// W as fp32 rows (prompt chunks then run BLAS on them). From 32 MB of output on (a 1B model's MLP
// matrices) it is split over the pool in blocks of about 1 MB: at load 8 here, 64 MB took 16 ms
// on two threads against 19 on one (medians of 10, A/B), while 16 MB took 1.3 against 1.1 ms
// (the workers' wake-up, and one of them descheduled mid-block, cost more than the split saves).
void dequantize_rows(const QMat& W, float* out) {
  const Impl* I = impl();
  if (W.N * W.K * int64_t(sizeof(float)) < (int64_t(32) << 20)) return I->dequant_rows(W, 0, W.N, out);
  const int64_t rows = std::max<int64_t>(1, (int64_t(1) << 18) / W.K);  // ~1 MB of fp32 a block
  const int64_t nblocks = (W.N + rows - 1) / rows;
  parallel_for(nblocks, [&](int64_t b) { I->dequant_rows(W, b * rows, std::min(W.N, (b + 1) * rows), out); });
}

class Dequantize : public QuantizedPrimitive {
 public:
  using QuantizedPrimitive::QuantizedPrimitive;
  Task task() const override {
    return [gs = gs_, bits = bits_](const Arrays& in, Arrays& out) {
      QHold keep;
      const QMat W = qmat(in[0], in[1], in[2], gs, bits, keep);
      ScopedPart part(Part::Dequantize);
      dequantize_rows(W, out[0].data<float>());
    };
  }
  void allocate(mx::array& out) const override { BufferCache::get().give_to(out); }
  const char* name() const override { return "MlxchatDequantize"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {{in[0].shape(0), int(unpacked(in[0]))}};
  }
};

// A quantized table's columns (w's unpacked), after check_quantized on them.
int check_table(const mx::array& w, const mx::array& s, const mx::array& b, int gs, int bits) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("bits must be 4 or 8");
  const int64_t K = int64_t(w.ndim() == 2 ? w.shape(1) : 0) * (32 / bits);
  check_quantized(K, w, s, b, gs, bits);
  return int(K);
}

mx::array dequantize(const mx::array& w, const mx::array& s, const mx::array& b, int gs, int bits) {
  return mx::array({w.shape(0), check_table(w, s, b, gs, bits)}, mx::float32,
                   std::make_shared<Dequantize>(cpu_stream(), gs, bits), {w, s, b});
}

// -------------------------------------------- embedding lookup (rows of a quantized table)

// Row `id` of W (N, K) as fp32 into out (K floats): code * scale, then + bias, two roundings as
// mx.dequantize does (no fused multiply-add: this file is built without FMA). A negative id
// counts from the end (as MLX's indexing does); one outside the table gives zeros.
void embedding_row(const QMat& W, int64_t id, float* out) {
  if (id < 0) id += W.N;
  if (id < 0 || id >= W.N) return std::fill(out, out + W.K, 0.0f);
  const int64_t groups = W.K / W.gs, per_word = 32 / W.bits;
  const uint32_t mask = (1u << W.bits) - 1;
  const uint32_t* w = W.w + id * (W.K / per_word);
  for (int64_t g = 0; g < groups; ++g) {
    const float sc = load_scalar(W.scales, W.st, id * groups + g);
    const float bi = load_scalar(W.biases, W.st, id * groups + g);
    for (int64_t k = g * W.gs, e = k + W.gs; k < e; ++k) {
      const float scaled = float((w[k / per_word] >> (W.bits * (k % per_word))) & mask) * sc;
      out[k] = scaled + bi;
    }
  }
}

template <class T>
void embedding_rows(const mx::array& ids, const QMat& W, float* out) {
  std::vector<T> tmp;
  const T* p = contiguous_as<T>(ids, tmp);
  for (size_t i = 0; i < ids.size(); ++i) embedding_row(W, int64_t(p[i]), out + int64_t(i) * W.K);
}

class EmbeddingRows : public QuantizedPrimitive {
 public:
  using QuantizedPrimitive::QuantizedPrimitive;
  Task task() const override {
    return [gs = gs_, bits = bits_](const Arrays& in, Arrays& out) {
      QHold keep;
      const QMat W = qmat(in[1], in[2], in[3], gs, bits, keep);
      float* y = out[0].data<float>();
      const auto& ids = in[0];
      if (ids.dtype() == mx::int32) embedding_rows<int32_t>(ids, W, y);
      else if (ids.dtype() == mx::uint32) embedding_rows<uint32_t>(ids, W, y);
      else if (ids.dtype() == mx::int64) embedding_rows<int64_t>(ids, W, y);
      else embedding_rows<uint64_t>(ids, W, y);
    };
  }
  const char* name() const override { return "MlxchatEmbedding"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {rows_shape(in[0], int(unpacked(in[1])))};
  }

  // ids.shape + (K,)
  static mx::Shape rows_shape(const mx::array& ids, int K) {
    auto shape = ids.shape();
    shape.push_back(K);
    return shape;
  }
};

// The rows `ids` (any shape, 32- or 64-bit integers) of the quantized table (w, scales, biases)
// as float32: ids.shape + (K,). One op for what gathering and mx.dequantize take ~35 graph nodes.
mx::array embedding(const mx::array& ids, const mx::array& w, const mx::array& s,
                    const mx::array& b, int gs, int bits) {
  const auto t = ids.dtype();
  if (t != mx::int32 && t != mx::uint32 && t != mx::int64 && t != mx::uint64)
    throw std::invalid_argument("ids must be 32- or 64-bit integers");
  return mx::array(EmbeddingRows::rows_shape(ids, check_table(w, s, b, gs, bits)), mx::float32,
                   std::make_shared<EmbeddingRows>(cpu_stream(), gs, bits), {ids, w, s, b});
}

// ------------------------------------ prompt products: a tile of W dequantized at a time, then BLAS

// cblas_sgemm of the BLAS this process has loaded (the preloaded OpenBLAS; looked up once, by
// name, so the extension links no BLAS of its own), or null.
using Sgemm = void (*)(int order, int ta, int tb, int M, int N, int K, float alpha, const float* A,
                       int lda, const float* B, int ldb, float beta, float* C, int ldc);
Sgemm sgemm() {
  static const Sgemm f = reinterpret_cast<Sgemm>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  return f;
}

// A prompt product's tile: kTileRows rows of W (or all N when fewer) by as many columns as
// g_tile_bytes of fp32 holds (a multiple of the group size, at most K). Each BLAS call packs its
// share of x (M x the tile's columns) anew, once per tile of rows: at 144-256 rows a tile (8 MB
// of a K = 8192-14336 weight) that repacking cost 10-25% of the product here, at 1,024 rows ~2%.
constexpr int64_t kTileRows = 1024;
std::atomic<int64_t> g_tile_bytes{int64_t(8) << 20};  // set_prefill_tile_bytes

std::pair<int64_t, int64_t> tile_shape(int64_t N, int64_t K, int gs) {
  const int64_t rows = std::min(N, kTileRows);
  const int64_t cols = g_tile_bytes.load() / (rows * int64_t(sizeof(float))) / gs * gs;
  return {rows, std::clamp<int64_t>(cols, gs, K)};
}

// W's rows n0..n1-1 and columns k0..k0+cols-1 as a matrix of their own (cols a multiple of the
// group size), for dequant_rows one row at a time: its w, scales and biases start at row n0,
// column k0, and a one-row view's row stride is never read.
QMat slice(const QMat& W, int64_t n0, int64_t n1, int64_t k0, int64_t cols) {
  const int64_t groups = W.K / W.gs, sbytes = W.st == SType::F32 ? 4 : 2;
  const int64_t at = n0 * groups + k0 / W.gs;
  QMat S = W;
  S.w = W.w + n0 * (W.K * W.bits / 32) + k0 * W.bits / 32;
  S.scales = static_cast<const char*>(W.scales) + at * sbytes;
  S.biases = static_cast<const char*>(W.biases) + at * sbytes;
  S.N = n1 - n0;
  S.K = cols;
  return S;
}

// The bytes every thread's TileBuffer holds (prefill_buffer_bytes).
std::atomic<int64_t> g_tile_held{0};

// A thread's reused tile of n fp32 values: kept while it is large enough and no larger than
// `bound` (the tile size) or n, else given back and taken again at n.
struct TileBuffer {
  std::vector<float> v;
  float* take(int64_t n, int64_t bound) {
    if (int64_t(v.size()) < n || int64_t(v.size()) > std::max(n, bound)) {
      g_tile_held -= int64_t(v.capacity() * sizeof(float));
      std::vector<float>().swap(v);
      v.resize(size_t(n));
      g_tile_held += int64_t(v.capacity() * sizeof(float));
    }
    return v.data();
  }
  ~TileBuffer() { g_tile_held -= int64_t(v.capacity() * sizeof(float)); }
};

// y (M, N) = x (M, K) @ W.T for a prompt chunk, W never whole in fp32: tile after tile of W
// (tile_shape) is dequantized over the pool into one reused buffer (the calling thread's:
// 8 MB by default, whatever the model) and multiplied with BLAS (its own threads) into y's
// columns of that tile, the column blocks of one tile of rows summed into them. The
// dequantization is the exact q * scale + bias of `dequantize`.
void prefill_product(const float* x, int64_t M, const QMat& W, float* y) {
  const Impl* I = impl();
  const int64_t K = W.K, N = W.N;
  const auto [T, C] = tile_shape(N, K, W.gs);
  thread_local TileBuffer tile;
  // the pool's threads write to buf (`tile` names each thread's own)
  float* buf = tile.take(T * C, g_tile_bytes.load() / int64_t(sizeof(float)));
  const int64_t block = std::max<int64_t>(1, (int64_t(1) << 18) / C);  // ~1 MB of fp32 a block
  for (int64_t n0 = 0; n0 < N; n0 += T) {
    const int64_t rows = std::min(T, N - n0);
    for (int64_t k0 = 0; k0 < K; k0 += C) {
      const int64_t cols = std::min(C, K - k0);
      {
        ScopedPart part(Part::Dequantize);
        parallel_for((rows + block - 1) / block, [&](int64_t b) {
          for (int64_t r = b * block, e = std::min(rows, r + block); r < e; ++r)
            I->dequant_rows(slice(W, n0 + r, n0 + r + 1, k0, cols), 0, 1, buf + r * cols);
        });
      }
      ScopedPart part(Part::Product);
      sgemm()(101 /* row major */, 111 /* x as is */, 112 /* the tile transposed */, int(M),
              int(rows), int(cols), 1.0f, x + k0, int(K), buf, int(cols), k0 ? 1.0f : 0.0f,
              y + n0, int(N));
    }
  }
}

class PrefillMatmul : public QuantizedPrimitive {
 public:
  using QuantizedPrimitive::QuantizedPrimitive;

  Task task() const override {
    return [gs = gs_, bits = bits_](const Arrays& in, Arrays& out) {
      const auto& x = in[0];
      std::vector<float> tmp;
      QHold keep;
      prefill_product(contiguous_f32(x, tmp), int64_t(x.size()) / x.shape(-1),
                      qmat(in[1], in[2], in[3], gs, bits, keep), out[0].data<float>());
    };
  }
  const char* name() const override { return "MlxchatPrefillMatmul"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {product_shape(in[0], in[1])};
  }
};

mx::array prefill_matmul(const mx::array& x, const mx::array& w, const mx::array& s,
                         const mx::array& b, int gs, int bits) {
  if (!sgemm()) throw std::runtime_error("no cblas_sgemm is loaded in this process");
  if (x.dtype() != mx::float32) throw std::invalid_argument("x must be float32");
  check_quantized(x.shape(-1), w, s, b, gs, bits);
  return mx::array(product_shape(x, w), mx::float32,
                   std::make_shared<PrefillMatmul>(cpu_stream(), gs, bits), {x, w, s, b});
}

// ------------------------------------------------------- SwiGLU (a llama MLP's activation)

class SwiGLU : public CpuPrimitive {
 public:
  explicit SwiGLU(mx::Stream s) : CpuPrimitive(s) {}
  Task task() const override {
    return [](const Arrays& in, Arrays& out) {
      std::vector<float> tg, tu;
      const auto& g = in[0];
      const float* gd = contiguous_f32(g, tg);
      float* y = out[0].data<float>();
      ScopedPart part(Part::SwiGLU);
      std::copy(gd, gd + g.size(), y);
      swiglu_rows(y, contiguous_f32(in[1], tu), int64_t(g.size()));
    };
  }
  const char* name() const override { return "MlxchatSwiGLU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// silu(gate) * up, float32 arrays of one shape.
mx::array swiglu(const mx::array& gate, const mx::array& up) {
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32 || gate.shape() != up.shape())
    throw std::invalid_argument("gate and up must be float32 arrays of one shape");
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLU>(cpu_stream()), {gate, up});
}

// ------------------------------------------------------------------------------- RMSNorm

class RMSNorm : public CpuPrimitive {
 public:
  RMSNorm(mx::Stream s, float eps) : CpuPrimitive(s), eps_(eps) {}
  Task task() const override {
    return [eps = eps_](const Arrays& in, Arrays& out) {
      std::vector<float> t0, t1;
      const auto& x = in[0];
      const float* xd = contiguous_f32(x, t0);
      const float* wd = contiguous_f32(in[1], t1);
      const int64_t D = x.shape(-1);
      ScopedPart part(Part::Norm);
      rms_norm_rows(xd, wd, eps, int64_t(x.size()) / D, D, out[0].data<float>());
    };
  }
  const char* name() const override { return "MlxchatRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RMSNorm&>(other).eps_;
  }

 private:
  float eps_;
};

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps) {
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32) throw std::invalid_argument("float32 only");
  if (w.ndim() != 1 || w.shape(0) != x.shape(-1)) throw std::invalid_argument("weight must be (D,)");
  return mx::array(x.shape(), mx::float32, std::make_shared<RMSNorm>(cpu_stream(), eps), {x, w});
}

// ------------------------------------------------ log-softmax (softmax.cpp: MLX's, bit for bit)

// x - logsumexp(x, axis=-1, keepdims=True) of fp32 rows, identical to MLX's ops.
class LogSoftmax : public CpuPrimitive {
 public:
  explicit LogSoftmax(mx::Stream s) : CpuPrimitive(s) {}
  Task task() const override {
    return [isa = impl()->name](const Arrays& in, Arrays& out) {
      std::vector<float> t;
      const int64_t n = in[0].shape(-1);
      log_softmax_rows(contiguous_f32(in[0], t), out[0].data<float>(), int64_t(in[0].size()) / n, n,
                       isa);
    };
  }
  const char* name() const override { return "MlxchatLogSoftmax"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  static mx::array of(const mx::array& x) {
    if (x.dtype() != mx::float32 || x.ndim() == 0 || x.size() == 0)
      throw std::invalid_argument("x must be a non-empty float32 array of at least one axis");
    return mx::array(x.shape(), mx::float32, std::make_shared<LogSoftmax>(cpu_stream()), {x});
  }
};

// A batched step's per-row int32 vector (offsets or first valid keys): (B,) int32.
void check_rows(const std::optional<mx::array>& a, int64_t B, const char* what) {
  if (a && (a->dtype() != mx::int32 || a->ndim() != 1 || a->shape(0) != B))
    throw std::invalid_argument(std::string(what) + " must be a (batch,) int32 array");
}

// ---------------------------------------------------------------------------------- RoPE

class RoPE : public CpuPrimitive {
 public:
  RoPE(mx::Stream s, int dims, bool traditional, float base, float scale, int offset, bool rows)
      : CpuPrimitive(s), dims_(dims), trad_(traditional), base_(base), scale_(scale),
        offset_(offset), rows_(rows) {}
  Task task() const override {
    return [p = RopeParams{dims_, trad_, base_, scale_}, offset = offset_, rows = rows_](
               const Arrays& in, Arrays& out) {
      std::vector<float> tmp;
      std::vector<int32_t> to;
      const auto& x = in[0];
      const float* xd = contiguous_f32(x, tmp);
      const int64_t D = x.shape(-1), L = x.shape(-2), n = int64_t(x.size()) / D;
      float* y = out[0].data<float>();
      ScopedPart part(Part::Rope);
      if (!rows) {
        rope_rows(xd, y, n, L, D, p, offset);
        return;
      }
      // batch row b (x's first axis) at positions offsets[b] + t: its own table
      const int32_t* offsets = contiguous_as<int32_t>(in[1], to);
      const int64_t B = x.shape(0), per = n / B;
      for (int64_t b = 0; b < B; ++b)
        rope_rows(xd + b * per * D, y + b * per * D, per, L, D, p, offset + offsets[b]);
    };
  }
  const char* name() const override { return "MlxchatRoPE"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RoPE&>(other);
    return dims_ == o.dims_ && trad_ == o.trad_ && base_ == o.base_ && scale_ == o.scale_ &&
           offset_ == o.offset_ && rows_ == o.rows_;
  }

 private:
  int dims_;
  bool trad_;
  float base_, scale_;
  int offset_;
  bool rows_;
};

// x (..., L, D) at positions offset + t; with `offsets` ((B,) int32, x's first axis B), batch row
// b at offset + offsets[b] + t (a batched cache's per-row offsets, as MLX's rope takes them).
mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale, int offset,
               const std::optional<mx::array>& offsets) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("float32 only");
  if (x.ndim() < 2 || dims <= 0 || dims % 2 || dims > x.shape(-1))
    throw std::invalid_argument("bad rope dims");
  if (offsets && x.ndim() < 3) throw std::invalid_argument("per-row offsets need a batch axis");
  check_rows(offsets, x.shape(0), "offsets");
  std::vector<mx::array> inputs{x};
  if (offsets) inputs.push_back(*offsets);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<RoPE>(cpu_stream(), dims, traditional, base, scale, offset,
                                          bool(offsets)),
                   inputs);
}

// ------------------------------------------------ single-query attention over the KV cache

class DecodeAttention : public CpuPrimitive {
 public:
  DecodeAttention(mx::Stream s, float scale, bool starts)
      : CpuPrimitive(s), scale_(scale), starts_(starts) {}
  Task task() const override {
    return [scale = scale_, starts = starts_](const Arrays& in, Arrays& out) {
      const auto &q = in[0], &k = in[1], &v = in[2];
      std::vector<float> tq, tk, tv;
      std::vector<uint32_t> tk8, tv8;
      std::vector<int32_t> ts;
      const float* qd = contiguous_f32(q, tq);
      const int64_t D = q.shape(3);
      const KV kv = kv_view(k, tk, tk8, D), vv = kv_view(v, tv, tv8, D);
      BufferCache::get().release();  // a decode step: what `dequantize` kept goes back
      ScopedPart part(Part::Attention);
      attention(qd, kv, vv, q.shape(0), q.shape(1), k.shape(1), k.shape(2), D, scale,
                out[0].data<float>(), starts ? contiguous_as<int32_t>(in[3], ts) : nullptr);
    };
  }
  const char* name() const override { return "MlxchatDecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const DecodeAttention&>(other);
    return scale_ == o.scale_ && starts_ == o.starts_;
  }

 private:
  float scale_;
  bool starts_;
};

// q (B, H, L, D) float32; k and v (B, Hk, S, D) float32 or (B, Hk, S, W) uint32 packed 8-bit
// rows (KV above) of one width; H a multiple of Hk.
void check_attention(const mx::array& q, const mx::array& k, const mx::array& v) {
  if (q.dtype() != mx::float32 || q.ndim() != 4) throw std::invalid_argument("q must be 4-D float32");
  for (auto* a : {&k, &v})
    if ((a->dtype() != mx::float32 && a->dtype() != mx::uint32) || a->ndim() != 4)
      throw std::invalid_argument("k and v must be 4-D float32 or packed 8-bit rows (uint32)");
  if (k.shape() != v.shape() || k.dtype() != v.dtype() || k.shape(0) != q.shape(0) ||
      q.shape(1) % k.shape(1) != 0)
    throw std::invalid_argument("q, k, v shapes do not match");
  if (k.dtype() == mx::float32 ? k.shape(3) != q.shape(3) : !packed_group(k.shape(3), q.shape(3)))
    throw std::invalid_argument("k and v rows do not hold q's head dimension");
}

mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                           const std::optional<mx::array>& starts) {
  check_attention(q, k, v);
  if (q.shape(2) != 1) throw std::invalid_argument("one query position only");
  check_rows(starts, q.shape(0), "starts");
  std::vector<mx::array> inputs{q, k, v};
  if (starts) inputs.push_back(*starts);
  return mx::array(q.shape(), mx::float32,
                   std::make_shared<DecodeAttention>(cpu_stream(), scale, bool(starts)), inputs);
}


class PrefillAttention : public CpuPrimitive {
 public:
  PrefillAttention(mx::Stream s, float scale, bool starts)
      : CpuPrimitive(s), scale_(scale), starts_(starts) {}
  Task task() const override {
    return [scale = scale_, starts = starts_](const Arrays& in, Arrays& out) {
      const auto &q = in[0], &k = in[1], &v = in[2];
      std::vector<float> tq, tk, tv;
      std::vector<uint32_t> tk8, tv8;
      std::vector<int32_t> ts;
      const float* qd = contiguous_f32(q, tq);
      const int64_t D = q.shape(3);
      const KV kv = kv_view(k, tk, tk8, D), vv = kv_view(v, tv, tv8, D);
      prefill_attention(qd, kv, vv, q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2), D,
                        scale, out[0].data<float>(),
                        starts ? contiguous_as<int32_t>(in[3], ts) : nullptr);
    };
  }
  const char* name() const override { return "MlxchatPrefillAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const PrefillAttention&>(other);
    return scale_ == o.scale_ && starts_ == o.starts_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {{in[0].shape(0), in[0].shape(2), in[0].shape(1) * in[0].shape(3)}};
  }

 private:
  float scale_;
  bool starts_;
};

// q (B, H, L, D), k and v (B, Hk, S, D) float32 with S >= L -> (B, L, H * D); `starts` (B,)
// int32: each row's first visible key (a batched cache's left padding).
mx::array prefill_attention_op(const mx::array& q, const mx::array& k, const mx::array& v,
                               float scale, const std::optional<mx::array>& starts) {
  check_attention(q, k, v);
  if (k.shape(2) < q.shape(2)) throw std::invalid_argument("fewer keys than query positions");
  check_rows(starts, q.shape(0), "starts");
  std::vector<mx::array> inputs{q, k, v};
  if (starts) inputs.push_back(*starts);
  return mx::array({q.shape(0), q.shape(2), q.shape(1) * q.shape(3)}, mx::float32,
                   std::make_shared<PrefillAttention>(cpu_stream(), scale, bool(starts)), inputs);
}

// ------------------------------------------- a llama decoder layer's one-token step, in two ops
//
// attn_in:  q, k, v = rope(norm(h) @ Wq.T), rope(norm(h) @ Wk.T), norm(h) @ Wv.T
// (the caller appends k and v to its KV cache, then)
// block_out: h1 = h + attention(q, K, V) @ Wo.T;  out = h1 + mlp(norm2(h1))
// with mlp(x) = (silu(x @ Wg.T) * (x @ Wu.T)) @ Wd.T. Each step is the same kernel, in the same
// order, as the single ops above; only the graph nodes between them are gone.

struct QSpec {
  int gs, bits;
  bool int8;  // int8 activations (the lossy path) for this product
  bool operator==(const QSpec& o) const { return gs == o.gs && bits == o.bits && int8 == o.int8; }
};

// attn_in's work on B rows h (Dm floats each): qo (B, H, D) and ko (B, Hk, D) after RoPE (row b
// at position offset, or offsets[b] where given), vo (B, Hk, D). `w` holds the nine arrays of the
// q, k and v products (weight, scales, biases each).
void attn_in_rows(const float* h, int64_t B, int64_t Dm, const float* norm, float eps,
                  const mx::array* w, const std::vector<QSpec>& q, const RopeParams& rope,
                  int offset, const int32_t* offsets, int64_t H, int64_t Hk, int64_t D, float* qo,
                  float* ko, float* vo) {
  std::vector<float> xn(size_t(B * Dm));
  {
    ScopedPart part(Part::Norm);
    rms_norm_rows(h, norm, eps, B, Dm, xn.data());
  }
  QHold keep[3];
  std::vector<QMat> Ws;
  for (int i = 0; i < 3; ++i)
    Ws.push_back(qmat(w[3 * i], w[3 * i + 1], w[3 * i + 2], q[i].gs, q[i].bits, keep[i]));
  std::vector<float> qt(size_t(B * Ws[0].N)), kt(size_t(B * Ws[1].N));
  {
    ScopedPart part(Part::QKV);
    run_qmm_multi(xn.data(), B, Ws, {qt.data(), kt.data(), vo}, q[0].int8);
  }
  ScopedPart part(Part::Rope);
  if (offsets) {  // per-row positions: row b's heads at offsets[b]
    rope_qk_at(qt.data(), qo, H, kt.data(), ko, Hk, B, D, rope, offsets);
  } else {
    rope_rows(qt.data(), qo, B * H, 1, D, rope, offset);
    rope_rows(kt.data(), ko, B * Hk, 1, D, rope, offset);
  }
}

// block_out's work on B rows: y = h1 + mlp(norm2(h1)) with h1 = h + attention(q, K, V) @ Wo.T
// over keys 0..S-1 (from starts[b] on where given). `w` holds wo's three arrays, norm2, then
// gate's, up's and down's three each (13 arrays).
void block_out_rows(const float* h, int64_t B, int64_t Dm, const float* q, const KV& k, const KV& v,
                    int64_t H, int64_t Hk, int64_t S, int64_t D, float scale, float eps,
                    const mx::array* w, const std::vector<QSpec>& qs, const int32_t* starts,
                    float* y) {
  std::vector<float> tn, att(size_t(B * H * D));
  std::optional<ScopedPart> part(std::in_place, Part::Attention);  // the profile's part from here on
  attention(q, k, v, B, H, Hk, S, D, scale, att.data(), starts);
  QHold keep[4];
  const QMat Wo = qmat(w[0], w[1], w[2], qs[0].gs, qs[0].bits, keep[0]);
  const QMat Wg = qmat(w[4], w[5], w[6], qs[1].gs, qs[1].bits, keep[1]);
  const QMat Wu = qmat(w[7], w[8], w[9], qs[2].gs, qs[2].bits, keep[2]);
  const QMat Wd = qmat(w[10], w[11], w[12], qs[3].gs, qs[3].bits, keep[3]);
  std::vector<float> h1(size_t(B * Dm)), xn(size_t(B * Dm));
  part.emplace(Part::O);
  run_qmm(att.data(), B, Wo, h1.data(), qs[0].int8);
  part.emplace(Part::Norm);
  for (int64_t i = 0; i < B * Dm; ++i) h1[i] = h[i] + h1[i];
  rms_norm_rows(h1.data(), contiguous_f32(w[3], tn), eps, B, Dm, xn.data());
  const int64_t I = Wg.N;
  std::vector<float> g(size_t(B * I)), u(size_t(B * I));
  part.emplace(Part::GateUp);
  run_qmm_multi(xn.data(), B, {Wg, Wu}, {g.data(), u.data()}, qs[1].int8);
  part.emplace(Part::SwiGLU);
  swiglu_rows(g.data(), u.data(), B * I);
  part.emplace(Part::Down);
  run_qmm(g.data(), B, Wd, y, qs[3].int8);
  part.emplace(Part::Residual);
  for (int64_t i = 0; i < B * Dm; ++i) y[i] = h1[i] + y[i];
}

class AttnIn : public CpuPrimitive {
 public:
  AttnIn(mx::Stream s, float eps, std::vector<QSpec> q, int heads, int kv_heads, RopeParams rope,
         int offset, bool offsets)
      : CpuPrimitive(s), eps_(eps), q_(std::move(q)), heads_(heads), kv_heads_(kv_heads),
        rope_(rope), offset_(offset), offsets_(offsets) {}

  Task task() const override {
    return [eps = eps_, q = q_, rope = rope_, offset = offset_, offsets = offsets_](
               const Arrays& ins, Arrays& os) {
      BufferCache::get().release();  // a decode step: what `dequantize` kept goes back
      std::vector<float> th, tw;
      std::vector<int32_t> to;
      const auto& h = ins[0];
      const int64_t Dm = h.shape(-1), B = int64_t(h.size()) / Dm;
      attn_in_rows(contiguous_f32(h, th), B, Dm, contiguous_f32(ins[1], tw), eps, &ins[2], q, rope,
                   offset, offsets ? contiguous_as<int32_t>(ins[11], to) : nullptr,
                   os[0].shape(1), os[1].shape(1), os[0].shape(-1), os[0].data<float>(),
                   os[1].data<float>(), os[2].data<float>());
    };
  }
  const char* name() const override { return "MlxchatAttnIn"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const AttnIn&>(other);
    return eps_ == o.eps_ && q_ == o.q_ && heads_ == o.heads_ && kv_heads_ == o.kv_heads_ &&
           rope_ == o.rope_ && offset_ == o.offset_ && offsets_ == o.offsets_;
  }

 private:
  float eps_;
  std::vector<QSpec> q_;
  int heads_, kv_heads_;
  RopeParams rope_;
  int offset_;
  bool offsets_;
};

class BlockOut : public CpuPrimitive {
 public:
  BlockOut(mx::Stream s, float scale, float eps, std::vector<QSpec> q, bool starts)
      : CpuPrimitive(s), scale_(scale), eps_(eps), q_(std::move(q)), starts_(starts) {}

  Task task() const override {
    return [scale = scale_, eps = eps_, q = q_, starts = starts_](const Arrays& ins, Arrays& outs) {
      std::vector<float> th, tq, tk, tv;
      std::vector<uint32_t> tk8, tv8;
      std::vector<int32_t> ts;
      const auto &h = ins[0], &qa = ins[1], &ka = ins[2], &va = ins[3];
      const int64_t Dm = h.shape(-1), B = int64_t(h.size()) / Dm;
      const int64_t D = qa.shape(3);
      block_out_rows(contiguous_f32(h, th), B, Dm, contiguous_f32(qa, tq), kv_view(ka, tk, tk8, D),
                     kv_view(va, tv, tv8, D), qa.shape(1), ka.shape(1), ka.shape(2), D, scale, eps,
                     &ins[4], q, starts ? contiguous_as<int32_t>(ins[17], ts) : nullptr,
                     outs[0].data<float>());
    };
  }
  const char* name() const override { return "MlxchatBlockOut"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const BlockOut&>(other);
    return scale_ == o.scale_ && eps_ == o.eps_ && q_ == o.q_ && starts_ == o.starts_;
  }

 private:
  float scale_, eps_;
  std::vector<QSpec> q_;
  bool starts_;
};

using QW = std::tuple<mx::array, mx::array, mx::array, int, int>;  // w, scales, biases, gs, bits

void check_q(const QW& W, int64_t K) {
  const auto& [w, s, b, gs, bits] = W;
  check_quantized(K, w, s, b, gs, bits);
}

// A llama layer's q, k and v weights over Dm-wide rows: `heads` and `kv_heads` (a divisor) of one
// head size, which it returns, one bit width, RoPE over an even number of dims up to it.
int check_qkv(const QW& wq, const QW& wk, const QW& wv, int64_t Dm, int heads, int kv_heads,
              int rope_dims) {
  for (auto* W : {&wq, &wk, &wv}) check_q(*W, Dm);
  if (std::get<4>(wk) != std::get<4>(wq) || std::get<4>(wv) != std::get<4>(wq))
    throw std::invalid_argument("mixed bits");
  const int64_t nq = std::get<0>(wq).shape(0), nk = std::get<0>(wk).shape(0);
  if (heads <= 0 || kv_heads <= 0 || nq % heads || nk % kv_heads || nq / heads != nk / kv_heads ||
      std::get<0>(wv).shape(0) != nk || heads % kv_heads)
    throw std::invalid_argument("head shapes do not match the weights");
  const int D = int(nq / heads);
  if (rope_dims <= 0 || rope_dims % 2 || rope_dims > D) throw std::invalid_argument("bad rope dims");
  return D;
}

// A llama layer's o_proj (from the attention's nq columns) and MLP weights over Dm-wide rows.
void check_out_mlp(const QW& wo, const QW& wg, const QW& wu, const QW& wd, int64_t nq, int64_t Dm) {
  check_q(wo, nq);
  check_q(wg, Dm);
  check_q(wu, Dm);
  check_q(wd, std::get<0>(wg).shape(0));
  if (std::get<0>(wo).shape(0) != Dm || std::get<0>(wd).shape(0) != Dm ||
      std::get<0>(wu).shape(0) != std::get<0>(wg).shape(0) || std::get<4>(wg) != std::get<4>(wu))
    throw std::invalid_argument("layer weights do not match");
}

std::vector<mx::array> attn_in(const mx::array& h, const mx::array& norm, float eps, const QW& wq,
                               const QW& wk, const QW& wv, int heads, int kv_heads, int rope_dims,
                               bool traditional, float base, float scale, int offset, bool int8,
                               const std::optional<mx::array>& offsets) {
  const int64_t Dm = h.shape(-1);
  if (h.dtype() != mx::float32 || norm.dtype() != mx::float32 || h.ndim() != 3 || h.shape(1) != 1)
    throw std::invalid_argument("h must be (B, 1, D) float32");
  const int D = check_qkv(wq, wk, wv, Dm, heads, kv_heads, rope_dims);
  std::vector<mx::array> inputs{h, norm};
  std::vector<QSpec> q;
  for (auto* W : {&wq, &wk, &wv}) {
    inputs.insert(inputs.end(), {std::get<0>(*W), std::get<1>(*W), std::get<2>(*W)});
    q.push_back({std::get<3>(*W), std::get<4>(*W), int8});
  }
  const int B = h.shape(0);
  check_rows(offsets, B, "offsets");
  if (offsets) inputs.push_back(*offsets);
  return mx::array::make_arrays(
      {{B, heads, 1, D}, {B, kv_heads, 1, D}, {B, kv_heads, 1, D}},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<AttnIn>(cpu_stream(), eps, q, heads, kv_heads,
                               RopeParams{rope_dims, traditional, base, scale}, offset,
                               bool(offsets)),
      inputs);
}

mx::array block_out(const mx::array& h, const mx::array& q, const mx::array& k, const mx::array& v,
                    float attn_scale, const QW& wo, const mx::array& norm, float eps, const QW& wg,
                    const QW& wu, const QW& wd, bool int8,
                    const std::optional<mx::array>& starts) {
  const int64_t Dm = h.shape(-1);
  if (h.dtype() != mx::float32 || norm.dtype() != mx::float32 || h.ndim() != 3 || h.shape(1) != 1)
    throw std::invalid_argument("h must be (B, 1, D) float32");
  check_attention(q, k, v);
  if (q.shape(2) != 1 || q.shape(0) != h.shape(0))
    throw std::invalid_argument("q, k, v shapes do not match");
  check_out_mlp(wo, wg, wu, wd, q.shape(1) * q.shape(3), Dm);
  std::vector<mx::array> inputs{h, q, k, v};
  std::vector<QSpec> specs;
  for (auto* W : {&wo, &wg, &wu, &wd}) {
    inputs.insert(inputs.end(), {std::get<0>(*W), std::get<1>(*W), std::get<2>(*W)});
    if (W == &wo) inputs.push_back(norm);
    specs.push_back({std::get<3>(*W), std::get<4>(*W), int8});
  }
  check_rows(starts, h.shape(0), "starts");
  if (starts) inputs.push_back(*starts);
  return mx::array(h.shape(), mx::float32,
                   std::make_shared<BlockOut>(cpu_stream(), attn_scale, eps, specs, bool(starts)),
                   inputs);
}

// ---------------------------- a llama decoder layer's one-token step over a KV cache, in one op
//
// DecodeLayer is attn_in, the new position's keys and values written into the cache's buffers,
// and block_out over every position up to it: the same kernels in the same order as the two ops
// above and mlx-lm's cache update between them (KVCache.update_and_fetch: a SliceUpdate and a
// Slice for each of keys and values), so a layer's step is one graph node instead of six.
//
// Inputs: h (B, 1, Dm) and the cache's keys and values buffers (B, Hk, capacity, D float32; the
// new position `offset` < capacity); for a batched cache (mlx-lm's BatchKVCache layout: every row
// written at the shared `offset`, its `_idx`; the buffers may have more rows, free slots that the
// step leaves as they are, engine/slot_cache.py) also each row's RoPE position and first visible
// key, (B,) int32 each (`rows`: the cache's per-row offset and left padding), and then a fourth
// output, the offsets + 1 (what mlx-lm's update leaves in the cache's `offset`). The layer's weights (FusedLayer's, evaluated once) the op
// holds itself: norm1, the q, k and v products (weight, scales, biases each), o's three arrays,
// norm2, gate's, up's and down's three each. Outputs: the layer's output, then
// the keys and values buffers with position `offset` written. Like MLX's SliceUpdate, an output
// buffer is its input's own memory when MLX may reuse it (the input is donatable: no other array
// or view holds that memory) and a copy otherwise, so a snapshot holding the old buffer keeps it.
class DecodeLayer : public CpuPrimitive {
 public:
  static constexpr int kKeys = 1, kValues = 2, kRows = 3;  // input positions (h is the first)
  using Weights = std::shared_ptr<const std::vector<mx::array>>;

  DecodeLayer(mx::Stream s, Weights weights, float eps1, float eps2, std::vector<QSpec> q,
              int heads, RopeParams rope, int offset, float scale, bool rows)
      : CpuPrimitive(s), weights_(std::move(weights)), eps1_(eps1), eps2_(eps2), q_(std::move(q)),
        heads_(heads), rope_(rope), offset_(offset), scale_(scale), rows_(rows) {}

  Task task() const override {
    return [weights = weights_, eps1 = eps1_, eps2 = eps2_, q = q_, heads = heads_, rope = rope_,
            offset = offset_, scale = scale_, rows = rows_](const Arrays& ins, Arrays& outs) {
      const mx::array* w = weights->data();
      BufferCache::get().release();  // a decode step: what `dequantize` kept goes back
      std::vector<float> th, tw;
      std::vector<int32_t> to, ts;
      const int32_t* offsets = rows ? contiguous_as<int32_t>(ins[kRows], to) : nullptr;
      const int32_t* starts = rows ? contiguous_as<int32_t>(ins[kRows + 1], ts) : nullptr;
      const auto& h = ins[0];
      const int64_t Dm = h.shape(-1), B = int64_t(h.size()) / Dm;
      // the head dim from k's rows (the buffers' last axis is D, or a packed row's width)
      const int64_t Hk = ins[kKeys].shape(1), D = w[4].shape(0) / Hk, H = heads;
      std::vector<float> qo(size_t(B * H * D)), kv(size_t(2 * B * Hk * D));
      const float* hd = contiguous_f32(h, th);
      attn_in_rows(hd, B, Dm, contiguous_f32(w[0], tw), eps1, w + 1, {q[0], q[1], q[2]}, rope,
                   offset, offsets, H, Hk, D, qo.data(), kv.data(), kv.data() + B * Hk * D);
      KV views[2];
      {
        ScopedPart part(Part::KVWrite);
        for (int i = 0; i < 2; ++i) {
          const mx::array& in = ins[kKeys + i];
          mx::array& out = outs[1 + i];
          const bool packed = out.dtype() == mx::uint32;  // the 8-bit cache's rows (kv8.py)
          // fp32 values or uint32 words: 4 bytes an element either way
          uint32_t* dst = out.data<uint32_t>();
          if (dst != in.data<uint32_t>()) {  // not donated: a fresh row-contiguous buffer
            std::vector<uint32_t> tmp;
            std::memcpy(dst, contiguous_as<uint32_t>(in, tmp), out.nbytes());
          }
          const int64_t s0 = out.strides(0), s1 = out.strides(1), s2 = out.strides(2);
          const float* src = kv.data() + i * B * Hk * D;
          const int gs = packed ? packed_group(out.shape(3), D) : 0;
          for (int64_t b = 0; b < B; ++b)
            for (int64_t j = 0; j < Hk; ++j) {
              uint32_t* row = dst + b * s0 + j * s1 + offset * s2;
              if (packed)
                pack_kv_row(src + (b * Hk + j) * D, D, gs, row);
              else
                std::memcpy(row, src + (b * Hk + j) * D, sizeof(float) * size_t(D));
            }
          if (packed) {
            views[i].q8 = dst;
            views[i].gs = gs;
          } else {
            views[i].p = reinterpret_cast<const float*>(dst);
          }
          views[i].st[0] = s0;
          views[i].st[1] = s1;
          views[i].st[2] = s2;
        }
      }
      block_out_rows(hd, B, Dm, qo.data(), views[0], views[1], H, Hk, offset + 1, D, scale, eps2,
                     w + 10, {q[3], q[4], q[5], q[6]}, starts, outs[0].data<float>());
      if (rows)
        for (int64_t b = 0; b < B; ++b) outs[3].data<int32_t>()[b] = offsets[b] + 1;
    };
  }
  void allocate_outputs(const Arrays& in, Arrays& outs) const override {
    // MLX gives each output of an op its own copy of the inputs, so while the three outputs exist
    // the cache's buffers are held three times and never donatable. The output being evaluated
    // owns `in`; the other two's copies are dropped here, as MLX drops them all once the op has
    // run (not while tracing, nor where the inputs are no output's own, as in mx.compile's eval).
    const bool owned = std::any_of(outs.begin(), outs.end(), [&](auto& o) { return &o.inputs() == &in; });
    const bool tracing = std::any_of(outs.begin(), outs.end(), [](auto& o) { return o.is_tracer(); });
    if (owned && !tracing)
      for (auto& o : outs)
        if (&o.inputs() != &in) o.inputs().clear();
    // MLX also keeps every input's and every other output's memory alive until the stream has run
    // the op (a task queued after it), so while the previous step is still running (the engine
    // evaluates the next step's graph asynchronously) that memory looks held. A buffer that looks
    // held waits for the stream to finish what it was given, then is taken if nothing holds it
    // still (once a step: the previous step's holds all end together).
    alloc(outs[0]);
    if (rows_) alloc(outs[3]);
    for (int i = 0; i < 2; ++i) {
      const mx::array& buf = in[kKeys + i];
      if (!buf.flags().row_contiguous) {
        alloc(outs[1 + i]);
        continue;
      }
      if (!buf.is_donatable()) mx::synchronize(const_cast<DecodeLayer*>(this)->stream());
      if (buf.is_donatable())
        outs[1 + i].copy_shared_buffer(buf);
      else
        alloc(outs[1 + i]);
    }
  }
  std::vector<mx::Shape> output_shapes(const Arrays& in) override {
    if (rows_) return {in[0].shape(), in[kKeys].shape(), in[kValues].shape(), in[kRows].shape()};
    return {in[0].shape(), in[kKeys].shape(), in[kValues].shape()};
  }
  const char* name() const override { return "MlxchatDecodeLayer"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const DecodeLayer&>(other);
    return weights_ == o.weights_ && eps1_ == o.eps1_ && eps2_ == o.eps2_ && q_ == o.q_ &&
           heads_ == o.heads_ && rope_ == o.rope_ && offset_ == o.offset_ && scale_ == o.scale_ &&
           rows_ == o.rows_;
  }

 private:
  Weights weights_;
  float eps1_, eps2_;
  std::vector<QSpec> q_;  // q, k, v, o, gate, up, down
  int heads_;
  RopeParams rope_;
  int offset_;
  float scale_;
  bool rows_;  // a batched cache's per-row offsets and starts are inputs kRows, kRows + 1
};

// One llama layer's weights and settings, checked once, for its one-token steps over a plain or
// batched KV cache (engine/kernels/layout.py builds one per layer on its first such step):
// calling it with the step's h, the cache's keys and values buffers and the new position (and a
// batched cache's per-row offsets and starts) gives the layer's output and updates the two
// buffer arrays to DecodeLayer's others. It holds the weights it was made with: a later change
// of the layer's arrays is not seen.
class FusedLayer {
 public:
  FusedLayer(const mx::array& norm1, float eps1, const QW& wq, const QW& wk, const QW& wv,
             int heads, int kv_heads, int rope_dims, bool traditional, float base, float rope_scale,
             float attn_scale, const QW& wo, const mx::array& norm2, float eps2, const QW& wg,
             const QW& wu, const QW& wd, bool int8)
      : eps1_(eps1), eps2_(eps2), heads_(heads), kv_heads_(kv_heads),
        rope_{rope_dims, traditional, base, rope_scale}, scale_(attn_scale) {
    dm_ = norm1.ndim() == 1 ? norm1.shape(0) : 0;
    if (norm1.dtype() != mx::float32 || norm2.dtype() != mx::float32 || norm1.shape() != norm2.shape() || !dm_)
      throw std::invalid_argument("the norms' weights must be (D,) float32");
    d_ = check_qkv(wq, wk, wv, dm_, heads, kv_heads, rope_dims);
    check_out_mlp(wo, wg, wu, wd, std::get<0>(wq).shape(0), dm_);
    std::vector<mx::array> weights{norm1};
    for (auto* W : {&wq, &wk, &wv, &wo, &wg, &wu, &wd}) {
      weights.insert(weights.end(), {std::get<0>(*W), std::get<1>(*W), std::get<2>(*W)});
      if (W == &wo) weights.push_back(norm2);
      q_.push_back({std::get<3>(*W), std::get<4>(*W), int8});
    }
    mx::eval(weights);
    weights_ = std::make_shared<const std::vector<mx::array>>(std::move(weights));
  }

  // The step's output; `keys` and `values` become the written buffers, in place (the arrays
  // themselves are updated, as mlx-lm's `cache.keys[..., i, :] = k` updates them).
  mx::array operator()(const mx::array& h, mx::array& keys, mx::array& values, int offset) const {
    return step(h, keys, values, offset, std::nullopt, std::nullopt)[0];
  }

  // A batched cache's step (mlx-lm's BatchKVCache): every row written at the shared index `idx`
  // (its `_idx`), row b's RoPE at offsets[b] and its keys from starts[b] on (its `offset` and
  // `left_padding`). Returns the output and the offsets + 1 (the cache's next `offset`).
  std::tuple<mx::array, mx::array> batch(const mx::array& h, mx::array& keys, mx::array& values,
                                         int idx, const mx::array& offsets,
                                         const mx::array& starts) const {
    auto outs = step(h, keys, values, idx, offsets, starts);
    return {outs[0], outs[3]};
  }

 private:
  std::vector<mx::array> step(const mx::array& h, mx::array& keys, mx::array& values, int offset,
                              const std::optional<mx::array>& offsets,
                              const std::optional<mx::array>& starts) const {
    if (h.dtype() != mx::float32 || h.ndim() != 3 || h.shape(1) != 1 || h.shape(2) != dm_)
      throw std::invalid_argument("h must be (B, 1, D) float32");
    for (auto* a : {&keys, &values}) {
      const bool packed = a->dtype() == mx::uint32 && a->ndim() == 4 && packed_group(a->shape(3), d_);
      // a batched cache's buffers may hold more rows than the step (free slots, slot_cache.py):
      // the step reads and writes rows 0..B-1 only
      if ((a->dtype() != mx::float32 && !packed) || a->ndim() != 4 || a->shape(0) < h.shape(0) ||
          (!offsets && a->shape(0) != h.shape(0)) || a->shape(1) != kv_heads_ ||
          (!packed && a->shape(3) != d_))
        throw std::invalid_argument("keys and values must be (B or more rows, kv heads, capacity, "
                                    "head dim) float32, or the 8-bit cache's packed rows");
    }
    if (keys.shape() != values.shape() || keys.dtype() != values.dtype() || offset < 0 ||
        offset >= keys.shape(2))
      throw std::invalid_argument("the new position must lie inside the cache's buffers");
    check_rows(offsets, h.shape(0), "offsets");
    check_rows(starts, h.shape(0), "starts");
    std::vector<mx::array> inputs{h, keys, values};
    if (offsets) inputs.insert(inputs.end(), {*offsets, *starts});
    std::vector<mx::Shape> shapes{h.shape(), keys.shape(), values.shape()};
    std::vector<mx::Dtype> dtypes{mx::float32, keys.dtype(), values.dtype()};
    if (offsets) {
      shapes.push_back(offsets->shape());
      dtypes.push_back(mx::int32);
    }
    auto outs = mx::array::make_arrays(
        std::move(shapes), dtypes,
        std::make_shared<DecodeLayer>(cpu_stream(), weights_, eps1_, eps2_, q_, heads_, rope_,
                                      offset, scale_, bool(offsets)),
        inputs);
    keys.overwrite_descriptor(outs[1]);
    values.overwrite_descriptor(outs[2]);
    return outs;
  }

  float eps1_, eps2_;
  int heads_, kv_heads_, d_ = 0;
  int64_t dm_ = 0;
  RopeParams rope_;
  float scale_;
  std::vector<QSpec> q_;
  // norm1, q's, k's, v's and o's three arrays each, norm2, gate's, up's and down's: evaluated
  // once, read by every step's op (not its graph inputs: fewer arrays for MLX to track each step)
  DecodeLayer::Weights weights_;
};

// ----------------------------------------------- read bandwidth (the bench's STREAM-style row)

// Reads the array `a` (evaluated first) `passes` times over our pool (the threads the kernels use, blocks
// of 256 KB handed out as the products hand them out), summing its 64-bit words with the active
// unit's widest loads (Impl::read_sum) so no read can be skipped; returns (seconds, checksum).
// Bytes read = passes * a.nbytes().
std::tuple<double, uint64_t> read_bandwidth(mx::array a, int passes) {
  a.eval();
  if (!a.flags().row_contiguous || a.nbytes() % 8 || passes < 1)
    throw std::invalid_argument("a row-contiguous array of whole 64-bit words, passes >= 1");
  const auto* words = reinterpret_cast<const uint64_t*>(a.data<uint8_t>());
  const int64_t n = int64_t(a.nbytes() / 8), block = 32768;
  const int64_t nblocks = (n + block - 1) / block;
  const Impl* I = impl();
  std::vector<uint64_t> sums(size_t(nblocks), 0);
  const auto t0 = std::chrono::steady_clock::now();
  for (int p = 0; p < passes; ++p)
    parallel_for(nblocks, [&](int64_t b) {
      sums[size_t(b)] += I->read_sum(words + b * block, std::min(block, n - b * block));
    });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  uint64_t check = 0;
  for (uint64_t x : sums) check += x;
  return {secs, check};
}

// Asks the kernel to back the array `a`'s memory (evaluated first) with 2 MB pages (madvise
// MADV_HUGEPAGE, then MADV_COLLAPSE to do it now, Linux 6.1+): a streaming read over 4 KB pages
// walks a page table entry (and often misses the TLB) every 4 KB. The contents do not change.
// Returns the bytes now in 2 MB pages (the whole 2 MB pages inside `a`), 0 where the kernel
// declined (no transparent huge pages, another OS, a file-backed mapping).
int64_t huge_pages(mx::array a) {
#if defined(__linux__)
  a.eval();
  constexpr uintptr_t H = uintptr_t(2) << 20;
  const auto p = reinterpret_cast<uintptr_t>(a.data<uint8_t>());
  const uintptr_t lo = (p + H - 1) & ~(H - 1), hi = (p + a.nbytes()) & ~(H - 1);
  if (hi <= lo) return 0;
  void* start = reinterpret_cast<void*>(lo);
  if (madvise(start, hi - lo, MADV_HUGEPAGE) != 0) return 0;
  if (madvise(start, hi - lo, MADV_COLLAPSE) != 0) return 0;
  return int64_t(hi - lo);
#else
  return 0;
#endif
}

}  // namespace
}  // namespace mlxchat

NB_MODULE(_mlxchat_kernels, m) {
  using namespace mlxchat;
  m.doc() = "mlxchat's CPU kernels for MLX (quantized matmul, RMSNorm, RoPE, decode attention)";
  m.def("quantized_matmul", &quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"), nb::arg("int8") = false);
  m.def("dequantize", &dequantize, nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"));
  m.def("embedding", &embedding, nb::arg("ids"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"));
  m.def("prefill_matmul", &prefill_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"));
  m.def("has_sgemm", [] { return sgemm() != nullptr; });
  m.def("prefill_tile_bytes", [] { return g_tile_bytes.load(); });
  m.def("prefill_buffer_bytes", [] { return g_tile_held.load(); });
  m.def("set_prefill_tile_bytes", [](int64_t n) { g_tile_bytes = std::max<int64_t>(n, 1); },
        nb::arg("n"));
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("up"));
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
  m.def("log_softmax", &LogSoftmax::of, nb::arg("x"));
  m.def("rope", &rope, nb::arg("x"), nb::arg("dims"), nb::arg("traditional"), nb::arg("base"),
        nb::arg("scale"), nb::arg("offset"), nb::arg("offsets") = nb::none());
  m.def("decode_attention", &decode_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("scale"), nb::arg("starts") = nb::none());
  m.def("prefill_attention", &prefill_attention_op, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("scale"), nb::arg("starts") = nb::none());
  m.def("attn_in", &attn_in, nb::arg("h"), nb::arg("norm"), nb::arg("eps"), nb::arg("wq"),
        nb::arg("wk"), nb::arg("wv"), nb::arg("heads"), nb::arg("kv_heads"), nb::arg("rope_dims"),
        nb::arg("traditional"), nb::arg("base"), nb::arg("scale"), nb::arg("offset"),
        nb::arg("int8") = false, nb::arg("offsets") = nb::none());
  m.def("block_out", &block_out, nb::arg("h"), nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("attn_scale"), nb::arg("wo"), nb::arg("norm"), nb::arg("eps"), nb::arg("wg"),
        nb::arg("wu"), nb::arg("wd"), nb::arg("int8") = false, nb::arg("starts") = nb::none());
  nb::class_<FusedLayer>(m, "FusedLayer")
      .def(nb::init<const mx::array&, float, const QW&, const QW&, const QW&, int, int, int, bool,
                    float, float, float, const QW&, const mx::array&, float, const QW&, const QW&,
                    const QW&, bool>(),
           nb::arg("norm1"), nb::arg("eps1"), nb::arg("wq"), nb::arg("wk"), nb::arg("wv"),
           nb::arg("heads"), nb::arg("kv_heads"), nb::arg("rope_dims"), nb::arg("traditional"),
           nb::arg("base"), nb::arg("rope_scale"), nb::arg("attn_scale"), nb::arg("wo"),
           nb::arg("norm2"), nb::arg("eps2"), nb::arg("wg"), nb::arg("wu"), nb::arg("wd"),
           nb::arg("int8") = false)
      .def("__call__", &FusedLayer::operator(), nb::arg("h"), nb::arg("keys"), nb::arg("values"),
           nb::arg("offset"))
      .def("batch", &FusedLayer::batch, nb::arg("h"), nb::arg("keys"), nb::arg("values"),
           nb::arg("idx"), nb::arg("offsets"), nb::arg("starts"));
  m.def("read_bandwidth", &read_bandwidth, nb::arg("a"), nb::arg("passes") = 1);
  m.def("huge_pages", &huge_pages, nb::arg("a"));
  m.def("isa", [] { return std::string(impl()->name); });
  m.def("isas", &isas);
  m.def("set_isa", &set_isa, nb::arg("name"));
  m.def("num_threads", &num_threads);
  m.def("interleave_rows", &interleave_rows);
  m.def("set_interleave_rows", &set_interleave_rows, nb::arg("on"));
  m.def("prefetch_bytes", &prefetch_bytes);
  m.def("set_prefetch_bytes", &set_prefetch_bytes, nb::arg("n"));
  m.def("set_num_threads", &set_num_threads, nb::arg("n"));
  m.def("dequantize_cache_bytes", [] { return int64_t(BufferCache::get().held()); });
  m.def("spin_us", &spin_us);
  m.def("set_spin_us", &set_spin_us, nb::arg("us"));
  m.def("profile_start", &profile_start);
  m.def("profile_stop", &profile_stop);
  m.def("mlx_version", [] { return std::string(MLXCHAT_MLX_VERSION); });
}
