"""engine/kernels/cpu_layout.py: the fp32 + W @ x layout computes the same logits as the plain fp32 model,
keeps mlx-lm's model classes, and is chosen only on the CPU with an optimised BLAS loaded, when our
CPU kernels are not available (here: turned off with MLXCHAT_KERNELS=0)."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import dequantize_model

from engine import device
from engine.kernels import cpu_layout
from engine.kernels.fastest import fastest_layout
from engine.kernels.gpu_layout import StackedAttention
from engine.loading import registry
from engine.kernels.cpu_layout import MatvecEmbedding, MatvecLinear, fp32_bytes, to_cpu_layout


@pytest.fixture(scope="module")
def models(lm):
    """(plain fp32, fp32 in our layout), both from the bundled model's folder."""
    plain, _ = mlx_lm_load(str(lm.path))
    plain = dequantize_model(plain)
    plain.set_dtype(mx.float32)
    fast, _ = mlx_lm_load(str(lm.path))
    return plain, to_cpu_layout(fast)


def kinds(model):
    return {type(m) for _, m in model.named_modules()}


def test_layout_keeps_mlx_lm_classes_and_shares_nothing_but_leaf_types(models):
    plain, fast = models
    assert type(fast) is type(plain)  # mlx_lm.models.llama.Model, not a fork
    assert nn.Linear not in kinds(fast) and nn.QuantizedLinear not in kinds(fast)
    assert MatvecLinear in kinds(fast) and MatvecEmbedding in kinds(fast)
    for _, m in fast.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            assert m.weight.dtype == mx.float32


def test_logits_equal_the_plain_fp32_model(models, lm):
    """Prefill (many tokens), one-token decode steps, and a batched decode step of 3 rows."""
    plain, fast = models
    prompt = mx.array([lm.tokenizer.encode("The capital of France is Paris. The capital of Italy")])
    caches = [make_prompt_cache(plain), make_prompt_cache(fast)]
    a, b = plain(prompt, cache=caches[0]), fast(prompt, cache=caches[1])
    assert mx.array_equal(a, b).item()  # several tokens: the very same x @ W.T
    token = mx.argmax(a[:, -1], axis=-1)[:, None]
    for _ in range(4):  # one token per step: W @ x, another gemm shape, rounds differently
        a, b = plain(token, cache=caches[0]), fast(token, cache=caches[1])
        assert mx.allclose(a, b, rtol=1e-5, atol=2e-4).item(), mx.abs(a - b).max().item()
        assert mx.array_equal(mx.argmax(a, -1), mx.argmax(b, -1)).item()
        token = mx.argmax(a[:, -1], axis=-1)[:, None]
    rows = mx.array([[17], [900], [4000]])
    a = plain(rows, cache=make_prompt_cache(plain))
    b = fast(rows, cache=make_prompt_cache(fast))
    assert mx.array_equal(a, b).item()  # several rows of one token: x @ W.T as well


@pytest.mark.parametrize("bias", [False, True])
def test_matvec_linear_matches_linear(bias):
    mx.random.seed(0)
    plain = nn.Linear(96, 160, bias=bias)
    fast = nn.Linear(96, 160, bias=bias)
    fast.update(plain.parameters())
    fast.__class__ = MatvecLinear
    for shape in [(96,), (1, 96), (1, 1, 96), (4, 1, 96), (1, 7, 96)]:
        x = mx.random.normal(shape)
        assert fast(x).shape == plain(x).shape
        assert mx.allclose(fast(x), plain(x), rtol=1e-5, atol=1e-5).item(), shape


def test_fp32_bytes_counts_dequantized_weights(lm):
    quantized, _ = mlx_lm_load(str(lm.path))
    dense = dequantize_model(mlx_lm_load(str(lm.path))[0])
    expected = sum(v.size * 4 for _, v in __import__("mlx.utils").utils.tree_flatten(dense.parameters()))
    assert fp32_bytes(quantized) == fp32_bytes(dense) == expected


def fresh(lm):
    model, _, config = mlx_lm_load(str(lm.path), return_config=True)
    return model, config


def test_layout_only_on_the_cpu_with_a_fast_blas(lm, monkeypatch):
    monkeypatch.setenv("MLXCHAT_KERNELS", "0")
    monkeypatch.setattr(device, "fast_blas_loaded", lambda: True)
    model, config = fresh(lm)
    assert cpu_layout.cpu_layout_wanted()[0]
    laid, compute = fastest_layout(model, config)
    assert MatvecLinear in kinds(laid) and compute == "cpu-layout"

    monkeypatch.setattr(device, "fast_blas_loaded", lambda: False)
    model, config = fresh(lm)
    wanted, why = cpu_layout.cpu_layout_wanted()
    assert not wanted and "BLAS" in why
    laid, compute = fastest_layout(model, config)
    kept = kinds(laid)
    assert nn.QuantizedLinear in kept and MatvecLinear not in kept and compute == "as-loaded"

    monkeypatch.setattr(device, "fast_blas_loaded", lambda: True)
    gpu = mx.Device(mx.gpu)
    monkeypatch.setattr(cpu_layout.mx, "default_device", lambda: gpu)
    model, config = fresh(lm)
    wanted, why = cpu_layout.cpu_layout_wanted()
    assert not wanted and "CPU" in why
    laid, compute = fastest_layout(model, config)  # on a GPU: gpu_layout.py's stacked projections
    kept = kinds(laid)
    assert nn.QuantizedLinear in kept and MatvecLinear not in kept and StackedAttention in kept
    assert compute == "gpu-layout"


def test_layout_skipped_when_fp32_would_not_fit_in_memory(lm, monkeypatch):
    monkeypatch.setenv("MLXCHAT_KERNELS", "0")
    monkeypatch.setattr(device, "fast_blas_loaded", lambda: True)
    monkeypatch.setattr(device, "available_ram", lambda: 100 << 20)  # fp32 needs ~540 MB
    model, config = fresh(lm)
    laid, compute = fastest_layout(model, config)
    assert nn.QuantizedLinear in kinds(laid) and compute == "as-loaded"


def test_the_model_runs_in_the_layout_when_the_kernels_are_off(monkeypatch):
    """scripts/test preloads OpenBLAS, as `mlxchat` does for itself."""
    if not device.fast_blas_loaded():
        pytest.skip("no optimised BLAS in this process (run through scripts/test)")
    monkeypatch.setenv("MLXCHAT_KERNELS", "0")
    lm = registry.load_model(None)
    assert MatvecLinear in kinds(lm.model) and nn.QuantizedLinear not in kinds(lm.model)
    assert lm.compute == "cpu-layout"  # recorded at load, for the prefix cache's snapshot files
