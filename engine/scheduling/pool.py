"""The model pool: the models loaded at once, each a `ModelSlot` (engine/scheduling/slot.py) with
its own batch and prefix cache, all under the engine's one `MemoryBudget`
(engine/scheduling/budget.py) and served by its one scheduler thread (ticks.py).

- A request for a model that is not loaded loads it (`acquire`): once, however many ask at the
  same time (they wait for the one load), and one load at a time. Its weights are reserved in the
  budget (estimated from its files before loading, then as loaded).
- Where the budget has no room (for weights, or for a request's model cache) or `max_loaded`
  models are in memory, the least recently used idle models leave memory first: a model with an
  admitted request, an embedding job (`Scheduler.hold`) or a pin is never evicted. When nothing
  can be evicted, the load is refused with `NoRoom` (a 503 with Retry-After), never an
  out-of-memory crash.
- A model idle past its keep-alive leaves memory (`expire`, on the scheduler thread): its own
  `keep_alive` setting or the server's default, the last request's `keep_alive` over both; a
  pinned model (`mlxchat serve --model`) stays unless a request says otherwise.
- Each model's settings (engine/scheduling/model_settings.py) apply on every load: at start, by a
  request naming it, after an idle unload or an eviction.
- The prefix caches share the budget's room fairly: each may hold the room left over by the
  reservations divided by the number of models that have one (`cache_share`).

A model that left memory stays a member (its tokenizer, config and description), so requests for
it are accepted and wait while it loads again.
"""

import logging
import threading
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import EngineError, ModelLoadError, NoRoom
from ..loading.memory import weight_files_bytes
from ..loading.progress import LoadCallback, reporting
from ..loading.registry import DEFAULT_MODEL, LoadedModel, ModelInfo, list_models, resolve
from .budget import MemoryBudget, mib
from .model_settings import ModelSettingsFile
from .slot import ModelSlot

if TYPE_CHECKING:
    from .ticks import Scheduler

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5.0  # what NoRoom tells clients to wait


@dataclass(frozen=True)
class ResidentModel:
    """A model whose weights are in memory, as `/api/ps` and the model panel show it."""

    name: str
    family: str
    weight_bytes: int  # reserved in the memory budget
    context_length: int
    kv_format: str
    expires_at: float | None  # time.time() when it unloads if still idle; None: it stays
    pinned: bool
    busy: bool  # requests (or an embedding job) run on it now
    default: bool  # the model requests run on when they name none
    capabilities: tuple[str, ...] = ()


def weight_bytes(lm: LoadedModel) -> int:
    """The bytes of a loaded model's weights (counted once per load, kept in `lm.extras`)."""
    if "weight_bytes" not in lm.extras:
        from mlx.utils import tree_flatten

        vision = lm.extras.get("vision")  # mlx-vlm's whole model: the tower and the text
        module = vision.vlm if vision is not None else lm.model
        lm.extras["weight_bytes"] = sum(p.nbytes for _, p in tree_flatten(module.parameters()))
    return lm.extras["weight_bytes"]


