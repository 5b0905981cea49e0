"""A batched decode step's attention over the decode batch's cache, one kernel a layer on CUDA.

A batched step over `SlotKVCache` (engine/slot_cache.py) gives each row one query against its
own keys: columns `left_padding[r]` to `left_padding[r] + offset[r] - 1` of slot r. mlx-lm passes
the rows' padding to `scaled_dot_product_attention` as an array mask, and MLX's CUDA backend has
no fused kernel for a masked single-query attention: it runs the unfused ops (two batched
matrix-vector products, the mask's `where`, a softmax, copies: ~10 kernels a layer; on an H100 at
32 rows of Qwen3-8B, ~2.5 ms of a 15 ms step, measured with Nsight Compute). `attend_rows` is one
kernel (two where a row's keys are split further) that reads each row's own keys only, with no
mask and no work on the padding: split single-query attention, online softmax, grouped-query heads
sharing each key load (the device code: `attend_rows_impl` in cuda/fused_decode.cuh), writing the
output in the layout the output projection reads. `attention_rows` goes further: from the
stacked q/k/v product, one kernel also norms (Qwen3) and rotates each row's queries and new key
and writes the new key and value into the cache's buffers in place (attention_rows_impl, the
batched form of the one-row step's attention_impl), where q/k norms, two RoPEs and the cache's
two writes were six more kernels a layer; the GPU layout's attention takes it wherever its RoPE
is one the kernel computes (`RowsLayer.of`), `attend_rows` elsewhere.

`attend_rows_ref` and `attention_rows_ref` are the same computations in MLX ops on any device
(mlx-lm's norms, RoPE and the cache's `update_and_fetch`), taking the same arguments. `enabled()`
says whether the GPU layout's attention takes the kernels: on CUDA, once `check()` found both
equal to their references on this device (outputs, and the buffers `attention_rows` wrote; a
kernel that does not compile or that differs leaves the unfused ops in place, with a warning);
`MLXCHAT_CUDA_BATCH_ATTENTION=0` turns them off, `=ref` runs the `attend_rows` reference instead
on any device (for tests).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .. import device
from .device_check import CheckedPerDtype
from .inputs import constant, int32
from .rope import inverse_frequencies

SWITCH = "MLXCHAT_CUDA_BATCH_ATTENTION"
TOLERANCE = 2e-2  # of the reference's largest output, the check's bound (16-bit outputs)

def attend_rows(queries: mx.array, keys: mx.array, values: mx.array, left_padding: mx.array,
                offset: mx.array, scale: float) -> mx.array:
    """Attention of `queries` (rows, heads, 1, D) over each row's keys in the buffers `keys` /
    `values` (slots >= rows, kv_heads, width, D), row r at slot r, columns `left_padding[r]` ..
    `left_padding[r] + offset[r] - 1` (both (rows,) int32, on the device). Returns (rows, 1,
    heads * D)."""
    from .fused_cuda import keys_at_once, splits

    rows, heads, _, dim = queries.shape
    kv, width = keys.shape[1], keys.shape[2]
    s, group = splits(rows * kv, width), heads // kv
    return _rows_kernel("attend_rows", ["q", "kc", "vc", "lp", "off", "dims", "fp"],
                        "attend_rows_impl<T, D, G, HKV, S, KU, WARPS>(q, kc, vc, lp, off, dims, fp, pm, pl, pa, y);",
                        [queries, keys, values, int32(left_padding), int32(offset), constant(width, mx.int32),
                         constant(scale, mx.float32)],
                        [("T", queries.dtype), ("D", dim), ("G", group), ("HKV", kv), ("S", s),
                         ("KU", keys_at_once(dim, group))], rows, heads, kv, dim, s, queries.dtype)


@dataclass(frozen=True)
class RowsLayer:
    """What `attention_rows` reads of an attention module besides its cache: the q/k norms'
    weights (any array of the activations' dtype where the model has none: unread), RoPE's
    inverse frequencies per rotated pair (float32) and (norm eps, RoPE's position scale, the
    attention's scale) as float32 arrays, the rotated dims and RoPE's kind."""

    qn: mx.array
    kn: mx.array
    inv_freq: mx.array
    params: mx.array
    heads: int
    kv_heads: int
    rotated: int
    traditional: bool
    norm: bool

    @classmethod
    def of(cls, attn: Any, dtype: mx.Dtype) -> "RowsLayer | None":
        """For a StackedAttention (engine/kernels/gpu_layout.py) in activations of `dtype`, or None
        where its RoPE is of a kind the kernel does not compute."""
        freqs = inverse_frequencies(attn.rope)
        if freqs is None:
            return None
        norm = "q_norm" in attn
        unread = mx.zeros((1,), dtype)
        layer = cls(attn.q_norm.weight if norm else unread, attn.k_norm.weight if norm else unread,
                    mx.array(freqs[0]), mx.array([attn.q_norm.eps if norm else 0.0, freqs[1], attn.scale],
                                                 dtype=mx.float32),
                    attn.n_heads, attn.n_kv_heads, attn.rope.dims, bool(attn.rope.traditional), norm)
        # evaluated here: an array left lazy is bound to this thread's stream (MLX's streams are
        # per thread), and the steps may run in another
        mx.eval(layer.qn, layer.kn, layer.inv_freq, layer.params)
        return layer


def attention_rows(layer: RowsLayer, qkv: mx.array, cache: Any, split: int | None = None) -> mx.array:
    """A batched decode step's attention in one kernel (two where rows are split, as
    `attend_rows`): from the stacked q/k/v product `qkv` (rows, 1, (heads + 2 kv_heads) * D) over
    a SlotKVCache (engine/slot_cache.py), each row's queries and new key normed (Qwen3) and
    rotated at its position, its new key and value written into the cache's buffers in place at
    its next column, and its queries attended over its own keys (attention_rows_impl in
    cuda/fused_decode.cuh): what q/k norms, RoPE, the cache update and `attend_rows` do in five
    or more kernels. Returns (rows, 1, heads * D). `split` (a power of two) overrides how many
    splits each row's keys are cut into (`fused_cuda.splits`), for the bench."""
    from .fused_cuda import keys_at_once, splits

    rows = qkv.shape[0]
    heads, kv = layer.heads, layer.kv_heads
    dim = qkv.shape[-1] // (heads + 2 * kv)
    cache.reserve(1, (cache.keys, cache.values))
    width = cache.keys.shape[2]
    s, group = split or splits(rows * kv, width), heads // kv
    y, offset = _rows_kernel("attention_rows", ["qkv", "qn", "kn", "invf", "fp", "lp", "off", "dims", "kc", "vc"],
                             "attention_rows_impl<T, D, G, HKV, ROT, TRAD, NORM, S, KU, WARPS>"
                             "(qkv, qn, kn, invf, fp, lp, off, dims, kc, vc, pm, pl, pa, y, offn);",
                             [qkv, layer.qn, layer.kn, layer.inv_freq, layer.params, int32(cache.left_padding),
                              int32(cache.offset), constant(width, mx.int32), cache.keys, cache.values],
                             [("T", qkv.dtype), ("D", dim), ("G", group), ("HKV", kv), ("ROT", layer.rotated),
                              ("TRAD", layer.traditional), ("NORM", layer.norm), ("S", s),
                              ("KU", keys_at_once(dim, group))],
                             rows, heads, kv, dim, s, qkv.dtype, offsets=True)
    cache.advance(1, offset)  # the kernel wrote each row's next offset
    return y


def _rows_kernel(name: str, inputs: list[str], source: str, arrays: list[mx.array], template: list[tuple[str, Any]],
                 rows: int, heads: int, kv: int, dim: int, s: int, dtype: mx.Dtype, offsets: bool = False) -> Any:
    """A batched step's attention kernel (grid: `s` splits x kv heads x rows) and, where its rows'
    keys are split, the kernel adding the splits up: (rows, 1, heads * dim) in `dtype`; with
    `offsets`, (that, the rows' next offsets: the kernel's output `offn`, (rows,) int32)."""
    from .fused_cuda import WARPS, _kernel

    parts = 1 if s == 1 else rows * heads * s
    names = ["pm", "pl", "pa", "y"] + (["offn"] if offsets else [])
    pm, pl, pa, y, *offn = _kernel(name, inputs, names, source)(
        inputs=arrays, template=template, grid=(s * WARPS * 32, kv, rows), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(parts,), (parts,), (parts * dim,), (rows, 1, heads * dim)] + ([(rows,)] if offsets else []),
        output_dtypes=[mx.float32, mx.float32, mx.float32, dtype] + ([mx.int32] if offsets else []))
    y = y if s == 1 else _combine(pm, pl, pa, rows, heads, dim, s, dtype)
    return (y, offn[0]) if offsets else y


