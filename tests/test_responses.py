"""OpenAI's Responses API (`/v1/responses`) through the official `openai` client and as Codex CLI
sends it, against a real server on 127.0.0.1 with a tiny random llama."""

import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from live_server import tiny_serving
from tiny_models import tiny_llama

pytestmark = pytest.mark.fast

ADD = {"type": "function", "name": "add", "description": "Add two numbers",
       "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                      "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}

# A short context: Codex sends no max_output_tokens, so its answer may run to the context's end,
# a few hundred tokens here rather than 8,000.
CONTEXT = 384


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_serving(tmp_path_factory.mktemp("responses"), tiny_llama(max_position_embeddings=CONTEXT)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_create_and_stream_agree(client, server):
    whole = client.responses.create(model="gpt-5-codex", input="Tell me a story",
                                    max_output_tokens=8, temperature=0)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.model == server.model and whole.output[0].type == "message"
    assert whole.usage.output_tokens == 8
    with client.responses.stream(model="x", input="Tell me a story", max_output_tokens=8,
                                 temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
    assert "response.output_item.done" in kinds and kinds[-1] == "response.completed"
    assert final.output_text == whole.output_text and final.status == "incomplete"


def test_a_function_call_round_trip(client):
    first = client.responses.create(model="x", input="What is 2 + 3?", tools=[ADD],
                                    tool_choice="required", max_output_tokens=60, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "add" and set(json.loads(calls[0].arguments)) == {"a", "b"}
    second = client.responses.create(model="x", tools=[ADD], max_output_tokens=5,
                                     previous_response_id=first.id, input=[
                                         {"type": "function_call_output",
                                          "call_id": calls[0].call_id, "output": "5"}])
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prefix reused


def test_streamed_function_call_events(client):
    with client.responses.stream(model="x", input="Add 1 and 2", tools=[ADD],
                                 tool_choice={"type": "function", "name": "add"},
                                 max_output_tokens=60) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert [o.type for o in final.output][-1] == "function_call"


def test_stored_responses_can_be_read_deleted_and_store_false_keeps_nothing(client):
    kept = client.responses.create(model="x", input="hi", max_output_tokens=3)
    assert client.responses.retrieve(kept.id).id == kept.id
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    fleeting = client.responses.create(model="x", input="hi", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(fleeting.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model="x", input="again", previous_response_id=fleeting.id)


def test_json_schema_format(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = client.responses.create(model="x", input="A number", max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "n",
                                                 "schema": schema, "strict": True}})
    assert set(json.loads(r.output_text)) == {"n"}


@pytest.mark.slow  # decodes to the end of a 384-token context: seconds by design, the second tier
def test_codex_request_shape_is_answered(server):
    """Codex CLI's request as shared/README.md describes it: streamed, a developer item as the
    system prompt, items with ids, function tools plus a namespace tool and a hosted web_search,
    no max_output_tokens, store false, include and prompt_cache_key."""
    body = {
        "model": "gpt-5.1-codex", "instructions": "You are Codex.", "stream": True, "store": False,
        "input": [{"type": "message", "role": "developer", "id": "m0",
                   "content": [{"type": "input_text", "text": "<permissions>sandboxed</permissions>"}]},
                  {"type": "message", "role": "user", "id": "m1",
                   "content": [{"type": "input_text", "text": "List the files."}]},
                  {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "abc"}],
        "tools": [ADD, {"type": "namespace", "name": "mcp", "tools": [
                      {**ADD, "name": "shell", "description": "Run a command"}]},
                  {"type": "web_search"}],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "abc-123",
        "text": {"verbosity": "medium"},
    }
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=300) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_item.done" in kinds
    assert [e["sequence_number"] for e in events] == list(range(1, len(events) + 1))
    final = events[-1]["response"]  # without max_output_tokens, the answer may fill the context
    assert final["usage"]["total_tokens"] == CONTEXT if final["status"] == "incomplete" \
        else final["usage"]["total_tokens"] < CONTEXT


@settings(suppress_health_check=list(HealthCheck))  # examples: tests/conftest.py
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(["model", "input", "type", "role", "content",
                                                       "text", "tools", "instructions", "call_id",
                                                       "output", "format", "tool_choice",
                                                       "previous_response_id"]),
                                      inner, max_size=4), max_leaves=12))
def test_bad_input_never_gets_a_5xx(server, body):
    if isinstance(body, dict):
        body = {**body, "max_output_tokens": 2, "stream": False}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert isinstance(r.json()["error"]["message"], str)
