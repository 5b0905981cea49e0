"""engine/kernels/qmv_cuda.py, the quantized one-to-eight-row matrix x vector kernel for CUDA. The
CPU cannot run it, so: its index math and summation order, restated in numpy (`emulate`), give
`mx.quantized_matmul`'s products for bits 4 and 8, groups 32/64/128, one row and several, widths
whose rows end part-way through the warp's last step and output counts that leave part of the last
block idle; and the hook in gpu_layout.py, on CUDA only, puts the kernel under the layers the
switch picks (`MLXCHAT_CUDA_QMV=1`: every layer it fits, up to eight rows; unset: 4-bit layers and
heads, one row; 0: none) and sends those products to it (a model served so still gives mlx-lm's
logits). `python -m bench.qmv` checks the kernel itself on a GPU."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from bench.shapes import Shape, build_module
from engine import device
from engine.kernels import qmv_cuda
from engine.kernels.gpu_layout import to_gpu_layout
from engine.kernels.qmv_cuda import MAX_ROWS, QMVLinear, emulate, fits_layer
from tiny_models import LLAMA

pytestmark = pytest.mark.fast

# (rows of x, input width K, outputs N): one row with K's words fewer than the 32 lanes (8 bits:
# 24 words) and N not a multiple of the 8 rows per block; three rows over 1.5 steps of the lanes;
# eight rows (MAX_ROWS) over more than two steps.
SHAPES = [(1, 384, 37), (3, 1536, 20), (8, 2176, 9)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_the_kernels_arithmetic_gives_quantized_matmul(bits, group_size, m, k, n):
    mx.random.seed(bits * 1000 + group_size + m)
    w = mx.random.normal((n, k)) / k ** 0.5
    x = mx.random.normal((m, k))
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    want = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group_size, bits=bits)
    got = emulate(np.array(x), np.array(wq), np.array(scales), np.array(biases), bits, group_size)
    np.testing.assert_allclose(got, np.array(want), rtol=1e-4, atol=1e-4)
    assert np.abs(got - np.array(w @ x.T).T).max() > 0  # the products are of the quantized weights


def test_bf16_activations_and_scales_sum_in_fp32():
    """bf16 x, scales and biases (a bf16 model's layers) are widened and summed in fp32: MLX's
    product of the same values in fp32, not its bf16 product (which, on the CPU, rounds as it
    goes)."""
    mx.random.seed(7)
    w = (mx.random.normal((40, 1024)) / 32).astype(mx.bfloat16)
    x = mx.random.normal((2, 1024)).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731
    want = mx.quantized_matmul(f32(x), wq, f32(scales), f32(biases), transpose=True, group_size=64, bits=4)
    got = emulate(np.array(f32(x)), np.array(wq), np.array(f32(scales)), np.array(f32(biases)), 4, 64)
    np.testing.assert_allclose(got, np.array(want), rtol=1e-4, atol=1e-4)


def quantized(bits=8, group_size=64, k=256, n=32, bias=False, mode="affine"):
    layer = nn.Linear(k, n, bias=bias)
    return nn.QuantizedLinear.from_linear(layer, group_size=group_size, bits=bits, mode=mode)


def test_the_kernel_fits_affine_4_and_8_bit_layers_only():
    assert fits_layer(quantized(8)) and fits_layer(quantized(4, 128)) and fits_layer(quantized(4, 32, bias=True))
    assert not fits_layer(quantized(3)) and not fits_layer(quantized(6))
    assert not fits_layer(quantized(4, 32, mode="mxfp4"))  # no biases, another layout
    assert not fits_layer(nn.Linear(256, 32))


@pytest.fixture
def launches(monkeypatch):
    """The kernel's launches, each computed by `emulate`, with the switch on and MLX taken for CUDA."""
    calls = []

    def launch(x, w, scales, biases, bits, group_size):
        x2 = x.reshape(-1, x.shape[-1])  # the kernel reads x as rows x K in memory
        calls.append(x2.shape)
        f32 = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
        y = emulate(f32(x2), np.array(w), f32(scales), f32(biases), bits, group_size)
        return mx.array(y).astype(x.dtype).reshape(*x.shape[:-1], w.shape[0])

    monkeypatch.setattr(qmv_cuda, "_launch", launch)
    monkeypatch.setattr(device, "backend", lambda: "cuda")
    monkeypatch.setenv(qmv_cuda.SWITCH, "1")
    return calls


def model_pair():
    shape = Shape("llama-8bit", LLAMA, bits=8)
    return build_module(shape, dtype=None, seed=3), build_module(shape, dtype=None, seed=3)


def test_with_the_switch_the_gpu_layout_runs_decode_steps_on_the_kernel(launches):
    from mlx_lm.models.cache import make_prompt_cache

    plain, ours = model_pair()
    to_gpu_layout(ours)
    swapped = [name for name, m in ours.named_modules() if isinstance(m, QMVLinear)]
    left = [name for name, m in ours.named_modules()
            if isinstance(m, nn.QuantizedLinear) and not isinstance(m, QMVLinear)]
    per_layer = {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}
    assert {name.split(".", 3)[-1] for name in swapped if name.startswith("model.layers.")} == per_layer
    assert len(swapped) >= LLAMA["num_hidden_layers"] * 4 and not left

    caches = [make_prompt_cache(plain), make_prompt_cache(ours)]
    prompt = mx.array([[5, 17, 300, 42, 9, 1000, 77, 3, 12]])  # 9 rows: over MAX_ROWS
    a, b = plain(prompt, cache=caches[0]), ours(prompt, cache=caches[1])
    mx.eval(a, b)
    assert prompt.shape[1] > MAX_ROWS and launches == []
    assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item()
    for token in (11, 4000):  # one-row decode steps: every swapped layer on the kernel
        step = mx.array([[token]])
        a, b = plain(step, cache=caches[0]), ours(step, cache=caches[1])
        mx.eval(a, b)
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item(), mx.abs(a - b).max().item()
        assert mx.array_equal(mx.argmax(a, -1), mx.argmax(b, -1)).item()
    assert len(launches) == 2 * len(swapped) and set(launches) <= {(1, LLAMA["hidden_size"]),
                                                                  (1, LLAMA["intermediate_size"])}
    launches.clear()
    rows = mx.array([[17], [900], [4000]])  # a batch of three decode rows: one launch per layer
    a, b = plain(rows, cache=make_prompt_cache(plain)), ours(rows, cache=make_prompt_cache(ours))
    mx.eval(a, b)
    assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item()
    assert len(launches) == len(swapped) and {s[0] for s in launches} == {3}


def test_by_default_only_4_bit_layers_and_heads_take_one_row_products(launches, monkeypatch):
    """Unset, the switch picks where the H200 measured the kernel faster: every 4-bit layer and a
    vocabulary head at 8 bits, for one-row products only; 8-bit layers of a decoder stay on MLX."""
    monkeypatch.delenv(qmv_cuda.SWITCH)
    assert qmv_cuda.mode() == "auto"
    four = to_gpu_layout(build_module(Shape("llama-4bit", LLAMA, bits=4), dtype=None, seed=3))
    swapped = [m for _, m in four.named_modules() if isinstance(m, QMVLinear)]
    assert len(swapped) >= LLAMA["num_hidden_layers"] * 4 and {m.max_rows for m in swapped} == {1}
    eight = to_gpu_layout(build_module(Shape("llama-8bit", LLAMA, bits=8), dtype=None, seed=3))
    assert not any(isinstance(m, QMVLinear) for _, m in eight.named_modules())
    head = nn.Module()
    head.lm_head = quantized(8, 64, k=64, n=qmv_cuda.HEAD_OUTPUTS)
    assert qmv_cuda.use_qmv(head, "auto") == 1 and head.lm_head.max_rows == 1

    x = mx.random.normal((1, 1, 64))
    assert mx.allclose(head.lm_head(x), nn.QuantizedLinear.__call__(head.lm_head, x), atol=1e-4).item()
    assert launches == [(1, 64)]
    head.lm_head(mx.random.normal((1, 2, 64)))  # two rows (a short prefill, a 2-stream step): MLX's
    assert launches == [(1, 64)]


def test_on_cuda_a_prompt_chunk_takes_the_dequantized_weight(launches, monkeypatch):
    """By default on CUDA a 4-bit layer's product of `DENSE_ROWS` rows or more is x times the
    weight dequantized to x's dtype (mx.dequantize's rounding), within 1% of the fp32 product;
    fewer rows, a vocabulary head, or `MLXCHAT_CUDA_PREFILL_DENSE=0` stay on mx.quantized_matmul."""
    monkeypatch.delenv(qmv_cuda.SWITCH)
    monkeypatch.delenv(qmv_cuda.DENSE_SWITCH, raising=False)
    layer = qmv_cuda.to_qmv(quantized(4, 64, k=256, n=96), max_rows=1)
    layer.set_dtype(mx.bfloat16)
    w, s, b = layer["weight"], layer["scales"], layer["biases"]
    x = mx.random.normal((1, qmv_cuda.DENSE_ROWS, 256), key=mx.random.key(5)).astype(mx.bfloat16)
    exact = x.astype(mx.float32) @ mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), bits=4).T
    assert layer._kernel(x) == "dense"
    y = layer(x)
    assert y.dtype == mx.bfloat16 and y.shape == (1, qmv_cuda.DENSE_ROWS, 96)
    assert mx.array_equal(y, x @ mx.dequantize(w, s, b, bits=4).T).item()
    scale = mx.abs(exact).max().item()
    assert mx.abs(y.astype(mx.float32) - exact).max().item() / scale < 1e-2
    assert layer._kernel(x[:, : qmv_cuda.DENSE_ROWS - 1]) is None  # a short chunk: mx.quantized_matmul
    head = qmv_cuda.to_qmv(quantized(4, 64, k=64, n=qmv_cuda.HEAD_OUTPUTS), max_rows=1)
    assert head._kernel(mx.zeros((1, qmv_cuda.DENSE_ROWS, 64), dtype=mx.bfloat16)) is None  # no 1 GB copies
    monkeypatch.setenv(qmv_cuda.DENSE_SWITCH, "0")
    assert layer._kernel(x) is None and launches == []


