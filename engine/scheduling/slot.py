"""The engine's model slot: the one loaded model, the decode batch and prefix cache it owns, its
loading, switching and unloading after an idle time.

Every method runs on the scheduler thread (the draft loader's `ensure_resident` excepted, as
before), with no request running when the model changes.
"""

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx

from ..decoding.defaults import ModelDefaults, resolve_defaults
from ..decoding.drafts import DraftChoice, draft_choices
from ..errors import EngineError
from ..kernels.layout import int8_activations_of
from ..loading.memory import weight_files_bytes
from ..loading.progress import LoadCallback, report, reporting
from ..loading.registry import LoadedModel, ModelInfo, capabilities, list_models
from .batch import DecodeBatch, KVFootprint, kv_footprint

log = logging.getLogger(__name__)

PERSIST_BYTES = 512 * 2**20  # prefix-cache snapshots written to disk at shutdown and unload

_NONE = object()  # no model was loaded (None itself names the bundled model)


@dataclass(frozen=True)
class ModelDescription:
    """The loaded model as callers see it: what it is and which drafts it can speculate with."""

    name: str
    family: str  # the config's model_type, e.g. "llama", "qwen3_5"
    context_length: int
    drafts: tuple[DraftChoice, ...]
    defaults: ModelDefaults  # each sampling option's default for this model, with its source
    capabilities: tuple[str, ...] = ("completion",)  # engine.loading.registry.CAPABILITIES
    # On our CPU kernels, whether it takes int8 activations; None where it does not run on them
    # (the GPU, the fp32 layout, a sharded or vision model): the choice does not apply to it.
    int8_activations: bool | None = None


