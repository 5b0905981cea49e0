"""The quality gate of the lossy int8-activation path (`MLXCHAT_KERNELS=int8`) on the real bundled
model: perplexity on a fixed public-domain text (bench/data/declaration-of-independence.txt, the
US Declaration of Independence, 1776) within 0.5% of the exact kernels, the text fed 8 tokens a
step so that every product takes the 1-8 row kernels, then 256 a step (prompt chunks). Greedy agreement with the exact path on the
identity prompts is printed (run with -s); token identity is not expected of this path."""

import mlx.core as mx
import pytest

from bench.quality import GATE, TEXT, perplexity
from engine.decoding.generate import build_prompt, generate
from engine.decoding.sampling import SamplingParams
from engine.kernels import active_path
from engine.loading.registry import load_model
from chats import CONVERSATIONS


@pytest.fixture(scope="module")
def int8_lm():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXCHAT_KERNELS", "int8")
        assert "int8 activations" in active_path(), active_path()
        return load_model(None)


@pytest.mark.timeout(900)
def test_int8_activations_pass_the_perplexity_gate(lm, int8_lm):
    tokens = lm.tokenizer.encode(TEXT.read_text())
    assert len(tokens) > 800
    exact, int8 = perplexity(lm, tokens), perplexity(int8_lm, tokens)
    print(f"\nperplexity over {len(tokens)} tokens: exact {exact:.4f}, int8 {int8:.4f} "
          f"({(int8 / exact - 1) * 100:+.3f}%)")
    assert 1.0 < exact < 100.0  # the model reads English: a real, finite perplexity
    assert abs(int8 / exact - 1) < GATE
    # in prompt chunks of 256 tokens (the int8 chunk product against the exact path's BLAS one)
    exact, int8 = perplexity(lm, tokens, step=256), perplexity(int8_lm, tokens, step=256)
    print(f"in 256-token chunks: exact {exact:.4f}, int8 {int8:.4f} ({(int8 / exact - 1) * 100:+.3f}%)")
    assert abs(int8 / exact - 1) < GATE


@pytest.mark.timeout(600)
def test_int8_activations_change_the_numbers_but_answer_alike(lm, int8_lm):
    """The int8 path really runs (its logits differ from the exact path's) and mostly picks the
    same next tokens; the greedy agreement on the identity prompts (tokens in common before the
    first difference) is printed."""
    ids = mx.array([lm.tokenizer.encode(TEXT.read_text())[:64]])
    exact_logits, int8_logits = (m.model(ids[:, :8])[0] for m in (lm, int8_lm))
    assert not mx.array_equal(exact_logits, int8_logits).item()
    agree = mx.mean(mx.argmax(exact_logits, -1) == mx.argmax(int8_logits, -1)).item()
    assert agree >= 0.75, agree  # the next-token choice at 8 positions of plain text
    lines = []
    for name, messages in CONVERSATIONS.items():
        prompt = build_prompt(lm, messages=messages)
        params = SamplingParams(max_tokens=16)  # printed, not asserted: a short look is enough
        ours = [e.token for e in generate(int8_lm, prompt, params) if e.kind == "token"]
        exact = [e.token for e in generate(lm, prompt, params) if e.kind == "token"]
        same = next((i for i, (a, b) in enumerate(zip(ours, exact)) if a != b), min(len(ours), len(exact)))
        lines.append(f"{name}: {same}/{len(exact)}")
        assert ours, name
    print("\ngreedy agreement, int8 vs exact (tokens before the first difference): " + ", ".join(lines))
