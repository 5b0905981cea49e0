"""The engine as a service: one scheduler thread owns the model and all MLX work; callers in any
thread (or an asyncio loop) submit requests and read their events.

Every request has one lifecycle, `[loading_draft ->] queued -> prefill -> decoding -> finished |
cancelled | failed`, recorded with the time of each transition, and always ends with exactly one
`done` event, whatever happens inside. `submit` never waits: a speculative request whose draft is
not loaded yet starts in `loading_draft` while a loader thread loads it (one draft at a time, and
one kept per engine: every spelling of a model is one draft) and the scheduler serves the others.
Admission is bounded (running + queued caps, and the memory budget for the model caches the
admitted requests may grow to); requests that decode at the same time share one model call per
step (engine/scheduling/batch.py).
"""

import asyncio
import concurrent.futures
import dataclasses
import gc
import itertools
import logging
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator, Sequence

import mlx.core as mx

from .batch import DecodeBatch, KVFootprint, can_prefill_together, kv_footprint, prefill_together
from ..decoding.drafts import (DraftChoice, SpeculativeOptions, SpeculatorFactory, check_draft,
                               draft_choices, draft_identity, load_draft)
from ..device import memory_budget as device_memory_budget
from ..errors import EngineError, InvalidRequest, Overloaded
from ..events import FINAL_STATES, Event, FinishReason, RequestState, Timings, Usage
from ..decoding.generate import Generation, build_prompt
from ..loading.memory import weight_files_bytes
from ..loading.registry import LoadedModel, ModelInfo, capabilities, list_models, load_model
from ..decoding.defaults import ModelDefaults, resolve_defaults
from ..decoding.sampling import SamplingParams
from ..decoding.tools import ToolRequest
from .keep_alive import DEFAULT_KEEP_ALIVE_S, keep_alive_seconds

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 2e-4
# The idle scheduler re-checks at least this often (a wait must stay under threading.TIMEOUT_MAX).
WAIT_MAX_S = 3600.0
# Prompt tokens prefilled per tick, in prefill chunks: one while requests decode (each tick of
# prefill delays their next token), more while nothing decodes, so that requests arriving
# together start together and the batch runs full from its first step.
PREFILL_CHUNKS_DECODING = 1
PREFILL_CHUNKS_IDLE = 4
# Requests submitted together (parallel calls of one client, a burst of streams) start together:
# an idle engine admits its first request once no other has arrived for ADMIT_QUIET_S, waiting at
# most ADMIT_WAIT_S, so that the burst prefills in shared calls and decodes as one batch.
ADMIT_QUIET_S = 5e-4
ADMIT_WAIT_S = 5e-3
PERSIST_BYTES = 512 * 2**20  # prefix-cache snapshots written to disk at shutdown


@dataclass(frozen=True)
class ModelDescription:
    """The loaded model as callers see it: what it is and which drafts it can speculate with."""

    name: str
    family: str  # the config's model_type, e.g. "llama", "qwen3_5"
    context_length: int
    drafts: tuple[DraftChoice, ...]
    defaults: ModelDefaults  # each sampling option's default for this model, with its source
    capabilities: tuple[str, ...] = ("completion",)  # engine.loading.registry.CAPABILITIES


@dataclass(frozen=True)
class EngineStatus:
    """A consistent reading of the scheduler's load."""

    model: str | None
    running: int
    queued: int
    loading_drafts: int
    batch_rows: int  # decoding requests sharing the batched model call
    drafts: tuple[str, ...]  # the draft kept for the current model (at most one), by identity
    memory_budget: int
    reserved_bytes: int  # model-cache memory reserved by the admitted requests
    resident: bool = False  # the model's weights are in memory (not unloaded after an idle time)


@dataclass(eq=False)
class RequestHandle:
    """A submitted request: its state, timestamps and events, readable from any thread."""

    id: str
    generation: Generation | None  # None while its draft loads
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


