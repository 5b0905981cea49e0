"""The engine as a service: callers in any thread (or an asyncio loop) submit requests and read
their events, while one scheduler thread owns the model and all MLX work
(engine/scheduling/ticks.py).

Every request has one lifecycle, `[loading_draft ->] queued -> prefill -> decoding -> finished |
cancelled | failed`, recorded with the time of each transition, and always ends with exactly one
`done` event, whatever happens inside. `submit` never waits: a speculative request whose draft is
not loaded yet starts in `loading_draft` while a loader thread loads it (one draft at a time, and
one kept per engine: every spelling of a model is one draft) and the scheduler serves the others.
Admission is by memory (the model-cache bytes each admitted request may grow to, reserved in the
engine's one memory budget, engine/scheduling/budget.py; a running cap only if asked, and a queue
cap); requests that decode at the same time share one model call per step
(engine/scheduling/batch.py).
"""

import itertools
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from ..decoding.drafts import SpeculativeOptions, SpeculatorFactory, check_draft
from ..device import memory_budget as device_memory_budget
from ..errors import EngineError, InvalidRequest, Overloaded
from ..decoding.fim import Infill
from ..decoding.generate import Generation, build_prompt
from ..decoding.prompt_size import check_prompt_size
from ..loading.progress import LoadCallback
from ..loading.registry import LoadedModel, ModelInfo, load_model
from ..decoding.defaults import ModelDefaults
from ..decoding.sampling import SamplingParams
from ..decoding.tools import ToolRequest
from .budget import MemoryBudget, mib
from .draft_loader import DraftLoader
from .embedding_queue import EmbeddingHandle, EmbeddingInput, EmbeddingQueue
from .speech import SpeechHandle, SpeechQueue, SpeechStream
from .keep_alive import DEFAULT_KEEP_ALIVE_S, keep_alive_seconds
from .rerank import RerankHandle, submit_rerank
from .stats import EngineStats, MemoryUse, PrefixCacheUse, StatsRecorder
from .requests import RequestHandle
from .slot import ModelDescription, ModelSlot
from .ticks import Load, Scheduler

if TYPE_CHECKING:
    from ..prefix_cache.store import PrefixCache

SWITCH_INTERVAL_S = 2e-4
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
    reserved_bytes: int  # of the budget: admitted requests' model caches, embedding models' weights
    resident: bool = False  # the model's weights are in memory (not unloaded after an idle time)
    embedding_models: tuple[str, ...] = ()  # dedicated embedding models loaded beside it
    speech_models: tuple[str, ...] = ()  # speech models loaded beside it (scheduling/speech.py)


