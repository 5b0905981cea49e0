"""Where local models live on disk: the Hugging Face hub cache (models downloaded by `mlxchat pull`,
engine/loading/hub.py, or by other tools) and the mlx-lm folders converted from GGUF files
(engine/loading/gguf.py), one per GGUF, under mlxchat's cache directory."""

import hashlib
import logging
import os
from pathlib import Path

from .gguf import convert_gguf
from .progress import report
from ..paths import cache_dir

log = logging.getLogger(__name__)


def hub_cache_dir() -> Path:
    """huggingface_hub's standard cache, as its environment variables choose it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def converted_folder(gguf: Path) -> Path:
    """Each GGUF converts once into the cache, keyed by its path, size and mtime."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{gguf.stem}-{key}"


def gguf_to_folder(gguf: Path) -> Path:
    """The mlx-lm folder converted from `gguf`, converting it the first time."""
    folder = converted_folder(gguf)
    if not (folder / "config.json").exists():
        log.info("converting %s to an mlx-lm folder at %s", gguf, folder)
        report("converting")
        convert_gguf(gguf, folder)
    return folder