class ModelPool:
    """The engine's models (see the module's doc). Thread-safe; `attach` gives it its scheduler."""

    def __init__(self, budget: MemoryBudget, load: Callable[..., LoadedModel], *,
                 settings: ModelSettingsFile, keep_alive: float | None,
                 max_loaded: int | None = None, prefix_cache: bool = True,
                 persist_prefix_cache: bool = False, int8_activations: bool | None = None,
                 on_release: Callable[[ModelSlot], None] = lambda slot: None):
        """`load(name, fallback_to_default=..., int8_activations=..., [kv_bits=...])` loads a
        model's weights; `keep_alive`: the server's default idle time (None: forever);
        `max_loaded`: at most this many models in memory (None: as many as the budget holds)."""
        self.budget = budget
        self.settings = settings
        self.keep_alive = keep_alive
        self.max_loaded = max_loaded
        self._load = load
        self._slot_options = dict(prefix_cache=prefix_cache,
                                  persist_prefix_cache=persist_prefix_cache,
                                  cache_budget=self.cache_share, on_release=on_release,
                                  int8_activations=int8_activations)
        self._members: dict[str, ModelSlot] = {}  # by name, as loaded
        self._spellings: dict[str | None, str] = {}  # how a model was asked for -> its name
        self._pending: dict[str | None, "Future[ModelSlot]"] = {}  # loads in flight, as asked
        self._lock = threading.Lock()
        self._loading = threading.Lock()  # one load at a time
        self.default: ModelSlot | None = None  # requests that name no model run on it
        self.scheduler: "Scheduler | None" = None

    def attach(self, scheduler: "Scheduler") -> None:
        self.scheduler = scheduler

    # -- reading ---------------------------------------------------------------------------------
    def find(self, name: str | None) -> ModelSlot | None:
        """The member called `name` (as loaded or as asked for), or None."""
        with self._lock:
            return self._find(name)

    def _find(self, name: str | None) -> ModelSlot | None:
        found = self._members.get(name) if name is not None else None
        return found or self._members.get(self._spellings.get(name, ""))

    def members(self) -> list[ModelSlot]:
        with self._lock:
            return list(self._members.values())

    def resident(self) -> list[ModelSlot]:
        """The members whose weights are in memory."""
        return [s for s in self.members() if s.resident]

    def cache_share(self) -> int:
        """The bytes one prefix cache may hold now: the budget's room, shared by the models in
        memory that have one."""
        caches = sum(1 for s in self.resident() if s.prefix_cache is not None)
        return self.budget.room() // max(caches, 1)

    def known(self) -> list[ModelInfo]:
        """The local models (bundled, downloaded), then the members loaded from a path."""
        found = {m.name: m for m in list_models()}
        for slot in self.members():
            lm = slot.lm
            if lm is None or lm.name in found:
                continue
            asked = Path(slot.asked).expanduser() if slot.asked else None
            path = asked if asked is not None and asked.exists() else lm.path
            found[lm.name] = ModelInfo(lm.name, "gguf" if path.is_file() else "folder", str(path),
                                       weight_files_bytes([path] if path.is_file()
                                                          else path.glob("*")),
                                       vision="vision" in lm.extras)
        return list(found.values())

    def in_memory(self) -> list[ResidentModel]:
        """The models in memory, most recently used first."""
        slots = sorted(self.resident(), key=lambda s: -s.last_used)
        out = []
        for slot in slots:
            described = slot.described
            if described is None:
                continue
            busy = self._busy(slot)
            out.append(ResidentModel(
                name=described.name, family=described.family, weight_bytes=slot.weight_bytes,
                context_length=described.context_length, kv_format=described.kv_format,
                expires_at=None if busy else slot.expires_at(), pinned=slot.pinned, busy=busy,
                default=slot is self.default, capabilities=described.capabilities))
        return out

    def _busy(self, slot: ModelSlot) -> bool:
        if self.scheduler is None:
            return slot.holds > 0
        with self.scheduler._lock:  # noqa: SLF001 - the pool shares the scheduler's lock
            return self.scheduler.busy(slot)

    def default_keep(self, slot: ModelSlot) -> float | None:
        """How long `slot` stays loaded when idle, unless a request says: its settings' keep-alive,
        else the server's (a pinned model: always)."""
        return slot.settings.idle_keep(None if slot.pinned else self.keep_alive)

    # -- loading ---------------------------------------------------------------------------------
    def acquire(self, name: str | None, *, progress: LoadCallback | None = None,
                pin: bool = False, load: Callable[..., LoadedModel] | None = None,
                fallback_to_default: bool = False, int8_activations: bool | None = None,
                evict_pinned: bool = False) -> ModelSlot:
        """The member `name` with its weights in memory, loaded now if they are not (on this
        thread; never the scheduler's); concurrent callers for one model wait for the one load.
        `progress`: its load's stages (engine/loading/progress.py; None: to the callback of the
        `reporting` block the caller runs in, if any; the caller says "ready").
        `pin`: never evict it to make room. `load`: another loader for a new member (the
        embedding queue's). `int8_activations`: a new member's choice (see
        `ModelSlot.int8_choice`). `evict_pinned`: an idle pinned model may leave memory for it
        where nothing else can (the user picked this model: `Engine.switch_model`). Raises the load's ModelLoadError, or NoRoom when the models holding
        the budget are all busy."""
        while True:
            with self._lock:
                slot = self._find(name)
                if slot is not None and slot.resident:
                    slot.pinned = slot.pinned or pin
                    return slot
                pending = self._pending.get(name)
                mine = pending is None
                if pending is None:
                    pending = self._pending[name] = Future()
            if not mine:
                slot = pending.result()  # the load in flight: its model, or its failure
                slot.pinned = slot.pinned or pin
                return slot
            try:
                with reporting(progress) if progress is not None else nullcontext():
                    slot = self._load_member(name, pin, load, fallback_to_default,
                                             int8_activations, evict_pinned)
                pending.set_result(slot)
                return slot
            except BaseException as exc:
                pending.set_exception(exc)
                raise
            finally:
                with self._lock:
                    self._pending.pop(name, None)

    def load_soon(self, slot: ModelSlot, failed: Callable[[ModelSlot, Exception], None]) -> None:
        """Load `slot`'s weights again on a thread of its own (for requests admitted while they
        were out of memory); `failed(slot, failure)` if they cannot load."""
        def run() -> None:
            try:
                self.acquire(slot.asked if slot.lm is None else slot.lm.name)
            except Exception as exc:  # the waiting requests fail with it
                failed(slot, exc)

        threading.Thread(target=run, name="mlxchat-model-load", daemon=True).start()

    def _load_member(self, name: str | None, pin: bool,
                     load: Callable[..., LoadedModel] | None, fallback_to_default: bool,
                     int8_activations: bool | None, evict_pinned: bool = False) -> ModelSlot:
        with self._loading:
            display, estimate = _probe(name)
            with self._lock:
                slot = self._find(name) or (self._members.get(display) if display else None)
            if slot is not None and slot.resident:  # loaded meanwhile, under another spelling
                self._remember(name, slot)
                slot.pinned = slot.pinned or pin
                return slot
            fresh = slot is None
            if slot is None:
                slot = ModelSlot(name, load or self._load, **self._slot_options)
            if int8_activations is not None:
                slot.int8_activations = int8_activations
            settings = self.settings.get(display, name) if fresh else \
                self.settings.get(slot.name, slot.asked)
            self._reserve(estimate, slot, adding=True, evict_pinned=evict_pinned)
            reserved = estimate
            try:
                loaded = slot.load(settings, fallback_to_default)
                if fallback_to_default and display is None and slot.lm is None \
                        and loaded.name == DEFAULT_MODEL and name not in (None, DEFAULT_MODEL):
                    slot.asked = None  # it fell back to the bundled model: reload that one
                target = self._members_get(loaded.name) or slot
                actual = weight_bytes(loaded)
                if actual > reserved:
                    self._reserve(actual - reserved, target, adding=False,
                                  evict_pinned=evict_pinned)
                elif actual < reserved:
                    self.budget.release(reserved - actual)
                reserved = actual
                if target is not slot:  # known under another spelling: its settings
                    settings = self.settings.get(target.name, target.asked)
                target.install(loaded, settings)
            except BaseException:
                self.budget.release(reserved)
                raise
            target.weight_bytes = reserved
            target.pinned = target.pinned or pin
            target.touch(self.default_keep(target))
            with self._lock:
                self._members.setdefault(target.name, target)
                self._remember(name, target)
            if self.scheduler is not None:
                self.scheduler.loaded(target)
            log.info("loaded %s (%s of weights; %s of %s reserved)", target.name, mib(reserved),
                     mib(self.budget.reserved), mib(self.budget.total))
            return target

    def _members_get(self, name: str) -> ModelSlot | None:
        with self._lock:
            return self._members.get(name)

    def _remember(self, name: str | None, slot: ModelSlot) -> None:
        """Under the lock: `name` asks for `slot` from now on."""
        if name != slot.name:
            self._spellings[name] = slot.name

    # -- room ------------------------------------------------------------------------------------
    def reserve(self, nbytes: int, what: str) -> None:
        """Reserve `nbytes` in the budget for something besides the pool's models (e.g. a speech
        model's weights), evicting idle models where it needs room; raises NoRoom when the models
        holding the budget are busy (release the bytes with `budget.release` when done)."""
        self._reserve(nbytes, None, False, what=what)

    def _reserve(self, nbytes: int, keep: ModelSlot | None, adding: bool,
                 evict_pinned: bool = False, what: str | None = None) -> None:
        """Reserve `nbytes` of weights for `keep`, evicting idle models as needed (`adding`: one
        more model comes into memory, so `max_loaded` counts; `evict_pinned`: pinned ones too,
        after the others); raises ModelLoadError when they could never fit, NoRoom when the
        models holding the budget are busy."""
        what = what or (keep.name if keep is not None else "this")
        if not self.budget.fits(nbytes):
            raise ModelLoadError(f"{what} needs {mib(nbytes)} for its weights, over the "
                                 f"memory budget of {mib(self.budget.total)}",
                                 code="insufficient_memory")
        if self.scheduler is None:
            evicted: list[ModelSlot] = []
            room = self._make_room(nbytes, keep, adding, evicted, ModelSlot.retire,
                                   evict_pinned)
        else:
            with self.scheduler._lock:  # noqa: SLF001 - the residency lock
                evicted = []
                room = self._make_room(nbytes, keep, adding, evicted,
                                       self.scheduler.retire_locked, evict_pinned)
        for slot in evicted:
            self._drop(slot, f"to make room for {what}")
        if not room:
            busy = ", ".join(s.name for s in self.resident() if s is not keep) or "none"
            raise NoRoom(f"no room to load {what} ({mib(nbytes)}): the memory budget "
                         f"({mib(self.budget.total)}, {mib(self.budget.reserved)} reserved) and "
                         f"the models in memory ({busy}) are all in use; try again when a "
                         f"request ends", retry_after=RETRY_AFTER_S)

    def evict_for(self, nbytes: int, keep: ModelSlot | None) -> None:
        """Under the scheduler's lock: evict idle models (never `keep`) until `nbytes` are free
        in the budget, for a request's model cache; reserves nothing (the caller does)."""
        evicted: list[ModelSlot] = []
        scheduler = self.scheduler
        assert scheduler is not None

        def room_now() -> bool:
            return self.budget.room() >= nbytes

        while not room_now():
            victim = self._idle_lru(keep, evicted)
            if victim is None or not scheduler.retire_locked(victim):
                break
            evicted.append(victim)
            self._free(victim)
        for slot in evicted:  # admission does not wait for their memory to come back
            self._drop(slot, "to make room for a request", wait=False)

    def _make_room(self, nbytes: int, keep: ModelSlot | None, adding: bool,
                   evicted: list[ModelSlot],
                   retire: Callable[[ModelSlot], bool], evict_pinned: bool = False) -> bool:
        """Under the residency lock: reserve `nbytes`, retiring idle models (into `evicted`,
        their reservations released) as long as needed; False when it cannot."""
        while True:
            count = sum(1 for s in self.resident() if s is not keep)
            if (not adding or self.max_loaded is None or count < self.max_loaded) and \
                    self.budget.try_reserve(nbytes):
                return True
            victim = self._idle_lru(keep, evicted) or \
                (self._idle_lru(keep, evicted, pinned=True) if evict_pinned else None)
            if victim is None or not retire(victim):
                return False
            evicted.append(victim)
            self._free(victim)

    def _idle_lru(self, keep: ModelSlot | None, skip: list[ModelSlot],
                  pinned: bool = False) -> ModelSlot | None:
        """The least recently used model in memory that may be evicted now (under the lock):
        one not pinned (`pinned`: one pinned)."""
        scheduler = self.scheduler
        idle = [s for s in self.resident() if s is not keep and s not in skip
                and s.pinned == pinned
                and s.holds == 0 and (scheduler is None or not scheduler.busy(s))]
        return min(idle, key=lambda s: s.last_used, default=None)

    def _free(self, slot: ModelSlot) -> None:
        """`slot` was just retired: its weights' reservation goes back to the budget."""
        self.budget.release(slot.weight_bytes)
        slot.weight_bytes = 0

    def _drop(self, slot: ModelSlot, why: str, wait: bool = True) -> None:
        """Unload `slot`'s weights (already retired, its reservation released) on a thread of its
        own that does nothing after (MLX 0.32.4 may crash a thread that runs a model after it
        freed one or emptied the buffer cache there: engine/decoding/speech.py's
        `_keep_buffer_cache`); `wait`: until their memory is back (a load that needs it)."""
        thread = threading.Thread(target=slot.unload, args=(why,), name="mlxchat-unload",
                                  daemon=True)
        thread.start()
        if wait:
            thread.join()

    # -- leaving memory --------------------------------------------------------------------------
    def until_expiry(self) -> float | None:
        """Under the scheduler's lock: seconds until an idle model is past its keep-alive (<= 0:
        now), or None when none will be."""
        scheduler = self.scheduler
        lefts = [left for s in self.resident()
                 if (left := s.until_unload()) is not None
                 and s.holds == 0 and (scheduler is None or not scheduler.busy(s))]
        return min(lefts, default=None)

    def expire(self) -> None:
        """On the scheduler thread: unload the idle models past their keep-alive."""
        for slot in self.resident():
            left = slot.until_unload()
            if left is not None and left <= 0 and self._retire(slot):
                self._free(slot)  # the scheduler thread goes on meanwhile
                self._drop(slot, f"idle for {slot.idle_keep:.0f} s", wait=False)

    def unload(self, name: str) -> bool:
        """Unload `name` now (Ollama's `keep_alive: 0`): at once if idle, else as soon as its
        requests end. False when it is not in memory."""
        slot = self.find(name)
        if slot is None or not slot.resident:
            return False
        slot.unload_after_use = True
        if self._retire(slot):
            self._free(slot)
            self._drop(slot, "asked to", wait=False)
        elif self.scheduler is not None:
            self.scheduler.wake()
        return True

    def reload(self, slot: ModelSlot) -> None:
        """Unload `slot` (idle: the caller drained its requests) so the next `acquire` loads it
        as its options say now."""
        if self._retire(slot):
            self._free(slot)
            self._drop(slot, "to load it with other options", wait=False)

    def _retire(self, slot: ModelSlot) -> bool:
        if self.scheduler is None:
            return slot.retire()
        return self.scheduler.retire(slot)

    def close(self) -> None:
        """The engine stops: write each model's prefix-cache snapshots (to continue after a
        restart without prefilling again)."""
        for slot in self.resident():
            slot.persist()


def _probe(name: str | None) -> tuple[str | None, int]:
    """(the name a model loads as, its weight files' bytes) before loading it; (None, 0) when the
    registry does not know it (a loader of its own may)."""
    try:
        display, folder = resolve(name)
    except (EngineError, OSError):
        return None, 0
    return display, weight_files_bytes(folder.glob("*"))
