"""One protocol for what the engine does with a model's cache (a list of mlx-lm layer caches, one per
layer), and its implementation over mlx-lm's caches on one process.

`CacheOps` is everything the prefix cache (engine/prefix_cache/store.py), the decode batch
(engine/scheduling/batch.py) and speculative decoding ask of a cache: compact snapshot copies and
restores from them, the batch edits (merge, extend, extract, filter), whether it can be trimmed,
and its size. A model's `LoadedModel.caches` says which implementation serves it: `LOCAL` here, or
a sharded model's mirrored one (engine/distributed/sharded.py), which makes every edit on every
rank. A new kind of cache is a new `LayerKind` or a new `CacheOps`, never a type switch at the
callers (the 8-bit KV cache, kv8.py, is the `KV8` kind).

A batch's keys and values are our `SlotKVCache` (engine/slot_cache.py; `SlotKV8Cache` for the
8-bit cache): rows joining and leaving copy only themselves. Other layers' batch caches are
mlx-lm's (`ArraysCache` stacks recurrent state).
"""

from typing import Any, Iterator, Protocol, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, QuantizedKVCache

from .kernels.kv8 import BITS, GROUP_SIZE, KV8Cache, SlotKV8Cache
from .slot_cache import SlotKVCache, filter_rows

Cache = list[Any]  # one mlx-lm cache object per layer
# one layer's arrays as a snapshot file stores them: its kind's name and the arrays
Layer = tuple[str, list[mx.array | None]]


class LayerKind(Protocol):
    """One kind of layer cache the prefix cache can snapshot."""

    name: str  # as snapshot files record it

    def arrays(self, layer: Any) -> list[mx.array | None]:
        """The arrays `layer` holds, as they are (no MLX op: safe on any thread)."""

    def held(self, layer: Any) -> list[mx.array | None]:
        """Its arrays cut to the tokens it holds, as a snapshot stores them."""

    def copy(self, layer: Any) -> Any:
        """A compact private copy (not yet evaluated)."""

    def restore(self, layer: Any, length: int) -> Any:
        """A new layer cache holding the first `length` tokens of the snapshot `layer`."""

    def from_arrays(self, arrays: list[mx.array | None], length: int) -> Any:
        """A layer cache from the `arrays` of a snapshot of `length` tokens."""

    def length(self, layer: Any) -> int | None:
        """Tokens it holds, or None when it cannot tell (recurrent state)."""

    def reset(self, layer: Any, arrays: list[mx.array | None]) -> None:
        """Put back the `arrays` it held earlier (a rollback of a layer that cannot trim)."""


class _KV:
    """mlx-lm's `KVCache`: keys and values, written into a buffer of several tokens' room; or,
    as `KV8`, the 8-bit cache (kv8.py: the same class holding packed rows)."""

    name = "KVCache"
    cls: type[KVCache] = KVCache

    def arrays(self, layer: KVCache) -> list[mx.array | None]:
        return [layer.keys, layer.values]

    def held(self, layer: KVCache) -> list[mx.array | None]:
        n = layer.offset
        return [None if a is None else a[..., :n, :] for a in (layer.keys, layer.values)]

    def copy(self, layer: KVCache) -> KVCache:
        keys, values = (None if a is None else mx.contiguous(a) for a in self.held(layer))
        return self.cls.from_state((keys, values, layer.offset))

    def restore(self, layer: KVCache, length: int) -> KVCache:
        keys, values = (None if a is None else a[..., :length, :] for a in (layer.keys, layer.values))
        return self.cls.from_state((keys, values, length))

    def from_arrays(self, arrays: list[mx.array | None], length: int) -> KVCache:
        return self.cls.from_state((arrays[0], arrays[1], length))

    def length(self, layer: KVCache) -> int | None:
        return layer.offset

    def reset(self, layer: KVCache, arrays: list[mx.array | None]) -> None:
        layer.keys, layer.values = arrays


class _Arrays:
    """mlx-lm's `ArraysCache`: recurrent state (linear attention), valid at one length only."""

    name = "ArraysCache"

    def arrays(self, layer: ArraysCache) -> list[mx.array | None]:
        return list(layer.cache)

    def held(self, layer: ArraysCache) -> list[mx.array | None]:
        return self.arrays(layer)

    def copy(self, layer: ArraysCache) -> ArraysCache:
        return self.from_arrays([None if a is None else mx.contiguous(a) for a in layer.cache], 0)

    def restore(self, layer: ArraysCache, length: int) -> ArraysCache:
        # fresh array objects: the request's in-place writes rebind its own arrays
        return self.from_arrays([None if a is None else a[...] for a in layer.cache], length)

    def from_arrays(self, arrays: list[mx.array | None], length: int) -> ArraysCache:
        return ArraysCache.from_state((list(arrays), None, None))

    def length(self, layer: ArraysCache) -> int | None:
        return None

    def reset(self, layer: ArraysCache, arrays: list[mx.array | None]) -> None:
        layer.cache = list(arrays)


