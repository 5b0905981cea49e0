"""The plan rank 0 broadcasts to the other ranks, through a real (one-rank) MLX group."""

import mlx.core as mx
import pytest

from engine.distributed.plan import Op, Plan, broadcast

pytestmark = pytest.mark.fast


def test_plan_survives_the_broadcast():
    group = mx.distributed.init()  # one rank: the sum is rank 0's own array
    tokens = mx.array([[5, 7, 49151]], dtype=mx.uint32)
    got = broadcast(group, Plan(Op.FORWARD, 3, (1, 3), 17, drops=[1, 2], name="m", tokens=tokens))
    assert (got.op, got.cache_id, got.shape, got.offset, got.drops, got.name) == \
        (Op.FORWARD, 3, (1, 3), 17, [1, 2], "m")
    assert got.tokens.tolist() == [[5, 7, 49151]]
    assert broadcast(group, Plan(Op.STOP)).tokens is None
