"""One model of the pool (engine/scheduling/pool.py): the loaded model, the decode batch and
prefix cache it owns, its settings, and when it was last used.

A slot is made by the pool for one model and keeps it: its weights load (on the thread that asked
for them), leave memory when the model is idle past its keep-alive or evicted to make room, and
load again for the next request; the tokenizer, config and description stay meanwhile. Its
requests run on the scheduler thread (engine/scheduling/ticks.py), which owns `batch` while the
weights are in memory.
"""

import dataclasses
import gc
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ..decoding.defaults import ModelDefaults, resolve_defaults
from ..decoding.drafts import DraftChoice, check_draft, draft_choices
from ..errors import EngineError
from ..kernels.kv8 import kv_format
from ..kernels.layout import int8_activations_of
from ..loading.embedding_recipe import embedding_recipe
from ..loading.registry import LoadedModel, capabilities
from .batch import DecodeBatch, KVFootprint, kv_footprint
from .model_settings import NONE, ModelSettings

log = logging.getLogger(__name__)

PERSIST_BYTES = 512 * 2**20  # prefix-cache snapshots written to disk at shutdown and unload


@dataclass(frozen=True)
class ModelDescription:
    """The loaded model as callers see it: what it is and which drafts it can speculate with."""

    name: str
    family: str  # the config's model_type, e.g. "llama", "qwen3_5"
    context_length: int  # the config's, or shorter where the model's settings say so
    drafts: tuple[DraftChoice, ...]
    defaults: ModelDefaults  # each sampling option's default for this model, with its source
    capabilities: tuple[str, ...] = ("completion",)  # engine.loading.registry.CAPABILITIES
    # On our CPU kernels, whether it takes int8 activations; None where it does not run on them
    # (the GPU, the fp32 layout, a sharded or vision model): the choice does not apply to it.
    int8_activations: bool | None = None
    kv_format: str = "full"  # its KV cache's format (engine/kernels/kv8.py)
    settings: ModelSettings = NONE  # its settings as of its last load (model_settings.py)