class _KV8(_KV):
    name = "KV8Cache"
    cls = KV8Cache


class _Quantized:
    """mlx-lm's `QuantizedKVCache` (the 8-bit cache on the GPU and in half precision, kv8.py):
    keys and values each a (codes, scales, biases) triple at kv8's bits; the group size follows
    from the arrays' widths, and the snapshot's `kv_format` records it."""

    name = "QuantizedKVCache"

    def arrays(self, layer: QuantizedKVCache) -> list[mx.array | None]:
        if layer.keys is None:
            return [None] * 6
        return [*layer.keys, *layer.values]

    def held(self, layer: QuantizedKVCache) -> list[mx.array | None]:
        return self._cut(self.arrays(layer), layer.offset)

    def copy(self, layer: QuantizedKVCache) -> QuantizedKVCache:
        held = [None if a is None else mx.contiguous(a) for a in self.held(layer)]
        return self.from_arrays(held, layer.offset)

    def restore(self, layer: QuantizedKVCache, length: int) -> QuantizedKVCache:
        return self.from_arrays(self._cut(self.arrays(layer), length), length)

    def from_arrays(self, arrays: list[mx.array | None], length: int) -> QuantizedKVCache:
        codes, scales = arrays[0], arrays[1]
        group = GROUP_SIZE if codes is None else codes.shape[-1] * (32 // BITS) // scales.shape[-1]
        layer = QuantizedKVCache(group_size=group, bits=BITS)
        self.reset(layer, arrays)
        layer.offset = length
        return layer

    def length(self, layer: QuantizedKVCache) -> int | None:
        return layer.offset

    def reset(self, layer: QuantizedKVCache, arrays: list[mx.array | None]) -> None:
        if arrays[0] is None:
            layer.keys = layer.values = None
        else:
            layer.keys, layer.values = tuple(arrays[:3]), tuple(arrays[3:])

    @staticmethod
    def _cut(arrays: list[mx.array | None], n: int) -> list[mx.array | None]:
        return [None if a is None else a[..., :n, :] for a in arrays]


KINDS: dict[type, LayerKind] = {KVCache: _KV(), KV8Cache: _KV8(), QuantizedKVCache: _Quantized(),
                                ArraysCache: _Arrays()}
# the kinds whose arrays are (batch, heads, tokens, ...): snapshot files check their token axis
KV_KINDS = frozenset({_KV.name, _KV8.name, _Quantized.name})
_BY_NAME = {kind.name: kind for kind in KINDS.values()}


def kind_of(layer: Any) -> LayerKind | None:
    """The snapshot kind of exactly this layer cache's class (subclasses, rotating caches, and
    quantized ones at other bits than kv8's have none)."""
    if isinstance(layer, QuantizedKVCache) and layer.bits != BITS:
        return None
    return KINDS.get(type(layer))


# The decode batch's cache of each kind of one sequence's keys and values (the kind each gives a
# row back as: its `row_cache`).
BATCH_CACHE: dict[type, type] = {c.row_cache: c for c in (SlotKVCache, SlotKV8Cache)}


def plain_kv(layer: Any) -> bool:
    """Exactly mlx-lm's `KVCache` or our 8-bit `KV8Cache` (one sequence's keys and values; not
    another subclass, mlx-lm's quantized or rotating cache), whose layout our attention kernels
    know."""
    return type(layer) in BATCH_CACHE


def batch_kv(layer: Any) -> bool:
    """Exactly mlx-lm's `BatchKVCache` or one of ours (`BATCH_CACHE`): rows right-aligned at a
    shared index, each from its `left_padding` on, whose layout our attention kernels know."""
    return type(layer) is BatchKVCache or type(layer) in BATCH_CACHE.values()


def trimmable(cache: Sequence[Any]) -> bool:
    """Whether every layer can be cut back to fewer tokens (mlx-lm's `is_trimmable`)."""
    return all(c.is_trimmable() for c in cache)


def rollback_mark(cache: Sequence[Any]) -> tuple[list | None, ...] | None:
    """What rolling `cache` back needs beyond trimming: each untrimmable layer's arrays as they are
    now (references to immutable arrays: free), None for the layers that trim; None when every
    layer trims."""
    if trimmable(cache):
        return None
    return tuple(None if c.is_trimmable() else KINDS[type(c)].arrays(c) for c in cache)


def can_roll_back(layer: Any) -> bool:
    """Whether a layer can be trimmed, or its arrays put back (`rollback_mark`, `roll_back`)."""
    return layer.is_trimmable() or kind_of(layer) is not None


def roll_back(layer: Any, arrays: list | None, tokens: int) -> None:
    """Trim `tokens` off a trimmable layer, or put back the `arrays` of an untrimmable one."""
    if arrays is None:
        layer.trim(tokens)
    else:
        KINDS[type(layer)].reset(layer, arrays)


class CacheOps(Protocol):
    """What the engine does with a model's caches; see the module's docstring."""

    # whether rows of several requests may prefill in one padded call (mlx-lm's batch caches'
    # `prepare` / `finalize` on the merged cache)
    padded_prefill: bool
    # a sharded model's per-rank snapshot files (engine/distributed/snapshots.py), else None
    shards: Any

    def supported(self, cache: Sequence[Any]) -> bool:
        """Whether the prefix cache can snapshot this cache."""

    def mergeable(self, cache: Sequence[Any]) -> bool:
        """Whether this cache can join a decode batch (quantized or chunked caches cannot)."""

    def copy(self, cache: Sequence[Any]) -> Cache:
        """Compact private copies of every layer's state, evaluated (a snapshot)."""

    def restore(self, snapshot: Sequence[Any], length: int) -> Cache:
        """A new cache for a request holding the first `length` tokens of `snapshot`: every array
        a fresh object, so the request's in-place writes never reach the snapshot."""

    def merge(self, caches: Sequence[Sequence[Any]]) -> Cache:
        """One batch cache holding `caches` as its rows, in order (left-padded)."""

    def extend(self, batch: Cache, rows: Cache) -> None:
        """Append the rows of the batch cache `rows` to `batch`."""

    def extract(self, batch: Cache, i: int) -> Cache:
        """Row `i` of `batch` as a cache of its own."""

    def filter(self, batch: Cache, keep: list[int]) -> None:
        """Keep only rows `keep` of `batch`, in place."""

    def trimmable(self, cache: Sequence[Any]) -> bool:
        """Whether every layer can be cut back to fewer tokens."""

    def nbytes(self, cache: Sequence[Any]) -> int:
        """The bytes a snapshot's arrays hold."""


class LocalCaches:
    """`CacheOps` over mlx-lm's caches in this process."""

    padded_prefill = True
    shards = None

    def supported(self, cache: Sequence[Any]) -> bool:
        return all(kind_of(c) is not None for c in cache)

    def mergeable(self, cache: Sequence[Any]) -> bool:
        return all(hasattr(c, "merge") for c in cache)

    def copy(self, cache: Sequence[Any]) -> Cache:
        out = [KINDS[type(c)].copy(c) for c in cache]
        mx.eval(list(_arrays(out)))
        return out

    def restore(self, snapshot: Sequence[Any], length: int) -> Cache:
        return [KINDS[type(c)].restore(c, length) for c in snapshot]

    def merge(self, caches: Sequence[Sequence[Any]]) -> Cache:
        """Each layer's rows merged by its batch cache (`BATCH_CACHE`, else mlx-lm's: the layer's
        own `merge`)."""
        layers = [[cache[i] for cache in caches] for i in range(len(caches[0]))] if caches else []
        return [BATCH_CACHE[type(rows[0])].merge(rows) if plain_kv(rows[0]) else rows[0].merge(rows)
                for rows in layers]

    def extend(self, batch: Cache, rows: Cache) -> None:
        for batch_layer, row_layer in zip(batch, rows):
            batch_layer.extend(row_layer)

    def extract(self, batch: Cache, i: int) -> Cache:
        return [layer.extract(i) for layer in batch]

    def filter(self, batch: Cache, keep: list[int]) -> None:
        filter_rows([layer for layer in batch if isinstance(layer, SlotKVCache)], keep)
        rows = mx.array(keep)
        for layer in batch:
            if not isinstance(layer, SlotKVCache):
                layer.filter(rows)

    def trimmable(self, cache: Sequence[Any]) -> bool:
        return trimmable(cache)

    def nbytes(self, cache: Sequence[Any]) -> int:
        return sum(a.nbytes for a in _arrays(cache))


LOCAL = LocalCaches()


def _arrays(cache: Sequence[Any]) -> Iterator[mx.array]:
    for c in cache:
        yield from (a for a in KINDS[type(c)].arrays(c) if a is not None)


def snapshot_layers(snapshot: Sequence[Any]) -> list[Layer]:
    """A snapshot's arrays by layer, as they are (no MLX op: safe on another thread)."""
    return [(KINDS[type(c)].name, KINDS[type(c)].arrays(c)) for c in snapshot]


def held_layers(cache: Sequence[Any]) -> list[Layer]:
    """A cache's arrays by layer, cut to the tokens each holds (lazy slices)."""
    return [(KINDS[type(c)].name, KINDS[type(c)].held(c)) for c in cache]


def from_layers(layers: Sequence[Layer], length: int) -> Cache:
    """The cache a snapshot file's layers describe, holding `length` tokens."""
    return [_BY_NAME[name].from_arrays(arrays, length) for name, arrays in layers]


def cache_length(cache: Sequence[Any]) -> int | None:
    """Tokens held by the layers that count them (None when none does, or they disagree)."""
    lengths = {n for c in cache if (n := KINDS[type(c)].length(c)) is not None}
    return lengths.pop() if len(lengths) == 1 else None
