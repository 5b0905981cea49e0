"""The OpenAI-compatible API against a real server on 127.0.0.1 running the real bundled model."""

import json
import time

import httpx
import openai
import pytest

from app.server import create_app
from live_server import ThreadedServer, openai_client, wait_idle

MODEL = "smollm2-135m-instruct"
HELLO = [{"role": "user", "content": "Say hello."}]
# An answer far longer than any test waits for (a few tokens a second on a CI CPU).
LONG = [{"role": "user", "content": "Write a very long story about a dragon who learns to cook."}]


@pytest.fixture(scope="module")
def engine():
    from engine.scheduling.service import Engine

    # Small limits so that over-capacity (429) is reachable with three requests.
    e = Engine(max_running=1, max_queued=1).start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    s = ThreadedServer(create_app(engine, tmp_path_factory.mktemp("api") / "db.sqlite")).start()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def idle(request):
    """Each test starts and ends with no generation running (they share one small engine)."""
    if "server" not in request.fixturenames:
        yield
        return
    server = request.getfixturevalue("server")
    wait_idle(server.url)
    yield
    wait_idle(server.url)


@pytest.fixture
def client(server):
    return openai_client(server)


def post(server, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, **kwargs,
                      **({"content": body} if isinstance(body, (str, bytes)) else {"json": body}))


def test_health_and_models(server, client):
    health = httpx.get(f"{server.url}/health").json()
    assert {k: health[k] for k in ("status", "model", "generating")} == {
        "status": "ok", "model": MODEL, "generating": 0}
    assert health["device"]["device"] == "cpu" and health["device"]["backend"] == "cpu"
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_models_retrieve_and_created(client):
    listed = client.models.list().data[0]
    one = client.models.retrieve(MODEL)
    assert one.model_dump() == listed.model_dump()
    assert one.id == MODEL and one.object == "model"
    assert 1_500_000_000 < one.created <= time.time()  # a real Unix time, not 0
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found" and "no-such-model" in err.value.body["message"]


def openai_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert error["message"] and error["type"] == "invalid_request_error"
    return error


def test_errors_outside_the_handlers_are_openai_json_under_v1(server):
    openai_error(httpx.get(f"{server.url}/v1/no/such/path"), 404, "not_found")
    wrong = httpx.get(f"{server.url}/v1/chat/completions")
    openai_error(wrong, 405, "method_not_allowed")
    assert wrong.headers["allow"] == "POST"
    openai_error(httpx.get(f"{server.url}/v1/models", headers={"Host": "evil.example"}),
                 400, "invalid_host")
    openai_error(post(server, {"messages": HELLO}, headers={"Origin": "http://evil.example"}),
                 403, "cross_origin")
    # The app's own paths keep their plain answers.
    for r, status in [(httpx.get(f"{server.url}/no/such/page"), 404),
                      (httpx.get(f"{server.url}/", headers={"Host": "evil.example"}), 400),
                      (httpx.post(f"{server.url}/conversations", headers={"Origin": "http://evil.example"}), 403)]:
        assert r.status_code == status and r.headers["content-type"].startswith("text/plain")


def test_openai_client_round_trip(client):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 4
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_openai_client_streaming_matches_non_streaming(client):
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=4, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole  # greedy: the same tokens either way
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 4
    # The second identical prompt reuses the cached prefix.
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_sse_framing(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    assert {p["object"] for p in payloads} == {"chat.completion.chunk"}
    assert len({p["id"] for p in payloads}) == 1
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for p in payloads if p["choices"][0]["delta"].get("content")) >= 1


def _valid(**changes):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not ...}


