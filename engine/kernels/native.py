"""Build, cache and load mlxchat's C++ kernels (the `_mlxchat_kernels` MLX extension).

An MLX extension only loads under the exact mlx it was compiled against, and pip's isolated build
environment may hold another mlx than the one installed, so the extension is compiled here, with
CMake, nanobind and the installed mlx's own CMake package, on first use (or by
`python -m engine.kernels build` at setup) into `cache_dir()/kernels/<mlx version>-<hash>`. The
hash covers the CPU's instruction-set features, the Python version and our sources, so a changed
mlx, CPU or kernel source builds anew; the extension still picks its AVX-512, AVX2 or portable
unit at run time. Any failure (no compiler, no CMake or nanobind, a build for another mlx) gives
one warning naming the fix, and the models keep today's fp32 layout (engine/kernels/cpu_layout.py).

`MLXCHAT_KERNELS=0` turns the kernels off; `MLXCHAT_KERNELS=int8` runs them with int8
activations by default (`int8_activations()`); `MLXCHAT_THREADS` sets their thread count
(default: the physical cores this process may run on).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from ..paths import cache_dir

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
MODULE = "_mlxchat_kernels"
FIX = ("run scripts/setup (it installs cmake, g++ and nanobind), or `apt-get install cmake g++` "
       "and `pip install nanobind`, then restart")
# The CPU flags that change which code the build can run.
_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
             "asimd", "neon")


@dataclass(frozen=True)
class Status:
    """The outcome of loading the kernels: the module, or None and why not."""

    module: ModuleType | None
    reason: str


def cpu_features() -> list[str]:
    """The instruction-set features of this CPU that matter to the build (from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("flags", "features")):
                    flags = set(line.split(":", 1)[1].split())
                    return sorted(flags.intersection(_FEATURES))
    except OSError:
        pass
    return []


def _sources() -> list[Path]:
    return [SOURCE_DIR / "CMakeLists.txt", *sorted((SOURCE_DIR / "csrc").glob("*"))]


def build_key() -> str:
    """`<mlx version>-<hash of CPU features, machine, Python version and our sources>`."""
    h = hashlib.sha256()
    # "sha256": builds whose module's digest is recorded (`_intact`) live in folders of their own
    h.update(f"{platform.machine()}|{' '.join(cpu_features())}|{sys.version_info[:2]}|sha256".encode())
    for path in _sources():
        h.update(path.name.encode() + path.read_bytes())
    return f"{mx.__version__}-{h.hexdigest()[:12]}"


def build_dir() -> Path:
    return cache_dir() / "kernels" / build_key()


def _built(folder: Path) -> Path | None:
    found = sorted(folder.glob(f"{MODULE}*.so")) + sorted(folder.glob(f"{MODULE}*.pyd"))
    return found[0] if found else None


def _run(cmd: list[str], cwd: Path) -> None:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-6:]
        raise RuntimeError(f"`{' '.join(cmd[:2])} ...` failed: " + " | ".join(tail))


def build(folder: Path) -> Path:
    """Compile the extension into `folder`; returns the module file. Raises RuntimeError."""
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if importlib.util.find_spec("nanobind") is None:
        missing.append("nanobind (Python package)")
    if missing:
        raise RuntimeError("missing build tools: " + ", ".join(missing))
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlxchat-kernels-") as tmp:
        log.info("building mlxchat's CPU kernels for mlx %s (one time, about a minute)", mx.__version__)
        _run(["cmake", "-S", str(SOURCE_DIR), "-B", tmp, "-DCMAKE_BUILD_TYPE=Release",
              f"-DPython_EXECUTABLE={sys.executable}", f"-DMLXCHAT_MLX_VERSION={mx.__version__}"],
             SOURCE_DIR)
        _run(["cmake", "--build", tmp, "-j", str(os.cpu_count() or 1)], SOURCE_DIR)
        built = _built(Path(tmp))
        if built is None:
            raise RuntimeError("the build produced no module")
        staged = folder / (built.name + ".tmp")
        shutil.copy2(built, staged)
        _digest_file(folder / built.name).write_text(_sha256(staged))
        os.replace(staged, folder / built.name)  # atomic: a concurrent loader sees all or nothing
    return folder / built.name


