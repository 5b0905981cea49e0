"""engine/kernels/smallmm_cuda.py, the bf16/fp16 few-rows matrix product on the tensor cores for
CUDA. The CPU cannot run it, so: its index math (the words each lane loads, the PTX fragment
layout of mma.m16n8k16, the order of the accumulation and of the warps' sum), restated in numpy
(`emulate`), gives `x @ w.T` for one row of x and several x tiles, widths with fewer 32-blocks than
warps and with warps of unequal step counts, and output counts that leave part of the last tile
idle; and the hook in gpu_layout.py, on CUDA only, puts the kernel under a bf16 model's dense
linears for the rows the switch picks, whose batched greedy decode then gives MLX's tokens.
`python -m bench.concurrency_step --parts matmul --device gpu` checks the kernel itself on a GPU."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from bench.shapes import Shape, build_module
from engine import device
from engine.kernels import smallmm_cuda
from engine.kernels.gpu_layout import to_gpu_layout
from engine.kernels.smallmm_cuda import MAX_ROWS, SmallMMLinear, emulate, fits_layer
from tiny_models import LLAMA

pytestmark = pytest.mark.fast

# (rows of x, K, N): one row, K of 2 blocks (2 warps), N short of a tile; 3 rows, 8 warps of one
# block each; 8 rows, 17 blocks (warp 0 takes 3, the others 2); 13 rows (two x tiles), a tile and
# a bit; 32 rows (MAX_ROWS, four tiles), 4 blocks per warp.
SHAPES = [(1, 64, 13), (3, 256, 37), (8, 544, 16), (13, 320, 50), (32, 1024, 21)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_the_kernels_arithmetic_gives_x_times_w_transposed(m, k, n):
    rng = np.random.default_rng(m * 100 + n)
    # bf16-representable values, as the kernel reads them
    x = np.array(mx.array(rng.standard_normal((m, k)), dtype=mx.bfloat16).astype(mx.float32))
    w = np.array(mx.array(rng.standard_normal((n, k)) / k ** 0.5, dtype=mx.bfloat16).astype(mx.float32))
    got = emulate(x, w)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [1, 4, 16])
def test_any_count_of_warps_per_block_gives_the_product(kw):
    rng = np.random.default_rng(kw)
    x, w = rng.standard_normal((6, 544)).astype(np.float32), rng.standard_normal((20, 544)).astype(np.float32)
    np.testing.assert_allclose(emulate(x, w, kw), x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-4, atol=1e-4)


def test_every_input_position_counts_once():
    """One-hot rows of x pick single columns of w: each physical k reaches the output exactly once,
    from its own column (a permutation slip would move or drop it)."""
    k, n = 96, 19
    w = np.arange(n * k, dtype=np.float32).reshape(n, k) % 251
    x = np.eye(k, dtype=np.float32)[[0, 7, 8, 31, 32, 45, 63, 95]]
    np.testing.assert_array_equal(emulate(x, w), w[:, [0, 7, 8, 31, 32, 45, 63, 95]].T)


def test_the_kernel_fits_bf16_and_fp16_linears_whose_width_is_whole_blocks():
    layers = {}
    for k, dtype in ((64, mx.bfloat16), (64, mx.float16), (64, mx.float32), (48, mx.bfloat16)):
        layer = nn.Linear(k, 8)
        layer.set_dtype(dtype)
        layers[(k, dtype)] = layer
    assert fits_layer(layers[(64, mx.bfloat16)]) and fits_layer(layers[(64, mx.float16)])
    assert not fits_layer(layers[(64, mx.float32)]) and not fits_layer(layers[(48, mx.bfloat16)])
    assert not fits_layer(nn.QuantizedLinear(64, 8))


@pytest.fixture
def launches(monkeypatch):
    """The kernel's launches, each computed by `emulate`, with MLX taken for CUDA."""
    calls = []

    def launch(x, w, kw=None, blocks=None):
        x2 = x.reshape(-1, x.shape[-1])  # the kernel reads x as rows x K in memory
        calls.append(x2.shape)
        y = emulate(np.array(x2.astype(mx.float32)), np.array(w.astype(mx.float32)))
        return mx.array(y).astype(x.dtype).reshape(*x.shape[:-1], w.shape[0])

    monkeypatch.setattr(smallmm_cuda, "_launch", launch)
    monkeypatch.setattr(smallmm_cuda, "COMPILED", False)  # numpy cannot run inside mx.compile
    monkeypatch.setattr(device, "backend", lambda: "cuda")
    return calls


