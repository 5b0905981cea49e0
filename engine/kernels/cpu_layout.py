"""The fastest layout for a dense model on MLX's CPU backend with an optimised BLAS loaded.

MLX's CPU kernels for quantized and half-precision matmuls run on one core and slowly; fp32 matmuls
go to BLAS (`cblas_sgemm`, never `sgemv`). So on the CPU, with OpenBLAS (or MKL) in the process,
the fastest way to run mlx-lm's own model classes is:

1. dequantize every quantized layer to fp32 (`mlx_lm.utils.dequantize_model`, then fp32 dtype);
2. swap each `nn.Linear` for `MatvecLinear`, and a tied `nn.Embedding` for `MatvecEmbedding`,
   whose one-token matmul is written `W @ x` ((out, in) @ (in, 1)) instead of `x @ W.T`
   ((1, in) @ (in, out)). Both are one `sgemm` call, but BLAS handles the second (the whole weight
   as the B operand of a one-row product) worse: it repacks or takes its slower path. Measured on
   the bundled SmolLM2-135M, OpenBLAS 0.3.21, 2 cores, quiet machine: decode ~16.7 tok/s with the
   swap vs 10.6-15 tok/s plain fp32 (and 8.6 tok/s for mlx-lm on the Q4 weights); prefill the
   same (~250 tok/s). Fusing q/k/v and gate/up into one weight each (bench/decode.py's FastLlama)
   gave no more (decode ~14.6 tok/s, prefill ~250): not worth forking mlx-lm's attention.

Everything else (attention, RoPE, norms, caches) stays mlx-lm's code: only the leaf modules change
class, their parameters are the same arrays. Inputs of more than one token (prefill, and batched
decoding with several rows) take `x @ W.T` exactly as `nn.Linear` does (see `MatvecLinear`).
"""

import logging

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)


def _matvec(weight: mx.array, x: mx.array) -> mx.array:
    """`x @ weight.T` for an `x` holding one vector (shape (..., in) with one row), as W @ x."""
    return (weight @ x.reshape(-1, 1)).reshape(*x.shape[:-1], weight.shape[0])


def _one_row(x: mx.array) -> bool:
    return x.size == x.shape[-1]


class MatvecLinear(nn.Linear):
    """`nn.Linear` whose one-token product runs as (out, in) @ (in, 1).

    Several rows (prompt chunks, batched decoding) keep `nn.Linear`'s `x @ W.T`: one gemm over all
    rows beats a matrix-vector product per row once there are 2+ rows (the weight is read once),
    and BLAS's packing cost is shared by all rows.
    """

    def __call__(self, x: mx.array) -> mx.array:
        if not _one_row(x):
            return super().__call__(x)
        y = _matvec(self["weight"], x)
        return y + self["bias"] if "bias" in self else y


class MatvecEmbedding(nn.Embedding):
    """`nn.Embedding` whose `as_linear` (the tied output head) takes the same one-token shortcut."""

    def as_linear(self, x: mx.array) -> mx.array:
        if not _one_row(x):
            return super().as_linear(x)
        return _matvec(self.weight, x)


_SWAPS = ((nn.Linear, MatvecLinear), (nn.Embedding, MatvecEmbedding))


def swap_matvec(module: nn.Module) -> int:
    """Change the class of every plain nn.Linear / nn.Embedding under `module`; returns how many."""
    count = 0
    for _, child in module.named_modules():
        for plain, fast in _SWAPS:
            if type(child) is plain:  # exact type: leave subclasses (quantized, LoRA...) alone
                child.__class__ = fast
                count += 1
    return count


def cpu_layout_wanted() -> tuple[bool, str]:
    """Whether this process should run models in this layout, and why (not)."""
    from ..device import fast_blas_loaded

    if mx.default_device().type != mx.DeviceType.cpu:
        return False, "not running on the CPU"
    if not fast_blas_loaded():
        return False, "no optimised BLAS loaded (fp32 matmuls would use MLX's reference BLAS)"
    return True, "CPU with an optimised BLAS"


def fp32_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters take once dequantized to fp32."""
    total = 0
    for _, module in model.named_modules():
        own = {k: v for k, v in module.items() if isinstance(v, mx.array)}
        bits = getattr(module, "bits", None) if "scales" in own else None
        for key, value in own.items():
            if bits and key == "weight":
                total += value.size * 32 // bits * 4
            elif not bits or key not in ("scales", "biases"):
                total += value.size * 4
    return total


def to_cpu_layout(model: nn.Module) -> nn.Module:
    """Dequantize to fp32 and swap in the matvec leaf modules; returns the model.

    Call only where `cpu_layout_wanted()` holds: on a GPU, or with MLX's reference BLAS, fp32 and
    these shapes are slower than the model as loaded.
    """
    from mlx_lm.utils import dequantize_model

    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    swapped = swap_matvec(model)
    mx.eval(model.parameters())
    log.info("CPU layout: fp32 weights; %d matmul layers take one-token products as W @ x", swapped)
    return model
