"""The 8-bit KV cache (`mlxchat serve --kv-bits 8`, or `MLXCHAT_KV_BITS=8`): keys and values
stored as 8-bit codes with a scale and a bias per group of GROUP_SIZE values (MLX's affine
quantization, the layout mlx-lm's `QuantizedKVCache` keeps), about 0.28-0.31 of the fp32 cache's
bytes and 0.56-0.63 of an fp16 one's.

On the CPU, where activations are fp32 (our kernel layout, engine/kernels/layout.py, and the fp32
layout, cpu_layout.py), each layer's cache is a `KV8Cache` (one sequence) or a `SlotKV8Cache`
(the decode batch): mlx-lm's `KVCache` / our `SlotKVCache` (engine/slot_cache.py, mlx-lm's
`BatchKVCache` layout) whose arrays hold one packed uint32 row per position (`pack`: the D / 4
words of codes, then the D / GROUP_SIZE fp32 scales, then the biases, bit for bit). So every cache edit mlx-lm makes on the position axis (growing, trimming,
merging rows left-padded, extending, filtering, extracting a row, the padded prefill's roll) and
every edit of the prefix cache and the snapshot files works on them unchanged. Our attention
kernels read the packed rows directly (`store`, then the kernels' decode, prefill and fused-layer
attention dequantize them per head); mlx-lm's own attention code (other model families, and the
steps our kernels do not take) gets dequantized fp32 keys and values from `update_and_fetch`.

Each token's keys and values are quantized on their own (per position, per head, per group), so
a row's attention is the same whatever else shares the batch. On the GPU, and on the CPU for a
model run in half precision, the cache is mlx-lm's `QuantizedKVCache`, whose
attention mlx-lm's models run themselves (at the same group size, 0.56 of an fp16 cache's bytes,
where the device's MLX runs it; else the next larger group that it runs, `quantized_group`, or the
full cache with a warning); the prefix cache snapshots it (engine/model_cache.py's
`QuantizedKVCache` kind), but it cannot join a decode batch.

The cache's format is part of a snapshot file's identity (engine/prefix_cache/snapshot_files.py,
`kv_format`): a snapshot written under one format is refused, and recomputed, under the other.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ..slot_cache import SlotKVCache

log = logging.getLogger(__name__)

BITS = 8
GROUP_SIZE = 32  # per-group scales as fine as llama.cpp's q8_0 blocks
ENV = "MLXCHAT_KV_BITS"
FULL = "full"


def kv_bits() -> int | None:
    """The KV cache's bits asked for in this process (`MLXCHAT_KV_BITS`): 8, or None for the full
    cache. Raises ValueError for anything else."""
    value = os.environ.get(ENV, "").strip()
    if value in ("", "0", "16", "32", "full"):
        return None
    if value != str(BITS):
        raise ValueError(f"{ENV}={value!r}: only 8 is supported (or unset for the full cache)")
    return BITS


def pack(x: mx.array) -> mx.array:
    """fp32 (..., D) -> uint32 (..., D / 4 + 2 * D / GROUP_SIZE): codes, scales, biases."""
    w, scales, biases = mx.quantize(x.astype(mx.float32), group_size=GROUP_SIZE, bits=BITS)
    return mx.concatenate([w, mx.view(scales, mx.uint32), mx.view(biases, mx.uint32)], axis=-1)


def head_dim(packed: mx.array) -> int:
    """The D a packed row of this width holds."""
    width = packed.shape[-1]  # D / 4 + 2 * D / GROUP_SIZE
    return width * 4 * GROUP_SIZE // (GROUP_SIZE + 8)


def unpack(packed: mx.array) -> mx.array:
    """The fp32 values of packed rows: code * scale + bias (two roundings, as the kernels do)."""
    D = head_dim(packed)
    n, g = D // 4, D // GROUP_SIZE
    codes = mx.view(packed[..., :n], mx.uint8).astype(mx.float32)
    scales = mx.view(packed[..., n:n + g], mx.float32)
    biases = mx.view(packed[..., n + g:], mx.float32)
    shape = (*codes.shape[:-1], g, GROUP_SIZE)
    out = codes.reshape(shape) * scales[..., None] + biases[..., None]
    return out.reshape(*codes.shape)


class _Packed:
    """What the 8-bit caches add to mlx-lm's: packing on the way in."""

    def store(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append fp32 keys and values; returns every position's packed rows (our kernels)."""
        return super().update_and_fetch(pack(keys), pack(values))  # type: ignore[misc]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """As mlx-lm's: append, then every position's keys and values (dequantized, fp32)."""
        k, v = self.store(keys, values)
        return unpack(k), unpack(v)


class KV8Cache(_Packed, KVCache):
    """One sequence's 8-bit keys and values (mlx-lm's `KVCache` holding packed rows)."""

    @classmethod
    def merge(cls, caches: list[Any]) -> "SlotKV8Cache":
        return SlotKV8Cache.merge(caches)


class SlotKV8Cache(_Packed, SlotKVCache):
    """The decode batch's 8-bit keys and values (engine/slot_cache.py's `SlotKVCache` holding
    packed rows)."""

    row_cache = KV8Cache


def packed_kv(layer: Any) -> bool:
    """Whether `layer` is one of our 8-bit caches (its `store` gives packed rows)."""
    return type(layer) in (KV8Cache, SlotKV8Cache)


def _float_dtypes(model: nn.Module) -> list[mx.Dtype]:
    from mlx.utils import tree_flatten

    return [p.dtype for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)]


