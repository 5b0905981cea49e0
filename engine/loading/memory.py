"""Whether a model can fit in memory, estimated from its weight files before loading or
downloading it, so that a model too big is refused with a message instead of swapping or dying."""

from pathlib import Path
from typing import Iterable

from ..device import memory_total

# Weights as loaded plus the runtime's own arrays and a first model cache, relative to the files.
OVERHEAD = 1.15
WEIGHT_SUFFIXES = (".safetensors", ".gguf")


def weight_files_bytes(files: Iterable[Path]) -> int:
    return sum(f.stat().st_size for f in files if f.name.endswith(WEIGHT_SUFFIXES))


def needed_bytes(weights_bytes: int) -> int:
    """The memory a model with this many bytes of weight files needs to run."""
    return int(weights_bytes * OVERHEAD)


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def shortfall(name: str, weights_bytes: int, available: int | None = None) -> str | None:
    """Why `name` cannot fit (a message for the user), or None when it can."""
    need = needed_bytes(weights_bytes)
    have = memory_total()[0] if available is None else available
    if need <= have:
        return None
    return (f"{name} needs about {_gb(need)} of memory (its weights are {_gb(weights_bytes)}) but "
            f"only {_gb(have)} is available: close other programs or pick a smaller or more "
            f"quantized model")
