"""engine/kernels: each C++ kernel against MLX's own op on random shapes, odd sizes, every
supported bits / group size and 1-8 rows, and layers the kernels cannot take falling back.

Tolerances (fp32 everywhere; the kernels sum in another order than MLX does):
- dequantize (prefill) vs mx.dequantize: equal;
- quantized matmul vs mx.quantized_matmul on the same weights (scales as fp32): rtol 1e-4,
  atol 1e-4 for outputs of magnitude ~10-100 (K up to 1536 products);
- RMSNorm vs mx.fast.rms_norm: rtol 1e-5, atol 1e-5;
- SwiGLU vs mlx-lm's swiglu: rtol 1e-5, atol 1e-5 (exp in another implementation);
- RoPE vs mx.fast.rope: atol 5e-5 (angles up to ~700 rad, where fp32 sin/cos implementations
  differ by an ulp of the angle), 1e-5 at small offsets;
- decode attention vs mx.fast.scaled_dot_product_attention: atol 1e-5;
- prefill (causal) attention vs mx.fast.scaled_dot_product_attention with mask="causal": atol 1e-5;
  each position equal, bit for bit, to a decode step's attention at that position;
- int8-activation matmul (lossy): vs the same arithmetic in MLX ops (x rounded per 32-element
  block to 15 bits, held as two int8 limbs; the bias times x's exact sums): rtol 1e-4, atol 2e-3;
  vs the exact product: relative L2 error under 0.1%.
"""

import logging

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.kernels import active_path, describe_device, device_report, fused_ref, native
from engine.kernels.layout import KernelLinear, to_kernel_layout, unsupported
from tiny_models import KERNEL_PROMPTS as PROMPTS, tiny_llama_pair

pytestmark = pytest.mark.fast


def quantized(n, k, bits, gs, scale_dtype=mx.float16, seed=0):
    mx.random.seed(seed)
    w, s, b = mx.quantize(mx.random.normal((n, k)), group_size=gs, bits=bits)
    return w, s.astype(scale_dtype), b.astype(scale_dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_quantized_matmul_matches_mlx(kern, bits, gs, rows):
    for n, k in [(37, 384), (200, 3 * gs), (576, 1536)]:
        w, s, b = quantized(n, k, bits, gs, seed=rows)
        x = mx.random.normal((rows, k))
        ref = mx.quantized_matmul(x, w, s.astype(mx.float32), b.astype(mx.float32),
                                  transpose=True, group_size=gs, bits=bits)
        ours = kern.quantized_matmul(x, w, s, b, gs, bits)
        assert ours.shape == ref.shape and ours.dtype == mx.float32
        assert mx.allclose(ours, ref, rtol=1e-4, atol=1e-4).item(), mx.abs(ours - ref).max().item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_dequantize_matches_mlx_exactly(kern, bits, gs):
    """The prefill path's dequantization (then BLAS): q * scale + bias, the same fp32 values."""
    w, s, b = quantized(77, 2 * gs * 3, bits, gs)
    ref = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), gs, bits)
    assert mx.array_equal(kern.dequantize(w, s, b, gs, bits), ref).item()


def test_dequantized_weights_reuse_their_memory(kern):
    """A prompt chunk dequantizes every layer's matrices: a result of a size seen before takes a
    kept buffer (no fresh pages from the OS, ~0.7 ms a MB here), while arrays alive at once never
    share one, and a large matrix split over the pool equals it dequantized on one thread."""
    import resource

    faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    w1, s1, b1 = quantized(2048, 1024, 4, 32, seed=1)  # 8 MB of fp32 out
    w2, s2, b2 = quantized(2048, 1024, 4, 32, seed=2)
    mx.eval(w1, s1, b1, w2, s2, b2)
    ref1 = mx.dequantize(w1, s1.astype(mx.float32), b1.astype(mx.float32), 32, 4)
    ref2 = mx.dequantize(w2, s2.astype(mx.float32), b2.astype(mx.float32), 32, 4)
    mx.eval(ref1, ref2)
    for _ in range(2):
        mx.eval(kern.dequantize(w1, s1, b1, 32, 4))
    before = faults()
    a = kern.dequantize(w1, s1, b1, 32, 4)
    mx.eval(a)
    assert faults() - before < 2048 // 8, faults() - before  # 2,048 pages if taken fresh
    b = kern.dequantize(w2, s2, b2, 32, 4)  # `a` still alive: another buffer
    mx.eval(b)
    assert mx.array_equal(a, ref1).item() and mx.array_equal(b, ref2).item()
    w, s, b = quantized(8192, 1024, 4, 32, seed=3)  # 32 MB out: split over the pool
    split = kern.dequantize(w, s, b, 32, 4)
    mx.eval(split)
    threads = kern.num_threads()
    try:
        kern.set_num_threads(1)
        assert mx.array_equal(split, kern.dequantize(w, s, b, 32, 4)).item()
    finally:
        kern.set_num_threads(threads)


