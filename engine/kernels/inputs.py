"""Small arrays our kernels take beside their data: int32 views of a cache's per-row arrays and
one-element constants made once."""

from __future__ import annotations

import functools

import mlx.core as mx


def int32(a: mx.array) -> mx.array:
    """`a` as int32 (itself when it is already)."""
    return a if a.dtype == mx.int32 else a.astype(mx.int32)


@functools.lru_cache(maxsize=512)
def constant(value: float, dtype: mx.Dtype) -> mx.array:
    """A one-element kernel input, made once per value (a step's layers share their scale, a
    buffer's width or a row count); made from host data, so any thread may use it."""
    return mx.array([value], dtype=dtype)
