"""Draft models for speculative requests, loaded off the scheduler thread.

One loader thread loads drafts one at a time, and one draft is kept resident per engine (every
spelling of a model is one draft, found by `draft_identity`); a draft is kept only for the model
it was loaded for, and dropped when that model leaves memory.
"""

import threading
import queue
from typing import Callable

from ..decoding.drafts import SpeculatorFactory, draft_identity, load_draft
from ..errors import EngineError, Overloaded
from ..loading.registry import LoadedModel

# called on the loader thread with the loaded draft's factory, or the failure that stopped it
Done = Callable[[SpeculatorFactory | None, Exception | None], None]


class DraftLoader:
    """The resident draft (at most one), by identity, the spellings known to name it, and the
    loader thread. Thread-safe."""

    def __init__(self, alive: Callable[[LoadedModel], bool]):
        """`alive(lm)`: whether `lm`'s weights are in memory; a draft is kept only while they are."""
        self._alive = alive
        self._lock = threading.Lock()
        self._drafts: dict[str, tuple[LoadedModel, SpeculatorFactory]] = {}
        self._spellings: dict[str, str] = {}
        self._jobs: "queue.Queue[Callable[[], None] | None]" = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="mlxchat-drafts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The loader thread ends after the jobs queued before this."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def resident(self, lm: LoadedModel, draft: str) -> SpeculatorFactory | None:
        """The factory of `draft` for `lm` if it is the resident draft, else None."""
        with self._lock:
            entry = self._drafts.get(self._spellings.get(draft, ""))
        return entry[1] if entry is not None and entry[0] is lm else None

    def identities(self, lm: LoadedModel | None = None) -> tuple[str, ...]:
        """The resident draft's identity (only if it was loaded for `lm`, when given)."""
        with self._lock:
            return tuple(i for i, (owner, _) in self._drafts.items() if lm is None or owner is lm)

    def drop(self, lm: LoadedModel | None) -> None:
        """Drop the resident draft if it was loaded for `lm` (whose weights leave memory)."""
        with self._lock:
            if any(owner is lm for owner, _ in self._drafts.values()):
                self._drafts.clear()
                self._spellings.clear()

    def load(self, lm: LoadedModel, draft: str, *, cancelled: Callable[[], bool],
             prepare: Callable[[], None], done: Done) -> None:
        """Queue loading `draft` for `lm`: on the loader thread, unless `cancelled()` by then,
        `prepare()` (e.g. reload the model's weights), find the draft by its identity, loading it
        if it is not the resident draft (which it then replaces), and hand the result to `done`."""
        self._jobs.put(lambda: self._load(lm, draft, cancelled, prepare, done))

    def _load(self, lm: LoadedModel, draft: str, cancelled: Callable[[], bool],
              prepare: Callable[[], None], done: Done) -> None:
        factory, failure = None, None
        try:
            if not cancelled():
                prepare()
                factory = self._find(lm, draft)
        except Exception as exc:  # handed to the caller through `accepted()` and the done event
            failure = exc if isinstance(exc, EngineError) else EngineError(
                f"{type(exc).__name__}: {exc}")
        done(factory, failure)

    def _find(self, lm: LoadedModel, draft: str) -> SpeculatorFactory:
        if not self._alive(lm):
            raise Overloaded(f"{lm.name} left memory while its draft loaded", retry_after=5.0)
        identity = draft_identity(draft)
        with self._lock:
            entry = self._drafts.get(identity)
            if entry is None or entry[0] is not lm:  # released before the next loads
                self._drafts.clear()
                self._spellings.clear()
        if entry is None or entry[0] is not lm:
            entry = (lm, load_draft(lm, identity))
        with self._lock:
            if self._alive(lm):
                self._drafts = {identity: entry}
                self._spellings = {**self._spellings, draft: identity}
        return entry[1]
