"""A submitted request as its caller holds it: its state, timestamps and events, readable from any
thread or event loop while the scheduler thread (engine/scheduling/ticks.py) moves it on.
"""

import asyncio
import concurrent.futures
import queue
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterator

from ..decoding.generate import Generation
from ..events import FINAL_STATES, Event, FinishReason, RequestState, Usage

if TYPE_CHECKING:
    from .slot import ModelSlot


@dataclass(eq=False)
class RequestHandle:
    """A submitted request: its state, timestamps and events, readable from any thread."""

    id: str
    generation: Generation | None  # None while its draft loads
    slot: "ModelSlot | None" = None  # the pool's model it runs on (engine/scheduling/slot.py)
    kv_bytes: int = 0  # estimated model-cache memory at full length, reserved while admitted
    state: RequestState = "queued"
    times: dict[str, float] = field(default_factory=dict)  # queued, started, first_token, last_token, ended
    transitions: list[tuple[RequestState, float]] = field(default_factory=list)
    error: str | None = None
    finish_reason: FinishReason | None = None
    cancel_requested: bool = False
    keep_alive: float | None = None  # seconds the model stays loaded after this request (None: the engine's)
    # SimpleQueue: a put is one C call (no Python lock and condition per token on the scheduler
    # thread, whose time per token a small model's step waits for)
    _events: "queue.SimpleQueue[Event]" = field(default_factory=queue.SimpleQueue)
    _loop: asyncio.AbstractEventLoop | None = None
    _wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    _on_cancel: Callable[["RequestHandle"], None] | None = None
    _accepted: "concurrent.futures.Future[None]" = field(default_factory=concurrent.futures.Future)

    def cancel(self) -> None:
        """Stop the request at its next step (or before it starts); safe from any thread."""
        self.cancel_requested = True
        if self.generation is not None:
            self.generation.cancel()
        if self._on_cancel is not None:
            self._on_cancel(self)

    @property
    def usage(self) -> Usage:
        return self.generation.usage() if self.generation is not None else Usage()

    def wait_accepted(self, timeout: float | None = None) -> None:
        """Block until the request is queued (its draft loaded); raises the EngineError that
        refused it instead (e.g. a draft that cannot load), as `submit` would have."""
        self._accepted.result(timeout)

    async def accepted(self) -> None:
        """`wait_accepted` for an event loop."""
        await asyncio.wrap_future(self._accepted)

    def _enter(self, state: RequestState) -> None:
        now = time.time()
        self.state = state
        self.transitions.append((state, now))
        if state in FINAL_STATES:
            self.times["ended"] = now
        elif state in ("loading_draft", "queued"):
            self.times.setdefault("queued", now)  # submitted
        elif state == "prefill":
            self.times["started"] = now
        # decoding starts with the first token, timed as first_token

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
        """Async iterator for an event loop; leaving it early (client gone) cancels the request.
        The loop that streams is the one woken, whichever thread submitted the request (a long
        prompt is tokenised in a worker thread, which has no loop)."""
        finished = False
        self._loop = asyncio.get_running_loop()
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
