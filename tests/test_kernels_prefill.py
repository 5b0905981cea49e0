"""Prompt products (engine/kernels/layout.py `quantized_product` at BLAS_ROWS rows or more): the
`prefill_matmul` op dequantizes a tile of the weight's rows at a time into one reused buffer and
multiplies it with the loaded BLAS, so no layer's weight is ever whole in fp32.

- against `x @ mx.dequantize(...).T` within fp32 tolerance (BLAS sums in its own order): 4 and 8
  bits, group sizes 32/64/128, scales in fp32/fp16/bf16, weight rows not a multiple of the tile's,
  K split into column blocks, batched and non-contiguous x;
- the buffer it keeps is bounded by the tile size, not the weight's;
- a tiny model's prompt chunk through it gives MLX's own logits and greedy tokens, and leaves no
  dequantized weight behind (`dequantize_cache_bytes`, the old path's kept fp32 weights).
"""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.kernels import layout
from tiny_models import tiny_llama_pair

pytestmark = pytest.mark.fast


@pytest.fixture
def blas(kern):
    """The prefill product needs the BLAS this process loaded (scripts/test preloads OpenBLAS)."""
    if not kern.has_sgemm():
        pytest.skip("no cblas_sgemm in this process (OpenBLAS not preloaded)")
    before = kern.prefill_tile_bytes()
    yield kern
    kern.set_prefill_tile_bytes(before)


def quantized(n, k, bits, gs, scale_dtype, seed=0):
    mx.random.seed(seed)
    w, s, b = mx.quantize(mx.random.normal((n, k)), group_size=gs, bits=bits)
    return w, s.astype(scale_dtype), b.astype(scale_dtype)


def reference(x, w, s, b, gs, bits):
    return x @ mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), gs, bits).T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_prefill_matmul_matches_the_dequantized_product(blas, bits, gs):
    # tiles of at most 1,024 weight rows by (here) 1-2 groups of columns: 1,100 rows are a whole
    # tile and 76 rows, every K several column blocks summed
    blas.set_prefill_tile_bytes(1100 * 2 * gs * 4 - 1)
    for scale_dtype, (rows, n, k) in zip([mx.float32, mx.float16, mx.bfloat16],
                                         [(64, 200, 384), (67, 1100, 3 * gs), (100, 64, 5 * gs)]):
        w, s, b = quantized(n, k, bits, gs, scale_dtype, seed=bits + gs)
        x = mx.random.normal((rows, k))
        ours, ref = blas.prefill_matmul(x, w, s, b, gs, bits), reference(x, w, s, b, gs, bits)
        assert ours.shape == ref.shape == (rows, n) and ours.dtype == mx.float32
        assert mx.allclose(ours, ref, rtol=1e-5, atol=1e-4).item(), mx.abs(ours - ref).max().item()


def test_batched_and_transposed_rows(blas):
    w, s, b = quantized(96, 256, 4, 32, mx.float16)
    x = mx.random.normal((2, 256, 40)).transpose(0, 2, 1)  # (2, 40, 256), not row-contiguous
    ours = blas.prefill_matmul(x, w, s, b, 32, 4)
    assert ours.shape == (2, 40, 96)
    assert mx.allclose(ours, reference(x, w, s, b, 32, 4), rtol=1e-5, atol=1e-4).item()


def test_the_kept_buffer_is_bounded_by_the_tile(blas):
    """A 16 MB fp32 weight through 1 MB tiles (1,024 rows by 256 columns): the op keeps 1 MB,
    not the weight. The count covers every thread's buffer, and the threads of earlier tests in
    this process keep theirs: the op runs on a stream of its own (a thread of its own, its buffer
    new), and what it adds is its buffer."""
    blas.set_prefill_tile_bytes(1 << 20)
    w, s, b = quantized(4096, 1024, 4, 64, mx.float16)
    x = mx.random.normal((64, 1024))
    mx.eval(w, s, b, x)
    before = blas.prefill_buffer_bytes()
    with mx.stream(mx.new_stream(mx.cpu)):
        ours = blas.prefill_matmul(x, w, s, b, 64, 4)
        mx.eval(ours)
    assert mx.allclose(ours, reference(x, w, s, b, 64, 4), rtol=1e-5, atol=1e-4).item()
    added = blas.prefill_buffer_bytes() - before
    assert 0 < added <= 1 << 20, added


