"""Llama 3.1's RoPE scaling from a GGUF file's `rope_freqs` tensor.

llama.cpp's converter turns a Hugging Face `rope_scaling` of type "llama3" (factor, low and high
frequency factors, original context length) into one number per rotary frequency, the factor
that frequency's period is multiplied by, and writes no other trace of it. mlx-lm's llama class
takes the four parameters instead, so they are recovered here: Llama 3.1/3.2/3.3's published
values first, otherwise fitted to the smoothly scaled frequencies. Either way the parameters are
only used when mlx-lm's formula gives back every stored factor.

In the smooth band the factor r of a frequency with wavelength w satisfies
    1/r = (1 - s)/factor + s,  s = (old_context/w - low)/(high - low) = a/w + b,
so a and b follow from two or more such frequencies; every (old_context, low, high) with the same
a and b gives the same model, and low = 1 is chosen.
"""

import math
from typing import Any

import numpy as np

from ..errors import UnsupportedArchitecture

# The values every Llama 3.1, 3.2 and 3.3 checkpoint ships (factor 8 or 32).
PUBLISHED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
RTOL = 1e-3


def llama3_factors(scaling: dict[str, Any], wavelengths: np.ndarray) -> np.ndarray:
    """Each frequency's period factor under mlx-lm's `Llama3RoPE` for these parameters."""
    factor, low, high = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old = scaling["original_max_position_embeddings"]
    smooth = (old / wavelengths - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelengths > old / low, factor,
                    np.where(wavelengths > old / high, medium, 1.0))


def llama3_rope_scaling(factors: list[float], base: float, dims: int) -> dict[str, Any] | None:
    """mlx-lm's `rope_scaling` for a llama GGUF's `rope_freqs` (None: it scales nothing); raises
    UnsupportedArchitecture when no llama3 scaling gives these factors."""
    r = np.asarray(factors, dtype=np.float64).reshape(-1)
    if r.size != dims // 2:
        raise UnsupportedArchitecture(f"rope_freqs has {r.size} values for {dims // 2} rotary "
                                      "frequencies")
    if np.allclose(r, 1.0, rtol=RTOL):
        return None
    factor = float(r.max())
    wavelengths = 2 * math.pi * base ** (np.arange(0, dims, 2) / dims)
    candidates = [{"factor": factor, **PUBLISHED}]
    medium = (r > 1 + RTOL) & (r < factor * (1 - RTOL))
    if medium.sum() >= 2:
        s = (1 / r[medium] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(1 / wavelengths[medium], s, 1)
        if b < 0:
            candidates.append({"factor": factor, "low_freq_factor": 1.0,
                               "high_freq_factor": float(1 - 1 / b),
                               "original_max_position_embeddings": float(-a / b)})
    for scaling in candidates:
        if np.allclose(llama3_factors(scaling, wavelengths), r, rtol=RTOL):
            return {"rope_type": "llama3", **scaling}
    raise UnsupportedArchitecture("the GGUF's rope_freqs are not a Llama 3 RoPE scaling, the only "
                                  "kind mlxchat can map onto mlx-lm")
