"""GGUF tensors to MLX arrays, quantized ones as MLX affine (weight, scales, biases) triples.

Q4_0, Q4_1 and Q8_0 blocks are 32 weights sharing one scale (and offset), which is MLX's affine
layout with group size 32: they are repacked exactly. Every other quantized type (the K-quants
above all) is dequantized with the `gguf` package, llama.cpp's own reference code, and quantized
again with `mx.quantize`: 4 bits for types of 5 bits or fewer, 8 bits for the rest. `mx.load`
cannot do this itself: it hands K-quants over as fp16, its Q4_K decoding disagrees with llama.cpp's,
and it refuses Q5_0 (which llama.cpp uses in K-quant files for rows not a multiple of 256).
"""

import numpy as np
import mlx.core as mx
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

GROUP_SIZE = 32
FLOAT_TYPES = {T.F32, T.F16, T.BF16}
# Requantized width per source type; types not listed here get 8 bits.
REQUANT_BITS = {T.Q4_K: 4, T.Q5_K: 4, T.Q2_K: 4, T.Q3_K: 4, T.IQ4_NL: 4, T.IQ4_XS: 4}


def _pack(q: np.ndarray, bits: int) -> mx.array:
    """Unsigned codes (..., n) to MLX's packing: element j of each uint32 in its bits j*bits..."""
    q = q.astype(np.uint8)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return mx.array(np.ascontiguousarray(q).view(np.uint32))


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    return raw.reshape(*raw.shape[:-1], raw.shape[-1] // block_bytes, block_bytes)


def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _affine(codes: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int) -> tuple:
    shape = codes.shape[:-2] + (codes.shape[-2] * codes.shape[-1],)
    return (_pack(codes.reshape(shape), bits), mx.array(scale.astype(np.float16)),
            mx.array(bias.astype(np.float16)), bits)


def _repack_q8_0(raw: np.ndarray) -> tuple:
    b = _blocks(raw, 34)  # fp16 d, 32 x int8
    d = _half(b[..., 0:2])
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.int16) + 128
    return _affine(q, d, -128 * d, 8)


def _repack_q4(raw: np.ndarray, with_min: bool) -> tuple:
    b = _blocks(raw, 20 if with_min else 18)  # fp16 d, [fp16 m], 16 bytes: low nibbles first
    d = _half(b[..., 0:2])
    packed = b[..., 4:] if with_min else b[..., 2:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
    bias = _half(b[..., 2:4]) if with_min else -8 * d
    return _affine(q, d, bias, 4)


def _requantize(raw: np.ndarray, qtype: T) -> tuple:
    bits = REQUANT_BITS.get(qtype, 8)
    values = mx.array(dequantize(raw, qtype).astype(np.float32))
    w, scales, biases = mx.quantize(values, group_size=GROUP_SIZE, bits=bits)
    return w, scales.astype(mx.float16), biases.astype(mx.float16), bits


def to_mlx(raw: np.ndarray, qtype: T) -> mx.array | tuple[mx.array, mx.array, mx.array, int]:
    """A float tensor as an array; a quantized one as (weight, scales, biases, bits).

    `raw` is the tensor as `gguf.GGUFReader` gives it: rows of bytes for quantized types.
    """
    if qtype in FLOAT_TYPES:
        if qtype == T.BF16:
            return mx.array(raw.view(np.uint16)).view(mx.bfloat16)
        return mx.array(raw)
    if qtype == T.Q8_0:
        return _repack_q8_0(raw)
    if qtype in (T.Q4_0, T.Q4_1):
        return _repack_q4(raw, with_min=qtype == T.Q4_1)
    return _requantize(raw, qtype)