def _combine(pm: mx.array, pl: mx.array, pa: mx.array, rows: int, heads: int, dim: int, s: int,
             dtype: mx.Dtype) -> mx.array:
    """The S splits' partial sums of each (row, head) added up: (rows, 1, heads * dim)."""
    from .fused_cuda import _kernel

    combine = _kernel("combine_rows", ["pm", "pl", "pa"], ["y"], "combine_rows_impl<T, D, HQ, S>(pm, pl, pa, y);")
    return combine(inputs=[pm, pl, pa], template=[("T", dtype), ("D", dim), ("HQ", heads), ("S", s)],
                   grid=(rows * heads * dim, 1, 1), threadgroup=(dim, 1, 1),
                   output_shapes=[(rows, 1, heads * dim)], output_dtypes=[dtype])[0]


def attend_rows_ref(queries: mx.array, keys: mx.array, values: mx.array, left_padding: mx.array,
                    offset: mx.array, scale: float) -> mx.array:
    """`attend_rows` in MLX ops (the same arguments; the rows' columns read back to the host):
    grouped-query heads repeated, softmax in fp32."""
    rows, heads, _, dim = queries.shape
    group = heads // keys.shape[1]
    out = []
    for r, (first, n) in enumerate(zip(left_padding.tolist(), offset.tolist())):
        k = mx.repeat(keys[r, :, first:first + n, :], group, axis=0).astype(mx.float32)
        v = mx.repeat(values[r, :, first:first + n, :], group, axis=0).astype(mx.float32)
        q = queries[r].astype(mx.float32) * scale  # (heads, 1, D)
        w = mx.softmax(q @ k.transpose(0, 2, 1), axis=-1)
        out.append((w @ v).astype(queries.dtype).reshape(1, heads * dim))
    return mx.stack(out)


