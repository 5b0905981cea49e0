"""Pick the device MLX runs on (GPU when present, else CPU) and the memory budget it allows."""

import logging
import os

import mlx.core as mx

from .errors import EngineError

log = logging.getLogger(__name__)
DEVICES = ("auto", "cpu", "gpu")


def gpu_available() -> bool:
    return mx.is_available(mx.gpu)


def select_device(preference: str = "auto") -> mx.Device:
    """Make `preference` MLX's default device and return it; a missing GPU is an error if asked."""
    if preference not in DEVICES:
        raise EngineError(f"--device must be one of {', '.join(DEVICES)}, got {preference!r}")
    if preference == "gpu" and not gpu_available():
        raise EngineError("no GPU is available to MLX here (no Metal or CUDA backend); use --device cpu")
    device = mx.gpu if preference == "gpu" or (preference == "auto" and gpu_available()) else mx.cpu
    mx.set_default_device(device)
    return mx.default_device()


def describe(device: mx.Device | None = None) -> str:
    """A one-line description, e.g. "gpu (NVIDIA H200)" or "cpu"."""
    device = device or mx.default_device()
    if device.type == mx.DeviceType.gpu:
        name = mx.device_info(device).get("device_name") if hasattr(mx, "device_info") else None
        return f"gpu ({name})" if name else "gpu"
    blas = "OpenBLAS" if "openblas" in os.environ.get("LD_PRELOAD", "") else "reference BLAS"
    return f"cpu ({os.cpu_count()} cores, {blas})"


def available_ram() -> int:
    """MemAvailable from /proc/meminfo, or total physical memory elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_budget(fraction: float = 0.5) -> int:
    """Bytes the engine may use for KV caches and prefix snapshots on the current device."""
    device = mx.default_device()
    if device.type == mx.DeviceType.gpu:
        info = mx.device_info(device)
        total = info.get("max_recommended_working_set_size") or info.get("memory_size") or 0
        if total:
            return int(total * fraction)
    return int(available_ram() * fraction)
