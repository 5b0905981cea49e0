"""The cache protocol (engine/model_cache.py): the engine's prefix cache and decode batch edit a
model's caches only through the `CacheOps` its `LoadedModel.caches` hands them, and the local
implementation's snapshots and rollbacks keep what they held."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.model_cache import (LOCAL, cache_length, from_layers, rollback_mark,
                                   roll_back, snapshot_layers)
from engine.scheduling.service import Engine
from engine.decoding.sampling import SamplingParams
from tiny_models import tiny_llama, tiny_qwen3_5
from watched_model import RecordingCaches as Recording

pytestmark = pytest.mark.fast


def arrays(cache) -> list[np.ndarray]:
    return [np.array(a) for _, layer in snapshot_layers(cache) for a in layer if a is not None]


def test_the_engine_edits_caches_only_through_the_models_protocol():
    lm = tiny_llama()
    caches = Recording()
    mine = dataclasses.replace(lm, caches=caches)
    engine = Engine(lm.name, load=lambda name, **_: mine, max_running=2).start()
    try:
        params = SamplingParams(max_tokens=6)
        messages = [{"role": "user", "content": "Tell me about the sea."}]
        handles = [engine.submit(messages=messages, params=params) for _ in range(2)]
        for h in handles:
            assert list(h.events(timeout=120))[-1].finish_reason == "length"
        again = engine.submit(messages=messages, params=params)
        assert list(again.events(timeout=120))[-1].finish_reason == "length"
        assert again.usage.cached_tokens > 0  # restored from a snapshot the first requests saved
    finally:
        engine.stop()
    # snapshots, their restore, the two requests decoding as one batch and leaving it
    for op in ("copy", "restore", "merge", "extract", "trimmable", "nbytes"):
        assert caches.calls[op] > 0, (op, caches.calls)


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3_5])
def test_a_snapshot_keeps_what_it_held_and_restores_through_files(make):
    lm = make()
    cache = make_prompt_cache(lm.model)
    mx.eval(lm.model(mx.array([list(range(5, 25))]), cache=cache))
    snapshot = LOCAL.copy(cache)
    before = arrays(snapshot)
    mx.eval(lm.model(mx.array([[7, 8, 9]]), cache=cache))  # the request goes on writing
    assert all(np.array_equal(a, b) for a, b in zip(before, arrays(snapshot)))
    assert LOCAL.nbytes(snapshot) == sum(a.nbytes for a in before)
    reloaded = from_layers(snapshot_layers(snapshot), 20)
    assert all(np.array_equal(a, b) for a, b in zip(before, arrays(reloaded)))
    assert cache_length(LOCAL.restore(snapshot, 20)) == 20


def test_a_rollback_puts_back_recurrent_state_and_trims_attention():
    lm = tiny_qwen3_5()
    cache = make_prompt_cache(lm.model)
    mx.eval(lm.model(mx.array([list(range(5, 15))]), cache=cache))
    assert not LOCAL.trimmable(cache)
    mark, before = rollback_mark(cache), arrays(LOCAL.copy(cache))
    mx.eval(lm.model(mx.array([[3, 4, 5]]), cache=cache))
    for layer, held in zip(cache, mark):
        roll_back(layer, held, 3)
    assert cache_length(cache) == 10
    assert all(np.array_equal(a, b) for a, b in zip(before, arrays(LOCAL.copy(cache))))
