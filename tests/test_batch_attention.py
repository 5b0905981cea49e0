"""engine/kernels/batch_attention.py's gate: the batched steps' attention kernel is used only once
it gave its MLX-ops reference's output on this device, per dtype; one that raises or differs
leaves mlx-lm's masked attention in place. (The kernel itself runs on CUDA only: on the CPU its
reference stands in for it; tests/test_cuda_source.py compiles it, tests/test_gpu_layout.py runs
the engine's batched steps on the reference.)"""

import mlx.core as mx
import pytest

from engine.kernels import batch_attention

pytestmark = pytest.mark.fast


def as_kernel(q, keys, values, lp, off, scale):
    """attend_rows's contract computed by the reference (row r: columns lp[r] .. lp[r] + off[r] - 1)."""
    return batch_attention.attend_rows_ref(q, keys, values, lp, off, scale)


@pytest.fixture
def gated(monkeypatch):
    monkeypatch.setattr(batch_attention, "mode", lambda: "on")
    batch_attention.reset()
    yield monkeypatch
    batch_attention.reset()


def test_a_kernel_equal_to_the_reference_is_taken_once_per_dtype(gated):
    calls = []
    gated.setattr(batch_attention, "attend_rows", lambda *a: calls.append(a[0].dtype) or as_kernel(*a))
    assert batch_attention.enabled(mx.bfloat16) == "kernel"
    checked = len(calls)
    assert checked == 3  # many splits, two, none
    assert batch_attention.enabled(mx.bfloat16) == "kernel" and len(calls) == checked
    assert batch_attention.enabled(mx.float16) == "kernel" and len(calls) == 2 * checked
    assert batch_attention.enabled(mx.float32) is None  # 16-bit activations only


@pytest.mark.parametrize("wrong", ["raises", "differs"])
def test_a_kernel_that_fails_or_differs_leaves_mlx_lm_attention(gated, caplog, wrong):
    def kernel(q, keys, values, lp, off, scale):
        if wrong == "raises":
            raise RuntimeError("nvrtc: error")
        out = as_kernel(q, keys, values, lp, off, scale)
        return out.at[:, :, :4].add(1.0)  # a few lanes off
    gated.setattr(batch_attention, "attend_rows", kernel)
    assert batch_attention.enabled(mx.bfloat16) is None
    assert "batched decode attention runs MLX's ops" in caplog.text
    result = batch_attention.check(mx.bfloat16)
    assert not result["kept"] and (("error" in result) == (wrong == "raises"))


def test_off_by_switch(monkeypatch):
    monkeypatch.setenv(batch_attention.SWITCH, "0")
    batch_attention.reset()
    try:
        assert batch_attention.enabled() is None
    finally:
        batch_attention.reset()
