"""The 8-bit KV cache's quality gate on the real bundled model (bench/quality.py's text, its first
512 tokens fed 8 a step, so every chunk attends over 8-bit keys and values the earlier chunks
left): perplexity no more than 0.5% above the full cache's, the next-token distributions close
(mean KL divergence under 0.005 nats, the most likely token the same at 95% of positions), and
the cache's bytes under a third of the full cache's. `python -m bench.kv8` measures the whole
text, longer contexts and decode speed."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from bench.quality import GATE, compare, logprobs, text_tokens
from engine.model_cache import LOCAL
from engine.kernels.kv8 import KV8Cache, kv_format
from engine.loading.registry import load_model


@pytest.fixture(scope="module")
def lm8():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXCHAT_KV_BITS", "8")
        return load_model(None)


def test_the_8bit_cache_passes_the_perplexity_gate(lm, lm8):
    assert kv_format(lm.model) == "full" and kv_format(lm8.model).startswith("kv8")
    tokens = text_tokens(lm)[:512]
    cache = make_prompt_cache(lm8.model)
    assert all(type(c) is KV8Cache for c in cache)
    got = compare(logprobs(lm, tokens), logprobs(lm8, tokens), tokens)
    print(f"\n8-bit KV cache over {len(tokens)} tokens: {got}")
    assert 1.0 < got["perplexity"] < 100.0  # the model reads English: a real, finite perplexity
    assert got["relative"] <= GATE, got
    assert got["mean_kl"] < 0.005 and got["top1_agreement"] >= 0.95, got


def test_the_8bit_cache_takes_under_a_third_of_the_bytes(lm, lm8):
    sizes = []
    for model in (lm.model, lm8.model):
        cache = make_prompt_cache(model)
        model(mx.array([text_tokens(lm)[:64]]), cache=cache)
        sizes.append(LOCAL.nbytes(LOCAL.copy(cache)))
    assert sizes[1] / sizes[0] == 0.3125, sizes  # 64 codes + 2 x (fp32 scale, bias) per 64 floats
