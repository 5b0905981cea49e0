"""The gated delta rule's per-token recurrence as one CUDA kernel, for decode steps and short
verify blocks of Qwen3.5 / Qwen3-Next on NVIDIA GPUs.

mlx-lm runs this recurrence as one Metal kernel on Apple GPUs; elsewhere it builds about twenty
small ops per token and layer (`gated_delta_ops`), and on a GPU, where a decode step's time is the
host launching its kernels, those ops are most of a hybrid model's step. This is mlx-lm's Metal
kernel restated for CUDA through `mx.fast.cuda_kernel`: one warp per value row of a head, each lane
holding Dk/32 of the row's state in registers for all T tokens, sums over the key dimension by
warp shuffles. The arithmetic is the Metal kernel's (fp32 state, inputs widened to fp32); only the
order of the 32-lane sums differs from the ops' reductions, so results agree to float rounding
(`python -m bench hybrid --device gpu` reports the largest difference against mlx-lm's ops).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .. import device

_SOURCE = """
    const int T_ = T[0];
    const int n = blockIdx.z;
    const int b_idx = n / Hv;
    const int hv_idx = n % Hv;
    const int hk_idx = hv_idx / (Hv / Hk);
    constexpr int n_per_t = Dk / 32;
    const int dk_idx = threadIdx.x;
    const int dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
    if (dv_idx >= Dv) return;  // a whole warp leaves together: lanes share dv_idx

    // q, k: [B, T, Hk, Dk]; v, y: [B, T, Hv, Dv]; g, beta: [B, T, Hv]; state: [B, Hv, Dv, Dk]
    const InT* q_ = q + (size_t)b_idx * T_ * Hk * Dk + hk_idx * Dk;
    const InT* k_ = k + (size_t)b_idx * T_ * Hk * Dk + hk_idx * Dk;
    const InT* v_ = v + (size_t)b_idx * T_ * Hv * Dv + hv_idx * Dv;
    InT* y_ = y + (size_t)b_idx * T_ * Hv * Dv + hv_idx * Dv;
    const GT* g_ = g + (size_t)b_idx * T_ * Hv;
    const BT* beta_ = beta + (size_t)b_idx * T_ * Hv;
    const StT* i_state = state_in + ((size_t)n * Dv + dv_idx) * Dk;
    StT* o_state = state_out + ((size_t)n * Dv + dv_idx) * Dk;

    float state[n_per_t];
    for (int i = 0; i < n_per_t; ++i) {
      state[i] = static_cast<float>(i_state[n_per_t * dk_idx + i]);
    }
    for (int t = 0; t < T_; ++t) {
      if (ACTIVE) {
        const float decay = static_cast<float>(g_[hv_idx]);
        float kv_mem = 0.0f;
        for (int i = 0; i < n_per_t; ++i) {
          const int s_idx = n_per_t * dk_idx + i;
          state[i] = state[i] * decay;
          kv_mem += state[i] * static_cast<float>(k_[s_idx]);
        }
        for (int off = 16; off > 0; off >>= 1) kv_mem += __shfl_xor_sync(0xffffffffu, kv_mem, off);
        const float delta = (static_cast<float>(v_[dv_idx]) - kv_mem) * static_cast<float>(beta_[hv_idx]);
        float out = 0.0f;
        for (int i = 0; i < n_per_t; ++i) {
          const int s_idx = n_per_t * dk_idx + i;
          state[i] = state[i] + static_cast<float>(k_[s_idx]) * delta;
          out += state[i] * static_cast<float>(q_[s_idx]);
        }
        for (int off = 16; off > 0; off >>= 1) out += __shfl_xor_sync(0xffffffffu, out, off);
        if (dk_idx == 0) y_[dv_idx] = static_cast<InT>(out);
      } else if (dk_idx == 0) {
        y_[dv_idx] = static_cast<InT>(0.0f);
      }
      q_ += Hk * Dk;
      k_ += Hk * Dk;
      v_ += Hv * Dv;
      y_ += Hv * Dv;
      g_ += Hv;
      beta_ += Hv;
    }
    for (int i = 0; i < n_per_t; ++i) {
      o_state[n_per_t * dk_idx + i] = static_cast<StT>(state[i]);
    }
"""

_KERNELS: dict[bool, object] = {}


def _kernel(masked: bool):
    if masked not in _KERNELS:
        names = ["q", "k", "v", "g", "beta", "state_in", "T"] + (["mask"] if masked else [])
        active = "static_cast<bool>(mask[b_idx * T_ + t])" if masked else "true"
        _KERNELS[masked] = mx.fast.cuda_kernel(
            name="mlxchat_gated_delta_step" + ("_mask" if masked else ""), input_names=names,
            output_names=["y", "state_out"], source=_SOURCE.replace("ACTIVE", active))
    return _KERNELS[masked]


def fits(q: mx.array, k: mx.array, v: mx.array, a: mx.array) -> bool:
    """Whether this kernel runs the step: on a CUDA GPU, q, k and v of one dtype, a key head size
    that is a multiple of 32 (the warp), one decay per head (`a`, the decay's input, is (B, T, Hv),
    not per key channel), value heads a multiple of the key heads, and B x Hv within a grid's z."""
    return (device.backend() == "cuda" and q.dtype == k.dtype == v.dtype and q.shape[-1] % 32 == 0
            and a.ndim == 3 and v.shape[-2] % q.shape[-2] == 0 and v.shape[0] * v.shape[-2] <= 65535)


def gated_delta_step(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                     state: Optional[mx.array] = None,
                     mask: Optional[mx.array] = None) -> tuple[mx.array, mx.array]:
    """mlx-lm's `gated_delta_kernel` contract: q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); g, beta
    (B, T, Hv); state (B, Hv, Dv, Dk), zeros when None; mask (B, T) or None. Returns y
    (B, T, Hv, Dv) in q's dtype and the new state; a masked-out token leaves the state as it was
    and gives y = 0."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    inputs = [q, k, v, g, beta, state, mx.array(T, dtype=mx.int32)]
    if mask is not None:
        inputs.append(mask)
    return _kernel(mask is not None)(
        inputs=inputs,
        template=[("InT", q.dtype), ("GT", g.dtype), ("BT", beta.dtype), ("StT", state.dtype),
                  ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        grid=(32, Dv, B * Hv), threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape], output_dtypes=[q.dtype, state.dtype])
