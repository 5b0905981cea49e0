"""Anthropic's Messages API (`/v1/messages`) through the official `anthropic` SDK and as Claude
Code sends it, against a real server on 127.0.0.1 with a tiny random llama (the text does not
matter here; the shapes, tool calls, usage, errors and cancellation do)."""

import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from live_server import anthropic_client, engine_serving, tiny_serving, wait_idle
from tiny_models import tiny_llama

pytestmark = pytest.mark.fast

KEY = "s3cret-key"
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "additionalProperties": False,
                            "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 0,
                                                    "maximum": 9}},
                            "required": ["city", "days"]}}

# A short context: Claude Code's max_tokens 32000, clamped to the context left, decodes to the
# context's end, a few hundred tokens here rather than 8,000.
CONTEXT = 384


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    lm = tiny_llama(max_position_embeddings=CONTEXT)
    with tiny_serving(tmp_path_factory.mktemp("anthropic"), lm, api_key=KEY,
                      aliases={"claude-*": lm.name}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic_client(server, KEY)


def ask(text: str = "Hello there", **fields) -> dict:
    return {"model": "claude-sonnet-4-5", "max_tokens": 8,
            "messages": [{"role": "user", "content": text}],
            "extra_body": {"temperature": 0}, **fields}


def test_create_answers_in_anthropic_shape(client, server):
    msg = client.messages.create(**ask())
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.model == server.model  # an unknown client name runs on (and names) the local model
    assert msg.stop_reason in ("max_tokens", "end_turn")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.usage.output_tokens >= 1
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 5


def test_stream_gives_the_same_text_as_create(client):
    whole = client.messages.create(**ask("Tell me a story"))
    with client.messages.stream(**ask("Tell me a story")) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_every_sse_event_has_its_event_line(server):
    body = {**ask(), "stream": True}
    body.pop("extra_body")
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body,
                      headers={"x-api-key": KEY}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    events = [line for line in lines if line.startswith("event: ")]
    datas = [line for line in lines if line.startswith("data: ")]
    assert len(events) == len(datas) >= 6
    for event, data in zip(events, datas):
        assert json.loads(data[6:])["type"] == event[7:]


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_a_forced_tool_call_is_valid_and_ends_tool_use(client, choice):
    msg = client.messages.create(**ask("Weather in Paris?", max_tokens=60, tools=[WEATHER],
                                       tool_choice=choice))
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert calls and calls[0].name == "get_weather"
    assert set(calls[0].input) == {"city", "days"} and isinstance(calls[0].input["days"], int)
    assert msg.stop_reason == "tool_use"

    # The result goes back as a tool_result turn (is_error too) and is answered.
    follow = client.messages.create(**ask(max_tokens=5, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": calls[0].id,
                                           "name": "get_weather", "input": calls[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                      "content": [{"type": "text", "text": "Sunny, 21 C"}]},
                                     {"type": "tool_result", "tool_use_id": "x", "is_error": True,
                                      "content": "timeout"}]}]))
    assert follow.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_streamed_tool_call_sends_input_json_deltas(client):
    with client.messages.stream(**ask("Weather?", max_tokens=60, tools=[WEATHER],
                                      tool_choice={"type": "tool", "name": "get_weather"})) as s:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in s]
        final = s.get_final_message()
    assert ("content_block_delta", "input_json_delta") in kinds
    assert final.content[-1].type == "tool_use" and "city" in final.content[-1].input


def test_count_tokens_matches_what_a_request_uses(client):
    counted = client.messages.count_tokens(model="claude-x", system="Be brief.",
                                           messages=[{"role": "user", "content": "Hello you"}])
    msg = client.messages.create(**ask("Hello you", system="Be brief."))
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_a_second_turn_reports_its_prefix_reuse(client):
    first = [{"role": "user", "content": "First question about a long topic " * 20}]
    one = client.messages.create(**ask(messages=first, system="You are terse."))
    two = client.messages.create(**ask(system="You are terse.", messages=first + [
        {"role": "assistant", "content": one.content[0].text or "ok"},
        {"role": "user", "content": "And the second?"}]))
    assert two.usage.cache_read_input_tokens > 100


