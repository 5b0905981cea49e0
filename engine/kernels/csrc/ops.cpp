// mlxchat's CPU primitives for MLX and their Python bindings (module _mlxchat_kernels).
//
// Each op is an MLX UnaryPrimitive: building it only adds a graph node; eval_cpu dispatches
// the work onto the stream's CPU thread through MLX's command encoder, as MLX's own CPU ops do,
// and the kernels there split it over our thread pool. fp32 activations only; the Python side
// (engine/kernels/ops.py) checks inputs and takes MLX's own ops for anything else.
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "common.h"
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
    g_impl = has_avx512() ? impl_avx512() : has_avx2() ? impl_avx2() : impl_generic();
#else
    g_impl = impl_generic();
#endif
  }
  return g_impl;
}

// A row-contiguous fp32 view of `a`: its own data, or a gathered copy in `tmp`.
const float* contiguous_f32(const mx::array& a, std::vector<float>& tmp) {
  if (a.flags().row_contiguous) return a.data<float>();
  tmp.resize(a.size());
  const float* src = a.data<float>();
  for (size_t i = 0; i < a.size(); ++i) tmp[i] = src[mx::elem_to_loc(int(i), a.shape(), a.strides())];
  return tmp.data();
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

// ---------------------------------------------------------------- quantized matmul (x @ W.T)

void run_qmm(const float* x, int64_t rows, const QMat& W, float* y) {
  const Impl* I = impl();
  const int64_t N = W.N, K = W.K;
  const int threads = num_threads();
  const int64_t nblocks = std::max<int64_t>(1, std::min<int64_t>(N / 16, int64_t(threads) * 8));
  const int64_t per = (N + nblocks - 1) / nblocks;
  std::vector<float> xp(size_t(std::min<int64_t>(rows, 8) * K));
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const int M = int(std::min<int64_t>(8, rows - r0));
    I->prep_x(W, x + r0 * K, M, xp.data());
    float* yr = y + r0 * N;
    const float* xpp = xp.data();
    parallel_for(nblocks, [&](int64_t b) {
      const int64_t n0 = b * per, n1 = std::min(N, n0 + per);
      if (n0 < n1) I->qmv_rows(W, xpp, M, n0, n1, yr, N);
    });
  }
}

class QMatmul : public mx::UnaryPrimitive {
 public:
  QMatmul(mx::Stream s, int gs, int bits) : mx::UnaryPrimitive(s), gs_(gs), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    alloc(out);
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([x = weak(in[0]), w = weak(in[1]), s = weak(in[2]), b = weak(in[3]),
                  out = weak(out), gs = gs_, bits = bits_]() mutable {
      std::vector<float> tmp;
      const float* xd = contiguous_f32(x, tmp);
      const int64_t K = x.shape(-1);
      QMat W{w.data<uint32_t>(), s.data<void>(), b.data<void>(), stype(s.dtype()),
             w.shape(0), K, bits, gs};
      run_qmm(xd, int64_t(x.size()) / K, W, out.data<float>());
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxchat kernels run on the CPU only");
  }
  const char* name() const override { return "MlxchatQuantizedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QMatmul&>(other);
    return gs_ == o.gs_ && bits_ == o.bits_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    auto shape = in[0].shape();
    shape.back() = in[1].shape(0);
    return {shape};
  }

 private:
  int gs_, bits_;
};

void check_quantized(const mx::array& x, const mx::array& w, const mx::array& s,
                     const mx::array& b, int gs, int bits) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("bits must be 4 or 8");
  if (gs != 32 && gs != 64 && gs != 128) throw std::invalid_argument("group size must be 32, 64 or 128");
  if (x.dtype() != mx::float32) throw std::invalid_argument("x must be float32");
  if (w.dtype() != mx::uint32 || w.ndim() != 2) throw std::invalid_argument("w must be 2-D uint32");
  const int64_t K = x.shape(-1);
  if (K % gs != 0 || w.shape(1) * (32 / bits) != K)
    throw std::invalid_argument("x's last dimension does not match the packed weight");
  if (s.shape() != b.shape() || s.ndim() != 2 || s.shape(0) != w.shape(0) || s.shape(1) != K / gs)
    throw std::invalid_argument("scales/biases do not match the weight");
  if (s.dtype() != b.dtype() ||
      (s.dtype() != mx::float32 && s.dtype() != mx::float16 && s.dtype() != mx::bfloat16))
    throw std::invalid_argument("scales/biases must be float32, float16 or bfloat16");
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& s,
                           const mx::array& b, int gs, int bits) {
  check_quantized(x, w, s, b, gs, bits);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  // Weights are materialised parameters; contiguous() is a no-op for them and guards the rest.
  return mx::array(shape, mx::float32, std::make_shared<QMatmul>(cpu_stream(), gs, bits),
                   {x, mx::contiguous(w), mx::contiguous(s), mx::contiguous(b)});
}