def attention_rows_ref(layer: RowsLayer, qkv: mx.array, cache: Any) -> mx.array:
    """`attention_rows` in MLX ops, as mlx-lm's attention and the cache's update do it (the same
    arguments): the q/k norms (mx.fast.rms_norm), RoPE at each row's offset (mx.fast.rope), the
    cache's `update_and_fetch`, then `attend_rows_ref`."""
    rows = qkv.shape[0]
    heads, kv = layer.heads, layer.kv_heads
    dim = qkv.shape[-1] // (heads + 2 * kv)
    q, k, v = mx.split(qkv, [heads * dim, (heads + kv) * dim], axis=-1)
    q, k, v = q.reshape(rows, 1, heads, dim), k.reshape(rows, 1, kv, dim), v.reshape(rows, 1, kv, dim)
    if layer.norm:
        eps = layer.params[0].item()
        q, k = mx.fast.rms_norm(q, layer.qn, eps), mx.fast.rms_norm(k, layer.kn, eps)
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    rope = functools.partial(mx.fast.rope, dims=layer.rotated, traditional=layer.traditional, base=None,
                             scale=layer.params[1].item(), offset=cache.offset, freqs=1.0 / layer.inv_freq)
    q, k = rope(q), rope(k)
    cache.update_and_fetch(k, v)
    return attend_rows_ref(q, cache.keys, cache.values, cache.left_padding, cache.offset, layer.params[2].item())


def mode() -> str:
    """"off", "ref" (the reference on any device) or "on" (the kernel; CUDA only), read once a
    process by `enabled()` (tests call `reset()` after changing it)."""
    value = os.environ.get(SWITCH, "").strip().lower()
    if value == "ref":
        return "ref"
    if value == "0" or device.backend() != "cuda":
        return "off"
    return "on"


def enabled(dtype: mx.Dtype = mx.bfloat16) -> str | None:
    """Which attention the GPU layout's batched decode steps in `dtype` take: "kernel" (checked
    once per dtype on this device), "ref", or None (mlx-lm's masked attention)."""
    how = _CHECKED.mode()
    if how == "ref":
        return "ref"
    if how == "off" or dtype not in (mx.bfloat16, mx.float16):
        return None
    return "kernel" if _CHECKED.passed(dtype) else None


def reset() -> None:
    """Forget the switch's value and the check's outcome (both are read once a process)."""
    _CHECKED.reset()


