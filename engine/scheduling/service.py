"""The engine as a service: callers in any thread (or an asyncio loop) submit requests and read
their events, while one scheduler thread runs every loaded model and all MLX work of their
requests (engine/scheduling/ticks.py).

Several models may be loaded at once (engine/scheduling/pool.py): each request runs on the model
it names (`submit(model=...)`, or a view bound to one, `on` / `use`), or on the default model.
A model not loaded yet loads on the first request naming it (`use`), evicting idle models where
the memory budget needs room; each model's own settings apply on every load
(engine/scheduling/model_settings.py).

Every request has one lifecycle, `[loading_draft ->] queued -> prefill -> decoding -> finished |
cancelled | failed`, recorded with the time of each transition, and always ends with exactly one
`done` event, whatever happens inside. `submit` never waits: a speculative request whose draft is
not loaded yet starts in `loading_draft` while a loader thread loads it (one draft at a time, and
one kept per engine: every spelling of a model is one draft) and the scheduler serves the others;
a request whose model left memory waits queued while it loads again.
Admission is by memory (the model-cache bytes each admitted request may grow to, reserved in the
engine's one memory budget, engine/scheduling/budget.py, beside every loaded model's weights; a
running cap only if asked, and a queue cap); requests of one model that decode at the same time
share one model call per step (engine/scheduling/batch.py).
"""

import copy
import itertools
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from ..decoding.drafts import SpeculativeOptions, SpeculatorFactory
from ..device import memory_budget as device_memory_budget
from ..errors import EngineError, InvalidRequest
from ..decoding.fim import Infill
from ..decoding.generate import Generation, build_prompt, check_fits
from ..decoding.prompt_size import check_prompt_size
from ..loading.progress import LoadCallback, report, reporting
from ..loading.registry import LoadedModel, ModelInfo, load_model
from ..decoding.defaults import ModelDefaults
from ..decoding.sampling import SamplingParams
from ..decoding.tools import ToolRequest
from .admission import cache_need, check_room, draft_ready, resident_draft, settings_draft
from .budget import MemoryBudget
from .draft_loader import DraftLoader
from .embedding_queue import EmbeddingHandle, EmbeddingInput, EmbeddingQueue
from .speech import SpeechHandle, SpeechQueue, SpeechStream
from .keep_alive import DEFAULT_KEEP_ALIVE_S, keep_alive_seconds
from .model_settings import ModelSettingsFile
from .pool import ModelPool, ResidentModel
from .rerank import RerankHandle, submit_rerank
from .stats import EngineStats, MemoryUse, PrefixCacheUse, StatsRecorder
from .requests import RequestHandle
from .slot import ModelDescription, ModelSlot
from .ticks import Scheduler

if TYPE_CHECKING:
    from ..prefix_cache.store import PrefixCache

SWITCH_INTERVAL_S = 2e-4
# Admitted by memory (no `max_running`), at most this many requests run at once: a batched step's
# host work grows with its rows (bench.concurrency_step: 32 rows on the H200 still gained).
MAX_RUNNING_ROWS = 64
# The memory budget's share of the device's memory: every loaded model's weights, the admitted
# requests' model caches and the prefix caches' snapshots.
MEMORY_FRACTION = 0.75


@dataclass(frozen=True)
class EngineStatus:
    """A consistent reading of the scheduler's load."""

    model: str | None  # the default model (requests that name none run on it)
    running: int
    queued: int
    loading_drafts: int
    batch_rows: int  # decoding requests sharing a batched model call
    drafts: tuple[str, ...]  # the draft kept for the default model (at most one), by identity
    memory_budget: int
    reserved_bytes: int  # of the budget: the admitted requests' model caches
    resident: bool = False  # the default model's weights are in memory
    embedding_models: tuple[str, ...] = ()  # dedicated embedding models in memory
    speech_models: tuple[str, ...] = ()  # speech models in memory (scheduling/speech.py)
    loaded: tuple[str, ...] = ()  # every model of the pool in memory, most recently used first
    weight_bytes: int = 0  # of the budget: the weights of the pool's models in memory