@pytest.mark.slow  # decodes to the end of a 384-token context: seconds by design, the second tier
def test_claude_code_request_shape_is_answered(server):
    """Claude Code's request as the facts in shared/README.md describe it: a query string on the
    path, `Authorization: Bearer`, beta headers, system blocks with cache_control, a system-role
    message inside `messages`, max_tokens 32000 (clamped to the context), thinking adaptive,
    fields to ignore, tools with defer_loading and a server tool."""
    body = {
        "model": "claude-sonnet-4-5-20250929", "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "text": "You are Claude Code.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "system", "content": "Extra system text."},
                     {"role": "user", "content": [
                         {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                         {"type": "text", "text": "List the files.",
                          "cache_control": {"type": "ephemeral"}}]}],
        "tools": [{**WEATHER, "defer_loading": True},
                  {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        "metadata": {"user_id": "user_abc_account_def_session_123"},
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "medium"},
        "context_management": {"edits": []}, "temperature": 1,
    }
    headers = {"Authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
               "x-app": "cli"}
    with httpx.stream("POST", f"{server.url}/v1/messages?beta=true", json=body, headers=headers,
                      timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert any(e.get("delta", {}).get("type") == "text_delta" for e in events)
    stop = next(e for e in events if e["type"] == "message_delta")
    assert stop["delta"]["stop_reason"] in ("max_tokens", "end_turn", "tool_use")
    used = sum(stop["usage"][k] for k in ("input_tokens", "cache_read_input_tokens",
                                          "output_tokens"))
    # max_tokens 32000 was clamped to the context left: a full answer ends exactly at its end.
    assert used == CONTEXT if stop["delta"]["stop_reason"] == "max_tokens" else used < CONTEXT


def test_errors_come_in_anthropic_shape(server, client):
    bad = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY},
                     json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert bad.status_code == 400
    assert bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.json()["error"]["message"]

    from anthropic import AuthenticationError, BadRequestError

    with pytest.raises(AuthenticationError):
        anthropic_client(server, "wrong").messages.create(**ask())
    image = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": "iVBORw0KGgo="}}]
    with pytest.raises(BadRequestError, match="image"):
        client.messages.create(**ask(messages=[{"role": "user", "content": image}]))
    big = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY},
                     content=b"x" * (65 * 1024 * 1024))  # over the image routes' 64 MiB
    assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"


@settings(suppress_health_check=list(HealthCheck))  # examples: tests/conftest.py
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(["model", "max_tokens", "messages", "role",
                                                       "content", "type", "text", "system",
                                                       "tools", "tool_choice", "stream",
                                                       "stop_sequences", "name", "input"]),
                                      inner, max_size=4), max_leaves=12))
def test_bad_input_never_gets_a_5xx(server, body):
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                   json=body if not isinstance(body, dict) else {"max_tokens": 2, **body})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["type"] == "error"


def test_a_client_that_leaves_mid_stream_frees_its_request(server):
    body = {"model": "claude-x", "max_tokens": 4000, "stream": True,
            "messages": [{"role": "user", "content": "Write a long essay."}]}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body,
                      headers={"x-api-key": KEY}, timeout=60) as r:
        for line in r.iter_lines():
            if "text_delta" in line:
                break
    wait_idle(server.url)


def test_overload_surfaces_as_the_sdks_rate_limit_error(tmp_path):
    from anthropic import RateLimitError

    lm = tiny_llama()
    with engine_serving(tmp_path, lm, {"max_running": 1, "max_queued": 0}) as s:
        sdk = anthropic_client(s, timeout=60)
        body = {"model": "x", "max_tokens": 4000, "stream": True,
                "messages": [{"role": "user", "content": "Go on and on."}]}
        started, refused_seen = threading.Event(), threading.Event()

        def hold() -> None:  # decodes (holding the one running slot) until the refusal is seen
            with httpx.stream("POST", f"{s.url}/v1/messages", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if "text_delta" in line:
                        started.set()
                        refused_seen.wait(30)
                        return

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert started.wait(30)
            with pytest.raises(RateLimitError) as refused:
                sdk.messages.create(model="x", max_tokens=5,
                                    messages=[{"role": "user", "content": "hi"}])
        finally:
            refused_seen.set()
            holder.join()
        assert refused.value.response.headers.get("retry-after")
