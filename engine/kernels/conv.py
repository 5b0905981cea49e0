"""1-D convolutions that MLX's CPU backend runs slowly, as plain matrix products.

MLX's CPU `conv1d` with a dilation above 1 and its `conv_transpose1d` take a direct loop that is
~30x slower than its undilated convolution (a 256-channel, 3-tap dilated convolution over 250
frames: ~0.2 s against ~7 ms here). Kokoro's vocoder is made of them, so a sentence of speech took
seconds. The same sums as products:

- dilated: `y = sum_j x[j*d : j*d + L_out] @ W_j^T`, one product per tap;
- transposed (stride s): each input frame's taps `x @ W^T` (K of them) overlap-added into the
  output, s frames apart, then the padding cropped.

Each output is the same sum of the same products as MLX's own (in another order: equal within
float32 rounding, tests/test_voice_engine.py). Elsewhere than on the CPU, and for shapes these do
not cover (strides and groups of a dilated convolution, dilated transposed ones), MLX's own run.
`fast_convolutions(model)` has a Kokoro model's weight-normed convolutions use them.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx


def conv1d(x: mx.array, w: mx.array, stride: int = 1, padding: int = 0, dilation: int = 1,
           groups: int = 1) -> mx.array:
    """`mx.conv1d` (x: batch, length, in; w: out, taps, in)."""
    if dilation == 1 or stride != 1 or groups != 1 or mx.default_device() != mx.cpu:
        return mx.conv1d(x, w, stride=stride, padding=padding, dilation=dilation, groups=groups)
    taps = w.shape[1]
    xp = mx.pad(x, [(0, 0), (padding, padding), (0, 0)]) if padding else x
    length = xp.shape[1] - dilation * (taps - 1)
    y = None
    for j in range(taps):
        part = xp[:, j * dilation: j * dilation + length, :] @ w[:, j, :].T
        y = part if y is None else y + part
    return y


def conv_transpose1d(x: mx.array, w: mx.array, stride: int = 1, padding: int = 0,
                     dilation: int = 1, output_padding: int = 0, groups: int = 1) -> mx.array:
    """`mx.conv_transpose1d` (x: batch, length, in; w: out, taps, in / groups), for dilation 1
    and groups 1 or one group a channel."""
    channels = x.shape[-1]
    depthwise = groups == channels and w.shape[0] == channels and w.shape[-1] == 1
    if dilation != 1 or output_padding or (groups != 1 and not depthwise) \
            or mx.default_device() != mx.cpu:
        return mx.conv_transpose1d(x, w, stride=stride, padding=padding, dilation=dilation,
                                   output_padding=output_padding, groups=groups)
    batch, frames = x.shape[0], x.shape[1]
    taps, out = w.shape[1], w.shape[0]
    # every frame's contribution to its `taps` output frames: (batch, frames, taps, out)
    if depthwise:
        z = x[:, :, None, :] * w[:, :, 0].T[None, None]
    else:
        z = (x @ w.reshape(out * taps, -1).T).reshape(batch, frames, out, taps).swapaxes(2, 3)
    blocks = -(-taps // stride)
    if blocks * stride != taps:  # taps padded to whole strides with zero taps
        z = mx.pad(z, [(0, 0), (0, 0), (0, blocks * stride - taps), (0, 0)])
    z = z.reshape(batch, frames, blocks, stride, out)
    total = (frames + blocks - 1) * stride
    y = None
    for b in range(blocks):  # block b of every frame lands b strides later
        part = z[:, :, b].reshape(batch, frames * stride, out)
        part = mx.pad(part, [(0, 0), (b * stride, total - frames * stride - b * stride), (0, 0)])
        y = part if y is None else y + part
    full = (frames - 1) * stride + taps
    return y[:, padding: full - padding]


_FAST = {mx.conv1d: conv1d, mx.conv_transpose1d: conv_transpose1d}


@functools.cache
def _fast_class(base: type) -> type:
    """`base` (a module handed the MLX convolution to run) running these instead."""
    def call(self: Any, x: mx.array, conv: Any) -> mx.array:
        return base.__call__(self, x, _FAST.get(conv, conv))

    return type(f"Fast{base.__name__}", (base,), {"__call__": call})


def fast_convolutions(model: Any) -> int:
    """Have the weight-normed convolutions of a Kokoro model (mlx-audio's `ConvWeighted`, which
    are handed the MLX function to run) use these, this model's alone; returns how many."""
    from mlx_audio.tts.models.kokoro.istftnet import ConvWeighted

    count = 0
    for module in model.modules():
        if type(module) is ConvWeighted:
            module.__class__ = _fast_class(ConvWeighted)
            count += 1
    return count
