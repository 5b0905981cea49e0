"""The engine as a service: one scheduler thread owns the model and all MLX work; callers in any
thread (or an asyncio loop) submit requests and read their events.

Every request has one lifecycle, `queued -> prefill -> decoding -> finished | cancelled | failed`,
and always ends with exactly one `done` event, whatever happens inside.
"""

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

import mlx.core as mx

from .errors import EngineError, InvalidRequest
from .events import Event, Timings, Usage
from .generate import Generation, build_prompt
from .registry import LoadedModel, ModelInfo, list_models, load_model
from .sampling import SamplingParams

log = logging.getLogger(__name__)

STATES = ("queued", "prefill", "decoding", "finished", "cancelled", "failed")
FINAL_STATES = ("finished", "cancelled", "failed")


class Overloaded(EngineError):
    """Too many requests running and queued; try again after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class RequestHandle:
    """A submitted request: its state, timestamps and events, readable from any thread."""

    id: str
    generation: Generation
    state: str = "queued"
    times: dict[str, float] = field(default_factory=dict)  # queued, started, first_token, last_token, ended
    error: str | None = None
    finish_reason: str | None = None
    _events: "queue.Queue[Event]" = field(default_factory=queue.Queue)
    _loop: asyncio.AbstractEventLoop | None = None
    _wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    _on_cancel: Callable[["RequestHandle"], None] | None = None

    def cancel(self) -> None:
        """Stop the request at its next step (or before it starts); safe from any thread."""
        self.generation.cancel()
        if self._on_cancel is not None:
            self._on_cancel(self)

    @property
    def usage(self) -> Usage:
        return self.generation.usage()

    def snapshot(self) -> dict[str, Any]:
        """The observable state of this request (for the API and the UI)."""
        return {"id": self.id, "state": self.state, "times": dict(self.times),
                "finish_reason": self.finish_reason, "error": self.error,
                "usage": self.usage.__dict__}

    def _publish(self, event: Event) -> None:
        self._events.put(event)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wakeup.set)

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Blocking iterator for threads (CLI, tests); ends after the `done` event."""
        while True:
            event = self._events.get(timeout=timeout)
            yield event
            if event.kind == "done":
                return

    async def stream(self) -> AsyncIterator[Event]:
        """Async iterator for an event loop; leaving it early (client gone) cancels the request."""
        finished = False
        try:
            while True:
                self._wakeup.clear()
                while not self._events.empty():
                    event = self._events.get_nowait()
                    yield event
                    if event.kind == "done":
                        finished = True
                        return
                await self._wakeup.wait()
        finally:
            if not finished:
                self.cancel()


