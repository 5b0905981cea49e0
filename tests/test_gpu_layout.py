"""engine/kernels/gpu_layout.py, the layout a model takes on a GPU: q/k/v and gate/up each become
one product against their stacked weights. On the CPU in fp32 that gives mlx-lm's logits within
float rounding (a BLAS may sum a wider product in another order), for llama, qwen2 (projection biases), qwen3 (q/k norms), 4-bit affine
weights and the Qwen3.5 hybrid (its MLPs; its attention stays as loaded), over a prompt, a
one-token step and a step of several rows; the engine serving a stacked model answers with the
tokens mlx-lm's model gives, alone and with several requests decoding in one batch."""

import collections
import dataclasses
import io

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from bench.shapes import Shape, build_module
from engine.decoding.sampling import SamplingParams
from engine.kernels import batch_attention
from engine.kernels.gpu_layout import StackedAttention, StackedMLP, to_gpu_layout
from tiny_models import LLAMA, QWEN3_5, tiny_llama

pytestmark = pytest.mark.fast

CONFIGS = {
    "llama": (LLAMA, None),
    "qwen2": ({**LLAMA, "model_type": "qwen2"}, None),
    "qwen3": ({**LLAMA, "model_type": "qwen3"}, None),
    "llama-4bit": (LLAMA, 4),
    "qwen3_5": (QWEN3_5, None),
}


def pair(kind: str) -> tuple[nn.Module, nn.Module]:
    """(mlx-lm's model, the same weights in the GPU layout), fp32."""
    config, bits = CONFIGS[kind]
    shape = Shape(kind, config, bits=bits)
    return build_module(shape, dtype=None, seed=3), to_gpu_layout(build_module(shape, dtype=None, seed=3))


def assert_same(a: mx.array, b: mx.array) -> None:
    assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item(), mx.abs(a - b).max().item()
    assert mx.array_equal(mx.argmax(a, -1), mx.argmax(b, -1)).item()


def kinds(model: nn.Module) -> set[type]:
    return {type(m) for _, m in model.named_modules()}


@pytest.mark.parametrize("kind", CONFIGS)
def test_stacked_layers_compute_mlx_lm_logits(kind):
    plain, stacked = pair(kind)
    assert StackedMLP in kinds(stacked)
    assert (StackedAttention in kinds(stacked)) == (kind != "qwen3_5")
    names = {name.rsplit(".", 1)[-1] for name, _ in stacked.named_modules()}
    assert not names & {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} - (
        {"q_proj", "k_proj", "v_proj"} if kind == "qwen3_5" else set())

    caches = [make_prompt_cache(plain), make_prompt_cache(stacked)]
    prompt = mx.array([[5, 17, 300, 42, 9, 1000, 77, 3]])
    a, b = plain(prompt, cache=caches[0]), stacked(prompt, cache=caches[1])
    assert_same(a, b)
    for token in (11, 4000):
        step = mx.array([[token]])
        a, b = plain(step, cache=caches[0]), stacked(step, cache=caches[1])
        assert_same(a, b)
    rows = mx.array([[17], [900], [4000]])
    a, b = plain(rows, cache=make_prompt_cache(plain)), stacked(rows, cache=make_prompt_cache(stacked))
    assert_same(a, b)


