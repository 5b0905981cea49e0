"""mlxchat's CPU compute paths: our C++ kernels on quantized weights (native.py, layout.py), and
the fp32 layout (cpu_layout.py) they fall back to."""

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .. import device as _device


def active_path(int8: bool | None = None) -> str:
    """Which path quantized models take in this process, with the reason for any fallback, and
    the KV cache's format when it is not the full one (kv8.py). `int8`: whether the kernels take
    int8 activations (a loaded model's choice, layout.int8_activations_of; None: the process's
    default, native.int8_activations)."""
    from .kv8 import kv_bits

    try:
        kv = f"; {kv_bits()}-bit KV cache" if kv_bits() else ""
    except ValueError as exc:
        kv = f"; {exc}"
    if mx.default_device().type != mx.DeviceType.cpu:
        return f"mlx (GPU){kv}"
    from . import native

    result = native.status()
    if result.module is not None:
        int8 = native.int8_activations() if int8 is None else int8
        extra = ", int8 activations" if int8 else ""
        return f"quantized CPU kernels ({result.reason}{extra}){kv}"
    return f"fp32 layout (CPU kernels unavailable: {result.reason}){kv}"


def describe_device(device: mx.Device | None = None, *, int8: bool | None = None) -> str:
    """`engine.device.describe`, naming on the CPU which compute path quantized models take."""
    text = _device.describe(device)
    if text.startswith("cpu ("):
        text = f"{text[:-1]}; {active_path(int8)})"
    return text


def device_report(device: mx.Device | None = None, *, int8: bool | None = None) -> dict[str, Any]:
    """`engine.device.report` with the description above and the active compute path (`int8`: a
    loaded model's choice of int8 activations, see `active_path`)."""
    return {**_device.report(device), "description": describe_device(device, int8=int8),
            "compute_path": active_path(int8)}


def cache_variant(model: nn.Module) -> dict[str, str]:
    """What besides the weights and tokens changes the values `model`'s KV cache holds, where it
    is not the default: the KV cache's format (kv8.py) and int8 activations (layout.py). Prefix
    cache snapshots made under one variant are never read under another."""
    from .kv8 import FULL, kv_format
    from .layout import int8_activations_of

    fmt = kv_format(model)
    return {**({} if fmt == FULL else {"kv_format": fmt}),
            **({"activations": "int8"} if int8_activations_of(model) else {})}
