"""Tool calling on a tiny random model whose chat template has tool markers (mlx-lm infers its
`json_tools` parser): `auto` decodes free text until the opener, then a valid call, parsed by the
family's parser, every call of the answer with `parallel_tool_calls` (the default), one without;
invalid `tools` / `tool_choice` get 400 in OpenAI's error shape."""

import json

import httpx
import openai
import pytest

from engine.scheduling.service import Engine
from live_server import openai_client, serving
from tiny_models import VOCAB, tiny_marker_llama

pytestmark = pytest.mark.fast

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.tool_calls %}{% for tc in message.tool_calls %}{% set tool_call = tc.function %}"
    "<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}"
    "</tool_call>{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
OPENER = VOCAB  # "<tool_call>", see tiny_models.MARKERS
UNIT = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": UNIT}}]
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def lm():
    lm = tiny_marker_llama(TEMPLATE)
    assert lm.tokenizer.has_tool_calling  # the parser path is the family's, not the fallback
    return lm


@pytest.fixture(scope="module")
def server(lm, tmp_path_factory):
    engine = Engine(lm.name, load=lambda name, **_: lm).start()
    with serving(engine, tmp_path_factory.mktemp("tiny-tools") / "db.sqlite") as s:
        yield s


@pytest.fixture
def client(server):
    return openai_client(server)


def test_auto_free_text_without_the_opener(client):
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=ASK,
                                       tools=TOOLS, max_tokens=5, logit_bias={str(OPENER): -100})
    c = r.choices[0]
    assert c.message.tool_calls is None and c.finish_reason == "length"
    assert c.message.content


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_auto_call_after_the_opener_is_parsed(lm, client, stream):
    model = client.models.list().data[0].id
    # The random model is pushed to open a call at once; from there the grammar writes it; once
    # the call is complete, it is pushed to end the answer (rather than to close and open another).
    eos = min(lm.tokenizer.eos_token_ids)
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=80,
                  logit_bias={str(OPENER): 100, str(eos): 50})
    if not stream:
        c = client.chat.completions.create(**kwargs).choices[0]
        calls, finish, content = c.message.tool_calls, c.finish_reason, c.message.content
        calls = [(t.function.name, t.function.arguments) for t in calls]
    else:
        calls, finish, content = {}, None, ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                for d in ch.delta.tool_calls or []:
                    name, args = calls.get(d.index, ("", ""))
                    calls[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
                finish = ch.finish_reason or finish
        calls = list(calls.values())
    assert finish == "tool_calls"
    assert len(calls) == 1 and calls[0][0] == "get_weather"
    assert json.loads(calls[0][1])["unit"] in ("celsius", "fahrenheit")
    assert not content  # the opener and the call never reach `content`


def streamed(stream):
    """(calls as (index, id, name, arguments) rebuilt from the deltas by index, finish_reason)."""
    calls, finish = {}, None
    for chunk in stream:
        for ch in chunk.choices:
            assert not ch.delta.content
            for d in ch.delta.tool_calls or []:
                i, call_id, name, args = calls.get(d.index, (d.index, None, "", ""))
                calls[d.index] = (i, d.id or call_id, name + (d.function.name or ""),
                                  args + (d.function.arguments or ""))
            finish = ch.finish_reason or finish
    return list(calls.values()), finish


# The model is pushed to open a call and, after each, to close it (less: the answer must open
# with the opener), so it keeps calling until max_tokens: every complete call comes back (the
# one cut off does not).
KEEP_CALLING = {str(OPENER): 100, str(OPENER + 1): 50}


def valid_calls(calls) -> bool:
    """Several (id, name, arguments) calls, each to get_weather with valid arguments, ids distinct."""
    return (len(calls) >= 2 and len({call_id for call_id, _, _ in calls}) == len(calls)
            and all(call_id and name == "get_weather"
                    and json.loads(args)["unit"] in ("celsius", "fahrenheit")
                    for call_id, name, args in calls))


def test_auto_returns_every_call_of_an_answer(client):
    kwargs = dict(model=client.models.list().data[0].id, messages=ASK, tools=TOOLS,
                  max_tokens=60, logit_bias=KEEP_CALLING)
    c = client.chat.completions.create(**kwargs).choices[0]
    calls = [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    assert valid_calls(calls), calls
    assert c.finish_reason == "length" and not c.message.content
    deltas, finish = streamed(client.chat.completions.create(stream=True, **kwargs))
    assert [i for i, *_ in deltas] == list(range(len(deltas)))  # one index per call, increasing
    assert valid_calls([rest for _, *rest in deltas]), deltas
    assert finish == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_auto_without_parallel_calls_makes_one(client, stream):
    kwargs = dict(model=client.models.list().data[0].id, messages=ASK, tools=TOOLS,
                  max_tokens=60, logit_bias=KEEP_CALLING, parallel_tool_calls=False)
    if stream:
        calls, finish = streamed(client.chat.completions.create(stream=True, **kwargs))
    else:
        c = client.chat.completions.create(**kwargs).choices[0]
        calls, finish = c.message.tool_calls, c.finish_reason
    assert len(calls) == 1 and finish == "tool_calls"


BAD = {
    "tools not an array": dict(tools={"type": "function"}),
    "unknown tool type": dict(tools=[{"type": "retrieval"}]),
    "bad name": dict(tools=[{"type": "function", "function": {"name": "no spaces allowed"}}]),
    "schema not enforceable": dict(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}]),
    "unknown choice": dict(tools=TOOLS, tool_choice="always"),
    "named choice not offered": dict(tools=TOOLS, tool_choice={"type": "function",
                                                                "function": {"name": "other"}}),
    "choice without tools": dict(tool_choice="required"),
}


@pytest.mark.parametrize("case", BAD)
def test_invalid_tools_get_openai_400(server, case):
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"messages": ASK, "max_tokens": 2, **BAD[case]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    assert error["param"].startswith("tool"), error


def test_invalid_tools_raise_in_the_client(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=client.models.list().data[0].id, messages=ASK,
                                       tools=TOOLS, tool_choice="sometimes", max_tokens=2)
    assert err.value.body["param"] == "tool_choice"