@pytest.mark.parametrize("bits", [None, 4])
def test_a_layers_residual_adds_ride_in_its_dense_products(monkeypatch, bits):
    """A stacked llama/qwen3 layer adds its residuals inside the o_proj and down products where they
    are plain dense linears (mx.addmm): two ops fewer a layer in a prompt chunk's graph, mlx-lm's
    logits within float rounding; quantized products keep their adds."""
    from engine.kernels import gpu_layout

    def graph_ops(model, cache, tokens):  # a prompt chunk's primitives, by name
        logits = model(mx.array([tokens]), cache=cache)
        f = io.StringIO()
        mx.export_to_dot(f, logits)
        return collections.Counter(line.split('label ="', 1)[1].split('"', 1)[0]
                                   for line in f.getvalue().splitlines() if "shape=rectangle" in line)

    shape = Shape("qwen3", {**LLAMA, "model_type": "qwen3"}, bits=bits)
    plain, fused = build_module(shape, dtype=None, seed=3), to_gpu_layout(build_module(shape, dtype=None, seed=3))
    monkeypatch.setattr(gpu_layout, "residual_blocks", lambda model: None)
    unfused = to_gpu_layout(build_module(shape, dtype=None, seed=3))
    layers = len(fused.model.layers)
    assert all(isinstance(layer, gpu_layout.ResidualBlock) for layer in fused.model.layers)
    assert not any(isinstance(layer, gpu_layout.ResidualBlock) for layer in unfused.model.layers)
    prompt = mx.array([[5, 17, 300, 42, 9, 1000, 77, 3]])
    ops = {}
    for name, model in (("plain", plain), ("fused", fused), ("unfused", unfused)):
        cache = make_prompt_cache(model)
        mx.eval(model(prompt, cache=cache))
        ops[name] = graph_ops(model, cache, [11, 12, 13])
    addmm = ops["fused"]["AddMM"]
    assert addmm == (2 * layers if bits is None else 0)
    assert ops["unfused"]["Add"] - ops["fused"]["Add"] == addmm
    assert ops["fused"].total() <= ops["unfused"].total() - addmm
    caches = [make_prompt_cache(plain), make_prompt_cache(fused)]
    assert_same(plain(prompt, cache=caches[0]), fused(prompt, cache=caches[1]))


def test_a_dense_product_takes_its_residual_from_two_rows_on(monkeypatch):
    """One row keeps MLX's matrix-vector product and an add (mlx-lm's ops); two rows or more, a
    dense linear the few-row kernel does not take, one addmm; the kernel's rows keep their add.
    (The kernel runs on CUDA only: MLX's matmul stands in for it here.)"""
    from engine.kernels import smallmm_cuda
    from engine.kernels.gpu_layout import add_product

    monkeypatch.setattr(smallmm_cuda, "smallmm", lambda x, w: x @ w.T)
    linear = nn.Linear(64, 32, bias=False)
    linear.set_dtype(mx.bfloat16)
    small = smallmm_cuda.to_smallmm(linear, 2, 16)
    assert isinstance(small, smallmm_cuda.SmallMMLinear)
    for layer in (linear, small):
        for m, fused in ((1, False), (8, layer is linear), (32, True)):
            x, r = (mx.random.normal((m, 1, n)).astype(mx.bfloat16) for n in (64, 32))
            y = add_product(layer, x, r)
            f = io.StringIO()
            mx.export_to_dot(f, y)
            assert ('"AddMM"' in f.getvalue()) is fused, (type(layer).__name__, m)
            assert mx.allclose(y, r + linear(x), rtol=2e-2, atol=2e-2).item()


def test_projections_that_do_not_stack_stay_as_loaded():
    """A layer whose q/k/v differ in kind (one quantized) keeps its attention; its MLP still stacks."""
    model = build_module(Shape("llama", LLAMA), dtype=None, seed=3)
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda path, m: path.endswith("q_proj"))
    to_gpu_layout(model)
    assert StackedAttention not in kinds(model) and StackedMLP in kinds(model)
    assert nn.QuantizedLinear in kinds(model)


def engine_and_mlx_lm_tokens(serve, kind: str, prompts: list[list[int]], n: int = 12
                             ) -> tuple[list[list[int]], list[list[int]]]:
    """The engine's greedy tokens for `prompts` decoded together on `kind`'s model in the GPU
    layout, and mlx-lm's for each alone on the same weights (each ending at EOS)."""
    base = tiny_llama()
    plain, stacked_model = pair(kind)
    stacked = dataclasses.replace(base, model=stacked_model)
    expected = [[int(t) for t, _ in generate_step(mx.array(p), plain, max_tokens=n)] for p in prompts]
    eos = set(base.tokenizer.eos_token_ids)
    expected = [t[:next((i for i, x in enumerate(t) if x in eos), n)] for t in expected]  # ends at EOS
    engine = serve(stacked, max_running=len(prompts), prefix_cache=False)
    handles = [engine.submit(prompt_tokens=p, params=SamplingParams(max_tokens=n)) for p in prompts]
    return [[e.token for e in h.events(timeout=60) if e.kind == "token"] for h in handles], expected