def test_a_decode_step_hands_the_prompt_buffers_back(kern):
    """The buffers kept for a prompt's dequantized weights are freed when a decode step runs, so
    they do not stay resident while tokens are generated (resident memory <= weights + 0.6 GB)."""
    w, s, b = quantized(512, 1024, 4, 32)  # 2 MB of fp32 out
    q, k = mx.random.normal((1, 4, 1, 64)), mx.random.normal((1, 2, 10, 64))
    mx.eval(w, s, b, q, k)
    mx.eval(kern.decode_attention(q, k, k, 0.125))  # from an empty cache, whatever ran before
    mx.eval(kern.dequantize(w, s, b, 32, 4))  # the result dies: its buffer is kept
    assert kern.dequantize_cache_bytes() >= 512 * 1024 * 4
    mx.eval(kern.decode_attention(q, k, k, 0.125))
    assert kern.dequantize_cache_bytes() == 0


@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_quantized_matmul_scale_dtypes_and_shapes(kern, scale_dtype):
    w, s, b = quantized(96, 256, 4, 64, scale_dtype)
    ref_w = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), 64, 4)
    for shape in [(256,), (1, 1, 256), (2, 1, 256), (3, 4, 256), (11, 256)]:  # 11 rows: chunks of 8
        x = mx.random.normal(shape)
        ours = kern.quantized_matmul(x, w, s, b, 64, 4)
        assert ours.shape == (*shape[:-1], 96)
        assert mx.allclose(ours, x @ ref_w.T, rtol=1e-4, atol=1e-4).item()
    x = mx.random.normal((8, 512))[:, ::2]  # a strided (non-contiguous) input
    assert mx.allclose(kern.quantized_matmul(x, w, s, b, 64, 4), x @ ref_w.T, rtol=1e-4, atol=1e-4).item()


def test_quantized_matmul_same_result_on_any_thread_count(kern):
    w, s, b = quantized(1000, 512, 4, 32)
    x = mx.random.normal((3, 512))
    before = kern.num_threads()
    try:
        kern.set_num_threads(1)
        one = kern.quantized_matmul(x, w, s, b, 32, 4)
        mx.eval(one)
        kern.set_num_threads(3)
        three = kern.quantized_matmul(x, w, s, b, 32, 4)
        assert mx.array_equal(one, three).item()  # each output row is summed by one thread
    finally:
        kern.set_num_threads(before)


@pytest.mark.parametrize("bad", [dict(bits=3), dict(gs=16), dict(k=100)])
def test_quantized_matmul_rejects_what_it_cannot_run(kern, bad):
    bits, gs, k = bad.get("bits", 4), bad.get("gs", 32), bad.get("k", 128)
    w, s, b = quantized(16, 128, 4 if bits == 3 else bits, 32 if gs == 16 else gs)
    with pytest.raises(ValueError):
        kern.quantized_matmul(mx.random.normal((1, k)), w, s, b, gs, bits)


@pytest.mark.parametrize("shape", [(576,), (1, 1, 576), (3, 7, 65)])
def test_rms_norm_matches_mlx(kern, shape):
    x, w = mx.random.normal(shape) * 3, mx.random.normal(shape[-1:])
    ref = mx.fast.rms_norm(x, w, 1e-5)
    assert mx.allclose(kern.rms_norm(x, w, 1e-5), ref, rtol=1e-5, atol=1e-5).item()