def test_with_dense_all_8_bit_layers_take_prompt_chunks_only(launches, monkeypatch):
    """`MLXCHAT_CUDA_PREFILL_DENSE=all`: an 8-bit model's layers become QMVLinears serving no rows on
    the kernel (its decode steps stay MLX's, as loaded) whose prompt chunks take the dense path; by
    default they stay as loaded, and `MLXCHAT_CUDA_QMV=0` leaves every layer as loaded."""
    from mlx_lm.models.cache import make_prompt_cache

    monkeypatch.delenv(qmv_cuda.SWITCH)
    monkeypatch.setenv(qmv_cuda.DENSE_SWITCH, "all")
    plain, ours = model_pair()
    to_gpu_layout(ours)
    swapped = [m for _, m in ours.named_modules() if isinstance(m, QMVLinear)]
    assert len(swapped) >= LLAMA["num_hidden_layers"] * 4 and {m.max_rows for m in swapped} == {0}
    step = mx.array([[11]])
    a, b = plain(step, cache=make_prompt_cache(plain)), ours(step, cache=make_prompt_cache(ours))
    assert mx.array_equal(a, b).item() and launches == []  # one row: MLX's product, as loaded
    down = ours.model.layers[0].mlp.down_proj
    x = mx.random.normal((1, qmv_cuda.DENSE_ROWS, down.weight.shape[1] * 4), key=mx.random.key(2))
    assert down._kernel(x) is None  # fp32 activations: MLX's product
    x = x.astype(mx.bfloat16)
    assert down._kernel(x) is None  # fp32 scales: x @ their dtype's copy would promote to fp32
    down.set_dtype(mx.bfloat16)
    assert down._kernel(x) == "dense" and down._kernel(x[:, :1]) is None
    monkeypatch.setenv(qmv_cuda.SWITCH, "0")
    _, off = model_pair()
    to_gpu_layout(off)
    assert not any(isinstance(m, QMVLinear) for _, m in off.named_modules())