def check(dtype: mx.Dtype = mx.bfloat16) -> dict[str, Any]:
    """The kernels against their references on random rows of different lengths (split in many,
    in two and not at all; head dims 64 and 128): `attend_rows`, and `attention_rows` with and
    without q/k norms, its output and the buffers it wrote; the largest difference over the
    reference's largest value, `kept` when within TOLERANCE; a kernel that does not compile or
    run gives the `error`."""
    worst = 0.0
    try:
        key = mx.random.key(7)
        for rows, heads, kv, dim, padding, length in ((3, 8, 2, 64, [0, 5, 11], 40),
                                                      (20, 32, 8, 128, [i % 7 for i in range(20)], 29),
                                                      (32, 32, 8, 128, [i % 5 for i in range(32)], 9)):
            k1, k2, k3, key = mx.random.split(key, 4)
            q = mx.random.normal((rows, heads, 1, dim), key=k1).astype(dtype)
            keys = mx.random.normal((rows + 2, kv, length + 8, dim), key=k2).astype(dtype)
            values = mx.random.normal((rows + 2, kv, length + 8, dim), key=k3).astype(dtype)
            lp = mx.array(padding, dtype=mx.int32)
            off = mx.array([length - p for p in padding], dtype=mx.int32)
            got = attend_rows(q, keys, values, lp, off, dim ** -0.5).astype(mx.float32)
            ref = attend_rows_ref(q, keys, values, lp, off, dim ** -0.5).astype(mx.float32)
            worst = max(worst, _rel(got, ref))
            for norm in (True, False):  # the same rows through attention_rows, each side its own cache
                layer = _random_layer(heads, kv, dim, norm, dtype, key)
                qkv = mx.random.normal((rows, 1, (heads + 2 * kv) * dim), key=k1).astype(dtype)
                mine, theirs = (_slot_cache(keys, values, padding, length) for _ in range(2))
                got = attention_rows(layer, qkv, mine)
                ref = attention_rows_ref(layer, qkv, theirs)
                worst = max(worst, _rel(got, ref), _rel(mine.keys[:rows], theirs.keys[:rows]),
                            _rel(mine.values[:rows], theirs.values[:rows]))
                if not mx.array_equal(mine.offset, theirs.offset).item():  # the rows' next offsets
                    return {"error": f"offsets {mine.offset.tolist()} where {theirs.offset.tolist()}", "kept": False}
    except Exception as exc:  # noqa: BLE001 - a kernel that does not compile or run here
        return {"error": f"{type(exc).__name__}: {exc}"[:2000], "kept": False}
    return {"rel_diff": worst, "kept": worst < TOLERANCE}


def _rel(got: mx.array, ref: mx.array) -> float:
    """The largest difference over the reference's largest value."""
    got, ref = got.astype(mx.float32), ref.astype(mx.float32)
    return (mx.abs(got - ref).max() / mx.abs(ref).max()).item()


def _random_layer(heads: int, kv: int, dim: int, norm: bool, dtype: mx.Dtype, key: mx.array) -> RowsLayer:
    """A RowsLayer of random q/k norm weights, Qwen3's RoPE over 3/4 of the head (half-rotated)."""
    import numpy as np

    rotated = dim * 3 // 4 // 2 * 2
    weights = (1.0 + 0.1 * mx.random.normal((2, dim), key=key)).astype(dtype)
    inv = (1e6 ** -(np.arange(rotated // 2, dtype=np.float32) / (rotated // 2))).astype(np.float32)
    return RowsLayer(weights[0], weights[1], mx.array(inv), mx.array([1e-6, 1.0, dim ** -0.5], dtype=mx.float32),
                     heads, kv, rotated, False, norm)


def _slot_cache(keys: mx.array, values: mx.array, padding: list[int], length: int) -> Any:
    """A SlotKVCache of len(padding) rows holding copies of `keys` / `values` (free slots past
    them), written up to column `length`, row r from column padding[r] on."""
    from ..slot_cache import SlotKVCache

    cache = SlotKVCache(list(padding))
    cache.keys, cache.values = keys + 0, values + 0  # buffers of its own: the kernel writes in place
    mx.eval(cache.keys, cache.values)
    cache._idx = length
    cache._sync()
    return cache


_CHECKED = CheckedPerDtype(lambda dtype: check(dtype), "batched decode attention runs MLX's ops", lambda: mode())
