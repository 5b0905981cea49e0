"""The engine as a service: one scheduler thread owns the model and all MLX work; callers in any
thread (or an asyncio loop) submit requests and read their events.

Every request has one lifecycle, `[loading_draft ->] queued -> prefill -> decoding -> finished |
cancelled | failed`, recorded with the time of each transition, and always ends with exactly one
`done` event, whatever happens inside. `submit` never waits: a speculative request whose draft is
not loaded yet starts in `loading_draft` while a loader thread loads it (one draft at a time, and
one kept per engine: every spelling of a model is one draft) and the scheduler serves the others.
Admission is by memory (the model-cache bytes each admitted request may grow to, within the
memory budget; a running cap only if asked, and a queue cap); requests that decode at the same time share one model call per
step (engine/scheduling/batch.py).
"""

import itertools
import logging
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from .batch import DecodeBatch, can_prefill_together, prefill_together
from .prefill_policy import tick_budget
from ..decoding.drafts import SpeculativeOptions, SpeculatorFactory, check_draft
from ..device import memory_budget as device_memory_budget
from ..errors import EngineError, InvalidRequest, Overloaded
from ..events import FINAL_STATES, Event, FinishReason, RequestState, Timings
from ..decoding.fim import Infill
from ..decoding.generate import Generation, build_prompt
from ..loading.registry import LoadedModel, ModelInfo, load_model
from ..decoding.defaults import ModelDefaults
from ..decoding.sampling import SamplingParams
from ..decoding.tools import ToolRequest
from .draft_loader import DraftLoader
from .embeddings import EmbeddingHandle, EmbeddingInput, EmbeddingQueue
from .speech import SpeechHandle, SpeechQueue, SpeechStream
from .keep_alive import DEFAULT_KEEP_ALIVE_S, keep_alive_seconds
from .rerank import RerankHandle, submit_rerank
from .stats import EngineStats, MemoryUse, PrefixCacheUse, StatsRecorder
from .requests import RequestHandle
from .slot import ModelDescription, ModelSlot

if TYPE_CHECKING:
    from ..cache.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 2e-4
# The idle scheduler re-checks at least this often (a wait must stay under threading.TIMEOUT_MAX).
WAIT_MAX_S = 3600.0
# Requests submitted together (parallel calls of one client, a burst of streams) start together:
# an idle engine admits its first request once no other has arrived for ADMIT_QUIET_S, waiting at
# most ADMIT_WAIT_S, so that the burst prefills in shared calls and decodes as one batch.
ADMIT_QUIET_S = 5e-4
ADMIT_WAIT_S = 5e-3
# Admitted by memory (no `max_running`), at most this many requests run at once: a batched step's
# host work grows with its rows (bench.concurrency_step: 32 rows on the H200 still gained).
MAX_RUNNING_ROWS = 64


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
    embedding_models: tuple[str, ...] = ()  # dedicated embedding models loaded beside it
    speech_models: tuple[str, ...] = ()  # speech models loaded beside it (scheduling/speech.py)


