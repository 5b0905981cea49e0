"""The chunked gated-delta prefill (engine/kernels/gated_delta.py) against mlx-lm's per-token
recurrence: the operator on random inputs of Qwen3.5-style shapes, then whole tiny hybrid models
loaded as mlxchat loads them against the same folders loaded by plain mlx-lm.

Tolerance: fp32 on the CPU. The chunked form sums in a different order (matmuls over a chunk, a
product series for the chunk's triangular inverse), so it is not bitwise equal; outputs (|y| of
order 0.1-1) and states agree to within ATOL = 2e-5 absolute plus RTOL = 1e-4 relative. Through a
whole model (4 layers, logits of order 1) the differences grow: MODEL_ATOL = 1e-3.
"""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.gated_delta import gated_delta_ops, gated_delta_update as mlx_gated_delta_update
from mlx_lm.models.gated_delta import normalize_qk

from engine.kernels.gated_delta import (MIN_TOKENS, chunked_gated_delta, gated_delta_update,
                                        use_chunked_prefill)
from tiny_models import QWEN3_5, build_folder, tiny_llama, tiny_qwen3_5, tiny_qwen3_next

pytestmark = pytest.mark.fast

ATOL, RTOL = 2e-5, 1e-4
MODEL_ATOL = 1e-3
# tests/tiny_models.py's hybrid shape: 2 key heads, 4 value heads, head dims 16
HK, HV, DK, DV = (QWEN3_5[key] for key in ("linear_num_key_heads", "linear_num_value_heads",
                                           "linear_key_head_dim", "linear_value_head_dim"))


def inputs(T: int, B: int = 1, hk: int = HK, hv: int = HV, dk: int = DK, dv: int = DV, seed: int = 0,
           decay: tuple[float, float] = (0.0, 1.0)):
    """q, k (normalized as mlx-lm's layers do), v, log decay, beta, a random initial state."""
    mx.random.seed(seed)
    q, k = normalize_qk(mx.random.normal((B, T, hk, dk)), mx.random.normal((B, T, hk, dk)),
                        inv_scale=dk ** -0.5, eps=1e-6)
    v = mx.random.normal((B, T, hv, dv))
    log_g = -mx.random.uniform(*decay, (B, T, hv))
    beta = mx.random.uniform(0.0, 1.0, (B, T, hv))
    state = 0.5 * mx.random.normal((B, hv, dv, dk))
    return q, k, v, log_g, beta, state


def assert_close(got: mx.array, want: mx.array, atol: float = ATOL, rtol: float = RTOL) -> None:
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=atol, rtol=rtol).item(), mx.abs(got - want).max().item()