@pytest.mark.parametrize("shape", [(1, 1, 1536), (3, 7), (1, 300, 1536)])
def test_swiglu_matches_mlx_lm(kern, shape):
    from mlx_lm.models.activations import swiglu

    gate, up = 4 * mx.random.normal(shape), mx.random.normal(shape)
    ours = kern.swiglu(gate, up)
    assert mx.allclose(ours, swiglu(gate, up), rtol=1e-5, atol=1e-5).item()
    with pytest.raises(ValueError):
        kern.swiglu(gate, up[..., :1])


@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("dims,base,scale", [(64, 100000.0, 1.0), (32, 10000.0, 0.5), (18, 500.0, 2.0)])
@pytest.mark.parametrize("offset", [0, 5, 700])
def test_rope_matches_mlx(kern, traditional, dims, base, scale, offset):
    x = mx.random.normal((2, 5, 9, 64)).transpose(0, 2, 1, 3)  # (B, heads, L, D), strided
    ref = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
    ours = kern.rope(x, dims, traditional, base, scale, offset)
    atol = 5e-5 if offset * scale > 100 else 1e-5
    assert mx.allclose(ours, ref, rtol=1e-5, atol=atol).item(), mx.abs(ours - ref).max().item()


@pytest.mark.parametrize("traditional", [True, False])
def test_rope_at_per_row_offsets_is_each_row_at_its_own(kern, traditional):
    """A batched cache's per-row offsets (x's first axis): each row exactly what the op gives it
    at its own int offset, and MLX's rope at those offsets within fp32 rounding; a bad offsets
    array is refused."""
    x = mx.random.normal((3, 9, 5, 64)).transpose(0, 2, 1, 3)  # (B, heads, L, D), strided
    offsets = mx.array([0, 37, 700], dtype=mx.int32)
    ours = kern.rope(x, 64, traditional, 10000.0, 1.0, 0, offsets=offsets)
    for b, at in enumerate(offsets.tolist()):
        assert mx.array_equal(ours[b], kern.rope(x[b:b + 1], 64, traditional, 10000.0, 1.0, at)[0]).item()
    ref = mx.fast.rope(x, 64, traditional=traditional, base=10000.0, scale=1.0, offset=offsets)
    # at position ~700 an fp32 angle's own rounding (~6e-5 rad) moves values of |x| up to ~4
    assert mx.allclose(ours, ref, rtol=1e-5, atol=1e-4).item(), mx.abs(ours - ref).max().item()
    with pytest.raises(ValueError):
        kern.rope(x, 64, traditional, 10000.0, 1.0, 0, offsets=offsets[:2])


def test_inputs_strided_on_their_last_axis_are_read_as_they_are(kern):
    x = mx.random.normal((2, 7, 5, 64))[..., ::2]  # every other element of the last axis
    ref = mx.fast.rope(x, 32, traditional=False, base=10000.0, scale=1.0, offset=3)
    assert mx.allclose(kern.rope(x, 32, False, 10000.0, 1.0, 3), ref, rtol=1e-5, atol=1e-5).item()
    w = mx.random.normal((32,))
    ref = mx.fast.rms_norm(x, w, 1e-5)
    assert mx.allclose(kern.rms_norm(x, w, 1e-5), ref, rtol=1e-5, atol=1e-5).item()


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("length", [1, 37, 300])
def test_decode_attention_matches_mlx(kern, heads, kv_heads, length):
    q = mx.random.normal((2, heads, 1, 64))
    k_buf, v_buf = mx.random.normal((2, kv_heads, 512, 64)), mx.random.normal((2, kv_heads, 512, 64))
    k, v = k_buf[:, :, :length], v_buf[:, :, :length]  # a cache's prefix: strided, as in decoding
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    ours = kern.decode_attention(q, k, v, 0.125)
    assert mx.allclose(ours, ref, rtol=1e-5, atol=1e-5).item(), mx.abs(ours - ref).max().item()


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
def test_decode_attention_hides_each_rows_left_padding(kern, heads, kv_heads):
    """Per-row first visible keys (a BatchKVCache's left padding) vs MLX's attention with the
    mask mlx-lm builds for it: atol 1e-5."""
    length, starts = 40, mx.array([0, 7, 39, 12], dtype=mx.int32)
    q = mx.random.normal((4, heads, 1, 64))
    k_buf, v_buf = mx.random.normal((4, kv_heads, 256, 64)), mx.random.normal((4, kv_heads, 256, 64))
    k, v = k_buf[:, :, :length], v_buf[:, :, :length]
    mask = (starts[:, None] <= mx.arange(length)[None])[:, None, None, :]
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    ours = kern.decode_attention(q, k, v, 0.125, starts=starts)
    assert mx.allclose(ours, ref, rtol=1e-5, atol=1e-5).item(), mx.abs(ours - ref).max().item()
    with pytest.raises(ValueError):
        kern.decode_attention(q, k, v, 0.125, starts=starts[:3])