@pytest.mark.parametrize("switch,backend", [("0", "cuda"), ("1", "cpu"), ("1", "metal")])
def test_without_the_switch_or_off_cuda_the_layers_stay_as_loaded(monkeypatch, switch, backend):
    monkeypatch.setenv(qmv_cuda.SWITCH, switch)
    monkeypatch.setattr(device, "backend", lambda: backend)
    _, ours = model_pair()
    to_gpu_layout(ours)
    assert not any(isinstance(m, QMVLinear) for _, m in ours.named_modules())


@pytest.mark.slow  # a child process running the bench's every part: the second tier
def test_the_device_harness_runs_without_cuda(tmp_path):
    """`python -m bench.qmv` on the CPU: the kernel part checks the emulation (correct, MLX's rate
    only), and the step part runs bench.gpu_step with the switch on, unset and off, each to its
    JSON."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "qmv.json"
    run = subprocess.run([sys.executable, "-m", "bench.qmv", "--device", "cpu", "--sizes", "256:384", "--reps", "1",
                          "--chain-gb", "0.001", "--step-shapes", "tiny", "--step-reps", "1", "--gen", "8",
                          "--bw-gb", "0.01", "--out", str(out)],
                         cwd=root, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    data = json.loads(out.read_text())
    assert data["cuda"] is False
    checks = [r for r in data["rows"] if r["metric"].startswith("max error")]
    assert len(checks) == 2 and all(r["extra"]["check"]["ok"] for r in checks)
    assert not any(r["metric"] == "weight read" for r in data["rows"])  # no kernel rate without CUDA
    for switch in ("0", "1", "auto"):
        step = json.loads(Path(data["step"]["qmv" + switch]["json"]).read_text())
        assert step["meta"]["env"].get("MLXCHAT_CUDA_QMV", "auto") == switch
        assert {r["metric"] for r in step["rows"]} >= {"decode batch 1 (service)"}
