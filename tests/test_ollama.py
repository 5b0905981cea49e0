"""Ollama's API (`/api/*`) through the official `ollama` Python client against a real server on
127.0.0.1 with a tiny random llama: list, show, ps, chat and generate (streamed and not), tools,
format, options, prefix reuse in prompt_eval_count, pull against the hub stand-in, delete, and
bad input in Ollama's error shape."""

import json

import httpx
import ollama
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hub_standin import HubStandIn, Repo
from live_server import ThreadedServer, engine_serving, free_port, tiny_serving
from tiny_models import tiny_llama

pytestmark = pytest.mark.fast

ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                        "parameters": {"type": "object", "properties": {
                                            "a": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                                            "required": ["a", "b"],
                                            "additionalProperties": False}}}
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_serving(tmp_path_factory.mktemp("ollama")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=120)


def test_version_tags_show_and_ps(client, server):
    assert httpx.get(f"{server.url}/api/version").json()["version"] >= "0.13.4"
    names = [m.model for m in client.list().models]
    assert f"{server.model}:latest" in names
    raw = httpx.get(f"{server.url}/api/tags").json()["models"]
    assert all(m["digest"] and m["model"] and m["name"] for m in raw)
    shown = client.show(server.model)
    assert "completion" in shown.capabilities
    assert shown.modelinfo["llama.context_length"] == 8192
    running = client.ps().models
    assert [m.model for m in running] == [f"{server.model}:latest"]
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("no-such-model")
    assert missing.value.status_code == 404


def test_chat_streamed_equals_chat_whole(client, server):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    whole = client.chat(model=f"{server.model}:latest", messages=messages, options=GREEDY)
    parts = list(client.chat(model=server.model, messages=messages, options=GREEDY, stream=True))
    assert all(p.message is not None for p in parts)  # every chunk, the final one too
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done and parts[-1].done_reason == whole.done_reason == "length"
    assert whole.eval_count == 8 and whole.prompt_eval_count > 0 and whole.total_duration > 0


def test_generate_streamed_and_not(client, server):
    whole = client.generate(model=server.model, prompt="Once upon a time", options=GREEDY)
    parts = list(client.generate(model=server.model, prompt="Once upon a time", options=GREEDY,
                                 stream=True))
    assert "".join(p.response for p in parts) == whole.response and whole.done
    raw = client.generate(model=server.model, prompt="Once upon a time", raw=True, options=GREEDY)
    assert raw.eval_count == 8


def test_a_second_turn_shows_the_prefix_reuse(client, server):
    first = [{"role": "system", "content": "You answer briefly. " * 30},
             {"role": "user", "content": "Name a colour."}]
    one = client.chat(model=server.model, messages=first, options=GREEDY)
    two = client.chat(model=server.model, options=GREEDY, messages=first + [
        {"role": "assistant", "content": one.message.content}, {"role": "user", "content": "Another."}])
    full = client.chat(model=server.model, options={**GREEDY, "num_predict": 1}, messages=first + [
        {"role": "assistant", "content": one.message.content}, {"role": "user", "content": "Another."}])
    assert two.prompt_eval_count < one.prompt_eval_count  # only the new turn was computed
    assert full.prompt_eval_count <= two.prompt_eval_count


