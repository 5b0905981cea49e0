"""Sharding refuses what it cannot split (issue 24): the bundled SmolLM2 (9 heads, 3 KV heads)
over 2 processes is refused before any rank computes, with one line naming the model, the
numbers and the world sizes that would work."""

import pytest

from engine.errors import ModelLoadError
from engine.loading.shardable import check_shardable

pytestmark = pytest.mark.fast

SMOLLM2 = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}


def test_smollm2_over_two_processes_is_refused_with_what_would_work():
    with pytest.raises(ModelLoadError) as refused:
        check_shardable("smollm2-135m-instruct", SMOLLM2, 2)
    line = str(refused.value)
    assert "\n" not in line and "smollm2-135m-instruct" in line
    assert "num_attention_heads 9" in line and "num_key_value_heads 3" in line
    assert "world sizes that divide them all: 3" in line
    check_shardable("smollm2-135m-instruct", SMOLLM2, 3)  # divides: no error
    check_shardable("smollm2-135m-instruct", SMOLLM2, 1)


def test_a_hybrids_linear_heads_count_too():
    hybrid = {"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 512,
              "linear_num_key_heads": 2, "linear_num_value_heads": 6}
    with pytest.raises(ModelLoadError, match="linear_num_value_heads 6"):
        check_shardable("hybrid", hybrid, 4)
    check_shardable("hybrid", hybrid, 2)


def test_load_model_refuses_before_sharding():
    """Through the loader, as every rank runs it (`load_model(..., group=...)`): a tiny llama's
    4 heads and 2 KV heads over 3 processes."""
    from engine.loading.registry import load_model
    from tiny_models import tiny_llama

    class ThreeRanks:  # the only thing the check asks of a distributed group
        def size(self) -> int:
            return 3

    with pytest.raises(ModelLoadError, match="cannot split .* over 3 processes"):
        load_model(str(tiny_llama().path), group=ThreeRanks())
