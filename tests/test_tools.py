"""Tool calling through the official `openai` client against a real server on the bundled model:
`required` and a named `tool_choice` (streamed and not) give calls whose arguments validate against
the function's schema (a named call finishing with "stop", as OpenAI's do), and the conversation continues after a `tool` result."""

import json

import pytest

from engine.scheduling.service import Engine
from live_server import openai_client, serving

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": ADD}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid(name, arguments):
    """Arguments (JSON text) that satisfy the function's schema, checked by hand."""
    args = json.loads(arguments)
    if name == "get_weather":
        return (set(args) == {"city", "unit"} and isinstance(args["city"], str)
                and len(args["city"]) <= 12 and args["unit"] in ("celsius", "fahrenheit"))
    return (name == "add" and set(args) == {"a", "b"}
            and all(type(v) is int and 0 <= v <= 99 for v in args.values()))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with serving(Engine().start(), tmp_path_factory.mktemp("tools") / "db.sqlite") as server:
        yield openai_client(server)


def streamed_calls(stream):
    """Tool calls rebuilt from streamed deltas as a client does (concatenating by index)."""
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "add"}}}


@pytest.mark.parametrize("choice", CHOICES)
def test_forced_calls_validate(client, choice):
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=ASK, tools=TOOLS,
                                       tool_choice=CHOICES[choice], max_tokens=40,
                                       temperature=0)
    c = r.choices[0]
    # As OpenAI: a named call ends with "stop"; required calls may be several (parallel calls).
    assert c.finish_reason == ("stop" if choice == "named" else "tool_calls"), c
    assert len(c.message.tool_calls) == 1 if choice == "named" else len(c.message.tool_calls) >= 1
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert valid(call.function.name, call.function.arguments), call
        if choice == "named":
            assert call.function.name == "add"
    assert c.message.content is None


@pytest.mark.parametrize("choice", CHOICES)
def test_forced_calls_validate_streamed(client, choice):
    stream = client.chat.completions.create(model="smollm2-135m-instruct", messages=ASK,
                                            tools=TOOLS, tool_choice=CHOICES[choice],
                                            max_tokens=40, temperature=0, stream=True)
    calls, finish = streamed_calls(stream)
    assert finish == ("stop" if choice == "named" else "tool_calls")
    assert len(calls) == 1 if choice == "named" else len(calls) >= 1
    for call in calls:
        assert call["id"].startswith("call_") and valid(call["name"], call["arguments"]), calls
        if choice == "named":
            assert call["name"] == "add"


def test_conversation_continues_after_tool_result(client):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]}]
    result = {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}
    r = client.chat.completions.create(messages=history + [result], tools=TOOLS,
                                       tool_choice="none", max_tokens=6, model="smollm2-135m-instruct")
    without = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="none",
                                             max_tokens=1, model="smollm2-135m-instruct")
    answer = r.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")
    # The call and its result reached the prompt.
    assert r.usage.prompt_tokens > without.usage.prompt_tokens + 15
