"""Issue 24 H3: a conversation of thousands of messages is prepared in time linear in its length
and off the event loop. A real server on 127.0.0.1 with a tiny random llama; `/health` is polled
throughout each request and must keep answering (a generous bound: the issue's figure was 31 s to
62 s of silence, and more than 13 minutes for 200 long messages)."""

import bisect
import random

import httpx
import pytest

from engine.decoding import chat as chat_render
from live_server import tiny_serving
from loop_probe import STALL_S, health_probe
from tiny_models import tiny_llama

pytestmark = pytest.mark.fast



@pytest.fixture(scope="module")
def lm():
    return tiny_llama()


@pytest.fixture(scope="module")
def server(tmp_path_factory, lm):
    with tiny_serving(tmp_path_factory.mktemp("longconv"), lm) as s:
        yield s


def conversation(n: int, content: str = "hi") -> list[dict]:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": content} for i in range(n)]
    return msgs + [{"role": "user", "content": "q"}]


def test_thousands_of_messages_get_the_context_error_without_stalling(server):
    body = {"model": server.model, "max_tokens": 3, "messages": conversation(2000)}
    with health_probe(server.url) as probe:
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert probe.latencies and probe.worst < STALL_S, probe.worst


@pytest.mark.parametrize("n, content", [(2000, "hi"), (200, "x" * 1000)])
def test_dropping_the_oldest_of_a_long_conversation_does_not_stall(server, n, content):
    """Every tail is tried and none fits (the last message alone is too long): the whole search
    runs, and no prefill follows to blur what `/health` sees."""
    body = {"model": server.model, "max_tokens": 3, "truncate": "oldest",
            "messages": [{"role": "system", "content": "be brief"}] + conversation(n, content)
            + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "word " * 9000}]}
    with health_probe(server.url) as probe:
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "even the last message alone" in r.json()["error"]["message"]
    assert probe.latencies and probe.worst < STALL_S, probe.worst


def test_dropping_keeps_the_most_turns_that_fit(server, lm):
    """The binary search finds what dropping one turn at a time found: the longest tail that fits."""
    msgs = [{"role": "system", "content": "be brief"}] + conversation(400, "y" * 200)
    # max_tokens leaves ~1,200 tokens of prompt: a short prefill for the tiny model on 2 cores.
    # The end-of-turn token, biased up, ends the answer at its first token: the room reserved for
    # 7,000 tokens is what the search fits into, not 7,000 tokens of decoding.
    eos = sorted(lm.tokenizer.eos_token_ids)[0]
    body = {"model": server.model, "max_tokens": 7000, "temperature": 0, "truncate": "oldest",
            "messages": msgs, "logit_bias": {str(eos): 100}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 1
    used = r.json()["usage"]["prompt_tokens"]

    def tokens(kept):
        return len(chat_render.render(lm.tokenizer, kept, with_checkpoints=False).tokens)

    def fits(start):
        return tokens(msgs[:1] + rest[start:]) + 7000 <= 8192

    rest = msgs[1:]
    starts = [i for i in range(len(rest)) if rest[i]["role"] == "user"]
    # The first start whose tail fits (tails shrink as the start grows), found by bisection here
    # too: rendering every tail of 400 messages is what the server's search avoids.
    first = starts[bisect.bisect_left(starts, True, key=lambda s: fits(s))]
    assert used == tokens(msgs[:1] + rest[first:])
    assert not fits(starts[starts.index(first) - 1])


WORDS = ["hello", "wörld", "😀", "12345", "\n\n", "  x", "<b>", "日本語", " ", "."]


def every_prefix(tokenizer, msgs, **kwargs):
    """Checkpoints as rendering every prefix finds them (the exact, quadratic way)."""
    prompt = chat_render.render(tokenizer, msgs, with_checkpoints=False, **kwargs)
    found = chat_render._prefix_checkpoints(tokenizer, chat_render.validate_messages(msgs),
                                            prompt.tokens, {})
    return prompt.tokens, (found if found and found[-1] == len(prompt.tokens)
                           else found + [len(prompt.tokens)])


@pytest.mark.parametrize("seed", range(40))
def test_checkpoints_from_one_pass_equal_those_of_every_prefix(lm, seed):
    rng = random.Random(seed)
    msgs = [{"role": "system", "content": "sys" + rng.choice(WORDS)}] if seed % 2 else []
    for i in range(rng.randint(1, 70)):
        text = "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6)))
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": text or "a"})
    prompt = chat_render.render(lm.tokenizer, msgs)
    assert (prompt.tokens, prompt.checkpoints) == every_prefix(lm.tokenizer, msgs)
