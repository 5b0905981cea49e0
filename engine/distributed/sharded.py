"""Rank 0's side: the sharded model as the scheduler calls it.

The scheduler calls the model exactly as on one process; this wrapper broadcasts each call as a
plan first, so the followers run the same forward on their mirror of the same cache. Caches are
mirrored by id: a cache made here (mlx-lm's `make_prompt_cache` asks the model's `make_cache`)
gets the next id, and when rank 0 lets it go its id rides along with the next plan so the
followers drop theirs too. The loaded model's `caches` (`MirroredCaches`, the engine's cache
protocol, engine/model_cache.py) make every other cache edit on every rank the same way:
prefix-cache snapshots and the caches restored from them, so reuse works as on one process, the
batch edits of requests decoding together, and the snapshot files, each rank its own shard's
(engine/distributed/snapshots.py). A cache with no twin
on the followers is refused rather than run out of step. Speculative decoding stays off: its draft
model and caches, and the verify step's rollback of rejected tokens, have no plan ops yet.
"""

import itertools
import json
import threading
import weakref
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..errors import EngineError, ModelLoadError
from ..model_cache import LOCAL, Cache, LocalCaches
from ..loading.registry import LoadedModel, load_model, resolve
from ..loading.shardable import check_shardable
from .group import World
from .plan import FileWork, Op, Plan, broadcast
from .snapshots import SnapshotShards


def batch_edit(plan: Plan, caches: dict[int, list[Any]]) -> list[Any] | None:
    """The batch-cache edit `plan` describes, on `caches` by id (every rank runs this); returns
    the new cache of MERGE and EXTRACT."""
    source = caches[plan.cache_id]
    if plan.op == Op.MERGE:
        return LOCAL.merge([source])
    if plan.op == Op.EXTEND:
        LOCAL.extend(caches[plan.target], source)
    elif plan.op == Op.EXTRACT:
        return LOCAL.extract(source, plan.length)
    else:
        LOCAL.filter(source, list(plan.values))
    return None


class MirroredCache(list):
    """A model cache whose twin lives on every follower under `cache_id`."""

    cache_id: int


class MirroredCaches(LocalCaches):
    """The cache protocol for a sharded model: each edit made here, and by a plan on every
    follower's twin. Rows prefill alone (the followers have no plan for a padded prefill)."""

    padded_prefill = False

    def __init__(self, coordinator: "Coordinator", shards: SnapshotShards):
        self.coordinator = coordinator
        self.shards = shards  # engine/prefix_cache/store.py persists through it

    def copy(self, cache: Sequence[Any]) -> Cache:
        return self._mirror(cache, super().copy(cache), None)

    def restore(self, snapshot: Sequence[Any], length: int) -> Cache:
        return self._mirror(snapshot, super().restore(snapshot, length), length)

    def _mirror(self, source: Any, out: Cache, length: int | None) -> MirroredCache:
        """`out`, a copy of `source` (or of its first `length` tokens), made on every rank."""
        made = self.coordinator.adopt(out)
        op = Op.COPY if length is None else Op.RESTORE
        self.coordinator.send(Plan(op, source.cache_id, target=made.cache_id, length=length or 0))
        return made

    def _edit(self, plan: Plan, *involved: MirroredCache) -> MirroredCache | None:
        self.coordinator.send(plan)
        made = batch_edit(plan, {c.cache_id: c for c in involved})
        return self.coordinator.adopt(made, plan.target) if made is not None else None

    def merge(self, caches: Sequence[Sequence[Any]]) -> Cache:
        """Merged one cache at a time (one plan each), the later ones extending the first."""
        merged = [self._edit(Plan(Op.MERGE, c.cache_id, target=self.coordinator.next_id()), c)
                  for c in caches]
        for rows in merged[1:]:
            self.extend(merged[0], rows)
        return merged[0]

    def extend(self, batch: Cache, rows: Cache) -> None:
        self._edit(Plan(Op.EXTEND, rows.cache_id, target=batch.cache_id), batch, rows)

    def extract(self, batch: Cache, i: int) -> Cache:
        return self._edit(Plan(Op.EXTRACT, batch.cache_id, target=self.coordinator.next_id(),
                               length=i), batch)

    def filter(self, batch: Cache, keep: list[int]) -> None:
        self._edit(Plan(Op.FILTER, batch.cache_id, values=keep), batch)


def cache_offset(cache: list[Any]) -> int:
    """Tokens held by the first layer that counts them (every rank checks it before a forward)."""
    return next((int(c.offset) for c in cache if isinstance(getattr(c, "offset", None), int)), 0)


