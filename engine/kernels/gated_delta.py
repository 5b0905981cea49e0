"""The gated delta rule (Qwen3.5 / Qwen3-Next linear attention) in its chunked form, for prefill.

mlx-lm's `gated_delta_update` runs a Metal kernel on Apple GPUs and otherwise steps through the
tokens one by one (`gated_delta_ops`): on CUDA and on the CPU a long prompt costs one small graph
per token and layer. The chunked form (as flash-linear-attention's `chunk_gated_delta_rule`) cuts
the sequence into chunks of `CHUNK` tokens, does each chunk's intra-chunk work as batched matmuls
over all chunks at once, and leaves one short state update per chunk to the sequential loop.

Per token t, with the state S (Dv x Dk, mlx-lm's layout), decay g_t, write strength beta_t:

    S_t = g_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,    y_t = S_t q_t

Within a chunk, with G_i the log of the decay accumulated from the chunk's start to token i, the
WY form writes the chunk's updates as U = T (beta * v) and W = T (beta * e^G * k), where
T = (I + A)^-1 and A_ij = beta_i e^(G_i - G_j) k_i.k_j for j < i. A is strictly lower triangular,
so (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: a few matmuls, on any backend (MLX's triangular
solve runs only on the CPU). Every exponent is a difference G_i - G_j <= 0 taken inside one chunk,
so nothing overflows.

Only prefill takes this path (`MIN_TOKENS` or more tokens): one-token decode steps and short
speculative verify blocks keep mlx-lm's per-token code, so their results are mlx-lm's exactly,
except on a CUDA GPU, where they run as one kernel per layer (gated_delta_cuda.py).
"""

from __future__ import annotations

import sys
import types
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta as mlx_gated_delta

from . import gated_delta_cuda
from ..device import backend

CHUNK = 64
MIN_TOKENS = 16  # fewer tokens (decode, verify blocks) keep mlx-lm's per-token path
# mlx-lm's linear-attention layers whose __call__ calls `gated_delta_update` (qwen3_5_moe reuses qwen3_5's)
_LAYERS = {("mlx_lm.models.qwen3_5", "GatedDeltaNet"), ("mlx_lm.models.qwen3_next", "Qwen3NextGatedDeltaNet")}


def _unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 for strictly lower-triangular `a` (..., C, C), C a power of two, by the product
    series (I - a)(I + a^2)(I + a^4)...: a is nilpotent (a^C = 0), so the series is exact."""
    c = a.shape[-1]
    eye = mx.eye(c, dtype=a.dtype)
    n = -a
    inv = eye + n
    power = 2
    while power < c:
        n = n @ n
        inv = inv @ (eye + n)
        power *= 2
    return inv


@mx.compile
def _chunk_step(state, q, k, u, w, g_cum, attn_qk):
    """One chunk of the sequential part: outputs of the chunk and the state after it.

    state (B, H, Dv, Dk); q, k, w (B, H, C, Dk); u (B, H, C, Dv); g_cum (B, H, C) log decay from
    the chunk's start; attn_qk (B, H, C, C) the causal, decayed q.k scores inside the chunk."""
    st = state.swapaxes(-1, -2)  # (B, H, Dk, Dv)
    v_new = u - w @ st
    y = (q * mx.exp(g_cum)[..., None]) @ st + attn_qk @ v_new
    last = g_cum[..., -1:]
    k_dec = k * mx.exp(last - g_cum)[..., None]
    state = state * mx.exp(last)[..., None] + v_new.swapaxes(-1, -2) @ k_dec
    return y, state


