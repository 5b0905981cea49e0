"""mlxchat's CPU compute paths: our C++ kernels on quantized weights (native.py, layout.py), and
the fp32 layout (cpu_layout.py) they fall back to."""

import mlx.core as mx


def active_path() -> str:
    """Which path quantized models take in this process, with the reason for any fallback."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return "mlx (GPU)"
    from .native import status

    result = status()
    if result.module is not None:
        return f"quantized CPU kernels ({result.reason})"
    return f"fp32 layout (CPU kernels unavailable: {result.reason})"
