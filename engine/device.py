"""Pick the device MLX runs on (GPU when present, else CPU) and the memory budget it allows.

MLX offers a GPU through Metal (Apple Silicon) or CUDA (NVIDIA, the `mlx[cuda]` wheels); with
neither, or with the CPU-only wheel, only the CPU. `select_device("auto")` takes the GPU when there
is one and logs a warning when it has to run on the CPU, so a slow run is never silent.

The memory budget is what weights, KV caches and prefix-cache snapshots may use together:
- GPU: Metal's `max_recommended_working_set_size` (the wired-memory limit MLX recommends), else the
  device's memory (`memory_size` / `total_memory` as MLX reports it for CUDA), else free RAM;
- CPU: MemAvailable from /proc/meminfo (total physical memory where that is unreadable).
"""

import functools
import logging
import os
import sys
from typing import Any

import mlx.core as mx

from .errors import EngineError

log = logging.getLogger(__name__)
DEVICES = ("auto", "cpu", "gpu")

# Keys MLX's `device_info` has used for the GPU's memory, most specific first.
_GPU_MEMORY_KEYS = ("max_recommended_working_set_size", "memory_size", "total_memory")


def gpu_available() -> bool:
    try:
        return bool(mx.is_available(mx.gpu))
    except Exception:  # an MLX build without any GPU backend compiled in
        return False


def _device(device: "mx.Device | mx.DeviceType | None") -> mx.Device:
    if device is None:
        return mx.default_device()
    return mx.Device(device) if isinstance(device, mx.DeviceType) else device


@functools.cache
def _gpu_backend() -> str:
    """Which backend this MLX build's GPU is: fixed for the process, asked once (a decode step of
    a hybrid model asks for every layer)."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "gpu"


def backend(device: mx.Device | None = None) -> str:
    """"metal", "cuda" or "cpu": which MLX backend runs `device` (default: the current one)."""
    return _gpu_backend() if _device(device).type == mx.DeviceType.gpu else "cpu"


def select_device(preference: str = "auto") -> mx.Device:
    """Make `preference` MLX's default device and return it; a missing GPU is an error if asked."""
    if preference not in DEVICES:
        raise EngineError(f"--device must be one of {', '.join(DEVICES)}, got {preference!r}")
    has_gpu = gpu_available()
    if preference == "gpu" and not has_gpu:
        raise EngineError("--device gpu: no GPU is available to MLX here (this MLX has neither a "
                          "Metal nor a CUDA backend, or no device was found); install mlx[cuda] on "
                          "NVIDIA or use --device cpu")
    device = mx.gpu if preference == "gpu" or (preference == "auto" and has_gpu) else mx.cpu
    mx.set_default_device(device)
    device = mx.default_device()
    if preference == "auto" and not has_gpu:
        log.warning("no GPU is available to MLX (no Metal or CUDA backend); running on the CPU, "
                    "where decoding is much slower")
    log.info("device: %s", device)
    return device


def _info(device: mx.Device) -> dict[str, Any]:
    try:
        return dict(mx.device_info(device))
    except Exception:  # older MLX: device_info() takes no argument
        try:
            return dict(mx.device_info())
        except Exception:
            return {}


def gpu_memory(device: mx.Device | None = None) -> tuple[int, str] | None:
    """(bytes, source key) of the GPU's usable memory as MLX reports it, or None."""
    device = _device(device)
    if device.type != mx.DeviceType.gpu:
        return None
    info = _info(device)
    for key in _GPU_MEMORY_KEYS:
        value = info.get(key)
        if value:
            return int(value), key
    return None


def describe(device: mx.Device | None = None) -> str:
    """A one-line description, e.g. "gpu (cuda, NVIDIA H200, 140.4 GB)" or "cpu (16 cores, ...)"."""
    device = _device(device)
    if device.type == mx.DeviceType.gpu:
        name = _info(device).get("device_name")
        mem = gpu_memory(device)
        parts = [backend(device)] + ([str(name)] if name else [])
        if mem:
            parts.append(f"{mem[0] / 1e9:.1f} GB")
        return f"gpu ({', '.join(parts)})"
    blas = "OpenBLAS" if fast_blas_loaded() else "reference BLAS"
    return f"cpu ({os.cpu_count()} cores, {blas})"


# MLX's CPU wheel ships a slow reference BLAS; Debian's threaded OpenBLAS, preloaded before MLX
# loads, is many times faster. Only fp32 matmuls go through BLAS.
OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)


_blas_seen = False  # a library once mapped stays: only "not loaded" is read again


def fast_blas_loaded() -> bool:
    """Whether an optimised BLAS is mapped into this process (so fp32 weights pay on the CPU)."""
    global _blas_seen
    if not _blas_seen:
        try:
            with open("/proc/self/maps") as f:
                _blas_seen = any("libopenblas" in line or "libmkl" in line for line in f)
        except OSError:
            pass
    return _blas_seen


def restart_with_blas(module: str) -> None:
    """Start this process again as `python -m module` (same arguments) with OpenBLAS preloaded,
    which must happen before MLX loads; returns when there is nothing to gain (blas_preload_env)."""
    env = blas_preload_env()
    if env is not None:
        os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)


def blas_preload_env() -> dict[str, str] | None:
    """The environment to re-launch this process with OpenBLAS preloaded, or None when there is
    nothing to gain (not Linux, no OpenBLAS installed, already loaded, or MLXCHAT_NO_BLAS=1)."""
    if not sys.platform.startswith("linux") or os.environ.get("MLXCHAT_NO_BLAS") == "1":
        return None
    if fast_blas_loaded():
        return None
    lib = next((p for p in OPENBLAS_PATHS if os.path.exists(p)), None)
    if lib is None or lib in os.environ.get("LD_PRELOAD", ""):
        return None
    preload = " ".join(filter(None, [lib, os.environ.get("LD_PRELOAD")]))
    return {**os.environ, "LD_PRELOAD": preload}


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


def memory_total(device: mx.Device | None = None) -> tuple[int, str]:
    """(bytes, where it came from) that the device offers in all."""
    device = _device(device)
    mem = gpu_memory(device)
    if mem:
        return mem
    if device.type == mx.DeviceType.gpu:
        log.warning("MLX reports no memory size for this GPU; sizing the memory budget from free RAM")
    return available_ram(), "MemAvailable"


def memory_budget(fraction: float = 0.5, device: mx.Device | None = None) -> int:
    """Bytes the engine may use for KV caches and prefix snapshots on `device` (default: current)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    total, _ = memory_total(device)
    return int(total * fraction)


def report(device: mx.Device | None = None) -> dict[str, Any]:
    """What a results file or /health records about the device."""
    device = _device(device)
    total, source = memory_total(device)
    return {"device": device.type.name if hasattr(device.type, "name") else str(device.type),
            "backend": backend(device), "description": describe(device),
            "name": _info(device).get("device_name"), "memory_bytes": total,
            "memory_source": source, "mlx": mx.__version__}