@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 129, 200])
@pytest.mark.parametrize("initial_state", [False, True])
def test_chunked_equals_the_per_token_recurrence(T, initial_state):
    q, k, v, log_g, beta, state = inputs(T, B=2, seed=T)
    state = state if initial_state else None
    y_ref, s_ref = gated_delta_ops(q, k, v, mx.exp(log_g), beta, state)
    y, s = chunked_gated_delta(q, k, v, log_g, beta, state)
    assert_close(y, y_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("decay", [(0.0, 0.01), (0.0, 5.0)], ids=["slow-decay", "fast-decay"])
def test_real_head_sizes_and_extreme_decays(decay):
    """Qwen3.5's head dims (128) and decays near 1 (the intra-chunk matrix is then largest) or
    strong (its entries underflow)."""
    q, k, v, log_g, beta, state = inputs(150, hk=2, hv=4, dk=128, dv=128, seed=5, decay=decay)
    y_ref, s_ref = gated_delta_ops(q, k, v, mx.exp(log_g), beta, state)
    y, s = chunked_gated_delta(q, k, v, log_g, beta, state)
    assert_close(y, y_ref)
    assert_close(s, s_ref)


def test_padded_tokens_leave_the_state_alone():
    """A left-padded row (batched prefill): masked tokens change nothing and output 0."""
    T, pad = 100, 37
    q, k, v, log_g, beta, state = inputs(T, B=2, seed=3)
    mask = mx.array([[False] * pad + [True] * (T - pad), [True] * T])
    y_ref, s_ref = gated_delta_ops(q, k, v, mx.exp(log_g), beta, state, mask)
    y, s = chunked_gated_delta(q, k, v, log_g, beta, state, mask)
    assert_close(s, s_ref)
    assert_close(y[:, pad:], y_ref[:, pad:])
    assert_close(y[1], y_ref[1])
    assert mx.all(y[0, :pad] == 0).item()
    # the padded row's state equals running its real tokens alone
    _, s_alone = gated_delta_ops(q[:1, pad:], k[:1, pad:], v[:1, pad:], mx.exp(log_g[:1, pad:]),
                                 beta[:1, pad:], state[:1])
    assert_close(s[:1], s_alone)


def test_update_matches_mlx_lm_and_keeps_its_path_for_decode():
    """Same signature as mlx-lm's gated_delta_update; short inputs (decode, verify blocks) take
    mlx-lm's own path, so they are bitwise mlx-lm's."""
    mx.random.seed(11)
    for T in (1, MIN_TOKENS - 1, MIN_TOKENS, 300):
        q, k, v, _, _, state = inputs(T, seed=T)
        a, b = mx.random.normal((1, T, HV)), mx.random.normal((1, T, HV))
        A_log, dt_bias = mx.random.uniform(-2, 1, (HV,)), mx.random.normal((HV,))
        want = mlx_gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)
        got = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)
        if T < MIN_TOKENS:
            assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))
        else:
            assert_close(got[0], want[0])
            assert_close(got[1], want[1])


@pytest.mark.parametrize("make", [tiny_qwen3_5, tiny_qwen3_next], ids=["qwen3_5", "qwen3_next"])
def test_tiny_hybrid_model_prefill_matches_mlx_lm(make):
    """End to end: the model as mlxchat loads it (chunked prefill) against the same folder loaded
    by plain mlx-lm (per-token recurrence): prompt logits, the caches left behind, then greedy
    tokens decoded from each."""
    lm = make()
    assert use_chunked_prefill(lm.model) == 0  # the loader already switched every layer
    ref, _ = mlx_lm_load(str(lm.path))

    prompt = mx.array([[(i * 7919) % 40000 + 10 for i in range(333)]], dtype=mx.uint32)
    cache, ref_cache = make_prompt_cache(lm.model), make_prompt_cache(ref)
    logits = lm.model(prompt, cache=cache)
    ref_logits = ref(prompt, cache=ref_cache)
    assert_close(logits, ref_logits, MODEL_ATOL)
    states, ref_states = tree_flatten([c.state for c in cache]), tree_flatten([c.state for c in ref_cache])
    assert len(states) == len(ref_states) > 0
    for (_, s), (_, rs) in zip(states, ref_states):
        if isinstance(s, mx.array):
            assert_close(s, rs, MODEL_ATOL)
        else:
            assert s == rs

    tokens, ref_tokens = [], []
    y, ry = logits[:, -1].argmax(-1), ref_logits[:, -1].argmax(-1)
    for _ in range(12):
        tokens.append(y.item())
        ref_tokens.append(ry.item())
        y = lm.model(y[:, None], cache=cache)[:, -1].argmax(-1)
        ry = ref(ry[:, None], cache=ref_cache)[:, -1].argmax(-1)
    assert tokens == ref_tokens


def test_only_the_linear_attention_layers_are_switched():
    folder = build_folder(QWEN3_5)
    plain, _ = mlx_lm_load(str(folder))
    layers = [layer for layer in plain.layers if hasattr(layer, "linear_attn")]
    assert use_chunked_prefill(plain) == len(layers) == 3
    assert use_chunked_prefill(plain) == 0  # idempotent
    assert use_chunked_prefill(plain, enabled=False) == 3  # back to mlx-lm's layers
    assert use_chunked_prefill(plain, enabled=False) == 0
    assert use_chunked_prefill(tiny_llama().model) == 0
