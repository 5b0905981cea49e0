"""`parallel_tool_calls` under the forced-call grammar, on a tiny model's tokenizer (the bundled
one): with `required` the grammar admits a list of several valid calls and they parse as several
calls; with `parallel_tool_calls: false` or a named function only one call object is admitted.
In `auto`, every call of the text is parsed (one without `parallel_tool_calls`)."""

import json

import pytest

from engine.decoding.tools import constraint, parse_calls, tool_request
from tiny_models import tiny_llama

pytestmark = pytest.mark.fast

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
ECHO = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "echo", "parameters": ECHO}}]
TWO = [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "echo", "arguments": {"text": "hi"}}]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_llama().tokenizer


def admits(tokenizer, tools, text: str) -> bool:
    """Whether the request's call grammar lets the model write `text`, token by token, to its end."""
    grammar = constraint(tokenizer, tools, 0)
    for token in tokenizer.encode(text):
        if not grammar.matcher.consume_token(token):
            return False
    return grammar.matcher.is_accepting()


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def test_required_with_parallel_calls_admits_a_list_of_calls(tokenizer):
    tools = tool_request(TOOLS, "required")  # parallel_tool_calls defaults to true, as OpenAI's
    assert admits(tokenizer, tools, compact(TWO))
    assert admits(tokenizer, tools, compact(TWO[:1]))
    assert not admits(tokenizer, tools, "[]")  # at least one call
    assert not admits(tokenizer, tools, compact([{"name": "add", "arguments": {"a": "x", "b": 2}}]))
    calls = parse_calls(tokenizer, tools, compact(TWO))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(t["name"], t["arguments"]) for t in TWO]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("choice, parallel", [("required", False),
                                              ({"type": "function", "function": {"name": "add"}}, None)])
def test_one_call_when_parallel_calls_are_off_or_a_function_is_named(tokenizer, choice, parallel):
    tools = tool_request(TOOLS, choice, parallel)
    assert not admits(tokenizer, tools, compact(TWO))
    assert admits(tokenizer, tools, compact(TWO[0]))
    assert [c.name for c in parse_calls(tokenizer, tools, compact(TWO[0]))] == ["add"]


def test_auto_parses_every_call_and_leaves_out_only_a_last_one_cut_off(tokenizer):
    tools = tool_request(TOOLS)  # "auto"; the tiny llama has no tool markers: the fallback's
    one, two = (f"<tool_call>{compact(t)}</tool_call>" for t in TWO)
    assert [c.name for c in parse_calls(tokenizer, tools, one + "\n" + two)] == ["add", "echo"]
    assert [c.name for c in parse_calls(tokenizer, tools, one + two[:-20])] == ["add"]
    with pytest.raises(ValueError):  # a broken call before the last is an error, not dropped
        parse_calls(tokenizer, tools, one[:-25] + "</tool_call>" + two)
    one_only = tool_request(TOOLS, "auto", False)
    assert [c.name for c in parse_calls(tokenizer, one_only, one + two)] == ["add"]
