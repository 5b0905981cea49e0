"""engine/kernels/qmm_rows_cuda.py: the 4-bit product of 2-32 rows of x on the tensor cores is used
only once it gave `mx.quantized_matmul`'s output on this device, per dtype; one that raises or
differs leaves MLX's product in place. The GPU layout's `QMVLinear` sends it the products of 2-32
rows of a 4-bit layer, and nothing else. (The kernel runs on CUDA only: on the CPU MLX's product
stands in for it; tests/test_cuda_source.py compiles it for sm_90.)"""

import mlx.core as mx
import pytest
from kernel_gates import gate
from mlx import nn

from engine.kernels import qmm_rows_cuda, qmv_cuda

pytestmark = pytest.mark.fast


def as_kernel(x, w, scales, biases, group_size, tiles=None, unroll=None, residual=None):
    y = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=4)
    return y if residual is None else residual + y


@pytest.fixture
def gated(monkeypatch):
    yield from gate(monkeypatch, qmm_rows_cuda, qmm4_rows=as_kernel)


def test_a_kernel_equal_to_mlx_is_taken_once_per_dtype(gated):
    calls = []
    gated.setattr(qmm_rows_cuda, "qmm4_rows", lambda *a, **k: calls.append(a[0].shape[0]) or as_kernel(*a, **k))
    assert qmm_rows_cuda.enabled(mx.bfloat16)
    assert calls == [2, 2, 9, 9, 32, 32]  # groups of 64 and 128, rows of x from 2 to 32; plus a residual
    assert qmm_rows_cuda.enabled(mx.bfloat16) and len(calls) == 6
    assert qmm_rows_cuda.enabled(mx.float16) and len(calls) == 12


@pytest.mark.parametrize("wrong", ["raises", "differs", "drops the residual"])
def test_a_kernel_that_fails_or_differs_is_not_taken(gated, caplog, wrong):
    def kernel(x, w, scales, biases, group_size, residual=None):
        if wrong == "raises":
            raise RuntimeError("nvrtc: error")
        if wrong == "drops the residual":
            return as_kernel(x, w, scales, biases, group_size)
        return as_kernel(x, w, scales, biases, group_size, residual=residual).at[-1, :, :3].add(1.0)  # last row off
    gated.setattr(qmm_rows_cuda, "qmm4_rows", kernel)
    assert not qmm_rows_cuda.enabled(mx.bfloat16)
    assert "run MLX's quantized_matmul" in caplog.text
    result = qmm_rows_cuda.check(mx.bfloat16)
    assert not result["kept"] and (("error" in result) == (wrong == "raises"))


def test_off_by_switch(monkeypatch):
    monkeypatch.setenv(qmm_rows_cuda.SWITCH, "0")
    qmm_rows_cuda.reset()
    try:
        assert not qmm_rows_cuda.enabled(mx.bfloat16)
    finally:
        qmm_rows_cuda.reset()


@pytest.mark.parametrize("bits, group_size", [(4, 64), (4, 128), (4, 32), (8, 64)])
def test_qmv_linear_sends_it_the_products_of_a_few_rows_of_a_4bit_layer(gated, bits, group_size):
    """Rows 2-32 of a 4-bit layer (groups of 64/128) take the kernel; one row takes qmv_cuda's
    kernel, 33 rows, 8-bit layers and groups of 32 MLX's product; every output is the layer's."""
    linear = nn.Linear(256, 96, bias=False)
    linear.set_dtype(mx.bfloat16)
    layer = nn.QuantizedLinear.from_linear(linear, group_size=group_size, bits=bits)
    gated.setattr(qmv_cuda, "qmv", lambda x, w, s, b, bits, gs: mx.quantized_matmul(
        x, w, s, b, transpose=True, group_size=gs, bits=bits))
    assert qmm_rows_cuda.enabled(mx.bfloat16)
    calls = []
    gated.setattr(qmm_rows_cuda, "qmm4_rows", lambda *a, **k: calls.append(
        (a[0].shape[0], "residual" in k)) or as_kernel(*a, **k))
    ours = qmv_cuda.to_qmv(layer, max_rows=1)
    assert isinstance(ours, qmv_cuda.QMVLinear)
    taken = bits == 4 and group_size in (64, 128)
    for m in (1, 2, 8, 32, 33):
        x = mx.random.normal((m, 1, 256)).astype(mx.bfloat16)
        assert mx.array_equal(ours(x), layer(x)).item(), m
        # the batched step's residual add (gpu_layout.add_product) rides in the same kernel
        residual = mx.random.normal((m, 1, 96)).astype(mx.bfloat16)
        assert mx.array_equal(ours.add_product(x, residual), residual + layer(x)).item(), m
    assert calls == ([(m, r) for m in (2, 8, 32) for r in (False, True)] if taken else [])


@pytest.mark.parametrize("switch, tiles", [("", 1), ("4", 4), ("2", 2), ("3", 1)])
def test_the_tiles_switch_sets_each_blocks_weight_tiles_at_32_rows(monkeypatch, switch, tiles):
    """MLXCHAT_CUDA_QMM_TILES fixes the 16-row weight tiles a block takes (1, 2 or 4; anything else
    leaves tiles_per_block's own choice, one tile at 32 rows): the kernel is compiled for that
    many (its TPW) and launched over that many fewer blocks."""
    from engine.kernels import fused_cuda

    monkeypatch.setenv(qmm_rows_cuda.TILES_SWITCH, switch)
    launches = []

    def kernel(*_args):
        def launch(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            launches.append((dict(template), grid))
            return [mx.zeros(output_shapes[0], output_dtypes[0])]
        return launch

    monkeypatch.setattr(fused_cuda, "_kernel", kernel)
    w, scales, biases = mx.quantize(mx.random.normal((200, 256)), group_size=64, bits=4)
    qmm_rows_cuda.reset()  # the switch is read once a process
    try:
        qmm_rows_cuda.qmm4_rows(mx.zeros((32, 256), mx.bfloat16), w, scales, biases, 64)
    finally:
        qmm_rows_cuda.reset()
    (template, grid), = launches
    assert template["TPW"] == tiles and template["MT"] == 4
    assert grid[0] == -(-13 // tiles) * qmm_rows_cuda.WARPS * 32  # 200 outputs: 13 tiles of 16
