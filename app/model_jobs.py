"""The model jobs that run behind the model picker (app/ui/picker.py): the picker's model load in
progress, also the server's start (`mlxchat serve` listens at once and loads its first model this
way) — `begin_switch` loads a model into the engine's model pool in a thread of its own and makes
it the default (the other models stay loaded while the memory budget allows; API requests load
the models they name through the pool directly, app/api/models.py), `ModelSwitch` describes the
load while it runs (its stages: engine.LOAD_STAGES), `model_loaded` waits for it — and the one
download (`ModelDownload`). `StageLines` writes a load's stages to the terminal, a line each."""

import asyncio
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

from engine import DownloadProgress, Engine, EngineError, LoadProgress, LoadStage


@dataclass
class ModelSwitch:
    """The picker's model load that may be in progress (or the last one, until another begins),
    as the page shows it: its stages so far, the current one with its bytes while downloading."""

    name: str | None = None
    progress: LoadProgress | None = None  # the latest stage reported
    passed: list[LoadStage] = field(default_factory=list)  # every stage reported, in order
    started: float = 0.0
    error: str | None = None
    task: asyncio.Task | None = None

    @property
    def loading(self) -> bool:
        return self.task is not None and not self.task.done()

    @property
    def stage(self) -> LoadStage | None:
        return self.progress.stage if self.progress is not None else None

    def seen(self, progress: LoadProgress) -> None:
        """A stage reported by the engine (on its thread)."""
        if not self.passed or self.passed[-1] != progress.stage:
            self.passed.append(progress.stage)
        self.progress = progress

    @property
    def took(self) -> float:
        """Seconds the load took (so far, while it runs)."""
        end = self.progress.since if self.stage == "ready" and self.progress else time.time()
        return end - self.started

    def describe(self) -> str:
        """e.g. "Downloading smollm2-135m-instruct: 12.3 of 98.4 MB (4.1 MB/s, 21 s left)… 4 s"."""
        now = self.progress.describe() if self.progress is not None else ""
        what, _, detail = now.partition(": ")
        head = f"{(what or 'loading').capitalize()} {self.name}"
        return f"{head}{': ' + detail if detail else ''}… {time.time() - self.started:.0f} s"


def begin_switch(switch: ModelSwitch, engine: Engine, name: str, *,
                 int8_activations: bool | None = None,
                 echo: "StageLines | None" = None) -> asyncio.Task:
    """Start loading `name` as the picker's model load, to be the default model
    (`int8_activations`: on the CPU kernels, with int8 activations from now on or not; None: as
    its settings say), its stages also written by `echo`; the task's result is the EngineError
    that stopped it (also kept in `switch.error`), or None once loaded."""
    switch.name, switch.progress, switch.started, switch.error = name, None, time.time(), None
    switch.passed = []

    def progress(p: LoadProgress) -> None:
        switch.seen(p)
        if echo is not None:
            echo.stage(p)

    outcome = _in_thread(lambda: engine.switch_model(name, progress=progress,
                                                     int8_activations=int8_activations))

    async def load() -> EngineError | None:
        failure = await outcome
        if failure is not None:
            switch.error = f"Could not load {name}: {failure}"
            if echo is not None:
                echo.failed(switch.error)
        return failure

    switch.task = asyncio.create_task(load())
    return switch.task


def _in_thread(work: Callable[[], None]) -> "asyncio.Future[EngineError | None]":
    """Run `work` on a thread of its own, not the loop's executor: a server stopped while a
    download or a conversion runs exits at once instead of waiting for it (the thread is a
    daemon). The future's result is the EngineError `work` raised (any other exception said as
    one), or None."""
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[EngineError | None] = loop.create_future()

    def settle(result: EngineError | None) -> None:
        if not outcome.done():
            outcome.set_result(result)

    def run() -> None:
        result: EngineError | None = None
        try:
            work()
        except EngineError as exc:
            result = exc
        except Exception as exc:  # noqa: BLE001 - a bug in a load still ends the load, said
            result = EngineError(f"{type(exc).__name__}: {exc}")
        try:
            loop.call_soon_threadsafe(settle, result)
        except RuntimeError:  # the server stopped meanwhile: nobody waits any more
            pass

    threading.Thread(target=run, name="mlxchat-model-load", daemon=True).start()
    return outcome


async def model_loaded(switch: ModelSwitch, engine: Engine, timeout: float | None) -> bool:
    """Whether a model is loaded, once the load in progress (if any) has ended or `timeout`
    seconds have passed (None: however long it takes). Loaded means described too: a load
    sets the model's name a moment before its description (context length, defaults)."""
    task = switch.task
    if engine.model is None and task is not None and not task.done():
        await asyncio.wait([task], timeout=timeout)
    return engine.model is not None


class StageLines:
    """A load's stages on the terminal, a line each (a log keeps them readable): the stage as it
    begins, and while downloading a line every tenth of the bytes."""

    def __init__(self, out: TextIO = sys.stderr):
        self.out = out
        self.last: LoadStage | None = None
        self.tenth = -1

    def stage(self, p: LoadProgress) -> None:
        if p.stage == "ready":
            return  # the caller says what is ready, and where it runs
        if p.stage != self.last:
            self.last, self.tenth = p.stage, -1
            if p.download is None:
                self._line(p.stage)
        if p.download is not None and p.download.total_bytes:
            tenth = min(10, 10 * p.download.done_bytes // p.download.total_bytes)
            if tenth != self.tenth:
                self.tenth = tenth
                self._line(p.describe())

    def failed(self, message: str) -> None:
        self._line(message)

    def _line(self, text: str) -> None:
        print(f"  {text}", file=self.out, flush=True)


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