class Engine:
    """Runs every request on a single scheduler thread, on the model its `ModelSlot` holds
    (engine/scheduling/slot.py); drafts for speculative requests load on their own thread
    (engine/scheduling/draft_loader.py).

    Each scheduler tick prefills up to a budget of prompt tokens (oldest request first, short
    prompts that wait together in shared model calls; engine/scheduling/prefill_policy.py), runs the solo steps
    that cannot be batched (cancellations, speculative decoding, a lone decoder) and one batched
    decode step for every other decoding request (engine/scheduling/batch.py).
    """

    def __init__(self, model: str | None = None, *, max_running: int | None = None, max_queued: int = 8,
                 fallback_to_default: bool = False, prefix_cache: bool = True,
                 persist_prefix_cache: bool = False,
                 load: Callable[..., LoadedModel] = load_model, batching: bool = True,
                 memory_budget: int | None = None,
                 keep_alive: float | str | None = DEFAULT_KEEP_ALIVE_S, speculation: bool = True,
                 int8_activations: bool | None = None):
        """`max_running`: None admits requests by memory: they run together (one batched step)
        as long as the model-cache bytes each may grow to fit `memory_budget`, up to
        MAX_RUNNING_ROWS; a number caps the requests running at once (`mlxchat serve
        --max-running`). `max_queued`: requests waiting beyond those. `keep_alive`: unload the
        model's weights after it has been idle this long (seconds or a duration such as "30m";
        None or negative: never); the next request reloads them. `speculation=False` refuses
        speculative requests (a sharded model). `int8_activations`: on our CPU kernels, models
        load on the lossy int8-activation path (None: the process's default,
        `--int8-activations`); `switch_model` may change it."""
        self.requested_model = model
        self.keep_alive = keep_alive_seconds(keep_alive)
        self.max_running = max_running if max_running is not None else MAX_RUNNING_ROWS
        self.max_queued = max_queued
        self.batching = batching
        self.speculation = speculation  # off for a sharded model (engine/distributed/)
        # One budget for the model caches of admitted requests and the prefix cache's snapshots:
        # the prefix cache may hold what the admitted requests do not reserve.
        self.memory_budget = memory_budget if memory_budget is not None else device_memory_budget()
        self._reserved = 0  # bytes reserved by admitted requests (changed under the lock)
        self.drafts = DraftLoader(current=lambda: self.lm)
        self._stats = StatsRecorder()  # running totals for monitoring (`stats`)
        self.slot = ModelSlot(self._stats.counted(load), fallback_to_default=fallback_to_default,
                              prefix_cache=prefix_cache, persist_prefix_cache=persist_prefix_cache,
                              cache_budget=lambda: self.memory_budget - self._reserved,
                              on_release=self.drafts.clear, int8_activations=int8_activations)
        self.slot.touch(self.keep_alive)
        self._queued: deque[RequestHandle] = deque()
        self._running: list[RequestHandle] = []
        self._preparing: list[RequestHandle] = []  # loading_draft
        # SimpleQueues: the scheduler checks both every tick, and their `empty` is one C call
        self._control: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._soon: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()  # between ticks: drafts, embeddings
        self._embeddings = EmbeddingQueue(self)
        self._speech = SpeechQueue(self)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stopping = False
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
        self.drafts.start()
        self._call(lambda: self.slot.install(self.requested_model, progress, self.keep_alive))
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
        self.drafts.stop()
        self._embeddings.close()
        self._speech.close()
        self.slot.persist()  # so that reopening the app continues long conversations without re-prefill

    def halt(self, reason: str) -> None:
        """Fail every admitted request with `reason` and refuse new ones (EngineError) from now
        on; safe from any thread. For failures the scheduler thread cannot recover from, such as
        a rank of a sharded model gone: that thread may stay blocked in a collective that never
        returns, so this does not wait for it."""
        with self._wake:
            if self._halted is not None:
                return
            self._halted = reason
            self._embeddings.fail(reason)
            handles = self._preparing + list(self._queued) + self._running
            self._preparing, self._running = [], []
            self._queued.clear()
            for h in handles:
                self._end(h, "failed", [Event("done", finish_reason="failed", error=reason,
                                              usage=h.usage, timings=Timings())])
            self._wake.notify_all()
        self._speech.fail(reason)  # outside the engine's lock (the speech thread takes it)

    @property
    def halted(self) -> str | None:
        """Why the engine stopped serving for good, or None."""
        return self._halted

    @property
    def lm(self) -> LoadedModel | None:
        return self.slot.lm

    @property
    def prefix_cache(self) -> "PrefixCache | None":
        """The current model's prefix cache (None while its weights are unloaded, or when off)."""
        return self.slot.prefix_cache

    @property
    def model_name(self) -> str | None:
        return self.lm.name if self.lm else None

    @property
    def model(self) -> ModelDescription | None:
        """The current model (also while unloaded after an idle time), or None while none is."""
        return self.slot.described if self.lm is not None else None

    @property
    def int8_activations(self) -> bool | None:
        """Whether the current model takes int8 activations on our CPU kernels; None where it
        does not run on them, or while no model is loaded (`switch_model` changes it)."""
        model = self.model
        return model.int8_activations if model is not None else None

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
        return self.slot.list_models()

    def status(self) -> EngineStatus:
        with self._lock:
            batch = self.slot.batch
            return EngineStatus(
                model=self.model_name, running=len(self._running), queued=len(self._queued),
                loading_drafts=len(self._preparing),
                batch_rows=len(batch) if batch is not None else 0,
                drafts=self.drafts.identities(), memory_budget=self.memory_budget,
                reserved_bytes=self._reserved, resident=self.slot.resident,
                embedding_models=tuple(self._embeddings.resident_models()),
                speech_models=tuple(self._speech.resident_models()))

    def stats(self) -> EngineStats:
        """A reading for monitoring (engine/scheduling/stats.py): the load now, the running
        totals, memory by model and the prefix cache's counters. Safe from any thread; it takes
        the scheduler's lock only to copy a few numbers."""
        status = self.status()
        weights = dict(self._embeddings.resident_weights())
        weights.update(self._speech.resident_weights())
        lm = self.lm
        if lm is not None and self.slot.resident:
            weights[lm.name] = _weight_bytes(lm)
        cache = self.prefix_cache
        use = None
        if cache is not None and lm is not None:
            c = cache.stats()
            use = PrefixCacheUse(lm.name, c.entries, c.bytes, c.disk_entries, c.hits, c.misses,
                                 c.saves, c.evictions, c.file_reads, c.file_writes,
                                 c.reused_tokens)
        return EngineStats(at=time.time(), model=status.model, running=status.running,
                           queued=status.queued + status.loading_drafts,
                           embedding_queue=self._embeddings.pending(),
                           totals=self._stats.snapshot(),
                           memory=MemoryUse(weights, status.reserved_bytes, status.memory_budget),
                           prefix_cache=use)

    def request_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        """The model-cache memory a plain request of this size reserves while admitted."""
        return self.slot.footprint.bytes_for(prompt_tokens + max_tokens)

    def _admitted(self) -> list[RequestHandle]:
        with self._lock:
            return self._preparing + list(self._queued) + self._running

    def switch_model(self, name: str, progress: Callable[[str], None] | None = None,
                     cancel_running: bool = False, *, int8_activations: bool | None = None) -> None:
        """Load another model (a name `list_models` gives, or a path; the current one's name
        reloads it) once running and queued requests end (or are cancelled, if asked); meanwhile
        new requests are refused with Overloaded. A model that cannot load raises ModelLoadError
        with the previous model loaded again. `int8_activations`: on our CPU kernels, take the
        lossy int8-activation path from now on, or the exact one (None: as the current model;
        `model.int8_activations` says which the loaded model took)."""
        name = self.slot.path_of(name)
        if cancel_running:
            for h in self._admitted():  # outside the lock: cancelling a queued request takes it
                h.cancel()
        self._call(lambda: self.slot.install(name, progress, self.keep_alive, int8_activations))

    # -- idle unload -----------------------------------------------------------------------------
    def _until_unload(self) -> float | None:
        """Under the lock, with nothing queued or running: seconds until the idle model should be
        unloaded (<= 0: now), or None when it stays (also while drafts load or the engine stops)."""
        if self._preparing or self._stopping:
            return None
        return self.slot.until_unload()

    def _ensure_resident(self) -> None:
        """Reload the weights of a model unloaded after an idle time, and give the requests that
        waited for them its new prefix cache."""
        if not self.slot.ensure_resident():
            return
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
               split_reasoning: bool = False, keep_alive: float | str | None = None,
               fit_max_tokens: bool = False, infill: Infill | None = None) -> RequestHandle:
        """Validate and enqueue a request without waiting; raises InvalidRequest or Overloaded at
        once. `speculative` opts in to speculative decoding (engine/decoding/drafts.py; the default
        is plain): a draft not loaded yet loads on the loader thread while the request is in
        `loading_draft`; if it cannot load, the request ends `failed` and `accepted()` raises.
        `tools` and `split_reasoning`: see `Generation` (engine/decoding/generate.py).
        A model unloaded after an idle time is reloaded before the request runs; `keep_alive`
        (like Ollama's) sets how long it stays loaded after this request. `fit_max_tokens`:
        lower `max_tokens` to the context the prompt leaves instead of refusing (clients such as
        Claude Code always ask for 32,000; the prompt is tokenised once, here). `infill`: a
        fill-in-the-middle prompt instead of messages or text (engine/decoding/fim.py)."""
        lm = self._serving()
        params = params or SamplingParams()
        prompt = build_prompt(lm, messages=messages, prompt_tokens=prompt_tokens, text=text,
                              tools=tools, infill=infill)
        if fit_max_tokens and len(prompt.tokens) < lm.context_length:
            params = params.with_(max_tokens=min(params.max_tokens,
                                                 lm.context_length - len(prompt.tokens)))
        factory = self._resident_draft(lm, speculative)

        def generation(factory: SpeculatorFactory | None) -> Generation:
            speculator = factory(speculative.config()) if factory and speculative else None
            return Generation(lm, prompt, params, prefix_cache=self.prefix_cache,
                              speculator=speculator, tools=tools, split_reasoning=split_reasoning)

        # A speculative request also grows its draft's cache: at most the target's again.
        need = self._cache_need(len(prompt.tokens), params.max_tokens,
                                2 if speculative is not None else 1)
        handle = RequestHandle(id=f"req-{next(self._ids)}", generation=None, kv_bytes=need,
                               keep_alive=keep_alive_seconds(keep_alive, self.keep_alive),
                               _on_cancel=self._cancelled)
        if speculative is None or factory is not None:
            handle.generation = generation(factory)
            self._admit(handle)
        else:
            self._admit(handle, lambda: self.drafts.load(
                lm, speculative.draft, cancelled=lambda: handle.cancel_requested,
                prepare=self._ensure_resident,
                done=lambda f, failure: self._later(
                    lambda: self._draft_ready(handle, lm, f, failure, generation))))
        return handle

    def _serving(self) -> LoadedModel:
        """The model new requests run on; raises EngineError when there is none."""
        if self._halted is not None:
            raise EngineError(self._halted)
        if self.lm is None:
            raise EngineError("no model is loaded yet")
        return self.lm

    def _resident_draft(self, lm: LoadedModel,
                        speculative: SpeculativeOptions | None) -> SpeculatorFactory | None:
        """For a speculative request, its draft's factory if the draft is resident (else None:
        it loads while the request waits); raises InvalidRequest for a draft it cannot use."""
        if speculative is None:
            return None
        if not self.speculation:
            raise InvalidRequest("speculative decoding is not available with a model sharded "
                                 "over several processes: the other ranks do not mirror the "
                                 "draft model's cache or the rollback of rejected draft tokens",
                                 field="speculative")
        check_draft(lm, speculative.draft)
        return self.drafts.resident(lm, speculative.draft)

    def _cache_need(self, prompt_tokens: int, max_tokens: int, caches: int) -> int:
        """The model-cache bytes a request reserves; raises InvalidRequest over the budget."""
        need = self.slot.footprint.bytes_for(prompt_tokens + max_tokens) * caches
        if need > self.memory_budget:
            raise InvalidRequest(
                f"this request would need about {_mib(need)} of model cache (prompt "
                f"{prompt_tokens} tokens + max_tokens {max_tokens}), over the memory "
                f"budget of {_mib(self.memory_budget)}; shorten the prompt or lower max_tokens",
                field="max_tokens", code="over_memory_budget")
        return need

    def _admit(self, handle: RequestHandle, prepare: Callable[[], None] | None = None) -> None:
        """Admit `handle` (reserving its `kv_bytes`) or raise Overloaded. A handle with its
        generation is queued and accepted at once; otherwise it waits in `loading_draft` while
        `prepare()` (called under the lock) arranges for its generation."""
        with self._wake:
            self._check_room(handle.kv_bytes)
            self._reserved += handle.kv_bytes
            if prepare is None:
                handle._enter("queued")
                self._queued.append(handle)
            else:
                handle._enter("loading_draft")
                self._preparing.append(handle)
                prepare()
            self._wake.notify_all()
        if prepare is None:
            handle._accepted.set_result(None)

    def _check_room(self, need: int) -> None:
        """Under the lock: raise Overloaded unless a request needing `need` bytes fits now."""
        if not self._control.empty():  # accepted requests drain first, on the current model
            raise Overloaded(f"switching models: {self.model_name} is finishing its requests",
                             retry_after=5.0)
        admitted = len(self._preparing) + len(self._running) + len(self._queued)
        if admitted >= self.max_running + self.max_queued:
            raise Overloaded(f"server busy: {len(self._running)} requests running and "
                             f"{admitted - len(self._running)} queued (limits "
                             f"{self.max_running} + {self.max_queued})", retry_after=2.0)
        if self._reserved + need > self.memory_budget:
            raise Overloaded(f"server busy: admitted requests reserve {_mib(self._reserved)} of "
                             f"the {_mib(self.memory_budget)} memory budget and this one needs "
                             f"{_mib(need)}", retry_after=2.0)

    def embed(self, inputs: EmbeddingInput | Sequence[EmbeddingInput], *, model: str | None = None,
              dimensions: int | None = None, truncate: bool = False, query: bool = False,
              keep_alive: float | str | None = None) -> EmbeddingHandle:
        """Queue an embedding request without waiting (engine/scheduling/embeddings.py): on the
        loaded chat model (`model` None or its name) or a dedicated embedding model; raises
        InvalidRequest or Overloaded at once. Its chunks run between scheduler ticks."""
        return self._embeddings.submit(inputs, model=model, dimensions=dimensions,
                                       truncate=truncate, query=query, keep_alive=keep_alive)

    # -- speech (engine/scheduling/speech.py: its own thread, beside the scheduler) -------------
    def transcribe(self, samples, *, model: str | None = None, task: str = "transcribe",
                   language: str | None = None, prompt: str | None = None,
                   temperature: float | None = None, fallback: bool = True,
                   word_timestamps: bool = False,
                   keep_alive: float | str | None = None) -> SpeechHandle:
        """Queue a transcription ("translate": into English) of float32 mono samples at
        SPEECH_INPUT_RATE on a speech-to-text model (None: the first installed); raises
        InvalidRequest or Overloaded at once. `fallback`: Whisper's retries at higher
        temperatures (engine/decoding/speech.py)."""
        return self._speech.transcribe(samples, model=model, task=task, language=language,
                                       prompt=prompt, temperature=temperature, fallback=fallback,
                                       word_timestamps=word_timestamps, keep_alive=keep_alive)

    def speak(self, text: str, *, model: str | None = None, voice: str | None = None,
              speed: float = 1.0, keep_alive: float | str | None = None) -> SpeechStream:
        """Queue speech for `text` on a text-to-speech model (None: the first installed) in one
        of its voices (None: its first); its waveforms stream as they are made."""
        return self._speech.speak(text, model=model, voice_name=voice, speed=speed,
                                  keep_alive=keep_alive)

    def speech_models(self, kind: str) -> list[str]:
        """The installed speech models of `kind`: "transcription" or "speech"."""
        return self._speech.installed(kind)  # type: ignore[arg-type]

    def speech_voices(self, model: str | None = None) -> tuple[str, ...]:
        """The voices of a text-to-speech model (None: the first installed); raises
        InvalidRequest."""
        return self._speech.voices(model)

    def rerank(self, query: str, documents: Sequence[str], *, model: str | None = None,
               instruction: str | None = None, truncate: bool = True,
               keep_alive: float | str | None = None) -> RerankHandle:
        """Queue a rerank request without waiting (engine/scheduling/rerank.py): `documents`
        scored against `query` by a reranker or an embedding model (`model`; None: the loaded
        one), on the embedding queue; raises InvalidRequest or Overloaded at once."""
        return submit_rerank(self._embeddings, query, documents, model=model,
                             instruction=instruction, truncate=truncate, keep_alive=keep_alive)

    def _later(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the scheduler thread between ticks; safe from any thread."""
        with self._wake:
            self._soon.put(fn)
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
        """The loop: between ticks the drafts that loaded, then one piece of work at a time (an
        idle unload, a control task such as a model switch, or a tick of the admitted requests)."""
        while self._halted is None:
            for _ in range(self._soon.qsize()):  # those posted before this tick: one chunk each
                self._soon.get()()
            work = self._next_work()
            if work is _STOP:
                return
            if work is _UNLOAD:
                self.slot.unload()
            elif callable(work):
                work()
            elif work:
                self._serve_tick(work)

    def _next_work(self) -> "object | Callable[[], None] | list[RequestHandle]":
        """Under the lock, once there is something to do: _STOP, _UNLOAD, a control task, or the
        running requests (the queued ones admitted as far as `max_running` allows); [] when only
        the drafts that loaded wait. One lock section per tick: this runs once per token."""
        with self._wake:
            if self._idle_wait():
                return _UNLOAD
            if self._stopping and not (self._running or self._queued or self._preparing) \
                    and self._soon.empty():
                return _STOP
            if not self._running and not self._queued and not self._control.empty():
                return self._control.get()
            if not self._running and self._queued:
                self._settle()
            while self._queued and len(self._running) < self.max_running:
                handle = self._queued.popleft()
                handle._enter("prefill")
                self._running.append(handle)
            return list(self._running)

    def _idle_wait(self) -> bool:
        """Under the lock: wait until there is work; True when the idle model should unload."""
        # Stopping waits for the drafts being loaded: each request ends with its event.
        while not ((self._stopping and not self._preparing) or self._queued or self._running
                   or not self._control.empty() or not self._soon.empty()):
            wait_s = None if self._preparing else self._until_unload()
            if wait_s is not None and wait_s <= 0:
                return True
            self._wake.wait(None if wait_s is None else min(wait_s, WAIT_MAX_S))
        return False

    def _serve_tick(self, running: list[RequestHandle]) -> None:
        """One tick of the running requests, their weights reloaded first if they were unloaded;
        a failure of either fails these requests and serving goes on."""
        try:
            self._ensure_resident()
        except Exception as exc:  # the weights cannot come back: these requests fail
            for h in running:
                self._advance(h, exc)
            return
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
        solo = self._regroup(running)
        prefilling = [h for h in solo if h.generation.in_prefill and not h.cancel_requested]
        decoding = len(prefilling) < len(running)
        rider = None
        if prefilling:
            chunk = prefilling[0].generation.prefill_chunk
            budget = tick_budget(chunk, decoding)
            rider = self._rider(prefilling[0], budget) if decoding else None
            if rider is None:
                self._prefill(prefilling, budget, chunk)
        for h in solo:
            if h not in prefilling:
                self._step(h)
        if len(self.slot.batch):
            self._step_batch(running, rider)

    def _rider(self, handle: RequestHandle, budget: int) -> tuple[Generation, list[int]] | None:
        """The oldest waiting prompt's next chunk (at most `budget` tokens), to ride in the batch's
        step (a mixed step: engine/decoding/mixed.py), or None when it cannot (no batch, a model or
        cache the mixed step does not know, batching off): then it prefills in calls of its own."""
        batch, gen = self.slot.batch, handle.generation
        if not (self.batching and batch is not None and batch.mixed and len(batch)) or gen.done:
            return None
        try:
            tokens = gen.prefill_input(budget, with_last=gen.last_with_chunk)
        except Exception as exc:  # e.g. its prefix-cache fetch: this request fails alone
            self._advance(handle, exc)
            return None
        return (gen, tokens) if batch.can_carry(gen) else None

    def _regroup(self, running: list[RequestHandle]) -> list[RequestHandle]:
        """Move the decoders that can share the batched step into the batch and the others out of
        it; returns the requests that step alone this tick."""
        batch = self.slot.batch
        # each request's state read once per tick (this runs for every token)
        states = [(h, h.generation.batchable, h.generation in batch) for h in running]
        # A lone decoder runs solo: its plain cache and pipelined step beat a one-row batch.
        use_batch = self.batching and self.slot.footprint.batchable and \
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
        return solo

    def _step_batch(self, running: list[RequestHandle],
                    rider: tuple[Generation, list[int]] | None = None) -> None:
        """One batched decode step (carrying `rider`'s prefill chunk, if any); a failing shared
        model call fails every row and the rider, and the engine serves on with a fresh batch."""
        batch = self.slot.batch
        by_gen = {id(h.generation): h for h in running}
        try:
            results = batch.step(rider)
        except Exception as exc:  # the shared model call: every row fails, the engine serves on
            results = [(gen, exc) for gen in batch.rows + ([rider[0]] if rider else [])]
            self.slot.batch = DecodeBatch(batch.model, batch.caches)
        finished = [gen for gen, _ in results if gen.done and gen in self.slot.batch]
        if finished:
            self.slot.batch.leave(finished)
        for gen, outcome in results:
            self._advance(by_gen[id(gen)], outcome)

    def _prefill(self, prefilling: list[RequestHandle], budget: int, chunk: int) -> None:
        """Prefill within `budget` prompt tokens (engine/scheduling/prefill_policy.py), oldest
        prompts first: the prompts that can share a model call in calls of several
        (`_prefill_together`, at most `chunk` tokens a call), the others each in its own calls,
        finishing one before starting the next."""
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
            failures = prefill_together(self.lm.model, self.lm.caches,
                                        [(h.generation, t) for h, t in group])
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
        batch = self.slot.batch
        if batch is not None and gen in batch:
            batch.leave([gen])
        gen.release()
        state = {"cancelled": "cancelled", "failed": "failed"}.get(gen.finish_reason, "finished")
        with self._wake:
            self._running.remove(handle)
            self._end(handle, state, events)

    def _end(self, handle: RequestHandle, state: RequestState, events: list[Event]) -> None:
        """Under the lock: the request leaves admission, its last events are published."""
        self._reserved -= handle.kv_bytes
        self.slot.touch(handle.keep_alive)
        handle.error = events[-1].error if events else None
        handle.finish_reason = events[-1].finish_reason if events else state
        handle._enter(state)
        self._stats.record(state, events[-1].usage if events else handle.usage, handle.times)
        for event in events:
            handle._publish(event)


_STOP, _UNLOAD = object(), object()  # the scheduler loop's work besides tasks and ticks


def _weight_bytes(lm: LoadedModel) -> int:
    """The bytes of a loaded model's weights (counted once per load, kept in `lm.extras`)."""
    if "weight_bytes" not in lm.extras:
        from mlx.utils import tree_flatten

        lm.extras["weight_bytes"] = sum(p.nbytes for _, p in tree_flatten(lm.model.parameters()))
    return lm.extras["weight_bytes"]


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"