class ModelSlot:
    """One model of the pool: its weights while in memory (also its tokenizer, config and
    description while they are not), its batch and prefix cache, and its use."""

    def __init__(self, asked: str | None, load: Callable[..., LoadedModel], *, prefix_cache: bool,
                 persist_prefix_cache: bool, cache_budget: Callable[[], int],
                 on_release: Callable[["ModelSlot"], None], int8_activations: bool | None = None):
        """`asked`: the model as `load` takes it (a name or path; None: the bundled model).
        `cache_budget()`: the bytes its prefix cache may hold now; `on_release(slot)`: called
        when its weights go (e.g. to drop the drafts kept for them). `int8_activations`: the
        engine's choice for models whose settings make none (None: the process's default)."""
        self.asked = asked
        self._load = load
        self._int8_default = int8_activations
        self.int8_activations: bool | None = None  # `switch_model`'s choice, over the settings
        self.use_prefix_cache = prefix_cache
        self.persist_prefix_cache = persist_prefix_cache
        self._cache_budget = cache_budget
        self._on_release = on_release
        self.lm: LoadedModel | None = None
        self.prefix_cache = None
        self.batch: DecodeBatch | None = None
        self.footprint = KVFootprint(0, 0, False)
        self.described: ModelDescription | None = None
        self.settings = NONE
        self.resident = False  # the weights are in memory
        self.weight_bytes = 0  # reserved in the memory budget while resident (the pool's)
        self.pinned = False  # never evicted to make room (`mlxchat serve --model`)
        self.embedding_only = False  # a dedicated embedding model: no chat parts
        self.holds = 0  # users besides the scheduler's requests (the embedding queue's jobs)
        self.unload_after_use = False  # asked to unload (Ollama's keep_alive 0) while busy
        self._unloaded = threading.Event()  # clear from `retire` until `unload` is done
        self._unloaded.set()
        self.last_used = time.monotonic()
        self._idle_since = time.monotonic()
        self._idle_since_wall = time.time()
        self.idle_keep: float | None = None

    @property
    def name(self) -> str:
        return self.lm.name if self.lm is not None else str(self.asked)

    # -- loading ---------------------------------------------------------------------------------
    def load(self, settings: ModelSettings, fallback_to_default: bool = False) -> LoadedModel:
        """Load the weights as `settings` say (on the calling thread); nothing changes here yet
        (`install` takes them). Raises the load's EngineError."""
        options: dict = {"int8_activations": self.int8_choice(settings)}
        if settings.kv_bits is not None:  # only where asked: a custom loader may not take it
            options["kv_bits"] = settings.kv_bits
        return self._load(self.asked, fallback_to_default=fallback_to_default, **options)

    def int8_choice(self, settings: ModelSettings) -> bool | None:
        """The int8-activation choice a load takes: `switch_model`'s, else the settings', else
        the engine's."""
        for choice in (self.int8_activations, settings.int8_activations):
            if choice is not None:
                return choice
        return self._int8_default

    def install(self, loaded: LoadedModel, settings: ModelSettings) -> None:
        """Take freshly loaded weights: the first time the model itself (our own record of it:
        an unload empties its `model`, never the caller's object), later into that record, so
        that requests holding it see them; then its batch, prefix cache and description. An
        unload still under way ends first."""
        self._unloaded.wait()
        if self.lm is None:
            self.lm = dataclasses.replace(loaded)
        else:
            self.lm.model, self.lm.caches, self.lm.compute = loaded.model, loaded.caches, \
                loaded.compute
        lm = self.lm
        lm.context_limit = settings.context_length
        self.settings = settings
        self.embedding_only = embedding_recipe(lm.path).dedicated
        if not self.embedding_only:
            self.footprint = kv_footprint(lm.model, lm.caches)
            self.batch = DecodeBatch(lm.model, lm.caches)
            if self.use_prefix_cache:
                from ..prefix_cache.store import PrefixCache, default_persist_dir

                persist_dir = default_persist_dir() if self.persist_prefix_cache else None
                self.prefix_cache = PrefixCache(lm, persist_dir=persist_dir,
                                                budget_bytes=self._cache_budget)
        self.unload_after_use = False
        self.described = ModelDescription(
            name=lm.name, family=lm.family, context_length=lm.context_length,
            drafts=draft_choices(lm),
            defaults=resolve_defaults(lm.name, lm.path, lm.family,
                                      settings.sampling_defaults(lm.family)),
            capabilities=capabilities(lm), int8_activations=int8_activations_of(lm.model),
            kv_format=kv_format(lm.model), settings=settings)
        self.resident = True

    def default_draft(self) -> str | None:
        """The draft the model's settings give its requests, where it can use it."""
        draft = self.settings.draft
        if draft is None or self.lm is None:
            return None
        try:
            check_draft(self.lm, draft)
        except EngineError as exc:
            log.warning("ignoring the draft %r of %s's settings: %s", draft, self.name, exc)
            return None
        return draft

    def persist(self) -> None:
        """Write the prefix cache's snapshots to disk, if asked to keep them."""
        if self.prefix_cache is not None and self.persist_prefix_cache:
            self.prefix_cache.persist(max_bytes=PERSIST_BYTES)

    # -- use and idle unload ---------------------------------------------------------------------
    def touch(self, keep_alive: float | None) -> None:
        """The model was just used: it stays loaded `keep_alive` seconds from now (None: always;
        0 once asked to unload)."""
        self.last_used = self._idle_since = time.monotonic()
        self._idle_since_wall = time.time()
        self.idle_keep = 0.0 if self.unload_after_use else keep_alive

    def until_unload(self) -> float | None:
        """Seconds until the idle model should be unloaded (<= 0: now), or None when it stays."""
        if not self.resident or self.idle_keep is None:
            return None
        return self._idle_since + self.idle_keep - time.monotonic()

    def expires_at(self) -> float | None:
        """When (time.time()) the idle model unloads, or None when it stays."""
        if not self.resident or self.idle_keep is None:
            return None
        return self._idle_since_wall + self.idle_keep

    def retire(self) -> bool:
        """Mark the weights as leaving memory (no request runs on them: the scheduler checks,
        under its lock); the caller then calls `unload`. False when they were not in memory."""
        if not self.resident:
            return False
        self.resident = False
        self._unloaded.clear()
        return True

    def unload(self, why: str) -> None:
        """Return the weights' memory (retired: no request of this model is admitted). The
        tokenizer, config and description stay, so requests are still accepted; the persisted
        prefix-cache snapshots are written first and found again after the reload."""
        log.info("unloading %s (%s)", self.name, why)
        try:
            if self.prefix_cache is not None:
                self.persist()
                self.prefix_cache.close()
        finally:
            self.prefix_cache, self.batch = None, None
            self._on_release(self)
            self.resident = False
            if self.lm is not None:
                self.lm.model = None  # type: ignore[assignment]
            gc.collect()
            mx.clear_cache()
            self._unloaded.set()