class Engine:
    """Owns one loaded model and runs every request on a single scheduler thread.

    Each scheduler tick prefills up to a budget of prompt tokens (oldest request first, short
    prompts that wait together in shared model calls; see PREFILL_CHUNKS_*), runs the solo steps
    that cannot be batched (cancellations, speculative decoding, a lone decoder) and one batched
    decode step for every other decoding request (engine/scheduling/batch.py).
    """

    def __init__(self, model: str | None = None, *, max_running: int = 4, max_queued: int = 8,
                 fallback_to_default: bool = False, prefix_cache: bool = True,
                 persist_prefix_cache: bool = False,
                 load: Callable[..., LoadedModel] = load_model, batching: bool = True,
                 memory_budget: int | None = None,
                 keep_alive: float | str | None = DEFAULT_KEEP_ALIVE_S, speculation: bool = True):
        """`keep_alive`: unload the model's weights after it has been idle this long (seconds or
        a duration such as "30m"; None or negative: never); the next request reloads them.
        `speculation=False` refuses speculative requests (a sharded model)."""
        self.requested_model = model
        self.keep_alive = keep_alive_seconds(keep_alive)
        self.max_running = max_running
        self.max_queued = max_queued
        self.fallback_to_default = fallback_to_default
        self.use_prefix_cache = prefix_cache
        self.persist_prefix_cache = persist_prefix_cache
        self.batching = batching
        self.speculation = speculation  # off for a sharded model (engine/distributed/)
        # One budget for the model caches of admitted requests and the prefix cache's snapshots:
        # the prefix cache may hold what the admitted requests do not reserve.
        self.memory_budget = memory_budget if memory_budget is not None else device_memory_budget()
        self._reserved = 0  # bytes reserved by admitted requests (changed under the lock)
        self._load = load
        self.lm: LoadedModel | None = None
        self.prefix_cache = None
        self._footprint = KVFootprint(0, 0, False)
        self._batch: DecodeBatch | None = None
        self._queued: deque[RequestHandle] = deque()
        self._running: list[RequestHandle] = []
        self._preparing: list[RequestHandle] = []  # loading_draft
        # SimpleQueues: the scheduler checks both every tick, and their `empty` is one C call
        self._control: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._soon: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()  # between ticks: drafts
        # The resident draft (at most one), by identity, and the spellings known to name it;
        # changed under the lock by the loader thread and on model changes.
        self._drafts: dict[str, tuple[LoadedModel, SpeculatorFactory]] = {}
        self._draft_spellings: dict[str, str] = {}
        self._draft_jobs: "queue.Queue[Callable[[], None] | None]" = queue.Queue()
        self._draft_loader: threading.Thread | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._described: ModelDescription | None = None
        self._loaded_name: str | None = None  # as passed to `load`, for reloading after an unload
        self._opened: dict[str, ModelInfo] = {}  # models loaded from a path, by display name
        self._resident = False
        self._idle_since = time.monotonic()
        self._idle_keep: float | None = self.keep_alive
        self._halted: str | None = None  # why the engine stopped serving for good (see `halt`)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, progress: Callable[[str], None] | None = None) -> "Engine":
        """Load the model (on the scheduler thread) and start serving; blocks until loaded."""
        # Every token is handed from the scheduler thread to readers in other threads; with
        # Python's default 5 ms switch interval the scheduler waits for the GIL after each device
        # sync (bench/results/cuda-h200-2026-12-02-concurrency-switchinterval-only.json).
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="mlxchat-scheduler", daemon=True)
        self._thread.start()
        self._draft_loader = threading.Thread(target=self._load_drafts, name="mlxchat-drafts",
                                              daemon=True)
        self._draft_loader.start()
        self._call(lambda: self._install(self.requested_model, progress))
        return self

    def stop(self) -> None:
        """Cancel everything running or queued, let each end with its final event, then stop."""
        for h in self._admitted():
            h.cancel()
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            # a halted engine's thread may be blocked for good (see `halt`)
            self._thread.join(timeout=1 if self._halted else 30)
        self._draft_jobs.put(None)
        if self.prefix_cache is not None and self.persist_prefix_cache:
            # so that reopening the app continues long conversations without re-prefill
            self.prefix_cache.persist(max_bytes=PERSIST_BYTES)

    def halt(self, reason: str) -> None:
        """Fail every admitted request with `reason` and refuse new ones (EngineError) from now
        on; safe from any thread. For failures the scheduler thread cannot recover from, such as
        a rank of a sharded model gone: that thread may stay blocked in a collective that never
        returns, so this does not wait for it."""
        with self._wake:
            if self._halted is not None:
                return
            self._halted = reason
            handles = self._preparing + list(self._queued) + self._running
            self._preparing, self._running = [], []
            self._queued.clear()
            for h in handles:
                self._end(h, "failed", [Event("done", finish_reason="failed", error=reason,
                                              usage=h.usage, timings=Timings())])
            self._wake.notify_all()

    @property
    def halted(self) -> str | None:
        """Why the engine stopped serving for good, or None."""
        return self._halted

    @property
    def model_name(self) -> str | None:
        return self.lm.name if self.lm else None

    @property
    def model(self) -> ModelDescription | None:
        """The current model (also while unloaded after an idle time), or None while none is."""
        return self._described if self.lm is not None else None

    @property
    def defaults(self) -> ModelDefaults | None:
        """The current model's sampling defaults, each with its source."""
        model = self.model
        return model.defaults if model is not None else None

    def params(self, explicit: dict | None = None) -> SamplingParams:
        """SamplingParams for the current model: `explicit` values (a request's fields, a
        conversation's settings) over the model's defaults; raises InvalidRequest."""
        defaults = self.defaults
        if defaults is None:
            raise EngineError("no model is loaded yet")
        return defaults.params(explicit)

    def list_models(self) -> list[ModelInfo]:
        """The local models (bundled, downloaded), then those this engine loaded from a folder or
        GGUF path: any of them can be named to `switch_model`."""
        found = {m.name: m for m in list_models()}
        for m in self._opened.values():
            found.setdefault(m.name, m)
        if self.lm is not None:  # always listed, however it was loaded
            found.setdefault(self.lm.name, ModelInfo(self.lm.name, "folder", str(self.lm.path), None))
        return list(found.values())

    def status(self) -> EngineStatus:
        with self._lock:
            return EngineStatus(
                model=self.model_name, running=len(self._running), queued=len(self._queued),
                loading_drafts=len(self._preparing),
                batch_rows=len(self._batch) if self._batch is not None else 0,
                drafts=tuple(self._drafts), memory_budget=self.memory_budget,
                reserved_bytes=self._reserved, resident=self._resident)

    def request_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        """The model-cache memory a plain request of this size reserves while admitted."""
        return self._footprint.bytes_for(prompt_tokens + max_tokens)

    def _admitted(self) -> list[RequestHandle]:
        with self._lock:
            return self._preparing + list(self._queued) + self._running

    def switch_model(self, name: str, progress: Callable[[str], None] | None = None,
                     cancel_running: bool = False) -> None:
        """Load another model (a name `list_models` gives, or a path) once running and queued
        requests end (or are cancelled, if asked); meanwhile new requests are refused with
        Overloaded. A model that cannot load raises ModelLoadError with the previous model
        loaded again."""
        opened = self._opened.get(name)
        name = opened.path if opened is not None and opened.path else name
        if cancel_running:
            for h in self._admitted():  # outside the lock: cancelling a queued request takes it
                h.cancel()
        self._call(lambda: self._install(name, progress))

    def _install(self, name: str | None, progress: Callable[[str], None] | None) -> None:
        """Runs on the scheduler thread with no request running."""
        report = progress or (lambda stage: None)
        report("loading")
        previous = self._loaded_name if self.lm is not None else _NONE
        old, self.lm, self.prefix_cache, self._batch = self.lm, None, None, None
        with self._lock:  # the loader keeps a draft only while its model is self.lm
            self._drafts.clear()
            self._draft_spellings.clear()
        del old
        mx.clear_cache()
        self._described, self._resident = None, False
        try:
            loaded = self._load(name, fallback_to_default=self.fallback_to_default)
        except EngineError:
            if previous is not _NONE:  # keep serving the model that was loaded, then say why
                log.warning("could not load %s; reloading %s", name, previous)
                self._install(previous, None)  # type: ignore[arg-type]
            raise
        # Our own record of it: an idle unload empties its `model`, never the caller's object.
        self.lm = dataclasses.replace(loaded)
        self._loaded_name = name
        if name and Path(name).expanduser().exists():
            path = Path(name).expanduser()
            self._opened[self.lm.name] = ModelInfo(
                self.lm.name, "gguf" if path.is_file() else "folder", str(path),
                weight_files_bytes([path] if path.is_file() else path.glob("*")))
        self._footprint = kv_footprint(self.lm.model)
        self._make_resident_parts()
        lm = self.lm
        self._described = ModelDescription(
            name=lm.name, family=lm.family, context_length=lm.context_length,
            drafts=draft_choices(lm), defaults=resolve_defaults(lm.name, lm.path, lm.family),
            capabilities=capabilities(lm))
        self._touch(self.keep_alive)
        report("ready")

    def _make_resident_parts(self) -> None:
        """The decode batch and prefix cache of the model whose weights are in `self.lm`."""
        self._batch = DecodeBatch(self.lm.model)
        if self.use_prefix_cache:
            from ..cache.prefix_cache import PrefixCache, default_persist_dir

            persist_dir = default_persist_dir() if self.persist_prefix_cache else None
            self.prefix_cache = PrefixCache(self.lm, persist_dir=persist_dir,
                                            budget_bytes=lambda: self.memory_budget - self._reserved)
        self._resident = True

    # -- idle unload -----------------------------------------------------------------------------
    def _touch(self, keep_alive: float | None) -> None:
        """The model was just used: it stays loaded `keep_alive` seconds from now (None: always)."""
        self._idle_since = time.monotonic()
        self._idle_keep = keep_alive

    def _until_unload(self) -> float | None:
        """Under the lock, with nothing queued or running: seconds until the idle model should be
        unloaded (<= 0: now), or None when it stays."""
        if not self._resident or self._idle_keep is None or self._preparing or self._stopping:
            return None
        return self._idle_since + self._idle_keep - time.monotonic()

    def _unload(self) -> None:
        """On the scheduler thread, idle: return the weights' memory. The tokenizer, config and
        description stay, so requests are still accepted; the persisted prefix-cache snapshots
        are written first and found again after the reload."""
        log.info("unloading %s after %.0f s idle", self.model_name, self._idle_keep or 0)
        if self.prefix_cache is not None:
            if self.persist_prefix_cache:
                self.prefix_cache.persist(max_bytes=PERSIST_BYTES)
            self.prefix_cache.close()
        self.prefix_cache, self._batch = None, None
        self._drafts.clear()
        self._resident = False
        assert self.lm is not None
        self.lm.model = None  # type: ignore[assignment]
        gc.collect()
        mx.clear_cache()

    def _ensure_resident(self) -> None:
        """On the scheduler thread: reload the weights of a model unloaded after an idle time,
        and give the requests that waited for them its new prefix cache."""
        if self._resident or self.lm is None:
            return
        log.info("reloading %s", self.lm.name)
        fresh = self._load(self._loaded_name, fallback_to_default=False)
        self.lm.model = fresh.model
        del fresh
        self._make_resident_parts()
        with self._lock:
            waiting = list(self._queued) + self._running
        for handle in waiting:
            if handle.generation is not None and handle.generation.lm is self.lm:
                handle.generation.prefix_cache = self.prefix_cache

    def _call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the scheduler thread once no request is running or queued; blocks."""
        if self._thread is None or not self._thread.is_alive():
            raise EngineError("the engine is not running")
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
        while not done.wait(0.5):
            if self._halted is not None or not self._thread.is_alive():
                raise EngineError(self._halted or "the engine's scheduler stopped")
        if failure:
            raise failure[0]

    # -- submission ----------------------------------------------------------------------------
    def submit(self, messages: Sequence[dict] | None = None, params: SamplingParams | None = None,
               *, prompt_tokens: Sequence[int] | None = None, text: str | None = None,
               speculative: SpeculativeOptions | None = None, tools: ToolRequest | None = None,
               split_reasoning: bool = False,
               keep_alive: float | str | None = None) -> RequestHandle:
        """Validate and enqueue a request without waiting; raises InvalidRequest or Overloaded at
        once. `speculative` opts in to speculative decoding (engine/decoding/drafts.py; the default
        is plain): a draft not loaded yet loads on the scheduler thread while the request is in
        `loading_draft`; if it cannot load, the request ends `failed` and `accepted()` raises.
        `tools` and `split_reasoning`: see `Generation` (engine/decoding/generate.py).
        A model unloaded after an idle time is reloaded before the request runs; `keep_alive`
        (like Ollama's) sets how long it stays loaded after this request."""
        lm = self.lm
        if self._halted is not None:
            raise EngineError(self._halted)
        if lm is None:
            raise EngineError("no model is loaded yet")
        params = params or SamplingParams()
        prompt = build_prompt(lm, messages=messages, prompt_tokens=prompt_tokens, text=text,
                              tools=tools)
        factory = None
        if speculative is not None and not self.speculation:
            raise InvalidRequest("speculative decoding is not available with a model sharded "
                                 "over several processes: the other ranks do not mirror the "
                                 "draft model's cache or the rollback of rejected draft tokens",
                                 field="speculative")
        if speculative is not None:
            check_draft(lm, speculative.draft)
            with self._lock:
                entry = self._drafts.get(self._draft_spellings.get(speculative.draft, ""))
            factory = entry[1] if entry is not None and entry[0] is lm else None

        def generation(factory: SpeculatorFactory | None) -> Generation:
            speculator = factory(speculative.config()) if factory and speculative else None
            return Generation(lm, prompt, params, prefix_cache=self.prefix_cache,
                              speculator=speculator, tools=tools, split_reasoning=split_reasoning)

        ready = generation(factory) if speculative is None or factory is not None else None
        # A speculative request also grows its draft's cache: at most the target's again.
        need = self._footprint.bytes_for(len(prompt.tokens) + params.max_tokens) * \
            (2 if speculative is not None else 1)
        if need > self.memory_budget:
            raise InvalidRequest(
                f"this request would need about {_mib(need)} of model cache (prompt "
                f"{len(prompt.tokens)} tokens + max_tokens {params.max_tokens}), over the memory "
                f"budget of {_mib(self.memory_budget)}; shorten the prompt or lower max_tokens",
                field="max_tokens", code="over_memory_budget")
        handle = RequestHandle(id=f"req-{next(self._ids)}", generation=ready, kv_bytes=need,
                               keep_alive=keep_alive_seconds(keep_alive, self.keep_alive),
                               _on_cancel=self._cancelled)
        with self._wake:
            if not self._control.empty():  # accepted requests drain first, on the current model
                raise Overloaded(f"switching models: {self.model_name} is finishing its requests",
                                 retry_after=5.0)
            admitted = self._preparing + list(self._running) + list(self._queued)
            if len(admitted) >= self.max_running + self.max_queued:
                raise Overloaded(f"server busy: {len(self._running)} requests running and "
                                 f"{len(admitted) - len(self._running)} queued (limits "
                                 f"{self.max_running} + {self.max_queued})", retry_after=2.0)
            if self._reserved + need > self.memory_budget:
                raise Overloaded(f"server busy: admitted requests reserve {_mib(self._reserved)} of "
                                 f"the {_mib(self.memory_budget)} memory budget and this one needs "
                                 f"{_mib(need)}", retry_after=2.0)
            self._reserved += need
            if ready is not None:
                handle._enter("queued")
                self._queued.append(handle)
            else:
                handle._enter("loading_draft")
                self._preparing.append(handle)
                assert speculative is not None
                draft = speculative.draft
                self._draft_jobs.put(lambda: self._load_draft(handle, lm, draft, generation))
            self._wake.notify_all()
        if ready is not None:
            handle._accepted.set_result(None)
        return handle

    def _load_drafts(self) -> None:
        """The loader thread: load drafts one at a time, off the scheduler thread."""
        while (job := self._draft_jobs.get()) is not None:
            job()

    def _load_draft(self, handle: RequestHandle, lm: LoadedModel, draft: str,
                    generation: Callable[[SpeculatorFactory], Generation]) -> None:
        """On the loader thread: find `draft` for `lm` by its identity, loading it if it is not the
        resident draft (which it then replaces), then let the scheduler thread queue the request,
        or end it if that failed or it was cancelled."""
        factory, failure = None, None
        try:
            if not handle.cancel_requested:
                self._ensure_resident()
                if self.lm is not lm:
                    raise Overloaded(f"switching models: {lm.name} is being replaced",
                                     retry_after=5.0)
                identity = draft_identity(draft)
                with self._lock:
                    entry = self._drafts.get(identity)
                    if entry is None or entry[0] is not lm:  # released before the next loads
                        self._drafts.clear()
                        self._draft_spellings.clear()
                if entry is None or entry[0] is not lm:
                    entry = (lm, load_draft(lm, identity))
                with self._lock:
                    if self.lm is lm:
                        self._drafts = {identity: entry}
                        self._draft_spellings = {**self._draft_spellings, draft: identity}
                factory = entry[1]
        except Exception as exc:  # handed to the caller through `accepted()` and the done event
            failure = exc if isinstance(exc, EngineError) else EngineError(
                f"{type(exc).__name__}: {exc}")
        with self._wake:
            self._soon.put(lambda: self._draft_ready(handle, lm, factory, failure, generation))
            self._wake.notify_all()

    def _draft_ready(self, handle: RequestHandle, lm: LoadedModel,
                     factory: SpeculatorFactory | None, failure: Exception | None,
                     generation: Callable[[SpeculatorFactory], Generation]) -> None:
        """On the scheduler thread, between ticks: queue the request whose draft is loaded, or end
        it if that failed, it was cancelled or the model changed meanwhile."""
        gen = None
        try:
            if factory is not None and not handle.cancel_requested:
                if self.lm is not lm:
                    raise Overloaded(f"switching models: {lm.name} is being replaced",
                                     retry_after=5.0)
                gen = generation(factory)
        except Exception as exc:
            failure = exc if isinstance(exc, EngineError) else EngineError(
                f"{type(exc).__name__}: {exc}")
        with self._wake:
            self._preparing.remove(handle)
            if gen is None or handle.cancel_requested:
                reason: FinishReason = "cancelled" if failure is None else "failed"
                self._end(handle, "cancelled" if failure is None else "failed",
                          [Event("done", finish_reason=reason,
                                 error=str(failure) if failure else None)])
            else:
                handle.generation = gen
                handle._enter("queued")
                self._queued.append(handle)
            self._wake.notify_all()
        if failure is not None:
            handle._accepted.set_exception(failure)
        else:
            handle._accepted.set_result(None)

    def _cancelled(self, handle: RequestHandle) -> None:
        with self._wake:
            if handle in self._queued:  # never started: end it here, nothing to release
                self._queued.remove(handle)
                self._end(handle, "cancelled", [Event("done", finish_reason="cancelled",
                                                      usage=handle.usage, timings=Timings())])
            self._wake.notify_all()

    # -- the scheduler thread --------------------------------------------------------------------
    def _run(self) -> None:
        """The scheduler thread. Whatever escapes the loop halts the engine (every request fails
        with the reason, new ones are refused and /health says so) rather than leaving requests
        waiting on a thread that is gone."""
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the thread must not die silently
            log.critical("the scheduler thread stopped", exc_info=exc)
            self.halt(f"the engine's scheduler stopped ({type(exc).__name__}: {exc}); "
                      f"restart the server")

    def _serve(self) -> None:
        while self._halted is None:
            while not self._soon.empty():
                self._soon.get()()
            unload, task, running = False, None, []
            with self._wake:  # one lock section per tick: this loop runs once per token
                # Stopping waits for the drafts being loaded: each request ends with its event.
                while not ((self._stopping and not self._preparing) or self._queued
                           or self._running or not self._control.empty()
                           or not self._soon.empty()):
                    wait_s = None if self._preparing else self._until_unload()
                    if wait_s is not None and wait_s <= 0:
                        unload = True
                        break
                    self._wake.wait(None if wait_s is None else min(wait_s, WAIT_MAX_S))
                if not unload:
                    if self._stopping and not self._running and not self._queued \
                            and not self._preparing and self._soon.empty():
                        return
                    if not self._running and not self._queued and not self._control.empty():
                        task = self._control.get()
                    else:
                        if not self._running and self._queued:
                            self._settle()
                        while self._queued and len(self._running) < self.max_running:
                            handle = self._queued.popleft()
                            handle._enter("prefill")
                            self._running.append(handle)
                        running = list(self._running)
            if unload:
                self._unload()
                continue
            if task is not None:
                task()
            elif running:
                try:
                    self._ensure_resident()
                except Exception as exc:  # the weights cannot come back: these requests fail
                    for h in running:
                        self._advance(h, exc)
                    continue
                try:
                    self._tick(running)
                except Exception as exc:  # a tick-wide failure: its requests fail, serving goes on
                    log.error("a scheduler tick failed", exc_info=exc)
                    for h in running:
                        if h.state not in FINAL_STATES:
                            self._advance(h, exc)

    def _settle(self) -> None:
        """Under the lock: wait while requests keep arriving (see ADMIT_QUIET_S)."""
        deadline = time.monotonic() + ADMIT_WAIT_S
        while len(self._queued) < self.max_running and not self._stopping:
            seen = len(self._queued)
            quiet_until = time.monotonic() + ADMIT_QUIET_S
            while len(self._queued) == seen and (left := min(quiet_until, deadline) - time.monotonic()) > 0:
                self._wake.wait(left)
            if len(self._queued) == seen or time.monotonic() >= deadline:
                return

    def _tick(self, running: list[RequestHandle]) -> None:
        batch = self._batch
        # each request's state read once per tick (this runs for every token)
        states = [(h, h.generation.batchable, h.generation in batch) for h in running]
        # A lone decoder runs solo: its plain cache and pipelined step beat a one-row batch.
        use_batch = self.batching and self._footprint.batchable and \
            sum(ok for _, ok, _ in states) >= 2
        joining, leaving, solo = [], [], []
        for h, ok, inside in states:
            if inside and not (ok and use_batch):
                leaving.append(h.generation)
                solo.append(h)
            elif not inside and ok and use_batch:
                joining.append(h.generation)
            elif not inside:
                solo.append(h)
        if leaving:
            batch.leave(leaving)
        if joining:
            batch.join(joining)
        prefilling = [h for h in solo if h.generation.in_prefill and not h.cancel_requested]
        decoding = len(prefilling) < len(running)
        if prefilling:
            self._prefill(prefilling, PREFILL_CHUNKS_DECODING if decoding else PREFILL_CHUNKS_IDLE)
        for h in solo:
            if h not in prefilling:
                self._step(h)
        if len(batch):
            by_gen = {id(h.generation): h for h in running}
            try:
                results = batch.step()
            except Exception as exc:  # the shared model call: every row fails, the engine serves on
                results = [(gen, exc) for gen in batch.rows]
                self._batch = DecodeBatch(batch.model)
            finished = [gen for gen, _ in results if gen.done and gen in self._batch]
            if finished:
                self._batch.leave(finished)
            for gen, outcome in results:
                self._advance(by_gen[id(gen)], outcome)

    def _prefill(self, prefilling: list[RequestHandle], chunks: int) -> None:
        """Prefill within `chunks` prefill chunks' worth of prompt tokens, oldest prompts first:
        the prompts that can share a model call in calls of several (`_prefill_together`), the
        others each in its own calls, finishing one before starting the next."""
        chunk = prefilling[0].generation.prefill_chunk
        budget = chunks * chunk
        if self.batching:
            budget = self._prefill_together(prefilling, budget, chunk)
        for h in prefilling:
            gen = h.generation
            while budget > 0 and gen.in_prefill and not gen.done and not h.cancel_requested:
                left = gen.prefill_left
                self._step(h, prefill_limit=budget)
                budget -= max(left - gen.prefill_left, 1)
            if budget <= 0:
                return

    def _prefill_together(self, prefilling: list[RequestHandle], budget: int, chunk: int) -> int:
        """Short prompts arriving together prefill together: a call feeds, oldest first, the
        next chunks of as many prompts as fit in one chunk's worth of tokens (right-padded,
        engine/scheduling/batch.py `prefill_together`; a long prompt fills a call alone, as
        before), and once no body is left within the budget, one call feeds all of them their last
        prompt token and samples their first tokens, so they join the decode batch at once (as
        mlx-lm's `BatchGenerator` starts its batch). A prompt's chunks end at the stops of its
        solo prefill. Returns the budget left."""
        alone: set[int] = set()

        def ready(tail: bool) -> list[tuple[RequestHandle, list[int]]]:
            nonlocal budget
            group, room = [], chunk
            for h in prefilling:
                gen = h.generation
                if id(h) in alone or gen.done or not gen.in_prefill or h.cancel_requested:
                    continue
                if not tail and (budget <= 0 or room <= 0):
                    continue
                try:
                    tokens = gen.prefill_input(max(min(budget, chunk), 1))
                except Exception as exc:  # e.g. its prefix-cache fetch: this request fails alone
                    self._advance(h, exc)
                    continue
                if (gen.prefill_left == 1) != tail:
                    continue
                if not can_prefill_together(gen):
                    alone.add(id(h))
                    continue
                if not tail and group and len(tokens) > room:  # a later call takes it
                    continue
                group.append((h, tokens))
                budget -= len(tokens)
                room -= len(tokens)
            return group

        while body := ready(tail=False):
            self._run_together(body)
        self._run_together(ready(tail=True))  # every prompt down to its last token: one each
        return max(budget, 0)

    def _run_together(self, group: list[tuple[RequestHandle, list[int]]]) -> None:
        if len(group) == 1:  # alone it runs as its own prefill step does
            h, tokens = group[0]
            self._step(h, prefill_limit=len(tokens))
            return
        if not group:
            return
        try:
            failures = prefill_together(self.lm.model, [(h.generation, t) for h, t in group])
            outcomes: list[list[Event] | Exception] = [f if f is not None else [] for f in failures]
        except Exception as exc:  # the shared model call: every request in it fails
            outcomes = [exc] * len(group)
        for (h, _), outcome in zip(group, outcomes):
            self._advance(h, outcome)

    def _step(self, handle: RequestHandle, prefill_limit: int | None = None) -> None:
        try:
            outcome: list[Event] | Exception = handle.generation.step(prefill_limit)
        except Exception as exc:
            outcome = exc
        self._advance(handle, outcome)

    def _advance(self, handle: RequestHandle, outcome: list[Event] | Exception) -> None:
        """Publish one step's events (or its failure) and move the request's state on."""
        if self._halted is not None:  # `halt` ended every request already
            return
        gen = handle.generation
        if isinstance(outcome, Exception):  # isolated to this request
            log.error("request %s failed", handle.id, exc_info=outcome)
            gen.finish_reason = "failed"
            events = [Event("done", finish_reason="failed",
                            error=f"{type(outcome).__name__}: {outcome}",
                            usage=gen.usage(), timings=gen.timings())]
        else:
            events = outcome
        now = time.time()
        for event in events:
            if event.kind == "token":
                handle.times.setdefault("first_token", now)
                handle.times["last_token"] = now
        if handle.state == "prefill" and not gen.in_prefill:
            handle._enter("decoding")
        if not gen.done:
            for event in events:
                handle._publish(event)
            return
        if self._batch is not None and gen in self._batch:
            self._batch.leave([gen])
        gen.release()
        state = {"cancelled": "cancelled", "failed": "failed"}.get(gen.finish_reason, "finished")
        with self._wake:
            self._running.remove(handle)
            self._end(handle, state, events)

    def _end(self, handle: RequestHandle, state: RequestState, events: list[Event]) -> None:
        """Under the lock: the request leaves admission, its last events are published."""
        self._reserved -= handle.kv_bytes
        self._touch(handle.keep_alive)
        handle.error = events[-1].error if events else None
        handle.finish_reason = events[-1].finish_reason if events else state
        handle._enter(state)
        for event in events:
            handle._publish(event)


_NONE = object()  # no model was loaded (None itself names the bundled model)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"