def _fp32(model: nn.Module) -> bool:
    # our kernel layout keeps quantized layers' scales in their own dtype: count the rest
    return mx.default_device().type == mx.DeviceType.cpu and mx.float32 in _float_dtypes(model)


def quantized_group(dim: int, dtype: mx.Dtype) -> tuple[int | None, str]:
    """The first group size (GROUP_SIZE, then mlx-lm's default 64, then 128) at which mlx-lm's
    quantized attention runs on this device for heads of `dim` values in `dtype`, tried as a model
    runs it (a grouped-query cache: one token, a prompt chunk, one more token); (None, why) when
    none does. MLX's CUDA backend lacks some of the quantized products this needs."""
    why = ""
    for group in (GROUP_SIZE, 64, 128):
        if dim % group:
            continue
        try:
            cache = QuantizedKVCache(group_size=group, bits=BITS)
            for n in (1, 7, 1):
                kv = mx.ones((1, 1, n, dim), dtype)
                keys, values = cache.update_and_fetch(kv, kv)
                mx.eval(quantized_scaled_dot_product_attention(
                    mx.ones((1, 2, n, dim), dtype), keys, values, scale=1.0,
                    mask="causal" if n > 1 else None, group_size=group, bits=BITS))
            return group, ""
        except (RuntimeError, ValueError) as exc:
            why = f"group {group}: {exc}"
    return None, why


def _head_dim(config: dict[str, Any]) -> int | None:
    text = config.get("text_config", config)
    if text.get("head_dim"):
        return int(text["head_dim"])
    hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
    return int(hidden) // int(heads) if hidden and heads else None


def use_kv_bits(model: nn.Module, config: dict[str, Any], bits: int | None) -> str:
    """Give `model` 8-bit KV caches (`bits` 8) through its `make_cache`, which mlx-lm's
    `make_prompt_cache` and so every cache the engine makes asks; returns the cache's format as
    snapshot files record it (`kv_format`). Layers whose cache is not a plain `KVCache`
    (recurrent, rotating) keep theirs."""
    if bits is None:
        return FULL
    dim = _head_dim(config)
    if dim is None or dim % GROUP_SIZE:
        log.warning("keeping the full KV cache: head dimension %s is not a multiple of %d", dim,
                    GROUP_SIZE)
        return FULL
    if _fp32(model):
        factory: Callable[[], Any] = KV8Cache
        fmt = f"kv8-affine-g{GROUP_SIZE}"
    else:
        group, why = quantized_group(dim, next(iter(_float_dtypes(model)), mx.float16))
        if group is None:
            log.warning("keeping the full KV cache: mlx-lm's 8-bit cache does not run on this "
                        "device (%s)", why)
            return FULL
        fmt = f"mlx-lm-quantized-{BITS}-g{group}"

        def factory() -> QuantizedKVCache:
            return QuantizedKVCache(group_size=group, bits=BITS)
    own = getattr(model, "make_cache", None)
    layers = len(model.layers)

    def make_cache() -> list[Any]:
        cache = own() if own is not None else [KVCache() for _ in range(layers)]
        return [factory() if type(c) is KVCache else c for c in cache]

    make_cache.kv_format = fmt  # type: ignore[attr-defined]
    model.make_cache = make_cache
    log.info("KV cache: %d-bit (%s)", bits, fmt)
    return fmt


def kv_format(model: nn.Module) -> str:
    """The KV cache format `use_kv_bits` gave `model` ("full" when none)."""
    return getattr(getattr(model, "make_cache", None), "kv_format", FULL)