// ------------------------------------------------------------------------------- RMSNorm

class RMSNorm : public mx::UnaryPrimitive {
 public:
  RMSNorm(mx::Stream s, float eps) : mx::UnaryPrimitive(s), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    alloc(out);
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([x = weak(in[0]), w = weak(in[1]), out = weak(out), eps = eps_]() mutable {
      std::vector<float> t0, t1;
      const float* xd = contiguous_f32(x, t0);
      const float* wd = contiguous_f32(w, t1);
      float* y = out.data<float>();
      const int64_t D = x.shape(-1), rows = int64_t(x.size()) / D;
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xd + r * D;
        float acc[8] = {};
        int64_t i = 0;
        for (; i + 8 <= D; i += 8)
          for (int j = 0; j < 8; ++j) acc[j] += xr[i + j] * xr[i + j];
        float ss = 0;
        for (int j = 0; j < 8; ++j) ss += acc[j];
        for (; i < D; ++i) ss += xr[i] * xr[i];
        const float inv = 1.0f / std::sqrt(ss / float(D) + eps);
        for (int64_t k = 0; k < D; ++k) y[r * D + k] = (xr[k] * inv) * wd[k];
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxchat kernels run on the CPU only");
  }
  const char* name() const override { return "MlxchatRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RMSNorm&>(other).eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }

 private:
  float eps_;
};

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps) {
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32) throw std::invalid_argument("float32 only");
  if (w.ndim() != 1 || w.shape(0) != x.shape(-1)) throw std::invalid_argument("weight must be (D,)");
  return mx::array(x.shape(), mx::float32, std::make_shared<RMSNorm>(cpu_stream(), eps), {x, w});
}

// ---------------------------------------------------------------------------------- RoPE

class RoPE : public mx::UnaryPrimitive {
 public:
  RoPE(mx::Stream s, int dims, bool traditional, float base, float scale, int offset)
      : mx::UnaryPrimitive(s), dims_(dims), trad_(traditional), base_(base), scale_(scale),
        offset_(offset) {}
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    alloc(out);
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([x = weak(in[0]), out = weak(out), dims = dims_, trad = trad_, base = base_,
                  scale = scale_, offset = offset_]() mutable {
      std::vector<float> tmp;
      const float* xd = contiguous_f32(x, tmp);
      float* y = out.data<float>();
      const int64_t D = x.shape(-1), L = x.shape(-2), rows = int64_t(x.size()) / D;
      const int half = dims / 2;
      // The same formulas, in the same fp32 steps, as MLX's own rope.
      std::vector<float> inv(half), cs(size_t(L) * half), sn(size_t(L) * half);
      const float step = float(std::log(double(base)) / half);
      for (int i = 0; i < half; ++i) inv[i] = std::exp(float(-i) * step);
      for (int64_t t = 0; t < L; ++t) {
        const float pos = (float(t) + float(offset)) * scale;
        for (int i = 0; i < half; ++i) {
          const float th = pos * inv[i];
          cs[t * half + i] = std::cos(th);
          sn[t * half + i] = std::sin(th);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xd + r * D;
        float* yr = y + r * D;
        const float* c = cs.data() + (r % L) * half;
        const float* s = sn.data() + (r % L) * half;
        for (int i = 0; i < half; ++i) {
          const int64_t a = trad ? 2 * i : i, b = trad ? 2 * i + 1 : i + half;
          const float x1 = xr[a], x2 = xr[b];
          yr[a] = x1 * c[i] - x2 * s[i];
          yr[b] = x1 * s[i] + x2 * c[i];
        }
        for (int64_t k = dims; k < D; ++k) yr[k] = xr[k];
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxchat kernels run on the CPU only");
  }
  const char* name() const override { return "MlxchatRoPE"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RoPE&>(other);
    return dims_ == o.dims_ && trad_ == o.trad_ && base_ == o.base_ && scale_ == o.scale_ &&
           offset_ == o.offset_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }

 private:
  int dims_;
  bool trad_;
  float base_, scale_;
  int offset_;
};

mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale, int offset) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("float32 only");
  if (x.ndim() < 2 || dims <= 0 || dims % 2 || dims > x.shape(-1))
    throw std::invalid_argument("bad rope dims");
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<RoPE>(cpu_stream(), dims, traditional, base, scale, offset), {x});
}

