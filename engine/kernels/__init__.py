"""mlxchat's CPU compute paths: our C++ kernels on quantized weights (native.py, layout.py), and
the fp32 layout (cpu_layout.py) they fall back to."""

from typing import Any

import mlx.core as mx

from .. import device as _device


def active_path() -> str:
    """Which path quantized models take in this process, with the reason for any fallback, and
    the KV cache's format when it is not the full one (kv8.py)."""
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
        extra = ", int8 activations" if native.int8_activations() else ""
        return f"quantized CPU kernels ({result.reason}{extra}){kv}"
    return f"fp32 layout (CPU kernels unavailable: {result.reason}){kv}"


def describe_device(device: mx.Device | None = None) -> str:
    """`engine.device.describe`, naming on the CPU which compute path quantized models take."""
    text = _device.describe(device)
    if text.startswith("cpu ("):
        text = f"{text[:-1]}; {active_path()})"
    return text


def device_report(device: mx.Device | None = None) -> dict[str, Any]:
    """`engine.device.report` with the description above and the active compute path."""
    return {**_device.report(device), "description": describe_device(device),
            "compute_path": active_path()}