def test_a_prompt_chunk_matches_mlx_and_keeps_no_fp32_weight(blas):
    """A 96-token chunk of a tiny 4-bit llama (its products on the prefill path: rows >=
    BLAS_ROWS, several tiles per weight) gives MLX's own logits and greedy tokens; afterwards no
    dequantized weight stays in memory."""
    ours, ref = tiny_llama_pair(4, 32, False)
    assert layout._Run.blas, "the prefill product needs an optimised BLAS loaded"
    blas.set_prefill_tile_bytes(64 * 128 * 4)  # tiles of one group of columns: K in 4 blocks
    prompt = mx.array([[(7 * i + 3) % 320 for i in range(96)]])
    assert prompt.shape[1] >= layout.BLAS_ROWS
    caches = [make_prompt_cache(m) for m in (ours, ref)]
    before = blas.prefill_buffer_bytes()  # other threads' buffers (earlier tests in this process)
    with mx.stream(mx.new_stream(mx.cpu)):  # a thread of its own: its buffer is what it adds
        logits = [m(prompt, cache=c) for m, c in zip((ours, ref), caches)]
        mx.eval(logits)
    assert blas.dequantize_cache_bytes() == 0  # the old path kept every weight's fp32 copy here
    added = blas.prefill_buffer_bytes() - before
    assert 0 < added <= 320 * 32 * 4, added  # the head's 320 rows, one group
    assert mx.allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4).item()
    assert mx.array_equal(logits[0].argmax(-1), logits[1].argmax(-1)).item()
    tokens = [[], []]
    for i, (m, c) in enumerate(zip((ours, ref), caches)):
        token = logits[i][:, -1].argmax(-1)
        for _ in range(6):
            tokens[i].append(token.item())
            token = m(token[:, None], cache=c)[:, -1].argmax(-1)
    assert tokens[0] == tokens[1]


def _deep_llama(layers):
    import mlx.nn as nn
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=layers,
                           intermediate_size=2048, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=320, rope_theta=10000.0,
                           tie_word_embeddings=True)
    mx.random.seed(7)
    model = llama.Model(args)
    nn.quantize(model, group_size=32, bits=4)
    return layout.to_kernel_layout(model)


def test_a_prompt_chunks_peak_memory_does_not_grow_with_depth(blas):
    """Each layer of a prompt chunk is evaluated before the next is queued (KernelMLP), so the
    chunk's peak memory over what was allocated before it is about one layer's activations
    whatever the depth; unevaluated, MLX allocated ahead of its thread and 8 layers took ~2x
    what 2 layers did (61 vs 34 MB here)."""
    prompt = mx.array([[(7 * i + 3) % 320 for i in range(512)]])
    peaks = []
    for layers in (2, 8):
        model = _deep_llama(layers)
        mx.eval(model(prompt[:, :64], cache=make_prompt_cache(model)))  # warm up
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        mx.eval(model(prompt, cache=make_prompt_cache(model)))
        peaks.append(mx.get_peak_memory() - before)
    assert peaks[1] < 1.4 * peaks[0], peaks


# ---------------------------------------------- prompt chunks of several rows (a BatchKVCache)


def left_padding_mask(starts, length, cached):
    """mlx-lm's mask for a BatchKVCache chunk: key t visible to row b's position i when
    starts[b] <= t <= cached + i."""
    t = mx.arange(cached + length)
    causal = t[None] <= (cached + mx.arange(length))[:, None]
    return causal[None, None] & (starts[:, None, None, None] <= t)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 48), (4, 4, 32)])
