"""The 8-bit KV cache (engine/kernels/kv8.py, `--kv-bits 8`) on tiny random-weight llamas: our
attention kernels read the packed rows as exactly their dequantized values, on every instruction-
set unit; the model over the 8-bit cache gives mlx-lm's own logits over the same dequantized
cache; a row's tokens do not depend on what else shares the batch; the cache takes 0.3125 of the
fp32 cache's bytes; the engine batches, snapshots and restores it; and a snapshot written with one
KV format is refused under the other. The perplexity gate on the real model is
tests/test_kv8_quality.py."""

import dataclasses

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from engine.prefix_cache import snapshot_files
from engine.prefix_cache.store import PrefixCache
from engine.errors import ModelLoadError
from engine.kernels import active_path
from engine.decoding.sampling import SamplingParams
from engine.model_cache import LOCAL, held_layers
from engine.kernels.kv8 import (GROUP_SIZE, SlotKV8Cache, KV8Cache, kv_format, pack, unpack,
                                use_kv_bits)
from engine.scheduling.batch import kv_footprint
from engine.scheduling.service import Engine
from tiny_models import KERNEL_PROMPTS as PROMPTS, tiny_llama_pair
from watched_model import RecordingCaches as Recording
from tiny_models import tiny_llama

pytestmark = pytest.mark.fast

KV8 = {"head_dim": 32}  # a multiple of the 8-bit cache's group size (tiny_llama's 16 is not)


def test_packed_rows_are_mlx_affine_quantization():
    """unpack(pack(x)) is exactly MLX's dequantize(quantize(x)) at the cache's group size and bits:
    within one quantization step of x."""
    x = mx.random.normal((2, 3, 5, 64)) * 4
    packed = pack(x)
    assert packed.dtype == mx.uint32 and packed.shape == (2, 3, 5, 64 // 4 + 2 * 64 // GROUP_SIZE)
    ref = mx.dequantize(*mx.quantize(x, group_size=GROUP_SIZE, bits=8), group_size=GROUP_SIZE, bits=8)
    assert mx.array_equal(unpack(packed), ref).item()
    groups = x.reshape(2, 3, 5, -1, GROUP_SIZE)
    step = (groups.max(-1) - groups.min(-1)) / 255
    err = mx.abs(unpack(packed) - x).reshape(groups.shape).max(-1)
    assert mx.all(err <= step * 1.01).item()


def kv_prefix(kv_heads, dim, length, rows=2):
    """Packed keys and values as a cache holds them: the prefix of a longer buffer (strided)."""
    k = pack(mx.random.normal((rows, kv_heads, 512, dim)))[:, :, :length]
    v = pack(mx.random.normal((rows, kv_heads, 512, dim)))[:, :, :length]
    return k, v


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 128), (4, 4, 32)])
def test_decode_attention_reads_packed_rows_as_their_values(kern, isa, heads, kv_heads, dim):
    """Single-query attention over packed rows equals it over their dequantized fp32 values, bit
    for bit, with and without per-row left padding hidden."""
    k, v = kv_prefix(kv_heads, dim, 300, rows=3)
    q = mx.random.normal((3, heads, 1, dim))
    starts = mx.array([0, 17, 299], dtype=mx.int32)
    for extra in ({}, {"starts": starts}):
        ours = kern.decode_attention(q, k, v, dim ** -0.5, **extra)
        ref = kern.decode_attention(q, unpack(k), unpack(v), dim ** -0.5, **extra)
        assert mx.array_equal(ours, ref).item(), mx.abs(ours - ref).max().item()


@pytest.mark.parametrize("length,cached", [(37, 0), (19, 45)])
def test_prefill_attention_reads_packed_rows_as_their_values(kern, isa, length, cached):
    k, v = kv_prefix(3, 64, cached + length)
    q = mx.random.normal((2, 9, length, 64))
    ours = kern.prefill_attention(q, k, v, 0.125)
    assert mx.array_equal(ours, kern.prefill_attention(q, unpack(k), unpack(v), 0.125)).item()


