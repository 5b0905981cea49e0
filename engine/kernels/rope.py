"""RoPE's angles as MLX's kernel computes them, for the kernels that rotate queries and keys
themselves (engine/kernels/fused_cuda.py's one-row attention, batch_attention.py's rows)."""

from __future__ import annotations

import math

import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import Llama3RoPE


def inverse_frequencies(rope: nn.Module) -> tuple[np.ndarray, float] | None:
    """(1 / frequency per rotated pair, position scale) of a RoPE module as MLX's kernel computes
    its angles, or None for a kind this program does not know."""
    half = rope.dims // 2
    if type(rope) is nn.RoPE:
        log2_base = np.float32(math.log2(rope.base))
        d = np.arange(half, dtype=np.float32) / np.float32(half)
        return np.exp2(-d * log2_base).astype(np.float32), float(rope.scale)
    if type(rope) is Llama3RoPE:
        return (1.0 / np.array(rope._freqs, dtype=np.float32)).astype(np.float32), 1.0
    return None