def bf16_pair():
    shape = Shape("llama-bf16", LLAMA)
    return build_module(shape, dtype=mx.bfloat16, seed=5), to_gpu_layout(build_module(shape, dtype=mx.bfloat16, seed=5))


def test_by_default_batched_decode_steps_run_on_the_kernel_with_mlx_tokens(launches, monkeypatch):
    """Unset, the switch sends products of 2 to 16 rows to the kernel, for every dense linear but
    one of a vocabulary head's width (HEAD_OUTPUTS outputs; the tiny model's head has fewer): a
    prompt longer than that and one-row steps stay on MLX; a batch of four decode rows runs every
    dense linear on it, and four greedy steps give the tokens of MLX's matmul."""
    from mlx_lm.models.cache import make_prompt_cache

    monkeypatch.delenv(smallmm_cuda.SWITCH, raising=False)
    plain, ours = bf16_pair()
    swapped = [name for name, m in ours.named_modules() if isinstance(m, SmallMMLinear)]
    assert len(swapped) == LLAMA["num_hidden_layers"] * 4 + 1 and "lm_head" in swapped
    wide = nn.Module()
    wide.head = nn.Linear(32, 8, bias=False)
    wide.head.weight = mx.zeros((smallmm_cuda.HEAD_OUTPUTS, 32), mx.bfloat16)
    assert smallmm_cuda.use_smallmm(wide, "auto") == 0 and smallmm_cuda.use_smallmm(wide, "all") == 1
    assert {(m.min_rows, m.max_rows) for _, m in ours.named_modules() if isinstance(m, SmallMMLinear)} == {(2, 16)}

    caches = [make_prompt_cache(plain), make_prompt_cache(ours)]
    prompts = mx.array([[5, 17, 300, 42, 9, 100, 77, 3, 12] * 2] * 4)  # 4 x 18 rows: over 16
    a, b = plain(prompts, cache=caches[0])[:, -1], ours(prompts, cache=caches[1])[:, -1]
    assert prompts.size > 16 and launches == []
    tokens_plain, tokens_ours = [mx.argmax(a, -1)], [mx.argmax(b, -1)]
    for _ in range(4):
        a = plain(tokens_plain[-1][:, None], cache=caches[0])[:, -1]
        b = ours(tokens_ours[-1][:, None], cache=caches[1])[:, -1]
        assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=0.1).item()
        tokens_plain.append(mx.argmax(a, -1))
        tokens_ours.append(mx.argmax(b, -1))
    assert mx.array_equal(mx.stack(tokens_plain), mx.stack(tokens_ours)).item()
    assert len(launches) == 4 * len(swapped) and {s[0] for s in launches} == {4}

    launches.clear()
    one = ours(mx.array([[7]]), cache=make_prompt_cache(ours))  # one row: MLX's gemv
    mx.eval(one)
    assert launches == []


@pytest.mark.parametrize("switch,backend", [("0", "cuda"), ("1", "cpu"), ("1", "metal")])
def test_without_the_switch_or_off_cuda_the_layers_stay_as_loaded(monkeypatch, switch, backend):
    monkeypatch.setenv(smallmm_cuda.SWITCH, switch)
    monkeypatch.setattr(device, "backend", lambda: backend)
    ours = to_gpu_layout(build_module(Shape("llama-bf16", LLAMA), dtype=mx.bfloat16, seed=5))
    assert not any(isinstance(m, SmallMMLinear) for _, m in ours.named_modules())


def test_with_the_switch_one_row_and_heads_run_on_the_kernel_too(launches, monkeypatch):
    monkeypatch.setenv(smallmm_cuda.SWITCH, "1")
    _, ours = bf16_pair()
    heads = [m for name, m in ours.named_modules() if name == "lm_head"]
    assert isinstance(heads[0], SmallMMLinear) and (heads[0].min_rows, heads[0].max_rows) == (1, MAX_ROWS)
    layer = smallmm_cuda.to_smallmm(nn.Linear(64, 24), *smallmm_cuda.row_range("all"))
    assert not isinstance(layer, SmallMMLinear)  # fp32: MLX's
    base = nn.Linear(64, 24, bias=True)
    base.set_dtype(mx.float16)
    layer = smallmm_cuda.to_smallmm(base, *smallmm_cuda.row_range(smallmm_cuda.mode()))
    x = mx.random.normal((1, 1, 64)).astype(mx.float16)
    np.testing.assert_allclose(np.array(layer(x).astype(mx.float32)),
                               np.array(base(x).astype(mx.float32)), atol=2e-2, rtol=2e-2)
    assert launches == [(1, 64)]