def test_tool_calls_and_a_tool_result(server):
    body = {"model": server.model, "stream": False, "tools": [ADD], "options": GREEDY,
            "messages": [{"role": "user", "content": "What is 2 + 3?"}]}
    r = httpx.post(f"{server.url}/api/chat", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["done"]
    follow = httpx.post(f"{server.url}/api/chat", timeout=60, json={**body, "messages": [
        *body["messages"],
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5", "tool_name": "add"}]})
    assert follow.status_code == 200, follow.text


def test_format_json_gives_json(client, server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = client.chat(model=server.model, messages=[{"role": "user", "content": "A number"}],
                    format=schema, options={"temperature": 0, "num_predict": 40})
    assert set(json.loads(r.message.content)) == {"n"}


def test_loading_with_empty_messages_and_keep_alive(server):
    r = httpx.post(f"{server.url}/api/chat", json={"model": server.model, "messages": [],
                                                   "keep_alive": "10m"})
    assert r.json()["done_reason"] == "load"
    r = httpx.post(f"{server.url}/api/generate", timeout=60, json={
        "model": server.model, "prompt": "hi", "stream": False, "keep_alive": -1,
        "options": GREEDY})
    assert r.status_code == 200


def test_bad_input_gets_ollamas_error_shape(server):
    for body in ({"model": server.model, "messages": "x"}, {"model": server.model, "messages":
                 [{"role": "wizard", "content": "x"}]},
                 {"model": server.model, "messages": [{"role": "user", "content": "x"}],
                  "options": {"temperature": "hot"}},
                 {"model": server.model, "messages": [{"role": "user", "content": "x",
                                                       "images": ["aGk="]}]}):
        r = httpx.post(f"{server.url}/api/chat", json=body)
        assert r.status_code == 400 and isinstance(r.json()["error"], str), r.text
    r = httpx.post(f"{server.url}/api/chat", content=b"{")
    assert r.status_code == 400 and "error" in r.json()


@settings(suppress_health_check=list(HealthCheck))  # examples: tests/conftest.py
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(["model", "messages", "role", "content",
                                                       "options", "format", "tools", "stream",
                                                       "prompt", "num_predict", "images"]),
                                      inner, max_size=4), max_leaves=12),
       st.sampled_from(["chat", "generate", "show"]))
def test_no_body_gets_a_5xx(server, body, path):
    if isinstance(body, dict):
        body = {"stream": False, **body, "options": {"num_predict": 2}}
    r = httpx.post(f"{server.url}/api/{path}", json=body, timeout=60)
    assert r.status_code < 500, r.text


def test_pull_with_progress_then_delete(tmp_path, monkeypatch, server):
    source = tiny_llama().path
    files = {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}
    hub = ThreadedServer(HubStandIn({"tiny/llama": Repo(files)}).app).start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("MLXCHAT_HOME", str(tmp_path / "home"))
    try:
        client = ollama.Client(host=server.url, timeout=120)
        lines = list(client.pull("hf.co/tiny/llama", stream=True))
        assert lines[0].status == "pulling manifest" and lines[-1].status == "success"
        assert any(p.total and p.completed is not None for p in lines)
        assert "tiny/llama:latest" in [m.model for m in client.list().models]
        client.delete("tiny/llama")
        assert "tiny/llama:latest" not in [m.model for m in client.list().models]
    finally:
        hub.stop()


def test_an_offline_pull_fails_with_one_clear_line(server, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.setenv("MLXCHAT_HOME", str(tmp_path / "home"))
    r = httpx.post(f"{server.url}/api/pull", json={"model": "tiny/absent"}, timeout=60)
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert "error" in lines[-1] and "\n" not in lines[-1]["error"]
    with pytest.raises(ollama.ResponseError):
        list(ollama.Client(host=server.url).pull("tiny/absent", stream=True))


def test_allowed_origins_reach_the_apis_but_never_the_ui(tmp_path):
    from app.security.guards import LOOPBACK_NAMES

    lm = tiny_llama()
    with engine_serving(tmp_path, lm, allowed_origins=("chrome-extension://*",),
                        allowed_hosts={*LOOPBACK_NAMES, "host.docker.internal"}) as s:
        ext = {"Origin": "chrome-extension://abcdef"}
        body = {"model": lm.name, "stream": False, "options": GREEDY,
                "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{s.url}/api/chat", json=body, headers=ext, timeout=60)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ext["Origin"]
        pre = httpx.options(f"{s.url}/api/chat", headers={
            **ext, "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 204 and "POST" in pre.headers["access-control-allow-methods"]
        other = httpx.post(f"{s.url}/api/chat", json=body, headers={"Origin": "https://evil.example"})
        assert other.status_code == 403 and "error" in other.json()
        ui = httpx.post(f"{s.url}/conversations", data={}, headers=ext)
        assert ui.status_code == 403  # the UI's forms stay same-origin only
        docker = httpx.get(f"{s.url}/api/tags", headers={"Host": "host.docker.internal:8321"})
        assert docker.status_code == 200
        rebinding = httpx.get(f"{s.url}/api/tags", headers={"Host": "evil.example"})
        assert rebinding.status_code == 400 and rebinding.json() == {"error": "Invalid Host header"}


def test_without_allow_origin_an_extension_is_refused(server):
    r = httpx.post(f"{server.url}/api/chat", headers={"Origin": "chrome-extension://abcdef"},
                   json={"model": server.model, "messages": []})
    assert r.status_code == 403 and r.json() == {"error": "Cross-origin request refused"}


def test_pulling_a_name_the_hub_cannot_have_is_a_400(server):
    for stream in (False, True):
        r = httpx.post(f"{server.url}/api/pull", json={"model": "llama3.2", "stream": stream})
        assert r.status_code == 400 and "repository id" in r.json()["error"]


def test_embed_and_the_older_embeddings(client, server):
    r = client.embed(model=server.model, input=["the sea", "a cat"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 64  # the tiny model's width
    assert abs(sum(x * x for x in r.embeddings[0]) - 1) < 1e-4  # L2-normalised
    old = httpx.post(f"{server.url}/api/embeddings", json={"model": server.model, "prompt": "the sea"})
    assert old.status_code == 200
    assert max(abs(a - b) for a, b in zip(old.json()["embedding"], r.embeddings[0])) < 1e-5
    bad = httpx.post(f"{server.url}/api/embed", json={"model": server.model})
    assert bad.status_code == 400 and "input" in bad.json()["error"]
