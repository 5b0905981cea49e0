"""Mixed steps: the decode rows of a batch and one prompt's prefill chunk in one model call, as
vLLM's chunked prefill runs them.

A decode step of a few rows is bound by reading the weights; a prefill chunk of a few hundred
tokens reads the same weights once more. Fed together, every matmul reads its weights once for
both: the rows' tokens and the chunk's are one flattened sequence of `rows + C` tokens through the
embedding, the norms, the projections and the MLP, and only attention is split: the rows attend
to their own rows of the batch cache (engine/slot_cache.py's `SlotKVCache`, one query each), the
chunk to its prompt's own cache (causal). On the H200 (Qwen3-8B bf16, bench/results/cuda-h200-2026-issue33-*)
8 decode rows (11 ms) and a 512-token chunk (17 ms) cost 19 ms in one call against 28 ms apart.

Each row's and the chunk's results are those of their own calls up to the order a kernel sums
in: the same weights, the same positions (each part's RoPE offset is its own cache's), the same
masks. Supported: mlx-lm's llama, qwen2 and qwen3 models (and engine/kernels/gpu_layout.py's
stacked attention over them) with full attention on every layer and a plain head
(engine/kernels/head.py `split_head`); any other model prefills in calls of its own.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache

from ..kernels.head import split_head
from ..slot_cache import SlotKVCache

BODIES = (llama.LlamaModel, qwen2.Qwen2Model, qwen3.Qwen3Model)


def supports(model: nn.Module) -> bool:
    """Whether `model` can run mixed steps (see the module's docstring)."""
    parts = split_head(model)
    if parts is None or not isinstance(parts[0], BODIES):
        return False
    body = parts[0]
    if getattr(body, "swa_idx", None) is not None:  # sliding-window layers: masks of their own
        return False
    for layer in body.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, a) for a in ("rope", "n_heads", "n_kv_heads",
                                                               "scale", "o_proj")):
            return False
        if not (hasattr(attn, "qkv_proj") or hasattr(attn, "q_proj")):
            return False
    return True


def cache_fits(batch_cache: list[Any], chunk_cache: list[Any]) -> bool:
    """Whether the caches are the kinds a mixed step updates (plain keys and values)."""
    return all(type(b) in (BatchKVCache, SlotKVCache) for b in batch_cache) and \
        all(type(c) is KVCache for c in chunk_cache)


def _qkv(attn: nn.Module, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Queries, keys and values (1, N, heads, head_dim) of the flattened tokens `x` (1, N, D)."""
    N = x.shape[1]
    if hasattr(attn, "qkv_proj"):  # engine/kernels/gpu_layout.py StackedAttention
        q, k, v = mx.split(attn.qkv_proj(x), attn.split, axis=-1)
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q = q.reshape(1, N, attn.n_heads, -1)
    k = k.reshape(1, N, attn.n_kv_heads, -1)
    v = v.reshape(1, N, attn.n_kv_heads, -1)
    if "q_norm" in attn:  # qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v


def _attend(attn: nn.Module, q: mx.array, k: mx.array, v: mx.array, cache: Any,
            mask: Any) -> mx.array:
    """Attention of (B, L, heads, dim) queries over `cache` after adding k, v: (B, L, heads*dim)."""
    B, L = q.shape[:2]
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    q = attn.rope(q, offset=cache.offset)
    k = attn.rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(B, L, -1)


def _mixed_attention(attn: nn.Module, x: mx.array, rows: int, batch_layer: Any, chunk_layer: Any,
                     masks: tuple[Any, Any]) -> mx.array:
    q, k, v = _qkv(attn, x)
    split = lambda t: (t[:, :rows].reshape(rows, 1, *t.shape[2:]), t[:, rows:])
    (qd, qc), (kd, kc), (vd, vc) = split(q), split(k), split(v)
    decoded = _attend(attn, qd, kd, vd, batch_layer, masks[0]).reshape(1, rows, -1)
    chunk = _attend(attn, qc, kc, vc, chunk_layer, masks[1])
    return attn.o_proj(mx.concatenate([decoded, chunk], axis=1))


def mixed_call(model: nn.Module, row_tokens: mx.array, batch_cache: list[Any],
               chunk_tokens: mx.array, chunk_cache: list[Any],
               chunk_logits: bool) -> tuple[mx.array, mx.array | None]:
    """One model call over the batch's next tokens `row_tokens` (rows,) and a prefill chunk
    `chunk_tokens` (C,) of one prompt: the rows' logits (rows, vocab), and the logits (1, vocab) of
    the chunk's last token when `chunk_logits` (else None). Both caches are updated, as the two
    calls apart would update them."""
    body, head = split_head(model)
    rows, C = row_tokens.shape[0], chunk_tokens.shape[0]
    tokens = mx.concatenate([row_tokens.astype(mx.uint32), chunk_tokens.astype(mx.uint32)])
    h = body.embed_tokens(tokens[None])
    masks = (create_attention_mask(mx.zeros((rows, 1, 1)), batch_cache[0]),
             create_attention_mask(mx.zeros((1, C, 1)), chunk_cache[0]))
    for layer, batch_layer, chunk_layer in zip(body.layers, batch_cache, chunk_cache):
        r = _mixed_attention(layer.self_attn, layer.input_layernorm(h), rows, batch_layer,
                             chunk_layer, masks)
        h = h + r
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    picked = h[:, :rows] if not chunk_logits else \
        mx.concatenate([h[:, :rows], h[:, -1:]], axis=1)
    logits = head(body.norm(picked))[0]
    return logits[:rows], (logits[rows:] if chunk_logits else None)