class Engine:
    """The engine's façade: validates and admits requests, and starts, switches and stops the
    model. It holds the `Scheduler` that runs every request on one thread
    (engine/scheduling/ticks.py), the `ModelSlot` with the model (engine/scheduling/slot.py), the
    `MemoryBudget` they share with the prefix cache and the embedding queue
    (engine/scheduling/budget.py), the loader of drafts for speculative requests
    (engine/scheduling/draft_loader.py) and the `EmbeddingQueue` (engine/scheduling/embedding_queue.py).
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
        self.max_queued = max_queued
        self.speculation = speculation  # off for a sharded model (engine/distributed/)
        # One budget for the model caches of admitted requests, a dedicated embedding model's
        # weights and the prefix cache's snapshots, which may hold what the others do not reserve.
        self.budget = MemoryBudget(memory_budget if memory_budget is not None
                                   else device_memory_budget())
        self.drafts = DraftLoader(current=lambda: self.lm)
        self._stats = StatsRecorder()  # running totals for monitoring (`stats`)
        self.slot = ModelSlot(self._stats.counted(load), fallback_to_default=fallback_to_default,
                              prefix_cache=prefix_cache, persist_prefix_cache=persist_prefix_cache,
                              cache_budget=self.budget.room,
                              on_release=self.drafts.clear, int8_activations=int8_activations)
        self.slot.touch(self.keep_alive)
        self.scheduler = Scheduler(self.slot, self.budget, batching=batching,
                                   max_running=max_running if max_running is not None
                                   else MAX_RUNNING_ROWS, stats=self._stats,
                                   on_halt=self._fail_queues)
        self.embeddings = EmbeddingQueue(self.scheduler, self.budget, self.keep_alive)
        self.speech = SpeechQueue(self.budget, self.keep_alive,
                                  halted=lambda: self.scheduler.halted)
        self._ids = itertools.count(1)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, progress: LoadCallback | None = None, *, load: bool = True) -> "Engine":
        """Load the model (on the scheduler thread, its stages reported to `progress`) and start
        serving; blocks until loaded. `load=False` starts serving with no model: requests are
        refused until `switch_model` has loaded one (a server that answers while its first model
        loads)."""
        # Every token is handed from the scheduler thread to readers in other threads; with
        # Python's default 5 ms switch interval the scheduler waits for the GIL after each device
        # sync (bench/results/cuda-h200-2026-12-02-concurrency-switchinterval-only.json).
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.scheduler.start()
        self.drafts.start()
        if load:
            self.scheduler.call(lambda: self.slot.install(self.requested_model, progress,
                                                          self.keep_alive))
        return self

    def stop(self) -> None:
        """Cancel everything running or queued, let each end with its final event, then stop."""
        for h in self.scheduler.admitted():
            h.cancel()
        self.scheduler.stop()
        self.drafts.stop()
        self.embeddings.close()
        self.speech.close()
        self.slot.persist()  # so that reopening the app continues long conversations without re-prefill

    def halt(self, reason: str) -> None:
        """Fail every admitted request (and embedding request) with `reason` and refuse new ones
        (EngineError) from now on; safe from any thread. For failures the scheduler thread cannot
        recover from, such as a rank of a sharded model gone: that thread may stay blocked in a
        collective that never returns, so this does not wait for it."""
        self.scheduler.halt(reason)

    def _fail_queues(self, reason: str) -> None:
        """The engine halted: the embedding and speech requests fail with `reason`."""
        self.embeddings.fail(reason)
        self.speech.fail(reason)

    @property
    def halted(self) -> str | None:
        """Why the engine stopped serving for good, or None."""
        return self.scheduler.halted

    @property
    def busy_s(self) -> float:
        """How long the scheduler's current tick or embedding chunk has run (0: between them)."""
        return self.scheduler.busy_s()

    @property
    def max_running(self) -> int:
        """At most this many requests run at once (`max_running`, or MAX_RUNNING_ROWS)."""
        return self.scheduler.max_running

    @property
    def memory_budget(self) -> int:
        """The memory budget's bytes (`budget` holds its reservations)."""
        return self.budget.total

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
        load = self.scheduler.load()
        return EngineStatus(
            model=self.model_name, running=load.running, queued=load.queued,
            loading_drafts=load.preparing, batch_rows=load.batch_rows,
            drafts=self.drafts.identities(), memory_budget=self.budget.total,
            reserved_bytes=load.reserved_bytes, resident=self.slot.resident,
            embedding_models=tuple(self.embeddings.resident_models()),
            speech_models=tuple(self.speech.resident_models()))

    def stats(self) -> EngineStats:
        """A reading for monitoring (engine/scheduling/stats.py): the load now, the running
        totals, memory by model and the prefix cache's counters. Safe from any thread; it takes
        the scheduler's lock only to copy a few numbers."""
        status = self.status()
        weights = dict(self.embeddings.resident_weights())
        weights.update(self.speech.resident_weights())
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
                           embedding_queue=self.embeddings.pending(),
                           totals=self._stats.snapshot(),
                           memory=MemoryUse(weights, status.reserved_bytes, status.memory_budget),
                           prefix_cache=use)

    def request_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        """The model-cache memory a plain request of this size reserves while admitted."""
        return self.slot.footprint.bytes_for(prompt_tokens + max_tokens)

    def switch_model(self, name: str, progress: LoadCallback | None = None,
                     cancel_running: bool = False, *, int8_activations: bool | None = None) -> None:
        """Load another model (a name `list_models` gives, or a path; the current one's name
        reloads it) once running and queued requests end (or are cancelled, if asked); meanwhile
        new requests are refused with Overloaded. A model that cannot load raises ModelLoadError
        with the previous model loaded again. `int8_activations`: on our CPU kernels, take the
        lossy int8-activation path from now on, or the exact one (None: as the current model;
        `model.int8_activations` says which the loaded model took)."""
        name = self.slot.path_of(name)
        if cancel_running:
            for h in self.scheduler.admitted():  # cancelling a queued request takes the lock
                h.cancel()
        self.scheduler.call(lambda: self.slot.install(name, progress, self.keep_alive,
                                                      int8_activations))

    def run_on_scheduler(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the scheduler thread once no request is running or queued, and wait for it
        (e.g. to read that thread's CPU time or profile it: bench.concurrency_step)."""
        self.scheduler.call(fn)

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
        check_prompt_size(lm, messages, text, tools, infill)  # before tokenising anything
        prompt = build_prompt(lm, messages=messages, prompt_tokens=prompt_tokens, text=text,
                              tools=tools, infill=infill)
        if fit_max_tokens:  # no room left: max_tokens 1, refused as too long (not over budget)
            params = params.with_(max_tokens=max(1, min(params.max_tokens,
                                                        lm.context_length - len(prompt.tokens))))
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
                               _on_cancel=self.scheduler.cancelled)
        if speculative is None or factory is not None:
            handle.generation = generation(factory)
            self._admit(handle)
        else:
            self._admit(handle, lambda: self.drafts.load(
                lm, speculative.draft, cancelled=lambda: handle.cancel_requested,
                prepare=self.scheduler.ensure_resident,
                done=lambda f, failure: self.scheduler.soon(
                    lambda: self._draft_ready(handle, lm, f, failure, generation))))
        return handle

    def _serving(self) -> LoadedModel:
        """The model new requests run on; raises EngineError when there is none."""
        if self.halted is not None:
            raise EngineError(self.halted)
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
                f"this request would need about {mib(need)} of model cache (prompt "
                f"{prompt_tokens} tokens + max_tokens {max_tokens}), over the memory "
                f"budget of {mib(self.memory_budget)}; shorten the prompt or lower max_tokens",
                field="max_tokens", code="over_memory_budget")
        return need

    def _admit(self, handle: RequestHandle, prepare: Callable[[], None] | None = None) -> None:
        """Admit `handle` (its `kv_bytes` reserved in the memory budget) or raise Overloaded; see
        `Scheduler.admit` (a handle without its generation waits while `prepare()` loads its
        draft)."""
        self.scheduler.admit(handle, self._check_room, prepare)

    def _check_room(self, load: Load) -> None:
        """Raise Overloaded while a model switch drains the requests, or past the caps."""
        if load.switching:  # accepted requests drain first, on the current model
            raise Overloaded(f"switching models: {self.model_name} is finishing its requests",
                             retry_after=5.0)
        if load.admitted >= self.max_running + self.max_queued:
            raise Overloaded(f"server busy: {load.running} requests running and "
                             f"{load.admitted - load.running} queued (limits "
                             f"{self.max_running} + {self.max_queued})", retry_after=2.0)

    def embed(self, inputs: EmbeddingInput | Sequence[EmbeddingInput], *, model: str | None = None,
              dimensions: int | None = None, truncate: bool = False, query: bool = False,
              keep_alive: float | str | None = None) -> EmbeddingHandle:
        """Queue an embedding request without waiting (engine/scheduling/embedding_queue.py): on the
        loaded chat model (`model` None or its name) or a dedicated embedding model; raises
        InvalidRequest or Overloaded at once. Its chunks run between scheduler ticks."""
        return self.embeddings.submit(inputs, model=model, dimensions=dimensions,
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
        return self.speech.transcribe(samples, model=model, task=task, language=language,
                                       prompt=prompt, temperature=temperature, fallback=fallback,
                                       word_timestamps=word_timestamps, keep_alive=keep_alive)

    def speak(self, text: str, *, model: str | None = None, voice: str | None = None,
              speed: float = 1.0, keep_alive: float | str | None = None) -> SpeechStream:
        """Queue speech for `text` on a text-to-speech model (None: the first installed) in one
        of its voices (None: its first); its waveforms stream as they are made."""
        return self.speech.speak(text, model=model, voice_name=voice, speed=speed,
                                  keep_alive=keep_alive)

    def speech_models(self, kind: str) -> list[str]:
        """The installed speech models of `kind`: "transcription" or "speech"."""
        return self.speech.installed(kind)  # type: ignore[arg-type]

    def speech_voices(self, model: str | None = None) -> tuple[str, ...]:
        """The voices of a text-to-speech model (None: the first installed); raises
        InvalidRequest."""
        return self.speech.voices(model)

    def rerank(self, query: str, documents: Sequence[str], *, model: str | None = None,
               instruction: str | None = None, truncate: bool = True,
               keep_alive: float | str | None = None) -> RerankHandle:
        """Queue a rerank request without waiting (engine/scheduling/rerank.py): `documents`
        scored against `query` by a reranker or an embedding model (`model`; None: the loaded
        one), on the embedding queue; raises InvalidRequest or Overloaded at once."""
        return submit_rerank(self.embeddings, query, documents, model=model,
                             instruction=instruction, truncate=truncate, keep_alive=keep_alive)

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
        self.scheduler.prepared(handle, gen, failure)


def _weight_bytes(lm: LoadedModel) -> int:
    """The bytes of a loaded model's weights (counted once per load, kept in `lm.extras`)."""
    if "weight_bytes" not in lm.extras:
        from mlx.utils import tree_flatten

        lm.extras["weight_bytes"] = sum(p.nbytes for _, p in tree_flatten(lm.model.parameters()))
    return lm.extras["weight_bytes"]