class Engine:
    """The engine's façade: validates and admits requests (admission.py), and loads, unloads and
    describes the models. It holds, in engine/scheduling/, the `ModelPool` of loaded models, each
    a `ModelSlot` (pool.py, slot.py), the `Scheduler` that runs every request on one thread
    (ticks.py), the `MemoryBudget` they share with the prefix caches and the embedding and speech
    queues (budget.py, embedding_queue.py, speech.py) and the loader of drafts (draft_loader.py).

    `on(name)` and `use(name)` give this engine bound to one model: the same object's methods
    and properties (`submit`, `defaults`, `model`, `lm`...) then read that model instead of the
    default one; everything else is shared.
    """

    def __init__(self, model: str | None = None, *, max_running: int | None = None, max_queued: int = 8,
                 fallback_to_default: bool = False, prefix_cache: bool = True,
                 persist_prefix_cache: bool = False,
                 load: Callable[..., LoadedModel] = load_model, batching: bool = True,
                 memory_budget: int | None = None,
                 keep_alive: float | str | None = DEFAULT_KEEP_ALIVE_S, speculation: bool = True,
                 int8_activations: bool | None = None, max_loaded: int | None = None,
                 pinned: Sequence[str] = (), model_settings: ModelSettingsFile | None = None):
        """`model`: the default model, loaded by `start` (None: the bundled one). `pinned`:
        models loaded by `start` too and never evicted to make room (`mlxchat serve --model`).
        `max_loaded`: at most this many models in memory at once (None: as many as
        `memory_budget` holds: every loaded model's weights, the admitted requests' model caches
        and the prefix caches; default MEMORY_FRACTION of the device's memory).
        `max_running`: None admits requests by memory: they run together (one batched step a
        model) as long as the model-cache bytes each may grow to fit, up to MAX_RUNNING_ROWS; a
        number caps the requests running at once (`mlxchat serve --max-running`). `max_queued`:
        requests waiting beyond those. `keep_alive`: unload a model's weights after it has been
        idle this long (seconds or a duration such as "30m"; None or negative: never), unless its
        settings or a request say otherwise; the next request reloads them.
        `speculation=False` refuses speculative requests (a sharded model). `int8_activations`:
        on our CPU kernels, models whose settings make no choice load on the lossy
        int8-activation path (None: the process's default, `--int8-activations`).
        `model_settings`: each model's settings (default: models.json in the data folder)."""
        self.requested_model = model
        self.pinned = tuple(pinned)
        self.fallback_to_default = fallback_to_default
        self.keep_alive = keep_alive_seconds(keep_alive)
        self.max_queued = max_queued
        self.speculation = speculation  # off for a sharded model (engine/distributed/)
        self.model_settings = model_settings if model_settings is not None else ModelSettingsFile()
        # One budget for every loaded model's weights, the model caches of admitted requests and
        # the prefix caches' snapshots, which may hold what the others do not reserve.
        self.budget = MemoryBudget(memory_budget if memory_budget is not None
                                   else device_memory_budget(MEMORY_FRACTION))
        self.drafts = DraftLoader(alive=lambda lm: any(s.lm is lm and s.resident
                                                       for s in self.pool.members()))
        self._stats = StatsRecorder()  # running totals for monitoring (`stats`)
        self.pool = ModelPool(self.budget, self._stats.counted(load),
                              settings=self.model_settings, keep_alive=self.keep_alive,
                              max_loaded=max_loaded, prefix_cache=prefix_cache,
                              persist_prefix_cache=persist_prefix_cache,
                              int8_activations=int8_activations,
                              on_release=lambda slot: self.drafts.drop(slot.lm))
        self.scheduler = Scheduler(self.pool, self.budget, batching=batching,
                                   max_running=max_running if max_running is not None
                                   else MAX_RUNNING_ROWS, stats=self._stats,
                                   on_halt=self._fail_queues)
        self.pool.attach(self.scheduler)
        self.embeddings = EmbeddingQueue(self.scheduler, self.pool, self.keep_alive,
                                         self._stats.counted(load_model))
        # speech models reserve their weights through the pool (idle models leave for them)
        self.speech = SpeechQueue(self.budget, self.keep_alive,
                                  halted=lambda: self.scheduler.halted, reserve=self.pool.reserve)
        self._ids = itertools.count(1)
        self._bound: str | None = None  # the model this view is bound to (`on`), else the default
        self._pinned_loaded = False

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, progress: LoadCallback | None = None, *, load: bool = True) -> "Engine":
        """Load the default model and the pinned ones (their stages reported to `progress`) and
        start serving; blocks until loaded. `load=False` starts serving with no model: requests
        are refused until `switch_model` has loaded one (a server that answers while its first
        model loads), and the pinned ones load then."""
        # Every token is handed from the scheduler thread to readers in other threads; with
        # Python's default 5 ms switch interval the scheduler waits for the GIL after each device
        # sync (bench/results/cuda-h200-2026-12-02-concurrency-switchinterval-only.json).
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.scheduler.start()
        self.drafts.start()
        if load:
            self._load_first(progress)
        return self

    def _load_first(self, progress: LoadCallback | None) -> None:
        """The default model (its stages reported to `progress`), then the pinned ones."""
        with reporting(progress):
            first = self.pool.acquire(self.requested_model,
                                      pin=self.requested_model in self.pinned,
                                      fallback_to_default=self.fallback_to_default)
            self.pool.default = first
            report("ready")
        self._load_pinned()

    def _load_pinned(self) -> None:
        """The pinned models, once: after the first model loaded (by `start`, or the first
        `switch_model` of an engine started without one)."""
        if self._pinned_loaded:
            return
        self._pinned_loaded = True
        for name in self.pinned:
            self.pool.acquire(name, pin=True)

    def stop(self) -> None:
        """Cancel everything running or queued, let each end with its final event, then stop."""
        for h in self.scheduler.admitted():
            h.cancel()
        self.scheduler.stop()
        self.drafts.stop()
        self.embeddings.close()
        self.speech.close()
        self.pool.close()  # so that reopening the app continues long conversations without re-prefill

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

    # -- the models ------------------------------------------------------------------------------
    def on(self, name: str) -> "Engine":
        """This engine bound to the loaded model `name` (as loaded or as asked for): its
        properties and `submit` read that model. Raises InvalidRequest when no model of that name
        was loaded (`use` loads it)."""
        slot = self.pool.find(name)
        if slot is None:
            raise InvalidRequest(f"the model {name!r} is not loaded", field="model",
                                 code="model_not_loaded")
        bound = copy.copy(self)
        bound._bound = slot.name
        return bound

    def use(self, name: str, progress: LoadCallback | None = None) -> "Engine":
        """`on(name)`, the model loaded first if it is not in memory (blocks while it loads; call
        it off the event loop): once, however many ask at the same time, idle models evicted
        where the memory budget needs room. Raises ModelLoadError (no such model, it cannot
        load, it cannot fit) or NoRoom (every model holding the budget is busy: retry later)."""
        if self.halted is not None:
            raise EngineError(self.halted)
        with reporting(progress):
            slot = self.pool.acquire(name)
            report("ready")
        bound = copy.copy(self)
        bound._bound = slot.name
        return bound

    def unload_model(self, name: str) -> bool:
        """Unload `name`'s weights now, or as soon as its running requests end (Ollama's
        `keep_alive: 0`); False when it is not in memory. The next request loads it again."""
        return self.pool.unload(name)

    def touch(self, keep_alive: float | str | None) -> None:
        """The model stays loaded `keep_alive` from now when idle (seconds or a duration; None:
        as its settings or the server say), as a request's `keep_alive` would set it; raises
        InvalidRequest for a bad value."""
        slot = self._serving_slot()
        slot.touch(keep_alive_seconds(keep_alive, self.pool.default_keep(slot)))
        self.scheduler.wake()

    def loaded_models(self) -> list[ResidentModel]:
        """The models in memory, most recently used first: weights, context, expiry."""
        return self.pool.in_memory()

    @property
    def slot(self) -> ModelSlot | None:
        """The pool's slot of this view's model (the default model unless bound)."""
        if self._bound is not None:
            return self.pool.find(self._bound)
        return self.pool.default

    @property
    def lm(self) -> LoadedModel | None:
        slot = self.slot
        return slot.lm if slot is not None else None

    @property
    def prefix_cache(self) -> "PrefixCache | None":
        """The model's prefix cache (None while its weights are unloaded, or when off)."""
        slot = self.slot
        return slot.prefix_cache if slot is not None else None

    @property
    def model_name(self) -> str | None:
        lm = self.lm
        return lm.name if lm is not None else None

    @property
    def model(self) -> ModelDescription | None:
        """The model (also while unloaded after an idle time), or None while none is."""
        slot = self.slot
        return slot.described if slot is not None and slot.lm is not None else None

    @property
    def int8_activations(self) -> bool | None:
        """Whether the model takes int8 activations on our CPU kernels; None where it does not
        run on them, or while no model is loaded (`switch_model` changes it)."""
        model = self.model
        return model.int8_activations if model is not None else None

    @property
    def defaults(self) -> ModelDefaults | None:
        """The model's sampling defaults, each with its source."""
        model = self.model
        return model.defaults if model is not None else None

    def params(self, explicit: dict | None = None) -> SamplingParams:
        """SamplingParams for the model: `explicit` values (a request's fields, a conversation's
        settings) over the model's defaults; raises InvalidRequest."""
        defaults = self.defaults
        if defaults is None:
            raise EngineError("no model is loaded yet")
        return defaults.params(explicit)

    def list_models(self) -> list[ModelInfo]:
        """The local models (bundled, downloaded), then those this engine loaded from a folder or
        GGUF path: any of them can be named to `use` or `switch_model`."""
        return self.pool.known()

    def status(self) -> EngineStatus:
        load = self.scheduler.load()
        slot = self.slot
        resident = self.pool.resident()
        weights = sum(s.weight_bytes for s in resident)
        return EngineStatus(
            model=self.model_name, running=load.running, queued=load.queued,
            loading_drafts=load.preparing, batch_rows=load.batch_rows,
            drafts=self.drafts.identities(self.lm), memory_budget=self.budget.total,
            reserved_bytes=max(load.reserved_bytes - weights - self.speech.reserved(), 0),
            resident=slot is not None and slot.resident,
            embedding_models=tuple(s.name for s in resident if s.embedding_only),
            speech_models=tuple(self.speech.resident_models()),
            loaded=tuple(m.name for m in self.pool.in_memory()), weight_bytes=weights)

    def stats(self) -> EngineStats:
        """A reading for monitoring (engine/scheduling/stats.py): the load now, the running
        totals, memory by model and the prefix cache's counters. Safe from any thread; it takes
        the scheduler's lock only to copy a few numbers."""
        status = self.status()
        weights = {s.name: s.weight_bytes for s in self.pool.resident()}
        weights.update(self.speech.resident_weights())
        lm, cache = self.lm, self.prefix_cache
        use = PrefixCacheUse.of(lm.name, cache.stats()) if cache is not None and lm is not None else None
        return EngineStats(at=time.time(), model=status.model, running=status.running,
                           queued=status.queued + status.loading_drafts,
                           embedding_queue=self.embeddings.pending(),
                           totals=self._stats.snapshot(),
                           memory=MemoryUse(weights, status.reserved_bytes, status.memory_budget),
                           prefix_cache=use)

    def request_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        """The model-cache memory a plain request of this size reserves while admitted."""
        slot = self._serving_slot()
        return slot.footprint.bytes_for(prompt_tokens + max_tokens)

    def switch_model(self, name: str, progress: LoadCallback | None = None,
                     cancel_running: bool = False, *, int8_activations: bool | None = None) -> None:
        """Make `name` the default model (a name `list_models` gives, or a path), loading it if it
        is not in memory; the other models stay loaded while the budget allows (an idle pinned
        one leaves too where nothing else can), and their running requests go on (or are all
        cancelled, if asked). A model that cannot load raises
        ModelLoadError and the default stays as it was. `int8_activations`: on our CPU kernels,
        load `name` on the lossy int8-activation path from now on, or the exact one (None: as its
        settings say); a model in memory with the other choice reloads once its requests and
        every other running request end (new ones are refused meanwhile)."""
        if cancel_running:
            for h in self.scheduler.admitted():  # cancelling a queued request takes the lock
                h.cancel()
        slot = self.pool.find(name)
        if slot is not None and int8_activations is not None:
            slot.int8_activations = int8_activations
            described = slot.described
            if slot.resident and described is not None and \
                    described.int8_activations not in (None, int8_activations):
                self.scheduler.call(lambda: self.pool.reload(slot))
        with reporting(progress):
            slot = self.pool.acquire(name, int8_activations=int8_activations,
                                     evict_pinned=True, pin=name in self.pinned)
            self.pool.default = slot
            report("ready")
        self._load_pinned()

    def run_on_scheduler(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the scheduler thread once no request is running or queued, and wait for it
        (e.g. to read that thread's CPU time or profile it: bench.concurrency_step)."""
        self.scheduler.call(fn)

    # -- submission ----------------------------------------------------------------------------
    def submit(self, messages: Sequence[dict] | None = None, params: SamplingParams | None = None,
               *, prompt_tokens: Sequence[int] | None = None, text: str | None = None,
               speculative: SpeculativeOptions | None = None, tools: ToolRequest | None = None,
               split_reasoning: bool = False, keep_alive: float | str | None = None,
               fit_max_tokens: bool = False, infill: Infill | None = None,
               model: str | None = None) -> RequestHandle:
        """Validate and enqueue a request without waiting; raises InvalidRequest or Overloaded at
        once. `model`: a loaded model's name (None: this view's model, or the default one).
        `speculative` opts in to speculative decoding (engine/decoding/drafts.py; the default is
        plain, or the draft the model's settings name where the request allows it): a draft not
        loaded yet loads on the loader thread while the request is in `loading_draft`; if it
        cannot load, the request ends `failed` and `accepted()` raises.
        `tools` and `split_reasoning`: see `Generation` (engine/decoding/generate.py).
        A model that left memory (idle, or evicted) is loaded again before the request runs;
        `keep_alive` (like Ollama's) sets how long it stays loaded after this request.
        `fit_max_tokens`: lower `max_tokens` to the context the prompt leaves instead of refusing
        (clients such as Claude Code always ask for 32,000; the prompt is tokenised once, here).
        `infill`: a fill-in-the-middle prompt instead of messages or text
        (engine/decoding/fim.py)."""
        slot = self._serving_slot(model)
        lm = slot.lm
        assert lm is not None
        params = params or SamplingParams()
        check_prompt_size(lm, messages, text, tools, infill)  # before tokenising anything
        prompt = build_prompt(lm, messages=messages, prompt_tokens=prompt_tokens, text=text,
                              tools=tools, infill=infill)
        if fit_max_tokens:  # no room left: max_tokens 1, refused as too long (not over budget)
            params = params.with_(max_tokens=max(1, min(params.max_tokens,
                                                        lm.context_length - len(prompt.tokens))))
        check_fits(lm, prompt, params)  # now, also for a request that waits for its draft
        if speculative is None:
            speculative = settings_draft(slot, params, tools, prompt.vision is not None,
                                         self.speculation)
        factory = resident_draft(self.drafts, lm, speculative, self.speculation)

        def generation(factory: SpeculatorFactory | None) -> Generation:
            speculator = factory(speculative.config()) if factory and speculative else None
            return Generation(lm, prompt, params, prefix_cache=slot.prefix_cache,
                              speculator=speculator, tools=tools, split_reasoning=split_reasoning)

        # A speculative request also grows its draft's cache: at most the target's again.
        need = cache_need(slot, self.memory_budget, len(prompt.tokens), params.max_tokens,
                          2 if speculative is not None else 1)
        handle = RequestHandle(id=f"req-{next(self._ids)}", generation=None, kv_bytes=need,
                               slot=slot,
                               keep_alive=keep_alive_seconds(keep_alive,
                                                             self.pool.default_keep(slot)),
                               _on_cancel=self.scheduler.cancelled)
        if speculative is None or factory is not None:
            handle.generation = generation(factory)
            self._admit(handle)
            if not slot.resident:  # it waits queued while the weights load again
                self.pool.load_soon(slot, self.scheduler.fail_waiting)
        else:
            self._admit(handle, lambda: self.drafts.load(
                lm, speculative.draft, cancelled=lambda: handle.cancel_requested,
                prepare=lambda: self.pool.acquire(lm.name),
                done=lambda f, failure: self.scheduler.soon(
                    lambda: draft_ready(self.scheduler, handle, slot, lm, f, failure, generation))))
        return handle

    def _serving_slot(self, model: str | None = None) -> ModelSlot:
        """The model a new request runs on (`model`, else this view's, else the default); raises
        EngineError when there is none, InvalidRequest for one that does not chat."""
        if self.halted is not None:
            raise EngineError(self.halted)
        slot = self.on(model).slot if model is not None else self.slot
        if slot is None or slot.lm is None:
            raise EngineError("no model is loaded yet")
        if slot.embedding_only:
            raise InvalidRequest(f"{slot.name} is an embedding model: it embeds and ranks, it "
                                 f"does not generate text", field="model",
                                 code="model_not_generative")
        return slot

    def _admit(self, handle: RequestHandle, prepare: Callable[[], None] | None = None) -> None:
        """Admit `handle` (its `kv_bytes` reserved in the memory budget) or raise Overloaded; see
        `Scheduler.admit` (a handle without its generation waits while `prepare()` loads its
        draft)."""
        self.scheduler.admit(handle, lambda load: check_room(load, self.max_running, self.max_queued),
                             prepare)

    def embed(self, inputs: EmbeddingInput | Sequence[EmbeddingInput], *, model: str | None = None,
              dimensions: int | None = None, truncate: bool = False, query: bool = False,
              keep_alive: float | str | None = None) -> EmbeddingHandle:
        """Queue an embedding request without waiting (engine/scheduling/embedding_queue.py): on a
        loaded chat model (`model` its name; None: this view's model, or the default one) or a
        dedicated embedding model, loaded into the pool if it is not; raises InvalidRequest or
        Overloaded at once. Its chunks run between scheduler ticks."""
        if model is None and self._bound is not None:
            model = self._bound
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
        scored against `query` by a reranker or an embedding model (`model`; None: this view's
        model, or the default one), on the embedding queue; raises InvalidRequest or Overloaded at
        once."""
        if model is None and self._bound is not None:
            model = self._bound
        return submit_rerank(self.embeddings, query, documents, model=model,
                             instruction=instruction, truncate=truncate, keep_alive=keep_alive)