def test_layers_the_kernels_cannot_take_keep_mlx_ops_with_a_reason(kern, caplog):
    mx.random.seed(3)
    model = nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 64))
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda p, m: p == "layers.0")
    nn.quantize(model, group_size=32, bits=3, class_predicate=lambda p, m: p == "layers.1")
    x = mx.random.normal((1, 256))
    ref = model(x)
    assert unsupported(model.layers[0]) is None and "3-bit" in unsupported(model.layers[1])
    with caplog.at_level(logging.INFO):
        to_kernel_layout(model)
    assert type(model.layers[0]) is KernelLinear
    assert type(model.layers[1]) is nn.QuantizedLinear
    assert "layers.1 stays on MLX's quantized op: 3-bit weights" in caplog.text
    assert mx.allclose(model(x), ref.astype(mx.float32), rtol=1e-3, atol=1e-3).item()


def int8_reference(x, w, s, b, gs, bits, centred):
    """What the int8 kernels compute, in MLX ops: x per 32-element block as d * v (v = x *
    16192 / max|x| rounded: the two limbs 128 * hi + lo hold it exactly), times the weights'
    codes times s, plus b times x's exact sum over each group. `centred` (the units without VNNI
    at 512 bits): the codes enter as code - c (c = 2^(bits-1)) and b + c * s multiplies the sums,
    equal in exact arithmetic, not in x's rounding."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // 32, 32)
    amax = mx.max(mx.abs(blocks), axis=-1, keepdims=True)
    v = mx.round(blocks * mx.where(amax > 0, 16192.0 / amax, 0.0))
    xq = (v * (amax / 16192.0)).reshape(rows, k)
    s32, b32 = s.astype(mx.float32), b.astype(mx.float32)
    centre = 2 ** (bits - 1) if centred else 0
    codes = mx.dequantize(w, mx.ones_like(s32), mx.zeros_like(b32), gs, bits)
    w_centred = (codes - centre) * mx.repeat(s32, gs, axis=1)
    group_sums = x.reshape(rows, k // gs, gs).sum(-1)
    return xq @ w_centred.T + group_sums @ (b32 + centre * s32).T


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 1, 48)])
@pytest.mark.parametrize("length,cached", [(2, 0), (37, 0), (300, 0), (19, 45)])
def test_prefill_attention_matches_mlx(kern, heads, kv_heads, dim, length, cached):
    """A prompt chunk of `length` positions after `cached` keys already in the cache (mlx-lm's
    "causal" mask: position i sees keys up to cached + i); the output comes as (B, L, H * D)."""
    total = cached + length
    q = mx.random.normal((2, heads, length, dim))
    k_buf, v_buf = mx.random.normal((2, kv_heads, 512, dim)), mx.random.normal((2, kv_heads, 512, dim))
    k, v = k_buf[:, :, :total], v_buf[:, :, :total]  # a cache's prefix: strided
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, mask="causal")
    ours = kern.prefill_attention(q, k, v, dim ** -0.5)
    ref = ref.transpose(0, 2, 1, 3).reshape(2, length, -1)
    assert mx.allclose(ours, ref, rtol=1e-5, atol=1e-5).item(), mx.abs(ours - ref).max().item()
    for i in (0, length // 2, length - 1):  # what a decode step at that position gives
        step = kern.decode_attention(q[:, :, i:i + 1], k[:, :, :cached + i + 1],
                                     v[:, :, :cached + i + 1], dim ** -0.5)
        assert mx.array_equal(ours[:, i], step.reshape(2, -1)).item(), i
    with pytest.raises(ValueError):
        kern.prefill_attention(q, k[:, :, :length - 1], v[:, :, :length - 1], 0.125)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_quantized_matmul_on_every_unit(kern, isa, bits, gs, rows):
    """The exact path and the int8 path on each instruction-set unit; dequantize too."""
    w, s, b = quantized(200, 3 * gs * 2, bits, gs, seed=rows)
    x = mx.random.normal((rows, 3 * gs * 2))
    ref = mx.quantized_matmul(x, w, s.astype(mx.float32), b.astype(mx.float32),
                              transpose=True, group_size=gs, bits=bits)
    assert mx.allclose(kern.quantized_matmul(x, w, s, b, gs, bits), ref, rtol=1e-4, atol=1e-4).item()
    ours = kern.quantized_matmul(x, w, s, b, gs, bits, int8=True)
    ref8 = int8_reference(x, w, s, b, gs, bits, centred=isa != "avx512-vnni")
    assert mx.allclose(ours, ref8, rtol=1e-4, atol=2e-3).item()
    deq = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), gs, bits)
    assert mx.allclose(kern.dequantize(w, s, b, gs, bits), deq, rtol=1e-6, atol=1e-6).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("int8", [False, True])
def test_each_row_of_a_multi_row_product_equals_that_row_alone(kern, isa, bits, int8):
    """Batched decoding equals solo decoding only if the 2-8 row kernels sum each row exactly
    as the 1-row kernel does: bit for bit, on each unit, odd output counts included."""
    w, s, b = quantized(203, 576, bits, 32, seed=11)
    x = mx.random.normal((8, 576))
    alone = mx.concatenate([kern.quantized_matmul(x[i:i + 1], w, s, b, 32, bits, int8=int8)
                            for i in range(8)])
    for rows in range(2, 9):
        batched = kern.quantized_matmul(x[:rows], w, s, b, 32, bits, int8=int8)
        assert mx.array_equal(batched, alone[:rows]).item(), (rows, mx.abs(batched - alone[:rows]).max().item())


@pytest.mark.parametrize("bits", [4, 8])
def test_an_int8_prompt_chunk_gives_each_row_what_it_gets_alone(kern, isa, bits):
    """A prompt chunk on the int8 path (x quantized once, W's rows in blocks that stay in cache,
    every 8 rows of x over each block) computes each row as a decode step does: bit for bit,
    with several weight blocks and a last group of fewer than 8 rows."""
    w, s, b = quantized(300, 4096, bits, 64, seed=5)
    x = mx.random.normal((70, 4096))
    alone = mx.concatenate([kern.quantized_matmul(x[i:i + 1], w, s, b, 64, bits, int8=True)
                            for i in range(70)])
    for rows in (19, 70):
        chunk = kern.quantized_matmul(x[:rows], w, s, b, 64, bits, int8=True)
        assert mx.array_equal(chunk, alone[:rows]).item(), (rows, mx.abs(chunk - alone[:rows]).max().item())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_activation_matmul_matches_its_reference(kern, bits, gs, rows):
    for n, k in [(37, 384), (300, 3 * gs * 4)]:
        w, s, b = quantized(n, k, bits, gs, seed=rows + 7)
        x = mx.random.normal((rows, k)) * mx.random.uniform(0.1, 4.0, (rows, k))  # uneven blocks
        x = mx.concatenate([mx.zeros((rows, 32)), x[:, 32:]], axis=1)  # an all-zero block too
        ours = kern.quantized_matmul(x, w, s, b, gs, bits, int8=True)
        ref8 = int8_reference(x, w, s, b, gs, bits, centred=kern.isa() != "avx512-vnni")
        assert mx.allclose(ours, ref8, rtol=1e-4, atol=2e-3).item()
        # the GPU decode step's int8 products (fused_cuda.qdot) are checked against this one
        gpu_ref = fused_ref.int8_product(x, w, s, b, gs, bits)
        assert mx.allclose(gpu_ref, int8_reference(x, w, s, b, gs, bits, centred=False), rtol=1e-5, atol=1e-4).item()
        assert mx.allclose(gpu_ref, ours, rtol=1e-4, atol=2e-3).item()
        exact = kern.quantized_matmul(x, w, s, b, gs, bits)
        assert not mx.array_equal(ours, exact).item()
        # two limbs: x to 15 bits of each block's largest value (one int8 limb gave ~0.6%)
        assert (mx.linalg.norm(ours - exact) / mx.linalg.norm(exact)).item() < 1e-3


def test_active_path_names_the_kernels_and_threads(kern, monkeypatch):
    assert active_path() == f"quantized CPU kernels ({kern.isa()}, {kern.num_threads()} threads)"
    monkeypatch.setenv("MLXCHAT_KERNELS", "int8")
    assert active_path() == (f"quantized CPU kernels ({kern.isa()}, {kern.num_threads()} threads, "
                             "int8 activations)")
    monkeypatch.setenv("MLXCHAT_KERNELS", "0")
    assert active_path() == "fp32 layout (CPU kernels unavailable: turned off by MLXCHAT_KERNELS=0)"


def test_thread_count_honours_mlxchat_threads(monkeypatch):
    monkeypatch.setenv("MLXCHAT_THREADS", "3")
    assert native.thread_count() == 3
    monkeypatch.delenv("MLXCHAT_THREADS")
    assert 1 <= native.thread_count() == native.physical_cores()


def test_device_report_and_description_name_the_path(kern):
    assert device_report()["compute_path"] == active_path()
    assert describe_device(mx.Device(mx.cpu)).endswith(f"; {active_path()})")


@pytest.mark.parametrize("bits,gs,traditional", [(4, 32, True), (4, 64, False), (8, 128, True)])
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_layer_steps_match_mlx_lm(kern, bits, gs, traditional, batch):
    """Prefill (5 tokens: the single ops), then one-token steps (the fused layer ops) with a KV
    cache, 1 or 3 rows: logits within rtol 1e-4 / atol 1e-4 of mlx-lm's own model on MLX's ops."""
    from mlx_lm.models.cache import make_prompt_cache

    from engine.kernels.layout import KernelLlamaBlock

    ours, ref = tiny_llama_pair(bits, gs, traditional)
    assert all(type(layer) is KernelLlamaBlock and layer.fused_decode for layer in ours.model.layers)
    caches = make_prompt_cache(ours), make_prompt_cache(ref)
    tokens = mx.array([[5, 17, 200, 3, 99]] * batch) + mx.arange(batch)[:, None]
    for step in range(5):
        a, b = ours(tokens, cache=caches[0]), ref(tokens, cache=caches[1])
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item(), (step, mx.abs(a - b).max().item())
        tokens = mx.argmax(b[:, -1:], axis=-1)


def left_padded_batch(model, prompts):
    """A BatchKVCache per layer, prefilled with `prompts` left-padded as mlx-lm's BatchGenerator
    pads them; returns (caches, last-position logits)."""
    from mlx_lm.models.cache import BatchKVCache

    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    caches = [BatchKVCache(padding) for _ in model.layers]
    logits = model(mx.array([[0] * n + p for n, p in zip(padding, prompts)]), cache=caches)
    return caches, logits[:, -1:]


@pytest.mark.parametrize("bits,gs,traditional", [(4, 32, True), (4, 64, False), (8, 128, True)])
@pytest.mark.parametrize("fused", [True, False])
def test_batched_steps_match_mlx_lm(kern, bits, gs, traditional, fused):
    """One-token steps over a BatchKVCache with rows of different lengths (left padding 0, 5 and
    3): the fused layer ops (or, in a layer they cannot take, as with biased projections, our
    decode attention) with per-row RoPE positions and hidden padding keys give logits within
    rtol 1e-4 / atol 1e-4 of mlx-lm's own model (its mask, MLX's ops), over 6 steps."""
    from engine.kernels.layout import KernelLlamaAttention, KernelLlamaBlock

    ours, ref = tiny_llama_pair(bits, gs, traditional, attention_bias=not fused)
    layers = ours.model.layers
    assert all(type(layer) is KernelLlamaBlock and layer.fused_decode == fused for layer in layers)
    assert all(type(layer.self_attn) is KernelLlamaAttention for layer in layers)
    (ca, a), (cb, b) = left_padded_batch(ours, PROMPTS), left_padded_batch(ref, PROMPTS)
    for step in range(6):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item(), (step, mx.abs(a - b).max().item())
        tokens = mx.argmax(b, axis=-1)
        a, b = ours(tokens, cache=ca), ref(tokens, cache=cb)


def test_fused_batched_greedy_tokens_equal_each_row_alone(kern):
    """Greedy decoding of three rows together over a BatchKVCache gives each row the tokens it
    gets decoded alone over a plain KVCache (both on the fused ops)."""
    from mlx_lm.models.cache import make_prompt_cache

    ours, _ = tiny_llama_pair(4, 32, True)
    caches, logits = left_padded_batch(ours, PROMPTS)
    together = []
    for _ in range(10):
        tokens = mx.argmax(logits, axis=-1)
        together.append(tokens[:, 0].tolist())
        logits = ours(tokens, cache=caches)
    for row, prompt in enumerate(PROMPTS):
        cache, alone = make_prompt_cache(ours), []
        logits = ours(mx.array([prompt]), cache=cache)[:, -1:]
        for _ in range(10):
            token = mx.argmax(logits, axis=-1)
            alone.append(token.item())
            logits = ours(token, cache=cache)
        assert alone == [step[row] for step in together], row


def test_a_damaged_kernel_module_is_never_loaded(tmp_path):
    """A cached module whose bytes differ from what the build recorded is deleted, not loaded
    (loading a damaged shared library can kill the process with SIGSEGV); without build tools
    the app then runs the fp32 layout with one warning, and exits cleanly."""
    import shutil
    import subprocess
    import sys

    from engine.kernels import native

    if native.kernels() is None:
        pytest.skip("the kernels are not built on this machine")
    folder = native.build_dir()
    module = native._built(folder)
    home = tmp_path / "home"
    target = home / "cache" / "kernels" / folder.name
    target.mkdir(parents=True)
    shutil.copy2(module, target / module.name)
    shutil.copy2(native._digest_file(module), target / native._digest_file(module).name)
    with open(target / module.name, "r+b") as f:  # damage it
        f.seek(4096)
        f.write(b"\xff" * 4096)
    code = ("from engine.kernels import native; s = native.status(); "
            "print('module', s.module is not None); print('reason', s.reason)")
    env = {**__import__("os").environ, "MLXCHAT_HOME": str(home), "PATH": "/nonexistent"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=str(native.SOURCE_DIR.parents[1]))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "module False" in out.stdout and "damaged" in out.stdout
    assert not (target / module.name).exists()


def test_read_bandwidth_reads_every_word_of_every_pass(kern, isa):
    """The bench's STREAM-style row (bench/decode.py), on each unit's loads: its checksum is the
    sum of all 64-bit words, once per pass (odd lengths reach the tail loop), and it refuses
    arrays it cannot read as such."""
    import numpy as np

    for n in (3 << 18, (3 << 18) + 2 * 37):
        a = mx.arange(n, dtype=mx.uint32) * 7919
        mx.eval(a)
        seconds, check = kern.read_bandwidth(a, 3)
        words = np.array(a).view(np.uint64)
        assert seconds > 0 and check == (3 * int(words.sum(dtype=np.uint64))) % 2**64
    with pytest.raises(ValueError):
        kern.read_bandwidth(mx.zeros((3,), dtype=mx.uint8))


def test_huge_pages_keep_the_contents(kern):
    """2 MB pages under an array (the bench's read test and weight copies): the values stay, the
    whole 2 MB pages inside it are reported (0 where the kernel declines), and a product on it
    gives the same bits."""
    w, s, b = quantized(2048, 4096, 4, 32)  # 4 MB of codes: at least one whole 2 MB page
    x = mx.random.normal((1, 4096))
    before = kern.quantized_matmul(x, w, s, b, 32, 4)
    copy = mx.array(w)
    mx.eval(before, copy)
    done = kern.huge_pages(w)
    assert done in (0,) or (done % (2 << 20) == 0 and 0 < done <= w.nbytes)
    assert mx.array_equal(w, copy).item()
    assert mx.array_equal(kern.quantized_matmul(x, w, s, b, 32, 4), before).item()
    assert kern.huge_pages(mx.zeros((16,), dtype=mx.uint32)) == 0  # no whole page inside


def test_converted_weights_sit_on_huge_pages(kern):
    """to_kernel_layout backs the quantized weights with 2 MB pages (where the OS has
    transparent huge pages): the kernel reports them, the process's smaps count them, and the
    layer's output does not change."""
    from pathlib import Path

    from engine.kernels import layout

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("no transparent huge pages on this machine")
    model = nn.Sequential(nn.QuantizedLinear.from_linear(nn.Linear(4096, 2048, bias=False), 32, 4))
    x = mx.random.normal((1, 4096))
    before = model(x)
    mx.eval(before)
    layout.to_kernel_layout(model)
    assert type(model.layers[0]) is KernelLinear
    assert layout.huge_pages(model) >= 2 << 20  # the 4 MB of codes hold at least one whole page
    rollup = Path("/proc/self/smaps_rollup").read_text()
    huge_kb = int(next(line for line in rollup.splitlines() if line.startswith("AnonHugePages")).split()[1])
    assert huge_kb >= 2048
    assert mx.allclose(model(x), before, rtol=1e-4, atol=1e-4).item()


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_weight_rows_taken_together_give_the_same_bits(kern, isa, rows):
    """The 4- and 8-bit kernels take 2-4 weight rows at a time (independent accumulator chains;
    3-4 rows of x only where x outgrows its share of L1, so K = 2048 too); each output is summed
    in the same order as one row at a time, so the bits do not move (output counts that leave a
    tail of single rows included)."""
    for n, k, bits in ((203, 512, 4), (64, 512, 4), (203, 512, 8), (64, 512, 8), (203, 2048, 4),
                       (70, 2048, 8)):
        w, s, b = quantized(n, k, bits, 32, seed=n + rows)
        x = mx.random.normal((rows, k))
        assert kern.interleave_rows()
        together = kern.quantized_matmul(x, w, s, b, 32, bits)
        try:
            kern.set_interleave_rows(False)
            alone = kern.quantized_matmul(x, w, s, b, 32, bits)
            mx.eval(alone)
        finally:
            kern.set_interleave_rows(True)
        assert mx.array_equal(together, alone).item()


@pytest.mark.parametrize("unit", ["avx2", "generic"])
def test_a_fresh_thread_runs_a_product_of_three_to_eight_rows(kern, unit):
    """The first product a process runs, of 3-8 rows on a unit without AVX-512, in threads whose
    scratch buffers are still empty: each row's scales fit the scratch it asked for. (The AVX2
    unit once asked for none from three rows on, and wrote the scales through a null pointer:
    the default unit on CPUs without AVX-512 crashed with three or more streams.) A process of
    its own, so that no earlier product has grown the buffers; two threads, so the pool's
    worker runs blocks too."""
    import os
    import subprocess
    import sys

    if unit not in kern.isas():
        pytest.skip(f"this CPU cannot run the {unit} kernels")
    code = (
        "import mlx.core as mx\n"
        "from engine.kernels import native\n"
        f"k = native.kernels(); k.set_isa({unit!r})\n"
        "w, s, b = mx.quantize(mx.random.normal((203, 576)), group_size=64, bits=4)\n"
        "for rows in (3, 8):\n"
        "    x = mx.random.normal((rows, 576))\n"
        "    ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)\n"
        "    assert mx.allclose(k.quantized_matmul(x, w, s, b, 64, 4), ref, rtol=1e-4, atol=1e-4).item()\n"
        "print('ok')\n")
    env = {**os.environ, "MLXCHAT_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=str(native.SOURCE_DIR.parents[1]))
    assert out.returncode == 0 and "ok" in out.stdout, (out.returncode, out.stderr[-2000:])