class Engine:
    """Owns one loaded model and runs every request on a single scheduler thread."""

    def __init__(self, model: str | None = None, *, max_running: int = 4, max_queued: int = 8,
                 fallback_to_default: bool = False, prefix_cache: bool = True,
                 load: Callable[..., LoadedModel] = load_model):
        self.requested_model = model
        self.max_running = max_running
        self.max_queued = max_queued
        self.fallback_to_default = fallback_to_default
        self.use_prefix_cache = prefix_cache
        self._load = load
        self.lm: LoadedModel | None = None
        self.prefix_cache = None
        self._queued: deque[RequestHandle] = deque()
        self._running: list[RequestHandle] = []
        self._control: "queue.Queue[Callable[[], None]]" = queue.Queue()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.loading: dict[str, Any] | None = None  # {"model": name, "stage": ...} while loading

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, progress: Callable[[str], None] | None = None) -> "Engine":
        """Load the model (on the scheduler thread) and start serving; blocks until loaded."""
        self._thread = threading.Thread(target=self._run, name="mlxchat-scheduler", daemon=True)
        self._thread.start()
        self._call(lambda: self._install(self.requested_model, progress))
        return self

    def stop(self) -> None:
        """Cancel everything running or queued, let each end with its final event, then stop."""
        with self._lock:
            handles = list(self._queued) + list(self._running)
        for h in handles:
            h.cancel()
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def model_name(self) -> str | None:
        return self.lm.name if self.lm else None

    def list_models(self) -> list[ModelInfo]:
        return list_models()

    def switch_model(self, name: str, progress: Callable[[str], None] | None = None,
                     cancel_running: bool = False) -> None:
        """Load another model once running requests end (or are cancelled, if asked)."""
        if cancel_running:
            with self._lock:
                for h in list(self._queued) + list(self._running):
                    h.cancel()
        self._call(lambda: self._install(name, progress))

    def _install(self, name: str | None, progress: Callable[[str], None] | None) -> None:
        """Runs on the scheduler thread with no request running."""
        report = progress or (lambda stage: None)
        self.loading = {"model": name, "stage": "loading"}
        report("loading")
        old, self.lm, self.prefix_cache = self.lm, None, None
        del old
        mx.clear_cache()
        try:
            self.lm = self._load(name, fallback_to_default=self.fallback_to_default)
            if self.use_prefix_cache:
                from .prefix_cache import PrefixCache, default_persist_dir

                self.prefix_cache = PrefixCache(self.lm, persist_dir=default_persist_dir())
        finally:
            self.loading = None
        report("ready")

    def _call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the scheduler thread between steps once no request is running."""
        done = threading.Event()
        failure: list[BaseException] = []

        def task() -> None:
            try:
                fn()
            except BaseException as exc:  # handed back to the caller below
                failure.append(exc)
            finally:
                done.set()

        with self._wake:
            self._control.put(task)
            self._wake.notify_all()
        done.wait()
        if failure:
            raise failure[0]

    # -- submission ----------------------------------------------------------------------------
    def submit(self, messages: Sequence[dict] | None = None, params: SamplingParams | None = None,
               *, prompt_tokens: Sequence[int] | None = None, text: str | None = None) -> RequestHandle:
        """Validate and enqueue a request; raises InvalidRequest or Overloaded at once."""
        lm = self.lm
        if lm is None:
            raise EngineError("no model is loaded yet")
        params = params or SamplingParams()
        prompt = build_prompt(lm, messages=messages, prompt_tokens=prompt_tokens, text=text)
        generation = Generation(lm, prompt, params, prefix_cache=self.prefix_cache)
        handle = RequestHandle(id=f"req-{next(self._ids)}", generation=generation,
                               _on_cancel=self._cancelled)
        handle.times["queued"] = time.time()
        try:
            handle._loop = asyncio.get_running_loop()
        except RuntimeError:
            handle._loop = None
        with self._wake:
            if len(self._running) + len(self._queued) >= self.max_running + self.max_queued:
                raise Overloaded(f"server busy: {len(self._running)} requests running and "
                                 f"{len(self._queued)} queued (limits {self.max_running} + "
                                 f"{self.max_queued})", retry_after=2.0)
            self._queued.append(handle)
            self._wake.notify_all()
        return handle

    def generate(self, *args: Any, **kwargs: Any) -> Iterator[Event]:
        """Submit and iterate the events in the calling thread."""
        return self.submit(*args, **kwargs).events()

    def _cancelled(self, handle: RequestHandle) -> None:
        with self._wake:
            if handle in self._queued:  # never started: end it here, nothing to release
                self._queued.remove(handle)
                self._end(handle, "cancelled", [Event("done", finish_reason="cancelled",
                                                      usage=handle.usage, timings=Timings())])
            self._wake.notify_all()

    # -- the scheduler thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._queued or self._running
                           or not self._control.empty()):
                    self._wake.wait()
                if self._stopping and not self._running and not self._queued:
                    return
                if not self._running and not self._control.empty():
                    task = self._control.get()
                else:
                    task = None
                    while self._queued and len(self._running) < self.max_running \
                            and self._control.empty():
                        handle = self._queued.popleft()
                        handle.state = "prefill"
                        handle.times["started"] = time.time()
                        self._running.append(handle)
                running = list(self._running)
            if task is not None:
                task()
                continue
            for handle in running:
                self._step(handle)

    def _step(self, handle: RequestHandle) -> None:
        gen = handle.generation
        try:
            events = gen.step()
        except Exception as exc:  # isolate the failure to this request
            log.exception("request %s failed", handle.id)
            events = [Event("done", finish_reason="failed", error=f"{type(exc).__name__}: {exc}",
                            usage=gen.usage(), timings=gen.timings())]
            gen.finish_reason = "failed"
        if not gen.in_prefill and handle.state == "prefill":
            handle.state = "decoding"
        now = time.time()
        for event in events:
            if event.kind == "token":
                handle.times.setdefault("first_token", now)
                handle.times["last_token"] = now
        if gen.done or (events and events[-1].kind == "done"):
            reason = events[-1].finish_reason if events else gen.finish_reason
            state = {"cancelled": "cancelled", "failed": "failed"}.get(reason, "finished")
            with self._wake:
                if handle in self._running:
                    self._running.remove(handle)
                self._end(handle, state, events, error=events[-1].error if events else None)
            return
        for event in events:
            handle._publish(event)

    def _end(self, handle: RequestHandle, state: str, events: list[Event],
             error: str | None = None) -> None:
        handle.state = state
        handle.error = error
        handle.finish_reason = events[-1].finish_reason if events else state
        handle.times["ended"] = time.time()
        for event in events:
            handle._publish(event)
