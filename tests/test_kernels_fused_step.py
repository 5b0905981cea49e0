"""A llama layer's one-token step over a plain KVCache or mlx-lm's BatchKVCache as one op (engine/kernels/layout.py,
KernelLlamaBlock; ops.cpp, DecodeLayer): it writes the new keys and values into the cache's
buffers itself, so the cache must end exactly as mlx-lm's own update leaves it, the logits
must equal the two-op path's (attn_in, mlx-lm's update, block_out) bit for bit, and a buffer
another array still holds (a snapshot) must never be written into."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from bench.profile_decode import two_op_step
from engine.kernels.kv8 import KV8Cache, SlotKV8Cache
from engine.slot_cache import SlotKVCache
from tiny_models import tiny_llama_pair

pytestmark = pytest.mark.fast


def address(a: mx.array) -> int:
    """Where `a`'s data lives (the view is gone when this returns, so it holds nothing)."""
    return np.asarray(memoryview(a)).__array_interface__["data"][0]


def assert_one_op_step(logits, model):
    """The step's graph is the embedding, one op per layer, the final norm and the tied head:
    nothing else (no cache update, no offset add, no gather)."""
    ops = graph_primitives(logits)
    assert ops.count("MlxchatDecodeLayer") == len(model.model.layers), ops
    assert set(ops) == {"MlxchatEmbedding", "MlxchatDecodeLayer", "MlxchatRMSNorm",
                        "MlxchatQuantizedMatmul"}, ops
    assert len(ops) == len(model.model.layers) + 3, ops


def assert_same_step(a, b, fused, reference, step):
    """The one-op step's logits equal the two-op path's bit for bit, and every layer's whole keys
    and values buffers equal what mlx-lm's update left."""
    mx.eval(a, b)
    assert mx.array_equal(a, b).item(), step
    for x, y in zip(fused, reference):
        assert x.keys.shape == y.keys.shape and x.values.shape == y.values.shape
        assert mx.array_equal(x.keys, y.keys).item() and mx.array_equal(x.values, y.values).item()


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kv8", [False, True])
def test_one_op_steps_leave_the_cache_as_mlx_lms_update_across_a_buffer_growth(kern, batch, kv8):
    """A 250-token prompt, then 10 one-token steps (the cache's buffer grows from 256 to 512
    positions on the 7th): every step's logits equal the two-op path's bit for bit, and each
    layer's keys, values (whole buffers) and offset equal what mlx-lm's update leaves; each
    layer is one graph node, and the step's graph holds nothing but our ops. With the 8-bit
    cache (kv8.py) the op packs the new rows as `kv8.pack` (mx.quantize) does."""
    ours, _ = tiny_llama_pair(4, 32, True)
    prompt = mx.array([[(7 * i + r) % 300 + 1 for i in range(250)] for r in range(batch)])
    fused, reference = ([KV8Cache() for _ in ours.layers] for _ in range(2)) if kv8 else (
        make_prompt_cache(ours), make_prompt_cache(ours))
    mx.eval(ours(prompt, cache=fused), ours(prompt, cache=reference))
    tokens = mx.array([[5]] * batch)
    for step in range(10):
        mx.eval(tokens)
        a = ours(tokens, cache=fused)
        if fused[0].offset != 257:  # not the growth step (mlx-lm's update grows the buffer)
            assert_one_op_step(a, ours)
        assert_same_step(a, two_op_step(kern, ours, tokens, reference), fused, reference, step)
        for x, y in zip(fused, reference):
            assert x.offset == y.offset == 251 + step
        tokens = mx.argmax(a[:, -1:], axis=-1)
    assert fused[0].keys.shape[2] == 512


@pytest.mark.parametrize("padding", [[3, 0], [0, 5, 2, 9]])
@pytest.mark.parametrize("kind", [BatchKVCache, SlotKVCache, SlotKV8Cache])
def test_batched_one_op_steps_leave_the_cache_as_mlx_lms_update_across_a_buffer_growth(kern, padding, kind):
    """A batch (mlx-lm's BatchKVCache; the scheduler's SlotKVCache, full or 8-bit) of 2 and 4
    rows, each left-padded differently: a 250-position prompt, then 10 one-token steps (the buffers grow from 256 to 512
    positions on the 7th). Every step's logits equal the two-op path's bit for bit (each row's
    RoPE at its own offset, its keys from its padding on), and each layer's whole keys and values
    buffers, per-row offsets and write index equal what mlx-lm's update leaves; each layer is one
    graph node (its offsets + 1 that op's fourth output)."""
    ours, _ = tiny_llama_pair(4, 32, True)
    B = len(padding)
    prompt = mx.array([[0] * p + [(7 * i + r) % 300 + 1 for i in range(250 - p)]
                       for r, p in enumerate(padding)])
    fused = [kind(padding) for _ in ours.layers]
    reference = [kind(padding) for _ in ours.layers]
    mx.eval(ours(prompt, cache=fused), ours(prompt, cache=reference))
    tokens = mx.array([[5 + r] for r in range(B)])
    for step in range(10):
        mx.eval(tokens)
        a = ours(tokens, cache=fused)
        # not the first step nor the growth step or the one after it (mlx-lm's update, which
        # grows the buffer, leaves an unevaluated `offset + n` for the next step)
        if fused[0]._idx not in (251, 257, 258):
            assert_one_op_step(a, ours)
        assert_same_step(a, two_op_step(kern, ours, tokens, reference), fused, reference, step)
        for x, y in zip(fused, reference):
            assert x._idx == y._idx == 251 + step
            assert x.offset.tolist() == y.offset.tolist() == [251 + step - p for p in padding]
        tokens = mx.argmax(a[:, -1:], axis=-1)
    assert fused[0].keys.shape[2] == 512


