"""Batched decoding: every generation that is decoding takes its next token from one model call.

Rows join the batch after their prefill and leave it before anything that needs their own cache
(their last token, cancellation, failure, finishing: a request that ends inside a batched step is
saved to the prefix cache when it leaves). Their model caches are merged into the batch's caches
(keys and values in our `SlotKVCache`, engine/slot_cache.py: rows right-aligned at a common
length in buffers with free row slots; mlx-lm's `ArraysCache` stacks recurrent state) on joining
and extracted back on leaving, so outside the batch a `Generation` owns a normal cache again:
prefix-cache saves and solo steps work unchanged. A row joining is written into a free slot and
rows leaving leave holes that the last rows fill (`keep_order`), so neither copies the rows that
stay where they are; the batch's row order is the cache's.

Each row is sampled as its own `TokenSampler` would sample it alone (`sample_rows`: the greedy rows
in one op, the others from their own slice of the logits), so a seeded request draws the same keys
alone or batched. With MLX's own CPU kernels the batched logits of each row are
bit-identical to a batch-1 call (measured for the bundled Q4 llama, fp32 llama and the hybrid
qwen3_5, with rows of different lengths). With OpenBLAS, fp32 matmul results can change in the last
bits with the number of rows; tests/test_scheduler.py checks that no token changes.
"""

from typing import Any, NamedTuple, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..events import Event
from ..model_cache import CacheOps
from ..slot_cache import keep_order, slots_for
from ..decoding.generate import Generation, PrefixStore
from ..decoding.mixed import cache_fits, mixed_call, supports as supports_mixed
from ..decoding.sampling import sample_rows
from ..decoding.snapshots import POLICY


class KVFootprint(NamedTuple):
    """What one request's model cache costs on a model, and whether it can be batched."""

    per_token: float  # bytes per token held (attention layers' keys and values)
    fixed: int  # bytes independent of length (recurrent state of linear-attention layers)
    batchable: bool

    def bytes_for(self, tokens: int) -> int:
        return int(self.per_token * tokens + self.fixed)


def can_prefill_together(gen: Generation) -> bool:
    """Whether `gen` (started: its cache fetched) can prefill in a call shared with others (a
    sharded model's caches cannot: the other ranks have no plan for a padded prefill)."""
    caches = gen.lm.caches
    return (not gen.prefills_alone and gen.cache is not None and caches.padded_prefill
            and caches.mergeable(gen.cache))


def prefill_together(model: nn.Module, caches: CacheOps,
                     rows: list[tuple[Generation, list[int]]]) -> list[Exception | None]:
    """Feed each generation its next prefill tokens (`Generation.prefill_input`) in one model call,
    as mlx-lm's `BatchGenerator` prefills: the rows' caches merged (left-padded to a common
    length), the inputs right-padded to the longest, the padding moved to the left after the call
    (`prepare` / `finalize` of mlx-lm's batch caches), then each row's cache extracted back to it.
    A row whose tokens end its prompt gets the logits of its last token (all rows of the call
    should then be one token long: the logits are only computed when some row reads them).
    Returns each row's failure (its sampling raised) or None; a failing model call raises."""
    cache = caches.merge([gen.cache for gen, _ in rows])
    lengths = [len(tokens) for _, tokens in rows]
    width = max(lengths)
    padding = [width - n for n in lengths]
    inputs = mx.array([tokens + [0] * (width - len(tokens)) for _, tokens in rows], dtype=mx.uint32)
    if max(padding):
        for layer in cache:
            layer.prepare(lengths=lengths, right_padding=padding)
    logits = model(inputs, cache=cache)
    if max(padding):
        for layer in cache:
            layer.finalize()
    mx.eval([layer.state for layer in cache])
    failures: list[Exception | None] = []
    for i, (gen, tokens) in enumerate(rows):
        ends = len(gen.fed) + len(tokens) == len(gen.prompt.tokens)
        try:
            gen.prefilled(tokens, caches.extract(cache, i),
                          logits[i : i + 1, lengths[i] - 1, :] if ends else None)
            failures.append(None)
        except Exception as exc:  # isolated to this row; the scheduler fails that request
            failures.append(exc)
    return failures


def kv_footprint(model: nn.Module, caches: CacheOps) -> KVFootprint:
    """Measure the footprint by running one token through a fresh cache."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]]), cache=cache))
    per_token, fixed = 0.0, 0
    for layer in cache:
        keys = getattr(layer, "keys", None)
        if isinstance(keys, tuple) and keys:  # mlx-lm's QuantizedKVCache: (codes, scales, biases)
            keys = keys[0]
        if isinstance(keys, mx.array):  # allocated in steps of several tokens: divide by them
            per_token += layer.nbytes / keys.shape[2]
        else:
            fixed += layer.nbytes
    return KVFootprint(per_token, fixed, caches.mergeable(cache))


def still_to_add(gen: Generation) -> int:
    """The most tokens `gen` may still add to its cache."""
    return max(gen.params.max_tokens - len(gen.generated), 0)


def row_extent(gen: Generation) -> int:
    """The most tokens `gen`'s cache may hold: those it holds now and those it may still add."""
    return len(gen.fed) + still_to_add(gen)


