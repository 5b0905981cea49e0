"""The decode batch's KV cache: rows that stay where they are while others join and leave.

mlx-lm's `BatchKVCache` keeps a batch's keys and values in arrays of exactly its rows, left-padded
to a common length: a row joining builds new arrays of every row (`extend`), a row leaving
gathers the kept rows into new ones (`filter`). On the H200 a join at 32 rows cost 9-18 ms, as
much as a decode step (bench/results/cuda-h200-2026-issue33-8b-run6.log).

`SlotKVCache` keeps mlx-lm's layout, so everything that reads a `BatchKVCache` reads it unchanged:
every row right-aligned at the shared write index `_idx`, its own `left_padding` (its first
token's column) and `offset` (its length), which mlx-lm's models use (`make_mask`,
`update_and_fetch`) and from which our CPU kernels' one-op step reads each row
(engine/kernels/layout.py). What changes is that its buffers have room for rows as for tokens:
the batch's rows are the buffers' first `rows` rows (slots); the slots past them are free.

- A row joining is written into the first free slot, right-aligned at `_idx`: only its own keys
  and values are copied. Every row moves (one copy, into new buffers) only when the joining row
  holds more tokens than `_idx` (every row must then start further right) or no slot is free
  (the buffers then get `slots_for` rows: a quarter more, at least ROOM_ROWS more). `merge`
  leaves no free slot; a decode step's growth of the token axis (below) adds them.
- Rows leaving free their slots: `filter` keeps rows in any order, copying only the rows whose
  slot changes, and `keep_order` is the order that moves fewest (each hole below the new row
  count takes one of the last rows), which the decode batch asks for. The buffers are rebuilt to
  the kept rows' size only when they are far too large (`_oversized`: twice the slots the rows
  would get, or more unused columns, before every row's first token, than used ones), so one copy
  follows many leaves.
- The token axis grows by mlx-lm's step (256 positions) when `_idx` reaches the end. That growth
  copies every row, as mlx-lm's does (a one-token step's growth also makes `slots_for` slots),
  keeping every row where it is: it happens inside a model call, after mlx-lm's model built the
  step's mask from the layout as it was. (Moving the rows left there, over columns no row uses,
  had given a mask wider than the keys once the longest row had left.) Those columns go when
  rows leave and the buffers are far too large (`_oversized`).

Each row's `padding` is kept on the host, so no edit reads the device (mlx-lm's `filter` and
`extract` read `left_padding` back, a wait behind the step in flight on a GPU). A row's arithmetic
is what it would be anywhere: our CPU kernels read each row from its own first token on, and
mlx-lm's masked attention over the padding columns adds zeros.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

ROOM_ROWS = 1  # free slots a growth leaves at least


def slots_for(rows: int) -> int:
    """The slots buffers get that must hold `rows` rows: a quarter more (at least ROOM_ROWS more),
    so a batch growing one row at a time reallocates every few joins at first, then more rarely."""
    return rows + max(ROOM_ROWS, rows // 4)


def keep_order(rows: int, leaving: Sequence[int]) -> list[int]:
    """The rows kept when `leaving` leave a batch of `rows` rows, in the order that moves fewest
    in a `SlotKVCache`: rows stay where they are, except that each hole below the new row count
    takes one of the kept rows past it (in their order)."""
    gone = set(leaving)
    n = rows - len(gone)
    movers = iter(i for i in range(n, rows) if i not in gone)
    return [next(movers) if i in gone else i for i in range(n)]


class SlotKVCache(BatchKVCache):
    """A batch of rows' keys and values in buffers with free slots (see the module docstring)."""

    row_cache: type[KVCache] = KVCache  # what `extract` gives a row as

    def __init__(self, left_padding: list[int]):
        super().__init__(left_padding)
        self.padding = list(left_padding)  # the host's copy of `left_padding`

    @property
    def rows(self) -> int:
        return len(self.padding)

    @property
    def slots(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def _sync(self) -> None:
        """`left_padding` and `offset` from the host's padding (a row's offset is its length:
        `_idx` less its padding, which every update keeps)."""
        self.left_padding = mx.array(self.padding)
        self.offset = mx.array([self._idx - p for p in self.padding])

    def _width(self, used: int, tokens: int = 1) -> int:
        """Buffer positions for `used` columns and `tokens` more: mlx-lm's steps of `step`."""
        return used + (self.step + tokens - 1) // self.step * self.step

    def _rebuild(self, slots: int, idx: int, width: int, like: tuple[mx.array, mx.array]) -> None:
        """New buffers of `slots` rows and `width` positions holding the rows right-aligned at
        `idx` (each row's columns moved by `idx - _idx`); `like` gives the heads, head size and
        dtype when there are no buffers yet."""
        moved = []
        for old, template in zip((self.keys, self.values), like):
            _, heads, _, dim = template.shape
            new = mx.zeros((slots, heads, width, dim), template.dtype)
            if old is not None and self.rows:
                first = min(self.padding)  # the columns before it hold no row's token
                used = self._idx - first
                new[: self.rows, :, idx - used : idx, :] = old[: self.rows, :, first : self._idx, :]
            moved.append(new)
        self.keys, self.values = moved
        self.padding = [p + idx - self._idx for p in self.padding]
        self._idx = idx

    def _longest(self) -> int:
        """The most tokens a row holds (0 before any is written: a prepared padding may lie
        past `_idx`)."""
        return max(0, self._idx - min(self.padding)) if self.padding else 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """mlx-lm's: append `keys` and `values` (one entry per row) at `_idx`; every row's keys and
        values up to it. Buffers without room grow by mlx-lm's step (`reserve`)."""
        tokens = keys.shape[2]
        self.reserve(tokens, (keys, values))
        prev, rows = self._idx, self.rows
        self.advance(tokens)
        self.keys[:rows, :, prev : self._idx, :] = keys
        self.values[:rows, :, prev : self._idx, :] = values
        return self.keys_and_values()

    def reserve(self, tokens: int, like: tuple[mx.array, mx.array]) -> None:
        """Room in the buffers for `tokens` more columns at `_idx` (`like`: keys and values of
        the new tokens, for the heads, head size and dtype where there are no buffers yet). A
        kernel writing the new column in place itself (engine/kernels/batch_attention.py's
        `attention_rows`) calls this, then `advance`."""
        if self.keys is None or self._idx + tokens > self.keys.shape[2]:
            # a decode step's growth (one token) also leaves free slots, so that the batch's first
            # join after it forms (`merge` leaves none) writes in place; a prompt chunk's does not
            # the rows stay where they are (`_idx` kept): mlx-lm's model built this step's mask
            # from the layout before its first layer got here
            rows = slots_for(self.rows) if tokens == 1 else self.rows
            self._rebuild(max(self.slots, rows), self._idx, self._width(self._idx, tokens), like)

    def advance(self, tokens: int, offset: mx.array | None = None) -> None:
        """Every row holds `tokens` more (written at the old `_idx`); `offset`: the rows' new
        offsets where the kernel that wrote the columns computed them (else one add here)."""
        self._idx += tokens
        self.offset = self.offset + tokens if offset is None else offset

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        rows = self.rows
        return self.keys[:rows, :, : self._idx, :], self.values[:rows, :, : self._idx, :]

    def prepare(self, *, left_padding: list[int] | None = None, lengths: list[int] | None = None,
                right_padding: list[int] | None = None) -> None:
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
        if left_padding is not None:
            self.padding = [p + q for p, q in zip(self.padding, left_padding)]

    def finalize(self) -> None:
        """mlx-lm's: after a prefill whose rows were right-padded, move their padding left."""
        right = self._right_padding  # made from the host's list: reading it does not wait
        if right is None:
            return
        if self.slots != self.rows:  # mlx-lm rolls every row of the buffers
            self.keys, self.values = self.keys[: self.rows], self.values[: self.rows]
        super().finalize()
        self.padding = [p + q for p, q in zip(self.padding, right.tolist())]

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v
        self.padding = self.left_padding.tolist()

    def extend(self, other: BatchKVCache) -> None:
        """Append the rows of `other` (a batch cache of the joining rows) in free slots, each
        right-aligned at `_idx`."""
        theirs = other.padding if isinstance(other, SlotKVCache) else other.left_padding.tolist()
        lengths = [other._idx - p for p in theirs]
        rows, joined = self.rows, self.rows + len(theirs)
        no_room = self.keys is not None and joined > self.slots
        longer = other.keys is not None and (self.keys is None or max(lengths) > self._idx)
        if no_room or longer:
            idx = max(self._longest(), *lengths)  # and no column before every row's first token
            slots = max(self.slots, slots_for(joined) if joined > self.slots else 0)
            like = (self.keys, self.values) if self.keys is not None else (other.keys, other.values)
            self._rebuild(slots, idx, self._width(idx), like)
        if other.keys is not None:
            first = min(theirs)
            used = other._idx - first
            span = slice(self._idx - used, self._idx)
            self.keys[rows:joined, :, span, :] = other.keys[: len(theirs), :, first : other._idx, :]
            self.values[rows:joined, :, span, :] = other.values[: len(theirs), :, first : other._idx, :]
        self.padding += [self._idx - n for n in lengths]
        self._sync()

    def filter(self, batch_indices: mx.array | Sequence[int]) -> None:
        """Keep only the rows `batch_indices`, in that order (`filter_rows`)."""
        filter_rows([self], batch_indices)

    def _oversized(self) -> bool:
        """Whether the buffers are far larger than the rows need (see the module docstring)."""
        if self.keys is None or not self.rows:
            return False
        unused = min(self.padding)
        return self.slots >= 2 * slots_for(self.rows) or 2 * unused > self._idx

    def extract(self, idx: int) -> KVCache:
        """Row `idx` as a cache of its own (`row_cache`), its keys and values copied."""
        cache = self.row_cache()
        first = self.padding[idx]
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, first : self._idx])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, first : self._idx])
        cache.offset = self._idx - first
        return cache

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> "SlotKVCache":
        """One batch of `caches` (one sequence each) as its rows, right-aligned at the longest's
        length, with no free slot (mlx-lm's merge, as this class)."""
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        out = cls([longest - n for n in lengths])
        held = [c for c in caches if c.keys is not None]
        if longest == 0 or not held:
            return out
        keys, values = held[0].keys, held[0].values
        out.keys = mx.zeros((len(caches), keys.shape[1], longest, keys.shape[3]), keys.dtype)
        out.values = mx.zeros((len(caches), values.shape[1], longest, values.shape[3]), values.dtype)
        for i, (c, n) in enumerate(zip(caches, lengths)):
            if n:
                out.keys[i : i + 1, :, longest - n :, :] = c.keys[..., :n, :]
                out.values[i : i + 1, :, longest - n :, :] = c.values[..., :n, :]
        out._idx = longest
        out._sync()
        return out


