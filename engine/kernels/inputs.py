"""Small arrays our kernels take beside their data: int32 views of a cache's per-row arrays,
constants made once, and the one-token step's position.

MLX's CUDA allocator keeps every array of up to 8 bytes in one small pool of managed memory. The
host writes a page of that pool whenever it makes such an array (a token, a position) and takes
the page back whenever it reads one (a sampled token), so a kernel reading a value that lives
there waits on the page's migration back to the device: on an H100 a kernel that only read a
position the host had just written took 17-18 us, 2.7 us with a 16-byte array made once, and a
decode step whose norms' eps and attention's position lived in that pool spent ~1.2 ms a step so
(bench/kernel_probe.py; docs/gpu.md). So a one-value input here is WORDS values, the value first
(kernels read element 0): 16 bytes, out of that pool."""

from __future__ import annotations

import functools

import mlx.core as mx

WORDS = 4  # the elements of a one-value kernel input (16 bytes: more than the pool's 8)


def int32(a: mx.array) -> mx.array:
    """`a` as int32 (itself when it is already)."""
    return a if a.dtype == mx.int32 else a.astype(mx.int32)


def value(v: float, dtype: mx.Dtype) -> mx.array:
    """`v` as a kernel input of one value: WORDS elements, `v` first (see the module docstring)."""
    return mx.array([v] + [0] * (WORDS - 1), dtype=dtype)


@functools.lru_cache(maxsize=512)
def constant(v: float, dtype: mx.Dtype) -> mx.array:
    """A one-value kernel input made once per value (a step's layers share their scale, a norm's
    eps, a buffer's width or a row count); made from host data, so any thread may use it."""
    return value(v, dtype)
