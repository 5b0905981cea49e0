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
bodies = st.one_of(
    values,
    st.fixed_dictionaries(
        {"model": st.one_of(st.just(MODEL), values), "messages": st.one_of(messages, values),
         "max_tokens": st.one_of(st.just(1), st.just(2), values.filter(
             lambda v: not isinstance(v, int) or isinstance(v, bool) or v < 1))},
        optional={name: schemas if name == "response_format" else values for name in FIELDS}),
)


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

    @settings(max_examples=150, deadline=None, database=None,
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