// ------------------------------------------------ single-query attention over the KV cache

class DecodeAttention : public mx::UnaryPrimitive {
 public:
  DecodeAttention(mx::Stream s, float scale) : mx::UnaryPrimitive(s), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    alloc(out);
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([q = weak(in[0]), k = weak(in[1]), v = weak(in[2]), out = weak(out),
                  scale = scale_]() mutable {
      std::vector<float> tq, tk, tv;
      const float* qd = contiguous_f32(q, tq);
      // K and V are usually a prefix of the cache's buffer: strided over batch, heads, positions.
      auto view = [](const mx::array& a, std::vector<float>& tmp, int64_t st[3]) {
        if (a.strides(3) == 1) {
          for (int i = 0; i < 3; ++i) st[i] = a.strides(i);
          return static_cast<const float*>(a.data<float>());
        }
        const float* p = contiguous_f32(a, tmp);
        st[2] = a.shape(3);
        st[1] = st[2] * a.shape(2);
        st[0] = st[1] * a.shape(1);
        return p;
      };
      int64_t ks[3], vs[3];
      const float* kd = view(k, tk, ks);
      const float* vd = view(v, tv, vs);
      const int64_t B = q.shape(0), H = q.shape(1), D = q.shape(3);
      const int64_t Hk = k.shape(1), S = k.shape(2), rep = H / Hk;
      float* y = out.data<float>();
      const Impl* I = impl();
      parallel_for(B * H, [&](int64_t bh) {
        const int64_t b = bh / H, h = bh % H, hk = h / rep;
        std::vector<float> qs(D), sc(S);
        for (int64_t i = 0; i < D; ++i) qs[i] = qd[bh * D + i] * scale;
        const float* kb = kd + b * ks[0] + hk * ks[1];
        const float* vb = vd + b * vs[0] + hk * vs[1];
        float mx_ = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < S; ++t) {
          sc[t] = I->dot(qs.data(), kb + t * ks[2], D);
          mx_ = std::max(mx_, sc[t]);
        }
        float sum = 0;
        for (int64_t t = 0; t < S; ++t) sum += (sc[t] = std::exp(sc[t] - mx_));
        float* yr = y + bh * D;
        std::fill(yr, yr + D, 0.0f);
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < S; ++t) I->axpy(sc[t] * inv, vb + t * vs[2], yr, D);
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxchat kernels run on the CPU only");
  }
  const char* name() const override { return "MlxchatDecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const DecodeAttention&>(other).scale_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }

 private:
  float scale_;
};

mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale) {
  for (auto* a : {&q, &k, &v})
    if (a->dtype() != mx::float32 || a->ndim() != 4) throw std::invalid_argument("4-D float32 only");
  if (q.shape(2) != 1) throw std::invalid_argument("one query position only");
  if (k.shape() != v.shape() || k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) ||
      q.shape(1) % k.shape(1) != 0)
    throw std::invalid_argument("q, k, v shapes do not match");
  return mx::array(q.shape(), mx::float32, std::make_shared<DecodeAttention>(cpu_stream(), scale),
                   {q, k, v});
}

}  // namespace
}  // namespace mlxchat

NB_MODULE(_mlxchat_kernels, m) {
  using namespace mlxchat;
  m.doc() = "mlxchat's CPU kernels for MLX (quantized matmul, RMSNorm, RoPE, decode attention)";
  m.def("quantized_matmul", &quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"));
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
  m.def("rope", &rope, nb::arg("x"), nb::arg("dims"), nb::arg("traditional"), nb::arg("base"),
        nb::arg("scale"), nb::arg("offset"));
  m.def("decode_attention", &decode_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("scale"));
  m.def("isa", [] { return std::string(impl()->name); });
  m.def("num_threads", &num_threads);
  m.def("set_num_threads", &set_num_threads, nb::arg("n"));
  m.def("mlx_version", [] { return std::string(MLXCHAT_MLX_VERSION); });
}