class DecodeBatch:
    """The generations decoding together on one model, in row order."""

    def __init__(self, model: nn.Module, caches: CacheOps):
        self.model = model
        self.caches = caches
        self.rows: list[Generation] = []
        self.cache: list[Any] = []
        self.reserved = 0  # bytes of the memory budget its padding holds (the scheduler's)
        self._stores: dict[int, PrefixStore | None] = {}
        # the tokens the last step sampled (evaluating) and the rows they belong to, in order
        self._sampled: mx.array | None = None
        self._sampled_rows: list[Generation] = []
        self.mixed = supports_mixed(model)  # prefill chunks can ride in its steps

    def can_carry(self, gen: Generation) -> bool:
        """Whether the next prefill chunk of `gen` (started: its cache fetched) can ride in this
        batch's next step (engine/decoding/mixed.py)."""
        return (self.mixed and bool(self.rows) and can_prefill_together(gen)
                and cache_fits(self.cache, gen.cache))

    def padding_need(self, footprint: KVFootprint, joining: Sequence[Generation] = ()) -> int:
        """The bytes this batch's cache may take beyond its rows' own reservations once `joining`
        join (each request reserves its own cache at full length, `bytes_for(prompt + max_tokens)`,
        at admission). A batch cache keeps mlx-lm's layout: every row as wide as the longest, so a
        long row beside short ones makes each of them as long (and a free slot as well). Rows are
        right-aligned at one column (the buffers' write index, or the longest row's length where
        that is further right), and each step moves it by one for every row, so the widest the
        rows may grow to is that column plus the most any row may still add: a short row with a
        long answer beside a long row ends further right than either's own extent. The columns a
        longer row that left had held stay until rows leave buffers far too wide
        (engine/slot_cache.py). Slots: the buffers' (a join past them makes `slots_for` rows); the
        free slots a decode step's growth adds (a quarter of the rows) are not counted."""
        rows = list(self.rows) + list(joining)
        if not rows:
            return 0
        right = max([getattr(c, "_idx", 0) for c in self.cache] + [len(g.fed) for g in rows])
        width = right + max(map(still_to_add, rows))
        held = max((getattr(c, "slots", 0) for c in self.cache), default=0)  # SlotKVCache's
        slots = held if len(rows) <= held else (slots_for(len(rows)) if held else len(rows))
        own = sum(footprint.bytes_for(len(g.prompt.tokens) + g.params.max_tokens) for g in rows)
        return max(0, slots * footprint.bytes_for(width) - own)

    def __contains__(self, gen: Generation) -> bool:
        return id(gen) in self._stores  # every row has its entry there

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, gens: list[Generation]) -> None:
        """Move the caches of `gens` into the batch as new last rows."""
        merged = self.caches.merge([g.cache for g in gens])
        if self.cache:
            self.caches.extend(self.cache, merged)
        else:
            self.cache = merged
        for gen in gens:
            # The batch holds this request's keys and values now; its own copy is released. While
            # it is a row the scheduler never steps it alone, so nothing reads `gen.cache`, and its
            # prefix store is held back so that finishing inside a batched step saves nothing yet.
            gen.cache = []
            self._stores[id(gen)] = gen.prefix_cache
            gen.prefix_cache = None
            self.rows.append(gen)

    def leave(self, gens: list[Generation]) -> None:
        """Hand each of `gens` its row of the cache back and drop their rows from the batch in one
        edit (rows that finish in the same step leave together, as in mlx-lm's `BatchGenerator`);
        the last rows fill the holes (`keep_order`). A finished row whose cache nothing will save
        gets no copy of its row."""
        leaving = {id(g) for g in gens}
        for i, gen in enumerate(self.rows):
            if id(gen) not in leaving:
                continue
            store = self._stores.pop(id(gen))
            saves = store is not None and POLICY.save_at_finish(gen.finish_reason)
            if gen.done and not saves:
                gen.cache = []
            else:
                gen.cache = self.caches.extract(self.cache, i)
            gen.prefix_cache = store
            if gen.done and saves:
                store.save(list(gen.fed), gen.cache)  # the save its finish skipped
        keep = keep_order(len(self.rows), [j for j, g in enumerate(self.rows) if id(g) in leaving])
        self.rows = [self.rows[j] for j in keep]
        if self.rows:
            self.caches.filter(self.cache, keep)
        else:
            self.cache, self._sampled, self._sampled_rows = [], None, []

    def step(self, rider: tuple[Generation, list[int]] | None = None
             ) -> list[tuple[Generation, list[Event] | Exception]]:
        """One model call for all rows (and, with a `rider`, the prefill tokens of one prompt
        that `can_carry` allowed: a mixed step, engine/decoding/mixed.py; its outcome comes last
        in the results), their next tokens sampled together
        (engine/decoding/sampling.py `sample_rows`) and evaluated asynchronously, then one read of
        the tokens just fed, pipelined as mlx-lm's `BatchGenerator` is: those tokens are an array
        whose evaluation was queued before this step (the last step's own array while the rows
        stay the same), so reading it does not wait for this step, and the host builds the next
        step while the device runs this one. A row whose sampling or emitting raises gets its
        exception back; the other rows are unaffected.

        When every row's token to feed is its last (`Generation.feeds_last`: they reach
        `max_tokens` together) and no rider waits, there is no model call: the tokens are read and
        emitted at once, as a lone stream's last step does, rather than after a step whose logits
        nothing reads."""
        rows = list(self.rows)
        if rider is None and all(gen.feeds_last for gen in rows):
            return self._last_tokens(rows)
        inputs = self._inputs(rows)
        logits, chunk_logits = self._forward(inputs, rider)
        tokens, logprobs, failures = sample_rows([g.sampler for g in rows],
                                                 [g.history for g in rows], logits)
        wanted = False
        for i, gen in enumerate(rows):
            if i not in failures:
                keep = gen.params.logprobs is not None
                wanted = wanted or keep
                gen.sample_next(tokens[i:i + 1], logprobs[i:i + 1] if keep else None)
        mx.async_eval([tokens, logprobs] if wanted else tokens)
        values = inputs.tolist()
        self._sampled, self._sampled_rows = (tokens, rows) if not failures else (None, [])
        results: list[tuple[Generation, list[Event] | Exception]] = []
        for i, (gen, token) in enumerate(zip(rows, values)):
            if i in failures:
                results.append((gen, failures[i]))
                continue
            try:
                results.append((gen, gen.accept(token)))
            except Exception as exc:
                results.append((gen, exc))
        if rider is not None:
            results.append(_prefilled(*rider, chunk_logits))
        return results

    def _inputs(self, rows: list[Generation]) -> mx.array:
        """The tokens `rows` feed this step (each added to its history where one is kept)."""
        if self._pipelined(rows):
            for gen in rows:  # no op per row unless its history (logits processors) reads the token
                if gen.history is not None:
                    gen.decode_input()
            return self._sampled
        # rows joined or left since the last step: its tokens were not one array
        inputs = mx.concatenate([g.decode_input() for g in rows])
        mx.async_eval(inputs)
        return inputs

    def _pipelined(self, rows: list[Generation]) -> bool:
        """Whether the last step's sampled tokens are one array for exactly these rows."""
        return self._sampled is not None and len(self._sampled_rows) == len(rows) and \
            all(a is b for a, b in zip(self._sampled_rows, rows))

    def _last_tokens(self, rows: list[Generation]) -> list[tuple[Generation, list[Event] | Exception]]:
        """Read every row's last token (the last step's array while the rows stay the same) and
        emit it (`Generation.accept_last`); each row then finishes."""
        if self._pipelined(rows):
            values = self._sampled.tolist()
        else:
            values = mx.concatenate([gen.next_token for gen in rows]).tolist()
        self._sampled, self._sampled_rows = None, []
        results: list[tuple[Generation, list[Event] | Exception]] = []
        for gen, token in zip(rows, values):
            try:
                results.append((gen, gen.accept_last(token)))
            except Exception as exc:
                results.append((gen, exc))
        return results

    def _forward(self, inputs: mx.array, rider: tuple[Generation, list[int]] | None
                 ) -> tuple[mx.array, mx.array | None]:
        """The rows' logits for `inputs`, and with a `rider` whose chunk ends its prompt the
        logits of that prompt's last token (a mixed step)."""
        if rider is None:
            return self.model(inputs[:, None], cache=self.cache)[:, -1, :], None
        carried, chunk = rider
        ends = len(carried.fed) + len(chunk) == len(carried.prompt.tokens)
        return mixed_call(self.model, inputs, self.cache, mx.array(chunk, dtype=mx.uint32),
                          carried.cache, ends)


def _prefilled(gen: Generation, chunk: list[int], logits: mx.array | None
               ) -> tuple[Generation, list[Event] | Exception]:
    """A rider's outcome once its chunk went through the model: its sampling may fail it alone."""
    try:
        gen.prefilled(chunk, gen.cache, logits)
        return gen, []
    except Exception as exc:
        return gen, exc
