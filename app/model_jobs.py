"""The model jobs that run behind the model picker (app/ui/picker.py): the one model switch in
progress, shared with the API (a request naming another local model loads it) — `begin_switch`
starts loading a model in a worker thread and `ModelSwitch` describes the load while it runs —
and the one download (`ModelDownload`)."""

import asyncio
import threading
import time
from dataclasses import dataclass, field

from engine import DownloadProgress, Engine, EngineError


@dataclass
class ModelSwitch:
    """The one model load that may be in progress, shown in the model picker."""

    name: str | None = None
    stage: str = ""
    started: float = 0.0
    error: str | None = None
    task: asyncio.Task | None = None

    @property
    def loading(self) -> bool:
        return self.task is not None and not self.task.done()

    def describe(self) -> str:
        return f"{self.stage.capitalize() or 'Loading'} {self.name}… {time.time() - self.started:.0f} s"


def begin_switch(switch: ModelSwitch, engine: Engine, name: str, *,
                 int8_activations: bool | None = None) -> asyncio.Task:
    """Start loading `name` as the picker's one model load (`int8_activations`: on the CPU
    kernels, with int8 activations from now on or not; None: as the current model); the task's
    result is the EngineError that stopped it (also kept in `switch.error`), or None once loaded."""
    switch.name, switch.stage, switch.started, switch.error = name, "", time.time(), None

    def progress(stage: str) -> None:
        switch.stage = stage

    async def load() -> EngineError | None:
        try:
            await asyncio.to_thread(engine.switch_model, name, progress=progress,
                                    int8_activations=int8_activations)
        except EngineError as exc:
            switch.error = f"Could not load {name}: {exc}"
            return exc
        return None

    switch.task = asyncio.create_task(load())
    return switch.task


@dataclass
class ModelDownload:
    """The one download that may be in progress, shown in the model picker."""

    spec: str = ""
    progress: DownloadProgress | None = None
    error: str | None = None
    finished: str | None = None  # the message once a download completed
    task: asyncio.Task | None = None
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def active(self) -> bool:
        return self.task is not None and not self.task.done()

    def describe(self) -> str:
        if self.progress is None:
            return f"Downloading {self.spec}…"
        return f"Downloading {self.spec}: {self.progress.describe()}"
