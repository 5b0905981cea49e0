"""The rest of OpenAI's chat API through the official client, streamed and not, on the bundled
model: logprobs (equal to the model's own log-softmax), logit_bias, n with seeds,
system_fingerprint, a request without `model`, error codes, a continued assistant message, and the
legacy /v1/completions."""

import httpx
import mlx.core as mx
import openai
import pytest

from engine.decoding.generate import build_prompt
from engine.scheduling.service import Engine
from live_server import openai_client, serving

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def server(lm, tmp_path_factory):
    engine = Engine(lm.name, load=lambda name, **_: lm).start()
    with serving(engine, tmp_path_factory.mktemp("fields") / "db.sqlite") as s:
        yield s


@pytest.fixture
def client(server):
    return openai_client(server)


def first_logprobs(lm, messages):
    """The model's log-softmax for the first answer token, computed here directly."""
    tokens = build_prompt(lm, messages=messages).tokens
    logits = lm.model(mx.array(tokens)[None])[0, -1].astype(mx.float32)
    return logits - mx.logsumexp(logits)


def test_logprobs_are_the_models_log_softmax(lm, client):
    expected = first_logprobs(lm, ASK)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, logprobs=True,
                                       top_logprobs=3, temperature=0)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    first = entries[0]
    best = int(mx.argmax(expected).item())
    assert first.token == lm.tokenizer.decode([best])  # greedy: the most likely token
    assert first.logprob == pytest.approx(expected[best].item(), abs=2e-3)
    assert [t.logprob for t in first.top_logprobs] == sorted(
        (t.logprob for t in first.top_logprobs), reverse=True)
    assert len(first.top_logprobs) == 3 and first.top_logprobs[0].token == first.token
    assert bytes(first.bytes).decode() == first.token

    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                                 logprobs=True, top_logprobs=3, stream=True,
                                                 temperature=0))
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in entries]


def test_logit_bias_bans_a_token(lm, client):
    best = int(mx.argmax(first_logprobs(lm, ASK)).item())
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, logprobs=True,
                                           temperature=0)
    banned = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, logprobs=True,
                                            temperature=0, logit_bias={str(best): -100})
    assert plain.choices[0].logprobs.content[0].token == lm.tokenizer.decode([best])
    assert banned.choices[0].logprobs.content[0].token != lm.tokenizer.decode([best])


def test_n_choices_differ_and_repeat_with_a_seed(client):
    ask = dict(model=MODEL, messages=ASK, max_tokens=4, n=3, temperature=1.5, seed=11)
    a = client.chat.completions.create(**ask)
    b = client.chat.completions.create(**ask)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert len(set(texts)) > 1
    assert texts == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == 3 * 4 or all(c.finish_reason for c in a.choices)
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(stream=True, **ask):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts


def test_fingerprint_and_no_model(client, server):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert r.system_fingerprint and r.system_fingerprint.startswith("fp_")
    body = httpx.post(f"{server.url}/v1/chat/completions",
                      json={"messages": ASK, "max_tokens": 1}, timeout=120).json()
    assert body["model"] == MODEL and body["system_fingerprint"] == r.system_fingerprint
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, stream=True))
    assert {c.system_fingerprint for c in chunks} == {r.system_fingerprint}


def test_error_codes(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=1)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=9000)
    assert err.value.body["code"] == "context_length_exceeded"
    assert err.value.body["param"] == "max_tokens"


def test_final_assistant_message_is_continued(lm, client):
    messages = ASK + [{"role": "assistant", "content": "My favourite fruit is the"}]
    prompt = build_prompt(lm, messages=messages).tokens
    assert lm.tokenizer.decode(prompt).endswith("My favourite fruit is the")
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == len(prompt)
    expected = lm.tokenizer.decode([int(mx.argmax(first_logprobs(lm, messages)).item())])
    assert r.choices[0].message.content.startswith(expected)


def test_legacy_completions(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                                  logprobs=2, temperature=0)
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason == "length" and c.text
    assert len(c.logprobs.tokens) == 3 and "".join(c.logprobs.tokens) == c.text
    assert all(len(t) == 2 for t in c.logprobs.top_logprobs)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, stream=True)
        if ch.choices)
    assert streamed == c.text


def test_known_openai_fields_asking_for_nothing_different_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=1, reasoning_effort="low", service_tier="auto",
        modalities=["text"], prediction={"type": "content", "content": "An apple."}, audio=None,
        web_search_options=None, extra_body={"functions": [], "function_call": "auto"})
    assert r.usage.completion_tokens == 1
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, best_of=1, echo=False,
                                  suffix="")
    assert r.usage.completion_tokens == 1


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("web_search_options", {}), ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", {"name": "f"}), ("service_tier", 3)])
def test_known_chat_fields_asking_for_more_are_named(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                       extra_body={field: value})
    assert err.value.body["param"] == field and err.value.body["code"] == "unsupported_parameter"
    assert f"'{field}'" in err.value.body["message"]


@pytest.mark.parametrize("field, value", [("best_of", 2), ("echo", True)])
def test_known_completion_fields_asking_for_more_are_named(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, extra_body={field: value})
    assert err.value.body["param"] == field and err.value.body["code"] == "unsupported_parameter"


def test_a_suffix_is_refused_on_the_bundled_model_which_has_no_fim_tokens(client):
    """Fill-in-the-middle needs a code model's FIM tokens (tests/test_fim.py); SmolLM2 has none."""
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="def f():", suffix="\n", max_tokens=1)
    assert err.value.body["param"] == "suffix" and err.value.body["code"] == "fim_not_supported"
    assert "no FIM tokens" in err.value.body["message"]
    models = client.models.list().data
    assert "insert" not in next(m for m in models if m.id == MODEL).model_extra["capabilities"]


def test_unknown_fields_are_still_refused(client):
    for create, kwargs in [(client.chat.completions.create, {"messages": ASK}),
                           (client.completions.create, {"prompt": "Hello"})]:
        with pytest.raises(openai.BadRequestError) as err:
            create(model=MODEL, max_tokens=1, extra_body={"frobnicate": True}, **kwargs)
        assert err.value.body["code"] == "unknown_parameter" and err.value.body["param"] == "frobnicate"


def test_legacy_completions_take_every_single_prompt_form(lm, client):
    text = "The capital of France is"
    tokens = lm.tokenizer.encode(text)
    expected = client.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0)
    for prompt in ([text], tokens, [tokens]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
        assert r.choices[0].text == expected.choices[0].text, prompt
        assert r.usage.prompt_tokens == len(tokens)
    for prompt in (["one", "two"], [tokens, tokens], [], [1, "x"], [[]]):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert err.value.body["param"] == "prompt"
        if len(prompt) == 2 and prompt[0] != 1:
            assert "one prompt per request" in err.value.body["message"]