BAD_REQUESTS = [
    ("malformed JSON", '{"model": ', 400, None),
    ("body not an object", "[1, 2]", 400, None),
    ("model not a string", _valid(model=7), 400, "model"),
    ("unknown model", _valid(model="gpt-4o"), 404, "model"),
    ("missing messages", _valid(messages=...), 400, "messages"),
    ("empty messages", _valid(messages=[]), 400, "messages"),
    ("messages not a list", _valid(messages="hi"), 400, "messages"),
    ("message not an object", _valid(messages=["hi"]), 400, "messages[0]"),
    ("unknown role", _valid(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    ("content not text", _valid(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("image content", _valid(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "messages[0].content"),
    ("only blank content", _valid(messages=[{"role": "user", "content": "   "}]), 400, None),
    ("temperature a string", _valid(temperature="hot"), 400, "temperature"),
    ("temperature a boolean", _valid(temperature=True), 400, "temperature"),
    ("temperature out of range", _valid(temperature=9), 400, "temperature"),
    ("top_p zero", _valid(top_p=0), 400, "top_p"),
    ("top_k negative", _valid(top_k=-1), 400, "top_k"),
    ("top_k fractional", _valid(top_k=1.5), 400, "top_k"),
    ("min_p one", _valid(min_p=1), 400, "min_p"),
    ("max_tokens zero", _valid(max_tokens=0), 400, "max_tokens"),
    ("max_tokens a string", _valid(max_tokens="10"), 400, "max_tokens"),
    ("max_completion_tokens negative", _valid(max_completion_tokens=-5), 400, "max_tokens"),
    ("stop not strings", _valid(stop=[1]), 400, "stop"),
    ("seed negative", _valid(seed=-2), 400, "seed"),
    ("stream not a boolean", _valid(stream="yes"), 400, "stream"),
    ("stream_options without stream", _valid(stream_options={"include_usage": True}), 400, "stream_options"),
    ("unknown field", _valid(temprature=0.5), 400, "temprature"),
    ("too many choices", _valid(n=99), 400, "n"),
    ("presence penalty out of range", _valid(presence_penalty=3), 400, "presence_penalty"),
    ("keep_alive not a duration", _valid(keep_alive="soon"), 400, "keep_alive"),
    ("unknown response format", _valid(response_format={"type": "xml"}), 400, "response_format"),
]


@pytest.mark.parametrize("name, body, status, param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_validation_errors(server, name, body, status, param):
    r = post(server, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert httpx.get(f"{server.url}/health").json()["generating"] == 0  # nothing was started


def test_openai_client_raises_on_errors(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=HELLO)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=HELLO, temperature=-1)


def test_text_parts_and_developer_role_are_accepted(client):
    r = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]},
    ])
    assert r.choices[0].message.content


def test_stream_client_disconnect_cancels_generation(server):
    body = {"model": MODEL, "messages": LONG, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        while '"content": "' not in (line := next(lines)) or '"content": ""' in line:
            pass  # until a token arrives: the generation is running
        assert httpx.get(f"{server.url}/health").json()["generating"] == 1
        r.close()
    # 400 tokens would take minutes; the disconnect ends it within a few steps.
    assert wait_idle(server.url, timeout=15) < 15


def test_non_stream_client_disconnect_cancels_generation(server):
    body = {"model": MODEL, "messages": LONG, "max_tokens": 400}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(120, read=3))
    assert wait_idle(server.url, timeout=15) < 15


def test_over_capacity_is_429_with_retry_after(server):
    body = {"model": MODEL, "messages": LONG, "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=120) as http:
        streams = [http.stream("POST", f"{server.url}/v1/chat/completions", json=body)
                   for _ in range(2)]
        responses = [s.__enter__() for s in streams]  # one running, one queued (limits 1 + 1)
        try:
            assert [r.status_code for r in responses] == [200, 200]
            r = post(server, body)
            assert r.status_code == 429
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
        finally:
            for s in streams:
                s.__exit__(None, None, None)


def test_api_key_guards_v1_only(engine, tmp_path):
    s = ThreadedServer(create_app(engine, tmp_path / "db.sqlite", api_key="s3cret")).start()
    try:
        assert httpx.get(f"{s.url}/v1/models").status_code == 401
        wrong = httpx.get(f"{s.url}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{s.url}/health").status_code == 200
        good = openai.OpenAI(base_url=f"{s.url}/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list().data][0] == MODEL  # the loaded model first
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="bad", max_retries=0).models.list()
    finally:
        s.stop()
