"""Reasoning apart: on a tiny random model whose tokenizer has think markers and whose template
opens the thinking block, the API returns the text as `reasoning_content` (streamed as its own
deltas), `reasoning_format: "none"` keeps it inline, and the splitter moves text between channels
at the markers even when a marker arrives in pieces."""

import httpx
import pytest

from engine.decoding.channels import ChannelSplitter, Markers
from live_server import openai_client, tiny_serving
from tiny_models import VOCAB, tiny_marker_llama

pytestmark = pytest.mark.fast

THINKING = ("{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
            "{% endif %}")
THINK_END = VOCAB + 3  # "</think>", see tiny_models.MARKERS
ASK = [{"role": "user", "content": "Think about it."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    lm = tiny_marker_llama(THINKING)
    assert lm.tokenizer.has_thinking
    with tiny_serving(tmp_path_factory.mktemp("reasoning"), lm) as s:
        yield s


def test_reasoning_apart_and_inline(server):
    client = openai_client(server)
    model = client.models.list().data[0].id
    # Greedy and the same prompt: the same tokens either way.
    apart = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0,
                                           logit_bias={str(THINK_END): -100})
    inline = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0,
                                            logit_bias={str(THINK_END): -100},
                                            extra_body={"reasoning_format": "none"})
    message = apart.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and not message.content
    assert inline.choices[0].message.content == reasoning
    assert "reasoning_content" not in (inline.choices[0].message.model_extra or {})


def test_reasoning_streamed_as_its_own_deltas(server):
    client = openai_client(server)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0, stream=True,
                                            logit_bias={str(THINK_END): -100})
    reasoning, content = "", ""
    for chunk in stream:
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    whole = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0,
                                           logit_bias={str(THINK_END): -100})
    assert reasoning == whole.choices[0].message.model_extra["reasoning_content"]
    assert content == ""


def test_end_marker_switches_to_content(server):
    """Forcing the end marker first: everything after it is the answer, nothing is reasoning."""
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"messages": ASK, "max_tokens": 1, "logit_bias": {str(THINK_END): 100}})
    message = r.json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == ""


def split(pieces, start="content"):
    s = ChannelSplitter(Markers(("<think>", "</think>"), "<tool_call>"), start)
    out = [p for piece in pieces for p in s.feed(piece)] + s.flush()
    merged = []
    for channel, text in out:
        if merged and merged[-1][0] == channel:
            merged[-1] = (channel, merged[-1][1] + text)
        else:
            merged.append((channel, text))
    return merged


@pytest.mark.parametrize("pieces", [["<think>why</think>so"], ["<th", "ink>wh", "y</", "think>s", "o"],
                                    list("<think>why</think>so")])
def test_splitter_handles_markers_in_pieces(pieces):
    assert split(pieces) == [("reasoning", "why"), ("content", "so")]


def test_splitter_keeps_the_tool_opener_and_a_false_start():
    assert split(["a <tool", "_x b"]) == [("content", "a <tool_x b")]
    assert split(["pre<tool_", "call>{}"]) == [("content", "pre"), ("tool", "<tool_call>{}")]
    assert split(["deep", "</think>", "answer"], start="reasoning") == [
        ("reasoning", "deep"), ("content", "answer")]


# --- the thinking budget (engine/decoding/thinking.py) --------------------------------------------

def _chat(server, **fields) -> dict:
    body = {"messages": ASK, "temperature": 0, "logit_bias": {str(THINK_END): -100}, **fields}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def test_thinking_closes_at_the_budget_and_the_answer_follows(server):
    """The model never closes its thinking on its own here (the end marker is biased away):
    with a budget of 3 tokens it thinks exactly what it thinks unbounded in 3 tokens, then the
    closing marker is forced and the answer follows."""
    unbounded = _chat(server, max_tokens=3)
    budgeted = _chat(server, max_tokens=12, thinking_budget=3)
    assert budgeted["reasoning_content"] == unbounded["reasoning_content"]
    assert budgeted["content"]  # the answer after the forced marker
    effort = _chat(server, max_tokens=12, reasoning_effort="none")
    assert not effort.get("reasoning_content") and effort["content"]


def test_a_budget_not_reached_changes_nothing(server):
    assert _chat(server, max_tokens=8, thinking_budget=100) == _chat(server, max_tokens=8)


def test_a_bad_effort_or_budget_is_refused(server):
    for fields in ({"reasoning_effort": "extreme"}, {"thinking_budget": -5},
                   {"thinking_budget": "x"}):
        r = httpx.post(f"{server.url}/v1/chat/completions",
                       json={"messages": ASK, "max_tokens": 2, **fields})
        assert r.status_code == 400, fields