def _digest_file(module: Path) -> Path:
    return module.with_name(module.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(module: Path) -> bool:
    """Whether `module` is byte for byte what the build wrote (its sha256 recorded then): a
    damaged or swapped shared library must never be loaded, since loading it can crash the
    process before any Python error is raised."""
    digest = _digest_file(module)
    try:
        return digest.read_text().strip() == _sha256(module)
    except OSError:
        return False


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.mlx_version() != mx.__version__:
        raise ImportError(f"built for mlx {module.mlx_version()}, running mlx {mx.__version__}")
    return module


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyperthreads counted once)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
                      .read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return len(cores) or os.cpu_count() or 1


def thread_count() -> int:
    value = os.environ.get("MLXCHAT_THREADS", "").strip()
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            log.warning("MLXCHAT_THREADS=%r is not a number; using the physical cores", value)
    return physical_cores()


ENV = "MLXCHAT_KERNELS"  # 0 turns the kernels off; int8 takes int8_activations(); `--int8-activations`


def _setting() -> str:
    return os.environ.get(ENV, "1").strip().lower()


def _turned_off() -> bool:
    return _setting() in ("0", "off", "no", "false")


def int8_activations() -> bool:
    """The process's default for the lossy int8-activation path (`MLXCHAT_KERNELS=int8`, which
    `--int8-activations` sets); a load may choose otherwise (`load_model(int8_activations=...)`,
    `Engine.switch_model`, the model picker's checkbox). On that path every product of fewer than
    layout.INT8_BLAS_ROWS rows (decode steps, short prompt chunks) rounds x per 32-element block
    to 15 bits, held as two int8 limbs, and sums integer products against the weights' codes
    (common.h, Q8Rows); longer chunks take the exact BLAS product. Off by default: the exact path
    gives mlx-lm's greedy tokens; this one passes the perplexity gate
    (tests/test_kernels_quality.py: +0.011% on the bundled model) but not token identity."""
    return _setting() == "int8"


def _load() -> Status:
    try:
        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return Status(None, f"no cache folder to build them in ({exc})")
    with open(folder / ".lock", "w") as lock:  # one build at a time, across processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        path, error = _built(folder), None
        if path is not None and not _intact(path):  # rebuilt below, never loaded
            error = f"the cached build {path} is damaged or unverified (sha256)"
            log.warning("%s; building it again", error)
            path.unlink(missing_ok=True)
            path = None
        if path is not None:
            try:
                module = _import(path)
            except Exception as exc:  # a broken or foreign build: build again below
                error = f"the cached build {path} does not load ({exc})"
                path = None
        if path is None:
            try:
                module = _import(build(folder))
            except Exception as exc:
                return Status(None, f"{error + '; ' if error else ''}cannot build them: {exc}")
    module.set_num_threads(thread_count())
    return Status(module, f"{module.isa()}, {module.num_threads()} threads")


_status: Status | None = None


def status() -> Status:
    """Load (building if needed) the kernels once per process; warns once when they fail."""
    global _status
    if _turned_off():  # read each time: a benchmark row or a test may turn them off
        return Status(None, "turned off by MLXCHAT_KERNELS=0")
    if _status is None:
        _status = _load()
        if _status.module is None:
            log.warning("mlxchat's CPU kernels are unavailable, so models run in the slower fp32 "
                        "layout: %s. Fix: %s", _status.reason, FIX)
    return _status


def kernels() -> ModuleType | None:
    return status().module


def needs_build() -> bool:
    """Whether `status()` would compile the kernels first (a minute): they are on, not loaded in
    this process yet, and no build for this mlx, CPU and source is cached."""
    return not _turned_off() and _status is None and _built(build_dir()) is None