def chunked_gated_delta(q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array,
                        state: Optional[mx.array] = None, mask: Optional[mx.array] = None,
                        chunk: int = CHUNK) -> tuple[mx.array, mx.array]:
    """The gated delta recurrence over a whole sequence, chunked; same contract as mlx-lm's
    `gated_delta_ops` except that the decay comes as its log (`log_g`, scalar per head).

    q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); log_g, beta (B, T, Hv); state (B, Hv, Dv, Dk), fp32;
    mask (B, T) bool or None: a masked token leaves the state as it was and outputs 0 (as
    mlx-lm's Metal kernel). Returns y (B, T, Hv, Dv) in q's dtype and the new fp32 state.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    out_dtype = q.dtype
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, -2)
        k = mx.repeat(k, Hv // Hk, -2)
    f32 = mx.float32
    q, k, v = (x.astype(f32) for x in (q, k, v))
    log_g, beta = log_g.astype(f32), beta.astype(f32)
    if mask is not None:  # a padded token: no decay, no write, so the state passes unchanged
        log_g = mx.where(mask[..., None], log_g, 0.0)
        beta = mx.where(mask[..., None], beta, 0.0)
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:  # zero tokens with no decay and no write change nothing
        q, k, v = (mx.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
        log_g, beta = (mx.pad(x, [(0, 0), (0, pad), (0, 0)]) for x in (log_g, beta))

    def chunks(x: mx.array) -> mx.array:  # (B, T, H, ...) -> (B, H, n, C, ...)
        x = x.reshape(B, n, chunk, Hv, *x.shape[3:])
        return x.transpose(0, 3, 1, 2, *range(4, x.ndim))

    q, k, v, log_g, beta = (chunks(x) for x in (q, k, v, log_g, beta))
    g_cum = mx.cumsum(log_g, axis=-1)  # (B, H, n, C)
    causal = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_))
    diff = g_cum[..., :, None] - g_cum[..., None, :]
    decay = mx.exp(mx.where(causal, diff, -mx.inf))  # e^(G_i - G_j) for j <= i, else 0
    kk = k @ k.swapaxes(-1, -2)
    strict = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_), k=-1)
    a = mx.where(strict, beta[..., None] * kk * decay, 0.0)
    t_inv = _unit_lower_inverse(a)
    u = t_inv @ (v * beta[..., None])
    w = t_inv @ (k * (beta * mx.exp(g_cum))[..., None])
    attn_qk = (q @ k.swapaxes(-1, -2)) * decay

    ys = []
    for i in range(n):
        y, state = _chunk_step(state, q[:, :, i], k[:, :, i], u[:, :, i], w[:, :, i],
                               g_cum[:, :, i], attn_qk[:, :, i])
        ys.append(y)
    y = mx.stack(ys, axis=2).reshape(B, Hv, n * chunk, Dv).swapaxes(1, 2)[:, :T]
    if mask is not None:
        y = mx.where(mask[..., None, None], y, 0.0)
    return y.astype(out_dtype), state


def log_decay(A_log: mx.array, a: mx.array, dt_bias: mx.array,
              lower_bound: float | None = None) -> mx.array:
    """log(g) of mlx-lm's `compute_g` / `compute_lower_bound_g`, without taking a log."""
    if lower_bound is None:
        return -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)
    return lower_bound * mx.sigmoid(mx.exp(A_log.astype(mx.float32)) * (a.astype(mx.float32) + dt_bias))


def gated_delta_update(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array,
                       A_log: mx.array, dt_bias: mx.array, state: Optional[mx.array] = None,
                       mask: Optional[mx.array] = None, *, use_kernel: bool = True,
                       lower_bound: float | None = None,
                       allow_neg_eigval: bool = False) -> tuple[mx.array, mx.array]:
    """mlx-lm's `gated_delta_update` (same signature), chunked for `MIN_TOKENS` or more tokens off
    Apple GPUs; fewer tokens on a CUDA GPU take gated_delta_cuda.py's kernel; everything else goes
    to mlx-lm's own function."""
    short = q.shape[1] < MIN_TOKENS
    cuda_step = short and use_kernel and gated_delta_cuda.fits(q, k, v, a)
    if (short and not cuda_step) or (use_kernel and backend() == "metal"):
        return mlx_gated_delta.gated_delta_update(
            q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
            lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if cuda_step:
        g = (mlx_gated_delta.compute_g(A_log, a, dt_bias) if lower_bound is None
             else mlx_gated_delta.compute_lower_bound_g(A_log, a, dt_bias, lower_bound))
        return gated_delta_cuda.gated_delta_step(q, k, v, g, beta, state, mask)
    return chunked_gated_delta(q, k, v, log_decay(A_log, a, dt_bias, lower_bound), beta, state, mask)


_CHUNKED_CLASSES: dict[type, type] = {}


def _chunked_class(cls: type) -> type:
    """A subclass of mlx-lm's linear-attention layer whose `__call__` is mlx-lm's own code with
    the name `gated_delta_update` bound to this module's: only layers switched to it change, and
    mlx-lm's module (and any model not switched, such as a baseline in a benchmark) stays as is."""
    if cls not in _CHUNKED_CLASSES:
        call = cls.__call__
        scope = dict(vars(sys.modules[call.__module__]))
        scope["gated_delta_update"] = gated_delta_update
        body = types.FunctionType(call.__code__, scope, call.__name__, call.__defaults__, call.__closure__)
        _CHUNKED_CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": body, "__module__": __name__,
                                                             "__qualname__": f"Chunked{cls.__name__}"})
    return _CHUNKED_CLASSES[cls]


def use_chunked_prefill(model: nn.Module, enabled: bool = True) -> int:
    """Switch every gated-delta layer of a Qwen3.5 / Qwen3-Next model to the chunked prefill (or,
    with `enabled=False`, back to mlx-lm's own path); returns how many layers changed."""
    switched = 0
    for _, module in model.named_modules():
        cls = type(module)
        if not enabled and cls in _CHUNKED_CLASSES.values():
            module.__class__ = cls.__bases__[0]
            switched += 1
        elif (enabled and (cls.__module__, cls.__name__) in _LAYERS
              and "gated_delta_update" in cls.__call__.__code__.co_names):
            module.__class__ = _chunked_class(cls)
            switched += 1
    return switched
