"""Where mlxchat keeps its files: `MLXCHAT_HOME` overrides the platformdirs defaults."""

import os
from pathlib import Path

import platformdirs

APP_NAME = "mlxchat"


def _home() -> Path | None:
    value = os.environ.get("MLXCHAT_HOME")
    return Path(value).expanduser() if value else None


def data_dir() -> Path:
    """User data: the conversations database and settings."""
    home = _home()
    path = home / "data" if home else Path(platformdirs.user_data_dir(APP_NAME))
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir() -> Path:
    """Re-creatable files: the bundled model, converted model folders, prompt-cache snapshots."""
    home = _home()
    path = home / "cache" if home else Path(platformdirs.user_cache_dir(APP_NAME))
    path.mkdir(parents=True, exist_ok=True)
    return path
