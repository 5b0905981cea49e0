"""Property-based fuzzing of `/v1/chat/completions` against a real server with the bundled model:
whatever JSON arrives, the answer is 4xx in OpenAI's error shape or 200, never 5xx, and the server
stays alive."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.server import create_app
from live_server import ThreadedServer

MODEL = "smollm2-135m-instruct"
FIELDS = ["stream", "stream_options", "stop", "response_format", "n",
          "temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "presence_penalty",
          "user", "metadata", "speculative", "repetition_penalty", "unknown"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=False), st.text(max_size=20),
                    st.sampled_from(["user", "system", "assistant", MODEL, "\ud800", "#"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "developer", "assistant"]), values),
     "content": st.one_of(st.text(max_size=40), values)}), max_size=3)
schemas = st.one_of(values, st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema":
                    st.fixed_dictionaries({"name": st.just("x"), "schema": values})}))


@st.composite
def near_valid(draw) -> dict:
    """A valid request with one part fuzzed: the messages, the model or one more field."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    part = draw(st.one_of(st.just("messages"), st.sampled_from(["model", "max_tokens", *FIELDS])))
    if part == "messages":
        body["messages"] = draw(st.one_of(messages, values))
    elif part == "max_tokens":
        body["max_tokens"] = draw(values.filter(
            lambda v: not isinstance(v, int) or isinstance(v, bool) or v < 1))
    else:
        body[part] = draw(schemas if part == "response_format" else values)
    return body


bodies = st.one_of(values, near_valid())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from engine import Engine

    engine = Engine().start()
    s = ThreadedServer(create_app(engine, tmp_path_factory.mktemp("fuzz") / "db.sqlite")).start()
    yield s
    s.stop()
    engine.stop()


@pytest.mark.timeout(240)
def test_chat_endpoint_never_answers_5xx(server):
    client = httpx.Client(base_url=server.url, timeout=120)

    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(bodies)
    def check(body):
        raw = json.dumps(body, ensure_ascii=True).encode()
        r = client.post("/v1/chat/completions", content=raw,
                        headers={"Content-Type": "application/json"})
        assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text)
        if r.status_code != 200:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
        elif isinstance(body, dict) and body.get("stream") is True:
            assert r.text.rstrip().endswith("data: [DONE]")
        assert client.get("/health").status_code == 200

    try:
        check()
    finally:
        client.close()
