"""A model load's stages as it goes: `LoadProgress` events, reported to the callback a load runs
under (`Engine.start(progress=...)`, `Engine.switch_model(progress=...)`); and
`DownloadProgress`, the bytes of a download (a pull's, engine/loading/hub.py, or the bundled
model's).

The stages, in the order a first run on a fresh machine passes them (`LOAD_STAGES`): the
bundled model downloading (with its bytes), a GGUF converting to an mlx-lm folder, our CPU
kernels building (the first time on this machine), the weights loading, a first step warming up
the model, then ready. A load skips the stages it has no work for (a cached model starts at
`loading`). `reporting(callback)` sets the callback for the code that runs inside it on this
thread, so the loading functions (engine/loading/bundled.py, registry.py) say where they are with
`report(stage)` without a callback passed down through every call, as `logging` does.
"""

import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator, Literal


@dataclass(frozen=True)
class DownloadProgress:
    """How far a download is."""

    done_bytes: int
    total_bytes: int
    speed: float  # bytes per second over this session
    eta_s: float | None
    file: str  # the file being fetched
    finished: bool = False

    def describe(self) -> str:
        eta = f", {self.eta_s:.0f} s left" if self.eta_s is not None else ""
        return (f"{self.done_bytes / 1e6:.1f} of {self.total_bytes / 1e6:.1f} MB "
                f"({self.speed / 1e6:.1f} MB/s{eta})")


LoadStage = Literal["downloading", "converting", "building kernels", "loading", "warming up",
                    "ready"]
LOAD_STAGES: tuple[LoadStage, ...] = ("downloading", "converting", "building kernels", "loading",
                                      "warming up", "ready")


@dataclass(frozen=True)
class LoadProgress:
    """Where a model load is: its stage, when that stage began, and while downloading, the
    bytes (`download`, as `mlxchat pull` reports them)."""

    stage: LoadStage
    since: float  # time.time() when the stage began
    download: DownloadProgress | None = None

    def describe(self) -> str:
        """The stage in words, e.g. "downloading: 12.3 of 98.4 MB (4.1 MB/s, 21 s left)"."""
        return f"{self.stage}: {self.download.describe()}" if self.download else self.stage


LoadCallback = Callable[[LoadProgress], None]

_callback: ContextVar[LoadCallback | None] = ContextVar("load_progress", default=None)
_since: ContextVar[tuple[LoadStage, float] | None] = ContextVar("load_stage", default=None)


@contextmanager
def reporting(callback: LoadCallback | None) -> Iterator[None]:
    """Within the block, `report` hands each stage to `callback` (None: to nobody)."""
    token, since = _callback.set(callback), _since.set(None)
    try:
        yield
    finally:
        _callback.reset(token)
        _since.reset(since)


def report(stage: LoadStage, download: DownloadProgress | None = None) -> None:
    """Tell the load's callback (if any) that the load is at `stage` now."""
    callback = _callback.get()
    if callback is None:
        return
    current = _since.get()
    if current is None or current[0] != stage:
        current = (stage, time.time())
        _since.set(current)
    callback(LoadProgress(stage, current[1], download))