@pytest.mark.parametrize("starts,length,cached", [
    ([0, 5], 23, 0),            # left-padded prompts: 5 positions of row 1 see no key
    ([3, 0, 40], 37, 45),       # a chunk after cached keys; row 2's padding reaches past them
    ([0, 17, 299, 120], 300, 0),
    ([2], 2, 7),
])
def test_prefill_attention_hides_each_rows_left_padding(kern, heads, kv_heads, dim, starts,
                                                        length, cached):
    """Per-row first visible keys (a BatchKVCache's left padding) vs MLX's attention under the
    boolean mask mlx-lm builds for it (atol 1e-5, as the causal test), positions that see no
    key included (MLX gives them the mean of every value); each position that sees keys equals a
    decode step there bit for bit, and starts of 0 equal no starts bit for bit."""
    B, total = len(starts), cached + length
    starts = mx.array(starts, dtype=mx.int32)
    q = mx.random.normal((B, heads, length, dim))
    k_buf, v_buf = (mx.random.normal((B, kv_heads, 512, dim)) for _ in range(2))
    k, v = k_buf[:, :, :total], v_buf[:, :, :total]  # a cache's prefix: strided
    mask = left_padding_mask(starts, length, cached)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, mask=mask)
    ref = ref.transpose(0, 2, 1, 3).reshape(B, length, -1)
    ours = kern.prefill_attention(q, k, v, dim ** -0.5, starts=starts)
    assert ours.shape == ref.shape
    assert mx.allclose(ours, ref, rtol=1e-5, atol=1e-5).item(), mx.abs(ours - ref).max().item()
    for i in (0, length // 2, length - 1):
        step = kern.decode_attention(q[:, :, i:i + 1], k[:, :, :cached + i + 1],
                                     v[:, :, :cached + i + 1], dim ** -0.5, starts=starts)
        for b in range(B):
            if starts[b].item() <= cached + i:  # (a decode step gives zeros where none shows)
                assert mx.array_equal(ours[b, i], step[b].reshape(-1)).item(), (b, i)
    zeros = mx.zeros((B,), dtype=mx.int32)
    assert mx.array_equal(kern.prefill_attention(q, k, v, 0.125, starts=zeros),
                          kern.prefill_attention(q, k, v, 0.125)).item()
    with pytest.raises(ValueError):
        kern.prefill_attention(q, k, v, 0.125, starts=mx.zeros((B + 1,), dtype=mx.int32))
    with pytest.raises(ValueError):
        kern.prefill_attention(q, k, v, 0.125, starts=starts.astype(mx.int64))


def test_prefill_attention_with_starts_reads_packed_rows_as_their_values(kern, isa):
    """Over an 8-bit cache's packed rows (kv8.py) it equals the op over their dequantized fp32
    values, bit for bit."""
    from engine.kernels.kv8 import pack, unpack

    k = pack(mx.random.normal((3, 3, 512, 64)))[:, :, :70]
    v = pack(mx.random.normal((3, 3, 512, 64)))[:, :, :70]
    q = mx.random.normal((3, 9, 30, 64))
    starts = mx.array([0, 12, 55], dtype=mx.int32)
    ours = kern.prefill_attention(q, k, v, 0.125, starts=starts)
    ref = kern.prefill_attention(q, unpack(k), unpack(v), 0.125, starts=starts)
    assert mx.array_equal(ours, ref).item(), mx.abs(ours - ref).max().item()


BATCH_PROMPTS = [[(7 * i + 3) % 319 + 1 for i in range(70)],
                 [(5 * i + 11) % 319 + 1 for i in range(23)],
                 [(3 * i + 2) % 319 + 1 for i in range(41)]]


def batch_kinds():
    from mlx_lm.models.cache import BatchKVCache

    from engine.kernels.kv8 import KV8Cache, SlotKV8Cache
    from engine.slot_cache import SlotKVCache

    # (the batch's cache, a row's cache alone)
    return {"BatchKVCache": (BatchKVCache, lambda m: make_prompt_cache(m)),
            "SlotKVCache": (SlotKVCache, lambda m: make_prompt_cache(m)),
            "SlotKV8Cache": (SlotKV8Cache, lambda m: [KV8Cache() for _ in m.layers])}


def left_padded(prompts):
    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    return mx.array([[0] * n + p for n, p in zip(padding, prompts)]), padding


@pytest.fixture
def batched_chunks(monkeypatch):
    """How many prompt chunks over a batch cache took our prefill attention (the real method,
    counted)."""
    calls = []
    real = layout.KernelLlamaAttention._prompt_chunk

    def counted(self, x, cache, starts):
        if starts is not None:
            calls.append(x.shape)
        return real(self, x, cache, starts)

    monkeypatch.setattr(layout.KernelLlamaAttention, "_prompt_chunk", counted)
    return calls


@pytest.mark.parametrize("kind", ["BatchKVCache", "SlotKVCache", "SlotKV8Cache"])
@pytest.mark.parametrize("bits,gs,traditional", [(4, 32, True), (8, 64, False)])
def test_a_batched_prefill_gives_each_row_what_it_gets_alone(kern, batched_chunks, kind, bits,
                                                             gs, traditional):
    """Three prompts (70, 23 and 41 tokens) prefilled together over a batch cache, left-padded
    as mlx-lm's BatchGenerator pads them: every layer's attention is our prefill op (each row's
    RoPE at its own offset, its padding hidden), each row's last logits are within rtol 1e-4 /
    atol 1e-4 of the prompt's alone over a plain cache (as the batched decode tests) with the
    same next token, and so are 4 greedy steps after it; mlx-lm's own model on the same batch
    (its mask, MLX's attention) gives our logits at every position within the same tolerance.
    Over the 8-bit cache, values that differ in their last bit between two sums (two models', or
    a batch's products and one row's) can round to codes one step apart (one value of 8-bit
    weights' 70 x 3 rows here: 0.009 off), so there the logits are checked as test_kv8 checks the
    8-bit cache's own error, within 2% of their scale, and the tokens still equal."""
    batch_cache, alone_cache = batch_kinds()[kind]
    ours, ref = tiny_llama_pair(bits, gs, traditional)
    tokens, padding = left_padded(BATCH_PROMPTS)
    cache = [batch_cache(padding) for _ in ours.layers]
    logits = ours(tokens, cache=cache)
    assert batched_chunks == [(3, 70, 128)] * len(ours.layers)
    theirs = ref(tokens, cache=[batch_cache(padding) for _ in ref.layers])
    if kind == "SlotKV8Cache":
        assert mx.abs(logits - theirs).max().item() < 0.02 * mx.abs(theirs).max().item()
    else:
        assert mx.allclose(logits, theirs, rtol=1e-4, atol=1e-4).item(), mx.abs(logits - theirs).max().item()
    together, last = [], logits[:, -1:]
    for _ in range(5):
        step = mx.argmax(last, axis=-1)
        together.append((last, step[:, 0].tolist()))
        last = ours(step, cache=cache)
    for row, prompt in enumerate(BATCH_PROMPTS):
        cache_alone = alone_cache(ours)
        last = ours(mx.array([prompt]), cache=cache_alone)[:, -1:]
        for n, (batched, tokens_then) in enumerate(together):
            if kind == "SlotKV8Cache":  # a key one code apart, as against mlx-lm above
                assert mx.abs(last - batched[row]).max().item() < 0.02 * mx.abs(last).max().item(), (row, n)
            else:
                assert mx.allclose(last, batched[row], rtol=1e-4, atol=1e-4).item(), (row, n)
            token = mx.argmax(last, axis=-1)
            assert token.item() == tokens_then[row], (row, n)
            last = ours(token, cache=cache_alone)


def test_batched_chunks_the_op_cannot_express_keep_mlx_lms_attention(kern, batched_chunks):
    """The mask a BatchKVCache makes is exactly what `starts` says (and `_prompt_chunk` takes
    it); another mask (additive, of another shape, none), a rotating batch cache and a sliding
    window's layers (their mask also hides keys older than the window) keep mlx-lm's attention:
    with a window of 8 over 40-token prompts the logits are mlx-lm's, and taking our op there
    would change them."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

    tokens, padding = left_padded([p[:40] for p in BATCH_PROMPTS])
    cache = BatchKVCache(padding)
    mx.eval(cache.update_and_fetch(*(mx.zeros((3, 2, 5, 32)),) * 2))  # 5 keys already held
    x = mx.zeros((3, 40, 128))
    mask = cache.make_mask(40)
    took, starts = layout._prompt_chunk(x, mask, cache)
    assert took and starts.tolist() == padding
    assert mx.array_equal(mask, left_padding_mask(starts, 40, 5)).item()
    for other in (mask.astype(mx.float32), mask[..., 1:], None, "causal"):
        assert layout._prompt_chunk(x, other, cache) == (False, None)
    rotating = BatchRotatingKVCache(max_size=64, left_padding=padding)
    assert layout._prompt_chunk(x, rotating.make_mask(40), rotating) == (False, None)

    window = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    ours, ref = tiny_llama_pair(4, 32, False, **window)
    assert [layer.self_attn.sliding for layer in ours.layers] == [True, False]
    run = lambda m: m(tokens, cache=[BatchKVCache(padding) for _ in m.layers])
    logits, theirs = run(ours), run(ref)
    assert batched_chunks == [(3, 40, 128)]  # the full-attention layer only
    assert mx.allclose(logits, theirs, rtol=1e-4, atol=1e-4).item(), mx.abs(logits - theirs).max().item()
    ours.layers[0].self_attn.sliding = False
    assert not mx.allclose(run(ours), theirs, rtol=1e-2, atol=1e-2).item()