ROWS = [[5, 17, 300, 42, 9], [1000, 77, 3], [8, 8, 120, 4500, 61, 2, 19], [44] * 11]


def test_engine_on_a_stacked_model_answers_with_mlx_lm_tokens(serve):
    got, expected = engine_and_mlx_lm_tokens(serve, "llama", ROWS[:3])
    assert got == expected and all(len(t) > 2 for t in got)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_batched_steps_attending_each_rows_own_keys_give_mlx_lm_tokens(serve, monkeypatch, kind):
    """The batched steps' attention without a mask (batch_attention.py's reference, what its CUDA
    kernel computes): each row over its own columns of the decode batch's cache."""
    monkeypatch.setenv(batch_attention.SWITCH, "ref")
    batch_attention.reset()
    rows = []
    ref = batch_attention.attend_rows_ref
    monkeypatch.setattr(batch_attention, "attend_rows_ref", lambda *a: rows.append(a[0].shape[0]) or ref(*a))
    try:
        got, expected = engine_and_mlx_lm_tokens(serve, kind, ROWS)
    finally:
        batch_attention.reset()
    assert got == expected and all(len(t) > 2 for t in got)
    assert rows and max(rows) == len(ROWS)  # the batched steps took it, with every row


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_batched_steps_through_one_attention_call_give_mlx_lm_tokens(serve, monkeypatch, kind):
    """Where the batch attention kernel is taken, a batched step's attention is one call a layer
    from the stacked q/k/v product (batch_attention.attention_rows: q/k norms, RoPE at each row's
    position, the new column written into the cache, each row over its own keys). Here its MLX-ops
    reference stands in for the CUDA kernel (what `check` holds the kernel to on a GPU): the
    engine answers with mlx-lm's tokens, and every batched step took it, with every row."""
    monkeypatch.setattr(batch_attention, "enabled", lambda dtype=None: "kernel")
    rows = []
    ref = batch_attention.attention_rows_ref
    monkeypatch.setattr(batch_attention, "attention_rows",
                        lambda layer, qkv, cache: rows.append(qkv.shape[0]) or ref(layer, qkv, cache))
    got, expected = engine_and_mlx_lm_tokens(serve, kind, ROWS)
    assert got == expected and all(len(t) > 2 for t in got)
    assert rows and max(rows) == len(ROWS)


def test_snapshot_files_tell_the_gpu_layout_apart(monkeypatch):
    """A snapshot saved by a model in the GPU layout is not read back by one as loaded (their
    bf16 K/V differ), as CPU-layout snapshots are kept apart already: the layout that
    `fastest_layout` gives a model at load is recorded, and the snapshot's identity carries it."""
    from engine.kernels.fastest import fastest_layout
    from engine.prefix_cache.snapshot_files import identity

    base = tiny_llama()
    gpu = mx.Device(mx.gpu)
    with monkeypatch.context() as on_a_gpu:  # fastest_layout takes its GPU branch
        on_a_gpu.setattr(mx, "default_device", lambda: gpu)
        model, compute = fastest_layout(build_module(Shape("llama", LLAMA), dtype=None, seed=3), LLAMA)
    assert any(isinstance(m, StackedAttention) for m in model.modules())
    plain = dataclasses.replace(base, model=pair("llama")[0], compute="as-loaded")
    stacked = dataclasses.replace(base, model=model, compute=compute)
    assert identity(plain)["compute"] == "as-loaded"
    assert identity(stacked)["compute"] == "gpu-layout"


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_5"])
def test_last_row_head_gives_the_full_calls_last_logits(kind):
    """engine/kernels/head.py: the head on the last row of a prompt chunk gives the logits of the
    full call's last row and fills the cache alike, in mlx-lm's layout and in the GPU layout."""
    from engine.kernels.head import last_logits, split_head

    plain, stacked = pair(kind)
    for model in (plain, stacked):
        assert split_head(model) is not None
        caches = [make_prompt_cache(model), make_prompt_cache(model)]
        prompt = mx.array([[5, 17, 300, 42, 9, 1000, 77, 3, 64, 2]])
        full = model(prompt, cache=caches[0])
        last = last_logits(model, prompt, caches[1])
        assert last.shape == (1, 1, full.shape[-1])
        assert_same(full[:, -1:, :], last)
        step = mx.array([[11]])  # the caches the two calls left serve the next step alike
        assert_same(model(step, cache=caches[0]), model(step, cache=caches[1]))


