"""engine/kernels/fused_cuda.py's functions restated in MLX ops: what each fused kernel computes,
with mlx-lm's own modules and ops, so that the decode step (engine/kernels/decode_step.py) runs on
any device and its structure is tested on the CPU against mlx-lm (tests/test_decode_step.py), and
so that `bench.gpu_step --parts kernels` has each CUDA kernel's reference on the GPU.

The one difference of form: MLX ops cannot write into an array in place, so `attention` here
returns the cache buffers with the new position written (`mx.slice_update`) where the CUDA kernel
returns the buffers it wrote into (`IN_PLACE`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.activations import swiglu

IN_PLACE = False
Q8_LEVELS = 16192.0  # v's largest magnitude on the int8 path (kQ8Levels, engine/kernels/csrc/common.h)


def matvec(x: mx.array, w: mx.array, scales: mx.array | None, biases: mx.array | None,
           bits: int, group_size: int, epilogue: int = 0, a: mx.array | None = None,
           norm: tuple[mx.array, float] | None = None, int8: bool = False, ahead: tuple = ()) -> mx.array:
    if norm is not None:
        x = mx.fast.rms_norm(x, norm[0], norm[1])
    if int8 and bits in (4, 8):  # where the program gives it (fused_cuda.q8_fits)
        y = int8_product(x, w, scales, biases, group_size, bits).astype(x.dtype)
    elif bits in (4, 8):
        y = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    else:
        y = x @ w.T
    if epilogue == 1:
        return y + a.reshape(y.shape)
    if epilogue == 2:
        gate, up = mx.split(y, 2, axis=-1)
        return swiglu(gate, up)
    return y


def int8_product(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                 bits: int) -> mx.array:
    """x @ W.T on int8 activations, in fp32, as the CPU kernels' int8 path and fused_cuda.qdot
    compute it: x per 32-element block as d * v (d = max|x| / Q8_LEVELS, v = round(x / d), which
    two int8 limbs 128 hi + lo hold exactly), times the weights' codes times their scales, plus
    their biases times x's sum over each group."""
    k = x.shape[-1]
    xf = x.astype(mx.float32).reshape(-1, k)
    blocks = xf.reshape(-1, k // 32, 32)
    amax = mx.max(mx.abs(blocks), axis=-1, keepdims=True)
    v = mx.round(mx.clip(blocks * mx.where(amax > 0, Q8_LEVELS / amax, 0.0), -Q8_LEVELS, Q8_LEVELS))
    xq = (v * (amax / Q8_LEVELS)).reshape(-1, k)
    s32, b32 = scales.astype(mx.float32), biases.astype(mx.float32)
    codes = mx.dequantize(w, mx.ones_like(s32), mx.zeros_like(b32), group_size, bits)
    group_sums = xf.reshape(-1, k // group_size, group_size).sum(-1)
    y = xq @ (codes * mx.repeat(s32, group_size, axis=1)).T + group_sums @ b32.T
    return y.reshape(*x.shape[:-1], w.shape[0])


def attention(layer: Any, qkv: mx.array, pos: mx.array, keys: mx.array, values: mx.array,
              ahead: tuple = ()) -> tuple[mx.array, mx.array, mx.array]:
    # `ahead` (fused_cuda's L2 prefetch of the next kernel's weights) has nothing to do here
    pos = pos[:1]  # the program's position array holds the position first (decode_step._position)
    q, keys, values = rope_write(layer, qkv, pos, keys, values)
    return attend(layer, q, keys, values, pos), keys, values


def rope_write(layer: Any, qkv: mx.array, pos: mx.array, keys: mx.array, values: mx.array
               ) -> tuple[mx.array, mx.array, mx.array]:
    """mlx-lm's attention up to the cache update (engine/kernels/gpu_layout.py StackedAttention),
    the update at `pos` (1,). Returns q (1, heads, 1, head_dim) and the updated buffers."""
    heads, kv_heads, dim = layer.heads, layer.kv_heads, layer.head_dim
    q, k, v = mx.split(qkv, [heads * dim, (heads + kv_heads) * dim], axis=-1)
    q, k = q.reshape(1, 1, heads, dim), k.reshape(1, 1, kv_heads, dim)
    if layer.q_norm is not None:
        q, k = layer.q_norm(q), layer.k_norm(k)
    q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    v = v.reshape(1, 1, kv_heads, dim).transpose(0, 2, 1, 3)
    q, k = layer.rope(q, offset=pos), layer.rope(k, offset=pos)
    keys = mx.slice_update(keys, k, pos, axes=(2,))
    values = mx.slice_update(values, v, pos, axes=(2,))
    return q, keys, values


def attend(layer: Any, q: mx.array, keys: mx.array, values: mx.array, pos: mx.array) -> mx.array:
    """mlx-lm's attention of one query over the first `pos + 1` keys: the buffer's later rows are
    masked out. Returns (1, 1, heads * head_dim)."""
    visible = mx.arange(keys.shape[2]) <= pos
    mask = mx.where(visible, mx.array(0, q.dtype), mx.array(-mx.inf, q.dtype))
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=layer.scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(1, 1, -1)
