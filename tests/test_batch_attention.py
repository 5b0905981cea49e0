"""engine/kernels/batch_attention.py's gate: the batched steps' attention kernels (`attend_rows`,
and `attention_rows`, which also norms, rotates and writes the new column) are used only once they
gave their MLX-ops references' outputs (and, for `attention_rows`, the buffers it wrote) on this
device, per dtype; one that raises or differs leaves mlx-lm's masked attention in place. (The
kernels run on CUDA only: on the CPU the references stand in for them; tests/test_cuda_source.py
compiles them, tests/test_gpu_layout.py runs the engine's batched steps on the references.)"""

import mlx.core as mx
import pytest

from engine.kernels import batch_attention
from kernel_gates import gate

pytestmark = pytest.mark.fast


def as_kernel(q, keys, values, lp, off, scale):
    """attend_rows's contract computed by the reference (row r: columns lp[r] .. lp[r] + off[r] - 1)."""
    return batch_attention.attend_rows_ref(q, keys, values, lp, off, scale)


def as_rows_kernel(layer, qkv, cache):
    """attention_rows's contract computed by the reference (the new column written into `cache`)."""
    return batch_attention.attention_rows_ref(layer, qkv, cache)


@pytest.fixture
def gated(monkeypatch):
    yield from gate(monkeypatch, batch_attention, attend_rows=as_kernel, attention_rows=as_rows_kernel)


def test_kernels_equal_to_the_references_are_taken_once_per_dtype(gated):
    calls = []
    gated.setattr(batch_attention, "attend_rows", lambda *a: calls.append("attend") or as_kernel(*a))
    gated.setattr(batch_attention, "attention_rows", lambda *a: calls.append("rows") or as_rows_kernel(*a))
    assert batch_attention.enabled(mx.bfloat16) == "kernel"
    checked = len(calls)
    # many splits, two, none; attention_rows each with and without q/k norms
    assert calls.count("attend") == 3 and calls.count("rows") == 6
    assert batch_attention.enabled(mx.bfloat16) == "kernel" and len(calls) == checked
    assert batch_attention.enabled(mx.float16) == "kernel" and len(calls) == 2 * checked
    assert batch_attention.enabled(mx.float32) is None  # 16-bit activations only


@pytest.mark.parametrize("which, wrong", [("attend_rows", "raises"), ("attend_rows", "differs"),
                                          ("attention_rows", "raises"), ("attention_rows", "differs"),
                                          ("attention_rows", "leaves the new key out"),
                                          ("attention_rows", "miscounts the rows' offsets")])
def test_a_kernel_that_fails_or_differs_leaves_mlx_lm_attention(gated, caplog, which, wrong):
    def attend(q, keys, values, lp, off, scale):
        if wrong == "raises":
            raise RuntimeError("nvrtc: error")
        out = as_kernel(q, keys, values, lp, off, scale)
        return out.at[:, :, :4].add(1.0) if wrong == "differs" else out

    def rows(layer, qkv, cache):
        if wrong == "raises":
            raise RuntimeError("nvrtc: error")
        out = as_rows_kernel(layer, qkv, cache)
        if wrong == "leaves the new key out":  # its output right, the cache's new column zeros
            cache.keys = cache.keys.at[:, :, cache._idx - 1].add(-cache.keys[:, :, cache._idx - 1])
            return out
        if wrong == "miscounts the rows' offsets":  # output and buffers right, offsets one short
            cache.offset = cache.offset - 1
            return out
        return out.at[:, :, :4].add(1.0)

    gated.setattr(batch_attention, which, attend if which == "attend_rows" else rows)
    assert batch_attention.enabled(mx.bfloat16) is None
    assert "batched decode attention runs MLX's ops" in caplog.text
    result = batch_attention.check(mx.bfloat16)
    assert not result["kept"] and (("error" in result) == (wrong in ("raises", "miscounts the rows' offsets")))


def test_off_by_switch(monkeypatch):
    monkeypatch.setenv(batch_attention.SWITCH, "0")
    batch_attention.reset()
    try:
        assert batch_attention.enabled() is None
    finally:
        batch_attention.reset()
