"""Which compute layout a freshly loaded model takes on this machine (engine/loading runs it)."""

from __future__ import annotations

import logging
from typing import Any

import mlx.nn as nn

from .. import device

log = logging.getLogger(__name__)

# The compute paths a loaded model may take (`LoadedModel.compute`, recorded at load): arrays
# computed on one may differ in their last bits from another's, so a prefix-cache snapshot
# records its path and is never read under another (engine/prefix_cache/snapshot_files.py).
AS_LOADED = "as-loaded"  # mlx-lm's (or mlx-vlm's) own modules, as loaded
CPU_KERNELS = "cpu-kernels"  # our CPU kernels on the quantized weights (layout.py)
CPU_LAYOUT = "cpu-layout"  # fp32 weights, one-token products as W @ x (cpu_layout.py)
GPU_LAYOUT = "gpu-layout"  # stacked projections and our GPU kernels (gpu_layout.py)
# and its one-token steps as one compiled program (decode_step.py)
GPU_COMPILED_STEP = "gpu-compiled-step"


def fastest_layout(model: nn.Module, config: dict[str, Any], *,
                   int8_activations: bool | None = None) -> tuple[nn.Module, str]:
    """On a GPU, stack each layer's q/k/v and gate/up projections (gpu_layout.py) and, on CUDA,
    give a dense llama-family model its compiled one-token step (decode_step.py). On the CPU, run
    a quantized model on our kernels (layout.py); where they cannot load, or for a dense model,
    with an optimised BLAS, in cpu_layout.py's layout: fp32 weights (dequantized where quantized)
    with one-token matmuls written as W @ x.

    MLX's CPU kernels for quantized and half-precision matmuls are single-threaded and slow; fp32
    matmuls go to BLAS. Without a fast BLAS fp32 is slower. A model whose fp32 weights would take
    more than half of the free RAM also stays as loaded. `config` is the model's config.json (its
    "quantization" entry says it is quantized). `int8_activations`: on our kernels, take the lossy
    int8-activation path, and on CUDA the compiled step's products too (None: the process's default,
    `--int8-activations`).
    Returns the model and its compute path (one of the names above).
    """
    from .cpu_layout import cpu_layout_wanted, fp32_bytes, to_cpu_layout
    from .decode_step import attach
    from .gpu_layout import to_gpu_layout
    from .layout import kernel_layout_wanted, to_kernel_layout

    if device.backend() != "cpu":
        model = to_gpu_layout(model)
        if attach(model, int8=int8_activations):
            log.info("one-token steps run as one compiled program (%s to turn off)", "MLXCHAT_CUDA_DECODE=0")
            return model, GPU_COMPILED_STEP
        return model, GPU_LAYOUT
    wanted, why = kernel_layout_wanted(model)  # our CPU kernels, weights kept quantized
    if wanted:
        return to_kernel_layout(model, int8=int8_activations), CPU_KERNELS
    wanted, why = cpu_layout_wanted()
    if not wanted:
        if "quantization" in config:
            log.info("keeping quantized weights: %s", why)
        return model, AS_LOADED
    need, limit = fp32_bytes(model), device.available_ram() // 2
    if need > limit:
        log.warning("keeping the weights as loaded: fp32 would take %.1f GB, over half of the free "
                    "RAM (%.1f GB); expect slow CPU matmuls", need / 1e9, limit / 1e9)
        return model, AS_LOADED
    return to_cpu_layout(model), CPU_LAYOUT