def graph_primitives(a: mx.array) -> list[str]:
    """The primitives' names in `a`'s (unevaluated) graph, from mx.export_to_dot."""
    import io

    out = io.StringIO()
    mx.export_to_dot(out, a)
    return [line.split('label ="')[1].split('"')[0] for line in out.getvalue().splitlines()
            if 'label ="' in line and "shape=rectangle" in line]


def test_a_step_writes_in_place_but_never_into_memory_a_view_holds(kern):
    """As with mlx-lm's update: with nothing else holding the cache's buffers a step writes the
    new position into them (no copy), the `keys`/`values` array objects themselves are updated
    (a holder of them sees the new position), and memory a view still holds (a snapshot's
    slice) keeps its contents, the cache moving to a written copy."""
    ours, _ = tiny_llama_pair(4, 32, True)
    cache = make_prompt_cache(ours)
    mx.eval(ours(mx.array([[3, 1, 4, 1, 5, 9, 2, 6]]), cache=cache))
    token = mx.array([[7]])
    where = [address(c.keys) for c in cache]
    objects = [(c.keys, c.values) for c in cache]
    mx.eval(ours(token, cache=cache))
    assert [address(c.keys) for c in cache] == where
    assert all(c.keys is k and c.values is v for c, (k, v) in zip(cache, objects))
    views = [(c.keys[..., :16, :], c.values[..., :16, :]) for c in cache]
    mx.eval(views)
    before = [(np.array(k), np.array(v)) for k, v in views]
    mx.eval(ours(token, cache=cache))
    for (k, v), (k0, v0), c in zip(views, before, cache):
        assert np.array_equal(np.array(k), k0) and np.array_equal(np.array(v), v0)
        assert c.offset == 10 and not np.array_equal(np.array(c.keys)[..., 9, :], k0[..., 9, :])
        assert np.array_equal(np.array(c.keys)[..., :9, :], k0[..., :9, :])
        assert address(c.keys) != address(k)


@pytest.mark.parametrize("bits,gs,scales", [(4, 32, mx.float16), (8, 64, mx.float32), (4, 128, mx.bfloat16)])
def test_embedding_rows_equal_gathering_and_mx_dequantize(kern, bits, gs, scales):
    """kernels.embedding (the embedding's one op) equals mlx's gather + mx.dequantize exactly,
    for int32 ids (a negative one counting from the end, as MLX's indexing does) and uint32 ids
    (what mx.argmax gives)."""
    mx.random.seed(bits + gs)
    w, s, b = mx.quantize(mx.random.normal((50, 2 * gs)), group_size=gs, bits=bits)
    s, b = s.astype(scales), b.astype(scales)
    for ids in (mx.array([[0, 7, 49], [3, -1, 3]]), mx.array([[5]], dtype=mx.uint32)):
        ref = mx.dequantize(w[ids], s[ids].astype(mx.float32), b[ids].astype(mx.float32), gs, bits)
        ours = kern.embedding(ids, w, s, b, gs, bits)
        assert ours.shape == ref.shape and ours.dtype == mx.float32
        assert mx.array_equal(ours, ref).item()


def test_pipelined_steps_write_in_place(kern):
    """The engine builds and evaluates the next step's graph while the previous one still runs
    (mx.async_eval): MLX holds the previous step's buffers until its stream has run that step,
    and the one-op layer must still write into the same buffers (no copy of every layer's cache
    each step), as mlx-lm's update does."""
    ours, _ = tiny_llama_pair(4, 32, True)
    cache = make_prompt_cache(ours)
    mx.eval(ours(mx.array([[3, 1, 4, 1, 5, 9, 2, 6]]), cache=cache))
    where = [address(c.keys) for c in cache] + [address(c.values) for c in cache]
    logits = ours(mx.array([[7]]), cache=cache)
    mx.async_eval(logits)
    for _ in range(6):
        logits = ours(mx.argmax(logits[:, -1:], axis=-1), cache=cache)
        mx.async_eval(logits)
    mx.eval(logits)
    assert cache[0].offset == 15
    assert [address(c.keys) for c in cache] + [address(c.values) for c in cache] == where


def test_the_one_op_refuses_buffers_it_cannot_write(kern):
    """A position outside the buffers, buffers of another shape or dtype, a batched step's
    per-row offsets or starts not (batch,) int32: a ValueError before any graph is built, never
    a write out of bounds."""
    ours, _ = tiny_llama_pair(4, 32, True)
    layer = ours.model.layers[0]
    fused = layer._fused or layer._fuse()
    h = mx.zeros((1, 1, 128))
    keys, values = mx.zeros((1, 2, 8, 32)), mx.zeros((1, 2, 8, 32))
    mx.eval(fused(h, keys, values, 7))  # the last position: fine
    for bad in [(h, keys, values, 8), (h, keys, values, -1),
                (h, mx.zeros((1, 2, 8, 16)), mx.zeros((1, 2, 8, 16)), 0),
                (h, keys.astype(mx.float16), values.astype(mx.float16), 0),
                (h, keys, mx.zeros((1, 2, 9, 32)), 0), (mx.zeros((1, 1, 64)), keys, values, 0)]:
        with pytest.raises(ValueError):
            fused(*bad)
    rows, ok = mx.array([4], dtype=mx.int32), mx.array([0], dtype=mx.int32)
    mx.eval(fused.batch(h, keys, values, 7, rows, ok))
    for offsets, starts in [(rows.astype(mx.int64), ok), (rows, mx.array([0, 0], dtype=mx.int32)),
                            (rows, ok.reshape(1, 1))]:
        with pytest.raises(ValueError):
            fused.batch(h, keys, values, 7, offsets, starts)
    with pytest.raises(ValueError):
        fused.batch(h, keys, values, 8, rows, ok)
