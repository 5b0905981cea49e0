"""Speculative decoding through the OpenAI-compatible API (an extension field, sent with the `openai`
client's `extra_body`), against a real server running the bundled model: greedy text identical to
plain decoding, the statistics in `usage.speculative` (JSON and streamed), strict validation."""

import httpx
import openai
import pytest

from live_server import openai_client, serving

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
STATS = {"drafted", "accepted", "acceptance_rate", "tokens_per_target_step", "switched_off"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from engine.scheduling.service import Engine

    engine = Engine(max_running=2, max_queued=2).start()
    with serving(engine, tmp_path_factory.mktemp("api-spec") / "db.sqlite") as s:
        yield s


@pytest.fixture
def client(server):
    return openai_client(server)


def ask(client, speculative=None, **kwargs):
    extra = {"speculative": speculative} if speculative is not None else None
    return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24,
                                          temperature=0, extra_body=extra, **kwargs)


@pytest.mark.parametrize("draft", ["self-q4", "truncated:10"])
def test_greedy_text_is_identical_with_and_without_speculation(client, draft):
    plain = ask(client)
    fast = ask(client, {"draft": draft, "k": 4})
    assert fast.choices[0].message.content == plain.choices[0].message.content
    assert fast.choices[0].finish_reason == plain.choices[0].finish_reason
    assert fast.usage.completion_tokens == plain.usage.completion_tokens
    stats = fast.usage.model_extra["speculative"]
    assert set(stats) == STATS
    assert stats["drafted"] >= stats["accepted"] >= 0 and stats["tokens_per_target_step"] >= 1
    assert stats["acceptance_rate"] is None or 0 <= stats["acceptance_rate"] <= 1
    assert "speculative" not in (plain.usage.model_extra or {})  # the default stays plain
    if draft == "self-q4":  # its own 4-bit weights agree with it nearly always
        assert stats["acceptance_rate"] > 0.5


def test_streamed_usage_carries_the_statistics(client):
    plain = ask(client).choices[0].message.content
    stream = ask(client, {"draft": "truncated:20", "k": 3, "adaptive": False}, stream=True,
                 stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain
    usage = chunks[-1].usage
    assert not chunks[-1].choices and set(usage.model_extra["speculative"]) == STATS
    assert usage.model_extra["speculative"]["drafted"] > 0  # k fixed at 3: drafts every step


@pytest.mark.parametrize("speculative,message", [
    ("self-q4", "'speculative' must be an object"),
    ({"k": 4}, "'speculative.draft' is required"),
    ({"draft": "self-q4", "depth": 2}, "Unrecognized argument supplied in 'speculative': depth"),
    ({"draft": 4}, "'speculative.draft' must be a string"),
    ({"draft": "self-q4", "k": "4"}, "'speculative.k' must be an integer"),
    ({"draft": "self-q4", "k": 0}, "speculative.k must be an integer in [1, 16]"),
    ({"draft": "self-q4", "adaptive": 1}, "'speculative.adaptive' must be a boolean"),
    ({"draft": "no-such-draft"}, "unknown draft 'no-such-draft'"),
    ({"draft": "truncated:99"}, "N must be a whole number of layers in [1, 29]"),
    ({"draft": "mtp"}, "no multi-token-prediction head"),
])
def test_bad_speculative_options_are_refused_with_400(client, speculative, message):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, speculative)
    assert message in info.value.body["message"]


def test_null_means_plain_decoding(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": QUESTION, "max_tokens": 2, "speculative": None})
    assert r.status_code == 200 and "speculative" not in r.json()["usage"]


def test_json_mode_with_speculative_decoding_is_refused(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": QUESTION, "max_tokens": 2,
        "response_format": {"type": "json_object"}, "speculative": {"draft": "self-q4"}})
    assert r.status_code == 400
    assert "cannot be combined with speculative decoding" in r.json()["error"]["message"]
