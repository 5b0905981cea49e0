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
    not the weight."""
    blas.set_prefill_tile_bytes(1 << 20)
    w, s, b = quantized(4096, 1024, 4, 64, mx.float16)
    x = mx.random.normal((64, 1024))
    ours = blas.prefill_matmul(x, w, s, b, 64, 4)
    assert mx.allclose(ours, reference(x, w, s, b, 64, 4), rtol=1e-5, atol=1e-4).item()
    assert 0 < blas.prefill_buffer_bytes() <= 1 << 20, blas.prefill_buffer_bytes()


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
    logits = [m(prompt, cache=c) for m, c in zip((ours, ref), caches)]
    mx.eval(logits)
    assert blas.dequantize_cache_bytes() == 0  # the old path kept every weight's fp32 copy here
    assert 0 < blas.prefill_buffer_bytes() <= 320 * 32 * 4  # the head's 320 rows, one group
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