def test_last_row_head_falls_back_to_the_full_call_for_unknown_models():
    from engine.kernels.head import last_logits, split_head

    class Scaled(nn.Module):  # a head that is not "body then head"
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, x, cache=None):
            return 2.0 * self.inner(x, cache=cache)

    plain, _ = pair("llama")
    model = Scaled(plain)
    assert split_head(model) is None
    prompt = mx.array([[5, 17, 300, 42]])
    assert_same(model(prompt, cache=make_prompt_cache(plain))[:, -1:, :],
                last_logits(model, prompt, make_prompt_cache(plain)))


def test_prefill_chunk_is_sized_against_memory(monkeypatch):
    """engine/decoding/generate.py's CUDA chunk: the largest power of two (down to 256) whose
    estimated activations fit the budget, once per model. The estimate for the shapes measured on
    the H200 (Qwen3-8B: 1,024 tokens; the Qwen3.5-9B hybrid at 8 bits: 512)."""
    from bench.shapes import SHAPES
    from engine.decoding import generate as gen
    from mlx.utils import tree_flatten

    per_8b = gen.activation_bytes_per_token(SHAPES["qwen3-8b"].config)
    assert per_8b == 36 * (2 * 4096 + 3 * 12288) * 2
    assert gen.activation_bytes_per_token(SHAPES["qwen3_5-9b-8bit"].config) == 32 * (2 * 4096 + 3 * 12288) * 2
    # Qwen3-8B bf16 weights (16.38 GB): a quarter of them holds 1,024 tokens, not 2,048
    assert 1024 * per_8b <= 0.25 * 16.38e9 < 2048 * per_8b

    lm = tiny_llama()
    lm = dataclasses.replace(lm, extras={})
    weights = sum(p.nbytes for _, p in tree_flatten(lm.model.parameters()))
    per = gen.activation_bytes_per_token(lm.config)
    monkeypatch.setattr(gen, "CHUNK_ACTIVATIONS_MIN", 0)
    monkeypatch.setattr(gen, "CHUNK_ACTIVATIONS_OF_WEIGHTS", 600 * per / weights)  # budget: 600 tokens
    assert gen.memory_sized_chunk(lm, 4096) == 512 and lm.extras["prefill_chunk"] == 512
    monkeypatch.setattr(gen, "CHUNK_ACTIVATIONS_OF_WEIGHTS", 1.0)
    assert gen.memory_sized_chunk(lm, 4096) == 512  # kept for the model
    other = dataclasses.replace(lm, extras={})
    monkeypatch.setattr(gen, "CHUNK_ACTIVATIONS_OF_WEIGHTS", 10 * per / weights)  # below the floor
    assert gen.memory_sized_chunk(other, 4096) == gen.SMALLEST_CHUNK


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_a_long_prompt_chunk_is_evaluated_layer_by_layer_with_mlx_lm_logits(kind):
    """A chunk of EVAL_ROWS positions or more is evaluated after each decoder layer (its cache
    too), so a GPU holds one layer's activations at a time; the logits and the cache are mlx-lm's."""
    from engine.kernels.gpu_layout import EVAL_ROWS, EvalEachLayer

    plain, stacked = pair(kind)
    inner = getattr(stacked, "language_model", stacked)
    assert all(isinstance(layer, EvalEachLayer) for layer in inner.model.layers)
    prompt = mx.array([[(7 * i) % 4000 + 1 for i in range(EVAL_ROWS + 20)]])
    caches = make_prompt_cache(plain), make_prompt_cache(stacked)
    assert_same(plain(prompt, cache=caches[0]), stacked(prompt, cache=caches[1]))
    step = mx.array([[11]])
    assert_same(plain(step, cache=caches[0]), stacked(step, cache=caches[1]))