def filter_rows(layers: Sequence[SlotKVCache], batch_indices: mx.array | Sequence[int]) -> None:
    """Keep only the rows `batch_indices` of every layer, in that order: the rows whose slot
    changes are copied (`keep_order` gives the order that copies fewest), the others stay. The
    rows that move are copied out first, for all layers with one wait: MLX writes into a buffer in
    place only when nothing else holds it, and a pending copy out of it would (the write would
    then copy the whole buffer)."""
    keep = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
    moves = [(to, row) for to, row in enumerate(keep) if to != row]
    held = [layer for layer in layers if layer.keys is not None]
    if moves and held:
        rows = mx.array([row for _, row in moves])
        moved = [(layer.keys[rows], layer.values[rows]) for layer in held]
        mx.eval(moved)
        for layer, (keys, values) in zip(held, moved):
            for i, (to, _) in enumerate(moves):  # a slice update each (a scatter is ~10x slower)
                layer.keys[to : to + 1] = keys[i : i + 1]
                layer.values[to : to + 1] = values[i : i + 1]
    for layer in layers:
        layer.padding = [layer.padding[i] for i in keep]
        if layer._oversized():
            longest = layer._longest()
            layer._rebuild(slots_for(layer.rows), longest, layer._width(longest),
                           (layer.keys, layer.values))
        layer._sync()