class Coordinator:
    """Rank 0's end of the plan channel; one caller at a time (the scheduler thread)."""

    def __init__(self, world: World):
        self.world = world
        self._ids = itertools.count(1)
        self._dropped: list[int] = []
        self._work: list[FileWork] = []
        self._files: SnapshotShards | None = None  # the loaded model's snapshot files
        # reentrant: a cache collected while the lock is held (a garbage collection) releases
        # its id under it
        self._lock = threading.RLock()
        self.steps = 0  # plans sent
        self.ring: Callable[[int], None] | None = None  # the followers' doorbell (heartbeat.py)
        self.refused = ""  # why the last load was refused before any follower loaded (one line)

    def new_cache(self, model: nn.Module) -> MirroredCache:
        return self.adopt(make_prompt_cache(model))

    def next_id(self) -> int:
        return next(self._ids)

    def adopt(self, layers: list[Any], cache_id: int | None = None) -> MirroredCache:
        """`layers` under `cache_id` (default: the next id); its twins are dropped when rank 0
        lets it go."""
        cache = MirroredCache(layers)
        cache.cache_id = cache_id or self.next_id()
        weakref.finalize(cache, self._release, cache.cache_id)
        return cache

    def _release(self, cache_id: int) -> None:
        with self._lock:
            self._dropped.append(cache_id)

    def use_files(self, files: SnapshotShards | None) -> None:
        """From now on only `files` (the loaded model's) hands file work to the followers."""
        with self._lock:
            self._files = files

    def file_work(self, files: SnapshotShards, work: FileWork) -> None:
        """Queue `work` for the next plan, unless it comes from a model no longer loaded (its
        caches are gone from the followers; the next CHECK drops rank 0's file then)."""
        with self._lock:
            if files is self._files:
                self._work.append(work)

    def send(self, plan: Plan) -> Plan:
        with self._lock:
            plan.drops, self._dropped = self._dropped, []
            plan.files, self._work = self._work, []
        self.steps += 1
        if self.ring is not None:  # followers sleep until their doorbell rings (heartbeat.py)
            self.ring(self.steps)
        return broadcast(self.world.group, plan)


class ShardedModel:
    """Looks like the model to the engine; each call is broadcast before it runs here."""

    def __init__(self, model: nn.Module, coordinator: Coordinator):
        self.model = model
        self.coordinator = coordinator

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def make_cache(self) -> list[Any]:
        return self.coordinator.new_cache(self.model)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kwargs: Any) -> mx.array:
        if not isinstance(cache, MirroredCache) or kwargs:
            raise EngineError("a sharded model runs only plain requests on caches it made "
                              "(no prefix cache, batching or speculative decoding)")
        sent = self.coordinator.send(Plan(Op.FORWARD, cache.cache_id, tuple(inputs.shape),
                                          cache_offset(cache), tokens=inputs))
        out = self.model(sent.tokens.astype(inputs.dtype), cache=cache)
        # Every rank must run this call's collectives now and in this order, even if the caller
        # ends up not reading the result (a cancelled request).
        mx.async_eval(out)
        return out


def sharded_loader(world: World, coordinator: Coordinator) -> Callable[..., LoadedModel]:
    """`Engine(load=...)` for rank 0: every rank loads the same folder and shards it."""

    def load(name: str | None, *, fallback_to_default: bool = False,
             int8_activations: bool | None = None) -> LoadedModel:  # shards take no CPU layout
        display, folder = resolve(name)  # a bad name fails here, before any follower loads
        try:  # and a model the group cannot split: every rank leaves with the same line
            config = json.loads((folder / "config.json").read_text())
            check_shardable(display, config, world.size)
        except ModelLoadError as exc:
            coordinator.refused = str(exc)
            raise
        except (OSError, ValueError):
            pass  # load_model says what is wrong with the folder
        coordinator.refused = ""
        coordinator.use_files(None)  # the file work queued so far rides along with the LOAD
        coordinator.send(Plan(Op.LOAD, name=str(folder)))
        lm = load_model(str(folder), group=world.group)
        lm.name = display  # as the picker lists it (a hub model's folder is a snapshot hash)
        shards = SnapshotShards(world, coordinator, lm.model)
        coordinator.use_files(shards)
        lm.model = ShardedModel(lm.model, coordinator)
        lm.caches = MirroredCaches(coordinator, shards)
        return lm

    return load
