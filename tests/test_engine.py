"""The engine on the real bundled model: tokens equal mlx-lm's own generation, text streams without
splitting characters, and bad input gets a clear error."""

import mlx.core as mx
import pytest
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

from engine.decoding.chat import render
from engine.errors import InvalidRequest
from engine.decoding.generate import build_prompt, generate
from engine.decoding.defaults import preset
from engine.decoding.sampling import SamplingParams

CONVERSATIONS = {
    "english": [{"role": "user", "content": "What is the capital of France?"}],
    "chinese": [{"role": "user", "content": "请用中文介绍一下巴黎。"}],
    "multi-turn": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": "Another one, with an emoji 🍎?"},
    ],
}
SAMPLERS = {
    "greedy": SamplingParams(max_tokens=24),
    "seeded": preset("recommended", "qwen3", max_tokens=24, seed=1234),
}


def mlx_lm_tokens(lm, tokens, params):
    """What mlx-lm itself generates for the same prompt and sampler (global seed = our seed)."""
    mx.random.seed(params.seed or 0)
    sampler = make_sampler(temp=params.temperature, top_p=params.top_p if params.top_p < 1 else 0.0,
                           min_p=params.min_p, top_k=params.top_k)
    out = [r.token for r in stream_generate(lm.model, lm.tokenizer, mx.array(tokens),
                                            max_tokens=params.max_tokens, sampler=sampler)]
    eos = set(lm.tokenizer.eos_token_ids)
    return [t for t in out if t not in eos]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_tokens_equal_mlx_lm(lm, conversation, sampler):
    params = SAMPLERS[sampler]
    prompt = build_prompt(lm, messages=CONVERSATIONS[conversation])
    events = list(generate(lm, prompt, params))
    ours = [e.token for e in events if e.kind == "token"]
    assert ours == mlx_lm_tokens(lm, prompt.tokens, params)
    assert len(ours) > 0
    assert events[-1].kind == "done" and events[-1].finish_reason in ("stop", "length")


def test_same_seed_same_tokens_different_seed_differs(lm):
    prompt = build_prompt(lm, messages=CONVERSATIONS["english"])
    run = lambda seed: [e.token for e in generate(lm, prompt, preset(
        "recommended", "qwen3", temperature=1.0, max_tokens=16, seed=seed)) if e.kind == "token"]
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_streamed_text_never_splits_a_character(lm):
    """Chinese and emoji span several byte-level tokens; no event may carry half a character."""
    prompt = build_prompt(lm, messages=[{"role": "user", "content": "Repeat: 你好世界 😀🎉 你好"}])
    events = list(generate(lm, prompt, SamplingParams(max_tokens=40)))
    texts = [e.text for e in events]
    assert all("\ufffd" not in t for t in texts)
    tokens = [e.token for e in events if e.kind == "token"]
    full = lm.tokenizer.decode(tokens)
    assert "".join(texts) == full.rstrip("\ufffd").lstrip(" ")


def test_detokenizer_on_known_multibyte_tokens(lm):
    """Feeding the tokens of a known string one by one reproduces it with no partial characters."""
    text = "猫 and 🐈‍⬛ say 你好"
    tokens = lm.tokenizer.encode(text)
    detok = lm.tokenizer.detokenizer
    pieces = []
    for t in tokens:
        detok.add_token(t)
        pieces.append(detok.last_segment)
    detok.finalize()
    pieces.append(detok.last_segment)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_stops_on_end_of_turn(lm):
    prompt = build_prompt(lm, messages=CONVERSATIONS["english"])
    events = list(generate(lm, prompt, SamplingParams(max_tokens=60)))
    assert events[-1].finish_reason == "stop"
    assert "<|im_end|>" not in "".join(e.text for e in events)
    assert lm.tokenizer.eos_token_ids == {2}


def test_stop_string_cuts_the_text(lm):
    prompt = build_prompt(lm, messages=CONVERSATIONS["english"])
    full = "".join(e.text for e in generate(lm, prompt, SamplingParams(max_tokens=20)))
    assert "Paris" in full
    events = list(generate(lm, prompt, SamplingParams(max_tokens=20, stop=("Paris",))))
    text = "".join(e.text for e in events)
    assert text == full[: full.index("Paris")]
    assert events[-1].finish_reason == "stop"


def test_length_finish_reason(lm):
    prompt = build_prompt(lm, messages=CONVERSATIONS["english"])
    events = list(generate(lm, prompt, SamplingParams(max_tokens=3)))
    assert [e.kind for e in events] == ["token"] * 3 + ["done"]
    assert events[-1].finish_reason == "length"
    assert events[-1].usage.completion_tokens == 3


def test_checkpoints_sit_at_message_ends(lm):
    prompt = render(lm.tokenizer, CONVERSATIONS["multi-turn"])
    text = lm.tokenizer.decode(prompt.tokens)
    assert len(prompt.checkpoints) == 4 and prompt.checkpoints[-1] == len(prompt.tokens)
    for offset, ending in zip(prompt.checkpoints[:3], ["terse assistant.", "Name a fruit.", "Apple."]):
        assert lm.tokenizer.decode(prompt.tokens[:offset]).rstrip().endswith(ending + "<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-1), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(seed=-3), "seed"),
])
def test_bad_sampling_values_are_clear_errors(kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**kwargs)


def test_empty_prompt_is_rejected(lm):
    with pytest.raises(InvalidRequest, match="empty"):
        build_prompt(lm, messages=[{"role": "user", "content": "   "}])
    with pytest.raises(InvalidRequest, match="empty"):
        build_prompt(lm, messages=[])
    with pytest.raises(InvalidRequest, match="empty"):
        build_prompt(lm, text="")


def test_bad_roles_are_rejected(lm):
    with pytest.raises(InvalidRequest, match="role"):
        build_prompt(lm, messages=[{"role": "wizard", "content": "hi"}])


def test_prompt_longer_than_context_is_rejected(lm):
    tokens = [100] * (lm.context_length + 1)
    with pytest.raises(InvalidRequest, match="context"):
        list(generate(lm, build_prompt(lm, prompt_tokens=tokens), SamplingParams(max_tokens=4)))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        list(generate(lm, build_prompt(lm, prompt_tokens=[100] * 8000),
                      SamplingParams(max_tokens=500)))
