"""The kernels' `log_softmax` (engine/kernels/csrc/softmax.cpp) equals MLX's
`x - mx.logsumexp(x, axis=-1, keepdims=True)` bit for bit, NaN payloads included, on every
instruction-set unit this CPU runs: widths around the 16-lane vectors and the bundled model's
vocabulary, 1-5 rows (the kernel sums up to 4 rows at once), logit scales whose shifted values
pass exp's -88 cut-off, -inf / +inf / NaN entries, rows of zeros of either sign, all -inf rows,
many rows at once, strided input. And the sampler's `log_softmax` (engine/decoding/sampling.py)
gives MLX's values with or without the kernels.
"""

import mlx.core as mx
import numpy as np
import pytest

from engine.decoding import sampling

pytestmark = pytest.mark.fast

INF, NAN = np.inf, np.nan


def mlx_log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def assert_bits_equal(got: mx.array, want: mx.array) -> None:
    got_bits, want_bits = np.array(got).view(np.uint32), np.array(want).view(np.uint32)
    assert got.shape == want.shape
    differ = np.argwhere(got_bits != want_bits)
    assert differ.size == 0, f"{len(differ)} values differ, first at {differ[0].tolist()}"


def random_rows(rows: int, width: int, scale: float, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal((rows, width)) * scale).astype(np.float32))


@pytest.mark.parametrize("width", [1, 15, 16, 17, 255, 257, 4099, 49152])
def test_random_rows_equal_mlx(kern, isa, width):
    for seed, scale in enumerate([0.01, 1.0, 8.0, 60.0, 1e4]):  # 60, 1e4: many values < -88
        x = random_rows(seed + 1, width, scale, seed)  # 1-5 rows: groups of 1-4 rows, and 4 + 1
        assert_bits_equal(kern.log_softmax(x), mlx_log_softmax(x))


def test_every_exp_input_equals_mlx(kern, isa):
    """A dense sweep of exp's inputs (x - max from -95 to 0, 0.5M steps), rows [0, v] for v from
    -0.75 to 0 (whose log-softmax shows all but the last bit of exp(v): an exp rounded once
    differently, e.g. a multiply-add fused, fails here), and random bit patterns: every float,
    NaNs of any payload, infs."""
    sweep = mx.array(np.linspace(-95, 0, 500_001, dtype=np.float32)[None])
    assert_bits_equal(kern.log_softmax(sweep), mlx_log_softmax(sweep))
    pairs = np.zeros((100_000, 2), dtype=np.float32)
    pairs[:, 1] = np.linspace(-0.75, 0, len(pairs), dtype=np.float32)
    assert_bits_equal(kern.log_softmax(mx.array(pairs)), mlx_log_softmax(mx.array(pairs)))
    bits = np.random.default_rng(1).integers(0, 2**32, 200_000, dtype=np.uint64)
    values = bits.astype(np.uint32).view(np.float32)
    values = np.where(np.isfinite(values), np.clip(values, -150, 30), values).astype(np.float32)
    x = mx.array(values.reshape(40, 5000))
    assert_bits_equal(kern.log_softmax(x), mlx_log_softmax(x))


SPECIAL_ROWS = [
    [0.0, -0.0, -1.0, -0.0],  # a zero maximum: its sign is the first zero's
    [-0.0, 0.0, -1.0, 0.0],
    [-INF] * 5,  # all -inf: NaN everywhere, as MLX gives
    [INF, 1.0, 2.0, -INF],
    [1.0, NAN, 2.0, 3.0],
    [NAN, INF, 1.0, NAN],
    [-INF, 0.0, -200.0, 5.0, -87.9, -88.0, -88.1],
    [3.4e38, -3.4e38, 0.0, 1e-45],
    [-1e-40] * 17,
]


@pytest.mark.parametrize("row", SPECIAL_ROWS, ids=range(len(SPECIAL_ROWS)))
def test_special_values_equal_mlx(kern, isa, row):
    x = mx.array(np.array([row], dtype=np.float32))
    assert_bits_equal(kern.log_softmax(x), mlx_log_softmax(x))


def test_shapes_rows_and_strides(kern):
    """Any leading axes, rows split over the threads, a transposed (non-contiguous) input."""
    x = random_rows(24, 1000, 5.0, 7).reshape(2, 3, 4, 1000)
    assert_bits_equal(kern.log_softmax(x), mlx_log_softmax(x))
    t = random_rows(300, 33, 5.0, 8).T
    assert_bits_equal(kern.log_softmax(t), mlx_log_softmax(t))
    with pytest.raises(ValueError):
        kern.log_softmax(mx.zeros((2, 3), dtype=mx.float16))


def test_sampler_log_softmax_equals_mlx_with_and_without_kernels(kern, monkeypatch):
    x = random_rows(4, 1001, 6.0, 9)
    assert_bits_equal(sampling.log_softmax(x), mlx_log_softmax(x))
    assert_bits_equal(sampling.log_softmax_rows(x), mlx_log_softmax(x))
    half = x.astype(mx.bfloat16)  # not fp32: MLX's ops
    assert_bits_equal(sampling.log_softmax(half).astype(mx.float32),
                      mlx_log_softmax(half).astype(mx.float32))
    monkeypatch.setenv("MLXCHAT_KERNELS", "0")
    assert_bits_equal(sampling.log_softmax_rows(x), mlx_log_softmax(x))
