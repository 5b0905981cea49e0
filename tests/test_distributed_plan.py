"""The plan rank 0 broadcasts to the other ranks, through a real (one-rank) MLX group."""

import mlx.core as mx
import pytest

from engine.distributed.plan import Op, Plan, agree, broadcast

pytestmark = pytest.mark.fast


def test_plan_survives_the_broadcast():
    group = mx.distributed.init()  # one rank: the sum is rank 0's own array
    tokens = mx.array([[5, 7, 49151]], dtype=mx.uint32)
    got = broadcast(group, Plan(Op.FORWARD, 3, (1, 3), 17, drops=[1, 2], name="m", tokens=tokens))
    assert (got.op, got.cache_id, got.shape, got.offset, got.drops, got.name) == \
        (Op.FORWARD, 3, (1, 3), 17, [1, 2], "m")
    assert got.tokens.tolist() == [[5, 7, 49151]]
    assert broadcast(group, Plan(Op.STOP)).tokens is None


def test_file_work_and_agreement_survive_the_collectives():
    group = mx.distributed.init()
    work = [(4, [1, 2, 49151]), (0, "0123abcd.safetensors")]
    got = broadcast(group, Plan(Op.READ, name="f.safetensors", target=9, length=3, files=work))
    assert (got.op, got.name, got.target, got.length, got.files) == \
        (Op.READ, "f.safetensors", 9, 3, work)
    assert agree(group, [True, False, True]) == [True, False, True]
    assert agree(group, []) == []
