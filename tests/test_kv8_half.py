"""The 8-bit KV cache of a model in half precision (the GPU's, engine/kernels/kv8.py: mlx-lm's
`QuantizedKVCache`) in the prefix cache: snapshots at checkpoints, an edited last turn reusing
what came before, files written and read back, the answers those of a run without the cache.
A tiny random llama in bfloat16 on MLX's own ops stands in for the GPU's model."""

import dataclasses

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache
from mlx_lm.utils import load_model

from chats import SYSTEM, assistant, same_without_cache, user
from engine.prefix_cache import snapshot_files
from engine.prefix_cache.store import PrefixCache
from engine.decoding.sampling import SamplingParams
from engine.model_cache import LOCAL, from_layers, held_layers, kind_of
from engine.kernels.kv8 import GROUP_SIZE, kv_format, use_kv_bits
from tiny_models import tiny_llama

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def half():
    lm = tiny_llama(head_dim=32)  # a head a multiple of the cache's group size
    model, config = load_model(lm.path)
    model.set_dtype(mx.bfloat16)
    assert use_kv_bits(model, config, 8) == f"mlx-lm-quantized-8-g{GROUP_SIZE}"
    return dataclasses.replace(lm, model=model)


def test_an_edited_last_turn_reuses_the_8bit_cache_and_answers_as_without_it(half, tmp_path):
    assert all(type(c) is QuantizedKVCache for c in make_prompt_cache(half.model))
    cache = PrefixCache(half, persist_dir=tmp_path)
    assert cache.enabled
    chat = [SYSTEM, user("Tell me about rivers and the towns on them. " * 4),
            assistant("Rivers carry water, trade and stories. " * 4), user("And bridges?")]
    params = SamplingParams(max_tokens=4)
    assert same_without_cache(half, chat, params, cache).cached == 0
    edited = chat[:-1] + [user("And owls, briefly?")]
    again = same_without_cache(half, edited, params, cache)
    assert again.cached > 60  # the system prompt, the first turn and its answer

    written = cache.persist()  # files with (codes, scales, biases) for keys and values
    assert written
    fresh = PrefixCache(half, persist_dir=tmp_path)
    assert fresh.stats().disk_entries == len(written)
    assert same_without_cache(half, edited, params, fresh).cached >= again.cached


def test_a_snapshot_file_round_trips_the_quantized_layers(half, tmp_path):
    cache = make_prompt_cache(half.model)
    half.model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    layers = held_layers(LOCAL.copy(cache))
    assert [len(arrays) for _, arrays in layers] == [6] * len(cache)
    identity = snapshot_files.identity(half)
    path = snapshot_files.write(tmp_path, [1, 2, 3, 4, 5], layers, identity)
    header = snapshot_files.read_header(path, identity)
    back = from_layers(snapshot_files.load_arrays(path, header, snapshot_files.cache_layout(half.model)), 5)
    for mine, theirs in zip(back, cache):
        assert type(mine) is QuantizedKVCache and mine.offset == 5
        for a, b in zip((*mine.keys, *mine.values), (*theirs.keys, *theirs.values)):
            assert mx.array_equal(a[..., :5, :], b[..., :5, :]).item()
    assert kv_format(half.model).startswith("mlx-lm-quantized")


def test_quantized_caches_at_other_bits_are_not_snapshotted():
    assert kind_of(QuantizedKVCache(group_size=GROUP_SIZE, bits=8)) is not None
    assert kind_of(QuantizedKVCache(group_size=64, bits=8)) is not None
    assert kind_of(QuantizedKVCache(group_size=64, bits=4)) is None


def test_a_device_without_the_group_gets_the_next_one_or_the_full_cache(monkeypatch, caplog):
    """Where MLX cannot run the quantized attention at group 32 (its CUDA backend lacks some
    quantized products), the cache takes the next group that runs, and snapshots carry it; where
    none runs, the full cache, with a warning saying why."""
    import logging

    from engine.kernels import kv8

    assert kv8.quantized_group(32, mx.bfloat16) == (GROUP_SIZE, "")  # MLX's CPU runs them all
    real = kv8.quantized_scaled_dot_product_attention

    def refusing(*args, group_size, **kw):
        if group_size in refused:
            raise RuntimeError(f"[quantized_matmul] No implementation (group size: {group_size})")
        return real(*args, group_size=group_size, **kw)

    monkeypatch.setattr(kv8, "quantized_scaled_dot_product_attention", refusing)
    lm = tiny_llama(head_dim=64)
    model, config = load_model(lm.path)
    model.set_dtype(mx.bfloat16)
    refused = {32}
    assert use_kv_bits(model, config, 8) == "mlx-lm-quantized-8-g64"
    cache = make_prompt_cache(model)
    assert all(c.group_size == 64 for c in cache)
    model(mx.array([[1, 2, 3]]), cache=cache)
    back = from_layers(held_layers(LOCAL.copy(cache)), 3)
    assert all(c.group_size == 64 and c.offset == 3 for c in back)

    model, config = load_model(lm.path)
    model.set_dtype(mx.bfloat16)
    refused = {32, 64, 128}
    with caplog.at_level(logging.WARNING, logger="engine.kernels.kv8"):
        assert use_kv_bits(model, config, 8) == "full"
    assert "group 64: [quantized_matmul] No implementation" in caplog.text
