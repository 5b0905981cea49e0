"""Batched decoding: every generation that is decoding takes its next token from one model call.

Rows join the batch after their prefill and leave it before anything that needs their own cache
(their last token, cancellation, failure, finishing: a request that ends inside a batched step is
saved to the prefix cache when it leaves). Their model caches are merged into mlx-lm's
batch caches (`BatchKVCache` left-pads keys to a common length, `ArraysCache` stacks recurrent
state) on joining and extracted back on leaving, so outside the batch a `Generation` owns a normal
cache again: prefix-cache saves and solo steps work unchanged.

Each row is sampled by its own `TokenSampler` from its own slice of the logits, so a seeded request
draws the same keys alone or batched. With MLX's own CPU kernels the batched logits of each row are
bit-identical to a batch-1 call (measured for the bundled Q4 llama, fp32 llama and the hybrid
qwen3_5, with rows of different lengths). With OpenBLAS, fp32 matmul results can change in the last
bits with the number of rows; tests/test_scheduler.py checks that no token changes.
"""

from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import _merge_caches
from mlx_lm.models.cache import make_prompt_cache

from ..events import Event
from ..decoding.generate import Generation, PrefixStore
from ..decoding.snapshots import POLICY


def can_batch(cache: list[Any]) -> bool:
    """Whether mlx-lm can merge this kind of cache (quantized or chunked caches cannot)."""
    return all(hasattr(c, "merge") for c in cache)


class KVFootprint(NamedTuple):
    """What one request's model cache costs on a model, and whether it can be batched."""

    per_token: float  # bytes per token held (attention layers' keys and values)
    fixed: int  # bytes independent of length (recurrent state of linear-attention layers)
    batchable: bool

    def bytes_for(self, tokens: int) -> int:
        return int(self.per_token * tokens + self.fixed)


def kv_footprint(model: nn.Module) -> KVFootprint:
    """Measure the footprint by running one token through a fresh cache."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]]), cache=cache))
    per_token, fixed = 0.0, 0
    for layer in cache:
        keys = getattr(layer, "keys", None)
        if isinstance(keys, mx.array):  # allocated in steps of several tokens: divide by them
            per_token += layer.nbytes / keys.shape[2]
        else:
            fixed += layer.nbytes
    return KVFootprint(per_token, fixed, can_batch(cache))


class DecodeBatch:
    """The generations decoding together on one model, in row order."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.rows: list[Generation] = []
        self.cache: list[Any] = []
        self._stores: dict[int, PrefixStore | None] = {}

    def __contains__(self, gen: Generation) -> bool:
        return any(g is gen for g in self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, gen: Generation) -> None:
        """Move `gen`'s cache into the batch as a new last row."""
        merged = _merge_caches([gen.cache])
        if self.rows:
            for batch_layer, row_layer in zip(self.cache, merged):
                batch_layer.extend(row_layer)
        else:
            self.cache = merged
        # The batch holds this request's keys and values now; its own copy is released. While it
        # is a row the scheduler never steps it alone, so nothing reads `gen.cache`, and its prefix
        # store is held back so that finishing inside a batched step saves nothing yet.
        gen.cache = []
        self._stores[id(gen)] = gen.prefix_cache
        gen.prefix_cache = None
        self.rows.append(gen)

    def leave(self, gen: Generation) -> None:
        """Hand `gen` its row of the cache back and drop the row from the batch."""
        i = next(i for i, g in enumerate(self.rows) if g is gen)
        gen.cache = [layer.extract(i) for layer in self.cache]
        gen.prefix_cache = self._stores.pop(id(gen))
        if gen.prefix_cache is not None and POLICY.save_at_finish(gen.finish_reason):
            gen.prefix_cache.save(list(gen.fed), gen.cache)  # the save its finish skipped
        del self.rows[i]
        if self.rows:
            keep = mx.array([j for j in range(len(self.rows) + 1) if j != i])
            for layer in self.cache:
                layer.filter(keep)
        else:
            self.cache = []

    def step(self) -> list[tuple[Generation, list[Event] | Exception]]:
        """One model call for all rows, one evaluation of every row's next token and one read of
        the tokens they replace (a sync per row would stall the device once per row). A row whose
        sampling or emitting raises gets its exception back; the other rows are unaffected."""
        inputs = mx.concatenate([g.decode_input() for g in self.rows])
        logits = self.model(inputs[:, None], cache=self.cache)[:, -1, :]
        outcomes: list[list[Event] | Exception | mx.array] = []
        for i, gen in enumerate(self.rows):
            try:
                outcomes.append(gen.sample_next(logits[i : i + 1]))
            except Exception as exc:  # isolated to this row; the scheduler fails that request
                outcomes.append(exc)
        sampled = [o for o in outcomes if isinstance(o, mx.array)]
        mx.async_eval([g._next for g, o in zip(self.rows, outcomes) if isinstance(o, mx.array)])
        tokens = iter(mx.concatenate([y.reshape(1) for y in sampled]).tolist() if sampled else [])
        results: list[tuple[Generation, list[Event] | Exception]] = []
        for gen, outcome in zip(self.rows, outcomes):
            if isinstance(outcome, Exception):
                results.append((gen, outcome))
                continue
            try:
                results.append((gen, gen.accept(next(tokens))))
            except Exception as exc:
                results.append((gen, exc))
        return results