class ModelSlot:
    """Holds the loaded model (also while its weights are unloaded after an idle time: the
    tokenizer, config and description stay) and the parts that live with its weights."""

    def __init__(self, load: Callable[..., LoadedModel], *, fallback_to_default: bool,
                 prefix_cache: bool, persist_prefix_cache: bool,
                 cache_budget: Callable[[], int], on_release: Callable[[], None],
                 int8_activations: bool | None = None):
        """`cache_budget()`: the bytes the prefix cache may hold now; `on_release()`: called when
        the weights go (a switch or an unload), e.g. to drop the drafts kept for them.
        `int8_activations`: the choice every load takes until `install` changes it (None: the
        process's default, `--int8-activations`)."""
        self._load = load
        self.int8_activations = int8_activations
        self.fallback_to_default = fallback_to_default
        self.use_prefix_cache = prefix_cache
        self.persist_prefix_cache = persist_prefix_cache
        self._cache_budget = cache_budget
        self._on_release = on_release
        self.lm: LoadedModel | None = None
        self.prefix_cache = None
        self.batch: DecodeBatch | None = None
        self.footprint = KVFootprint(0, 0, False)
        self.described: ModelDescription | None = None
        self.resident = False  # the weights are in memory
        self._loaded_name: str | None = None  # as passed to `load`, for reloading after an unload
        self._opened: dict[str, ModelInfo] = {}  # models loaded from a path, by display name
        self._idle_since = time.monotonic()
        self.idle_keep: float | None = None

    # -- what is loaded --------------------------------------------------------------------------
    def path_of(self, name: str) -> str:
        """`name` as `load` takes it: the path of a model this slot loaded from one."""
        opened = self._opened.get(name)
        return opened.path if opened is not None and opened.path else name

    def list_models(self) -> list[ModelInfo]:
        """The local models, then those loaded from a folder or GGUF path, then the loaded one."""
        found = {m.name: m for m in list_models()}
        for m in self._opened.values():
            found.setdefault(m.name, m)
        if self.lm is not None:  # always listed, however it was loaded
            found.setdefault(self.lm.name, ModelInfo(self.lm.name, "folder", str(self.lm.path), None,
                                                     vision="vision" in self.lm.extras))
        return list(found.values())

    # -- loading and switching -------------------------------------------------------------------
    def install(self, name: str | None, progress: LoadCallback | None,
                keep_alive: float | None, int8_activations: bool | None = None) -> None:
        """Replace the model by `name`, with int8 activations on or off from now on where given
        (None: as before), its stages reported to `progress` (engine/loading/progress.py); a
        model that cannot load raises its EngineError with the previous model loaded again, as
        it was."""
        with reporting(progress):
            self._install(name, keep_alive, int8_activations)

    def _install(self, name: str | None, keep_alive: float | None,
                 int8_activations: bool | None) -> None:
        choice = self.int8_activations
        if int8_activations is not None:
            self.int8_activations = int8_activations
        previous = self._loaded_name if self.lm is not None else _NONE
        old, self.lm, self.prefix_cache, self.batch = self.lm, None, None, None
        self._on_release()
        del old
        mx.clear_cache()
        self.described, self.resident = None, False
        try:
            loaded = self._load(name, fallback_to_default=self.fallback_to_default,
                                int8_activations=self.int8_activations)
        except EngineError:
            self.int8_activations = choice
            if previous is not _NONE:  # keep serving the model that was loaded, then say why
                log.warning("could not load %s; reloading %s", name, previous)
                with reporting(None):
                    self._install(previous, keep_alive, None)  # type: ignore[arg-type]
            raise
        # Our own record of it: an idle unload empties its `model`, never the caller's object.
        self.lm = lm = dataclasses.replace(loaded)
        self._loaded_name = name
        if name and Path(name).expanduser().exists():
            path = Path(name).expanduser()
            self._opened[lm.name] = ModelInfo(
                lm.name, "gguf" if path.is_file() else "folder", str(path),
                weight_files_bytes([path] if path.is_file() else path.glob("*")),
                vision="vision" in lm.extras)
        self.footprint = kv_footprint(lm.model, lm.caches)
        self._make_resident_parts()
        self.described = ModelDescription(
            name=lm.name, family=lm.family, context_length=lm.context_length,
            drafts=draft_choices(lm), defaults=resolve_defaults(lm.name, lm.path, lm.family),
            capabilities=capabilities(lm), int8_activations=int8_activations_of(lm.model))
        self.touch(keep_alive)
        report("ready")

    def _make_resident_parts(self) -> None:
        """The decode batch and prefix cache of the model whose weights are in `self.lm`."""
        self.batch = DecodeBatch(self.lm.model, self.lm.caches)
        if self.use_prefix_cache:
            from ..prefix_cache.store import PrefixCache, default_persist_dir

            persist_dir = default_persist_dir() if self.persist_prefix_cache else None
            self.prefix_cache = PrefixCache(self.lm, persist_dir=persist_dir,
                                            budget_bytes=self._cache_budget)
        self.resident = True

    def persist(self) -> None:
        """Write the prefix cache's snapshots to disk, if asked to keep them."""
        if self.prefix_cache is not None and self.persist_prefix_cache:
            self.prefix_cache.persist(max_bytes=PERSIST_BYTES)

    # -- idle unload -----------------------------------------------------------------------------
    def touch(self, keep_alive: float | None) -> None:
        """The model was just used: it stays loaded `keep_alive` seconds from now (None: always)."""
        self._idle_since = time.monotonic()
        self.idle_keep = keep_alive

    def until_unload(self) -> float | None:
        """Seconds until the idle model should be unloaded (<= 0: now), or None when it stays."""
        if not self.resident or self.idle_keep is None:
            return None
        return self._idle_since + self.idle_keep - time.monotonic()

    def unload(self) -> None:
        """Idle: return the weights' memory. The tokenizer, config and description stay, so
        requests are still accepted; the persisted prefix-cache snapshots are written first and
        found again after the reload."""
        log.info("unloading %s after %.0f s idle", self.lm.name if self.lm else None,
                 self.idle_keep or 0)
        if self.prefix_cache is not None:
            self.persist()
            self.prefix_cache.close()
        self.prefix_cache, self.batch = None, None
        self._on_release()
        self.resident = False
        assert self.lm is not None
        self.lm.model = None  # type: ignore[assignment]
        gc.collect()
        mx.clear_cache()

    def ensure_resident(self) -> bool:
        """Reload the weights of a model unloaded after an idle time; True when it did (the
        requests that waited for them then take its new prefix cache)."""
        if self.resident or self.lm is None:
            return False
        log.info("reloading %s", self.lm.name)
        fresh = self._load(self._loaded_name, fallback_to_default=False,
                           int8_activations=self.int8_activations)
        self.lm.model, self.lm.caches, self.lm.compute = fresh.model, fresh.caches, fresh.compute
        del fresh
        self._make_resident_parts()
        return True