def test_packed_rows_of_a_width_no_group_gives_are_refused(kern):
    q = mx.random.normal((1, 4, 1, 64))
    bad = mx.zeros((1, 4, 10, 64 // 4 + 3), dtype=mx.uint32)
    with pytest.raises(ValueError, match="head dimension"):
        kern.decode_attention(q, bad, bad, 0.125)


def kv8_pair():
    """(ours, reference): tiny_llama_pair's quantized llama, ours on the kernels and the
    reference on mlx-lm's own ops, both with 8-bit KV caches."""
    ours, ref = tiny_llama_pair(4, 32, True)
    for model in (ours, ref):
        assert use_kv_bits(model, {"head_dim": 32}, 8) == f"kv8-affine-g{GROUP_SIZE}"
    return ours, ref


def test_the_kernels_over_the_8bit_cache_give_mlx_lms_logits_over_its_values(kern):
    """Prefill (our prefill attention on packed rows) then one-token steps (the fused layer ops):
    logits within 1e-4 of mlx-lm's model, whose attention gets the dequantized cache; and close
    to the full-precision cache's (the quantization's own error, well under the logits' scale)."""
    ours, ref = kv8_pair()
    full, _ = tiny_llama_pair(4, 32, True)
    caches = make_prompt_cache(ours), make_prompt_cache(ref), make_prompt_cache(full)
    assert type(caches[0][0]) is KV8Cache and type(caches[2][0]) is KVCache
    tokens = mx.array([[5, 17, 200, 3, 99, 41, 7, 12, 8]])
    for step in range(6):
        a, b, c = (m(tokens, cache=cache) for m, cache in zip((ours, ref, full), caches))
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item(), (step, mx.abs(a - b).max().item())
        assert mx.abs(a - c).max().item() < 0.02 * mx.abs(c).max().item(), step
        tokens = mx.argmax(b[:, -1:], axis=-1)


def test_cache_bytes_are_under_a_third_of_the_full_cache(kern):
    ours, _ = kv8_pair()
    full, _ = tiny_llama_pair(4, 32, True)
    sizes = []
    for model in (ours, full):
        cache = make_prompt_cache(model)
        model(mx.array([list(range(1, 41))]), cache=cache)
        sizes.append(LOCAL.nbytes(LOCAL.copy(cache)))  # a snapshot: the 40 tokens held
    assert sizes[0] / sizes[1] == (1 + 8 / GROUP_SIZE) / 4  # codes + fp32 scale and bias per group


def test_a_rows_logits_do_not_depend_on_its_batch(kern):
    """Rows prefilled alone (KV8Caches), then decoded greedily together (merged into a
    SlotKV8Cache, left-padded, as the engine's decode batch does): each row's logits are, bit for
    bit, the ones it gets decoding alone, in either batch composition."""
    ours, _ = kv8_pair()
    prefilled = []
    for prompt in PROMPTS:
        cache = make_prompt_cache(ours)
        prefilled.append((cache, ours(mx.array([prompt]), cache=cache)[:, -1:]))

    def decode(rows, steps=6):
        cache = LOCAL.merge([LOCAL.restore(prefilled[r][0], len(PROMPTS[r])) for r in rows])
        assert type(cache[0]) is SlotKV8Cache
        logits, out = mx.concatenate([prefilled[r][1] for r in rows]), []
        for _ in range(steps):
            out.append(logits)
            logits = ours(mx.argmax(logits, axis=-1), cache=cache)
        return mx.concatenate(out, axis=1)

    together = decode([0, 1, 2])
    for row in range(3):
        assert mx.array_equal(decode([row])[0], together[row]).item(), row
    assert mx.array_equal(decode([2, 1]), together[mx.array([2, 1])]).item()


@pytest.mark.parametrize("held", [0, 3])
def test_a_padded_prefill_of_rows_keeps_the_8bit_format(kern, held):
    """prefill_together's steps (rows merged, right padding moved left, each row extracted) on
    8-bit caches, empty (fresh requests) or not (prefix hits): the rows stay 8-bit and each row's
    last logits are its own prefill's."""
    ours, _ = kv8_pair()
    prompts = [[5, 17, 200, 3, 99], [12, 8]]
    starts = []
    for _ in prompts:
        cache = make_prompt_cache(ours)
        if held:
            ours(mx.array([[1, 2, 3][:held]]), cache=cache)
        starts.append(cache)
    alone = []
    for prompt, start in zip(prompts, starts):
        copy = LOCAL.restore(LOCAL.copy(start), held) if held else make_prompt_cache(ours)
        alone.append(ours(mx.array([prompt]), cache=copy)[:, -1])
    merged = LOCAL.merge(starts)
    assert all(type(layer) is SlotKV8Cache for layer in merged)
    lengths, width = [len(p) for p in prompts], max(map(len, prompts))
    for layer in merged:
        layer.prepare(lengths=lengths, right_padding=[width - n for n in lengths])
    logits = ours(mx.array([p + [0] * (width - len(p)) for p in prompts]), cache=merged)
    for layer in merged:
        layer.finalize()
    for i, n in enumerate(lengths):
        row = LOCAL.extract(merged, i)
        assert all(type(layer) is KV8Cache and layer.keys.dtype == mx.uint32 for layer in row)
        assert row[0].offset == held + n
        assert mx.allclose(logits[i, n - 1], alone[i][0], rtol=1e-4, atol=1e-4).item()


def test_the_gpu_and_half_precision_take_mlx_lms_quantized_cache():
    """A model whose activations are not fp32 (the GPU; the CPU without our layouts) gets mlx-lm's
    QuantizedKVCache, which its own attention reads; recurrent layers keep their caches."""
    _, ref = tiny_llama_pair(4, 32, True)
    ref.set_dtype(mx.bfloat16)
    assert use_kv_bits(ref, {"head_dim": 32}, 8) == f"mlx-lm-quantized-8-g{GROUP_SIZE}"
    cache = make_prompt_cache(ref)
    assert all(type(c) is QuantizedKVCache and c.bits == 8 for c in cache)
    assert ref(mx.array([[1, 2, 3]]), cache=cache).shape == (1, 3, 320)
    footprint = kv_footprint(ref, LOCAL)  # the engine's memory budget sees it grow per token
    assert footprint.per_token > 0 and footprint.fixed == 0 and not footprint.batchable
    assert use_kv_bits(ref, {"head_dim": 48}, 8) == "full"  # no group fits: kept full


@pytest.fixture(scope="module")
def lm8(monkey_module):
    monkey_module.setenv("MLXCHAT_KV_BITS", "8")
    lm = tiny_llama(**KV8)
    monkey_module.delenv("MLXCHAT_KV_BITS")
    return lm


@pytest.fixture(scope="module")
def monkey_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_the_engine_batches_snapshots_and_restores_the_8bit_cache(lm8):
    """Two requests decode as one batch over SlotKV8Caches; the prefix cache's snapshot of
    KV8Caches serves a third; the answers are the ones each gets alone."""
    assert kv_format(lm8.model) == f"kv8-affine-g{GROUP_SIZE}"
    assert all(type(c) is KV8Cache for c in make_prompt_cache(lm8.model))
    caches = Recording()
    mine = dataclasses.replace(lm8, caches=caches)
    engine = Engine(lm8.name, load=lambda name, **_: mine, max_running=2).start()
    try:
        params = SamplingParams(max_tokens=8)
        asks = [[{"role": "user", "content": "Tell me about the sea."}],
                [{"role": "user", "content": "And the mountains, in a few words?"}]]
        handles = [engine.submit(messages=m, params=params) for m in asks]
        together = [[e.token for e in h.events(timeout=120) if e.kind == "token"] for h in handles]
        again = engine.submit(messages=asks[0], params=params)
        tokens = [e.token for e in again.events(timeout=120) if e.kind == "token"]
        assert again.usage.cached_tokens > 0
        assert tokens == together[0] and len(tokens) == 8
    finally:
        engine.stop()
    for op in ("merge", "extract", "copy", "restore"):  # batched, snapshotted, restored
        assert caches.calls[op] > 0, (op, caches.calls)


def test_the_active_path_names_the_8bit_cache(monkeypatch):
    assert "KV cache" not in active_path()
    monkeypatch.setenv("MLXCHAT_KV_BITS", "8")
    assert active_path().endswith("; 8-bit KV cache")
    monkeypatch.setenv("MLXCHAT_KV_BITS", "4")
    assert "only 8 is supported" in active_path()
    with pytest.raises(ModelLoadError, match="only 8"):
        tiny_llama(**KV8)


def test_a_snapshot_of_one_kv_format_is_refused_under_the_other(lm8, tmp_path):
    full = tiny_llama(**KV8)
    assert kv_format(full.model) == "full"
    for writer, reader in ((lm8, full), (full, lm8)):
        cache = make_prompt_cache(writer.model)
        writer.model(mx.array([[1, 2, 3, 4]]), cache=cache)
        layers = held_layers(LOCAL.copy(cache))
        folder = tmp_path / kv_format(writer.model)
        folder.mkdir()
        path = snapshot_files.write(folder, [1, 2, 3, 4], layers, snapshot_files.identity(writer))
        mine = snapshot_files.read_header(path, snapshot_files.identity(writer))
        snapshot_files.load_arrays(path, mine, snapshot_files.cache_layout(writer.model))
        with pytest.raises(snapshot_files.BadSnapshot, match="kv_format"):
            snapshot_files.read_header(path, snapshot_files.identity(reader))
        with pytest.raises(snapshot_files.BadSnapshot, match="layer types"):
            snapshot_files.load_arrays(path, mine, snapshot_files.cache_layout(reader.model))



def test_the_cli_option_loads_the_model_with_the_8bit_cache(monkeypatch, caplog):
    """`mlxchat generate --kv-bits 8`: the loading line names the 8-bit cache and the model's
    layers get it."""
    import logging

    from click.testing import CliRunner

    from app.cli.commands import cli

    monkeypatch.setenv("MLXCHAT_KV_BITS", "")  # restored (unset) after the test: the option sets it
    folder = str(tiny_llama(**KV8).path)
    with caplog.at_level(logging.INFO, logger="engine.kernels.kv8"):
        result = CliRunner().invoke(cli, ["generate", "--model", folder, "--kv-bits", "8", "-n",
                                          "3", "Hello"])
    assert result.exit_code == 0, result.output
    assert "8-bit KV cache" in result.output
    assert any("KV cache: 8-bit" in r.getMessage() for r in caplog.records)


def test_the_prefix_cache_recomputes_what_the_other_format_persisted(lm8, tmp_path, caplog):
    """Each KV format keeps its own snapshot folder: the 8-bit model's prefix cache finds none of
    what the full one persisted (and the other way round), recomputes, answers as it does without
    a cache, and leaves the other's files in place. A file of the other format put in its folder
    is skipped (and deleted) with a log line."""
    import logging
    import shutil

    from chats import long_chat, persisted_apart

    full = tiny_llama(**KV8)
    chat, params = long_chat(2), SamplingParams(max_tokens=4)
    for writer, reader in ((full, lm8), (lm8, full)):
        folder = tmp_path / kv_format(writer.model)
        written, other = persisted_apart(writer, reader, folder, chat, params)
        if other.dir is not None:  # a stray file of the other format in the reader's own folder
            other.dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(written[0], other.dir / written[0].name)
            with caplog.at_level(logging.WARNING, logger="engine.prefix_cache.store"):
                assert PrefixCache(reader, persist_dir=folder).stats().disk_entries == 0
            assert any("kv_format" in r.getMessage() for r in caplog.records)
