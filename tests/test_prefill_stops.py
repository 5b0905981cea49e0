"""Prefill stops only where a snapshot is taken (engine/decoding/snapshots.py) and goes through
everything else in large chunks, yet every request gives the tokens it gives with the cache off
and reuses as much as a snapshot at every message end would (the earlier policy), in the ways
conversations are used: growing turn by turn, editing any earlier message of such a conversation,
regenerating, editing the last turn of a long chat sent at once, and branching twice off the
same place (where the branch-point snapshot reuses more).

Tiny random fp32 models on the CPU: a dense llama (trimmable cache) and a hybrid qwen3_5
(linear-attention state, valid only at the exact length where it was saved).
"""

import dataclasses

import pytest

from engine.prefix_cache.store import PrefixCache
from engine.decoding.generate import LAST_WITH_CHUNK_MAX, Generation, build_prompt
from engine.decoding.sampling import SamplingParams
from chats import assistant, user
from tiny_models import tiny_llama, tiny_qwen3_5
from watched_model import watched

pytestmark = pytest.mark.fast

LARGE = 4096  # one chunk for every prompt below
SMALL = 96  # the cache-off reference prefills in small chunks


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def lm(request):
    built = tiny_llama() if request.param == "dense" else tiny_qwen3_5()
    return watched(built)


@dataclasses.dataclass
class Reply:
    tokens: list[int]
    text: str
    cached: int
    prefill_calls: int  # model calls before the first token (the last prompt token's included)


def run(lm, messages, cache=None, chunk=LARGE, seed=None, last_with_chunk=False) -> Reply:
    params = SamplingParams(max_tokens=6) if seed is None else \
        SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=seed)
    gen = Generation(lm, build_prompt(lm, messages=messages), params, prefix_cache=cache,
                     prefill_chunk=chunk, last_with_chunk=last_with_chunk)
    start = len(lm.model.calls)
    events, prefill_calls = [], None
    while not gen.done:
        events += gen.step()
        if prefill_calls is None and not gen.in_prefill:
            prefill_calls = len(lm.model.calls) - start
    return Reply([e.token for e in events if e.kind == "token"], "".join(e.text for e in events),
                 events[-1].usage.cached_tokens, prefill_calls)


def ask(lm, messages, cache, seed=None) -> Reply:
    """With the cache and large chunks; the tokens must equal a cache-off run in small chunks."""
    on = run(lm, messages, cache, seed=seed)
    off = run(lm, messages, chunk=SMALL, seed=seed)
    assert on.tokens == off.tokens
    return on


SYSTEM = {"role": "system", "content": "You are a terse assistant."}
TOPICS = ["rivers", "bridges", "volcanoes", "tides", "owls"]


def question(topic: str) -> dict:
    return user(f"Tell me about {topic}. " + f"History, science and stories of {topic}. " * 6)


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def every_message_end_reuse(lm, cache, prompt, cached_prompts) -> int:
    """What a cache with a snapshot at every message end of every earlier prompt (and at each
    earlier prompt + answer) would reuse: the dense cache any common prefix, the hybrid one the
    deepest such snapshot point the new prompt shares. `cached_prompts`: (tokens, snapshot
    lengths along them)."""
    limit = len(prompt.tokens) - 1
    if cache.trimmable:
        return min(limit, max(common_prefix(prompt.tokens, t) for t, _ in cached_prompts))
    points = [n for tokens, ends in cached_prompts for n in ends
              if n <= limit and tokens[:n] == prompt.tokens[:n]]
    return max(points, default=0)


def test_a_growing_conversation_and_its_edits_reuse_what_every_message_end_would(lm):
    cache = PrefixCache(lm)
    chat, seen = [SYSTEM], []
    for i, topic in enumerate(TOPICS):
        chat.append(question(topic))
        prompt = build_prompt(lm, messages=chat)
        reply = ask(lm, chat, cache, seed=None if i % 2 else 11)
        assert reply.cached == (every_message_end_reuse(lm, cache, prompt, seen) if seen else 0)
        assert len(reply.tokens) == 6  # ended by length: the answer's snapshot holds all but the last
        held = prompt.tokens + reply.tokens[:-1]
        n = len(prompt.tokens)
        seen += [(prompt.tokens, prompt.checkpoints[:-1] + [n - 1, n]), (held, [len(held)])]
        chat.append(assistant(reply.text))
    # Edit each earlier question of the conversation in turn: each reuses everything before it.
    for k in range(1, len(chat) - 1, 2):
        edited = chat[:k] + [user(f"Instead, one line on {TOPICS[k // 2]}.")]
        prompt = build_prompt(lm, messages=edited)
        expected = every_message_end_reuse(lm, cache, prompt, seen)
        reply = ask(lm, edited, cache)
        assert reply.cached == expected and expected >= prompt.checkpoints[-2]
        assert ask(lm, edited, cache).cached == len(prompt.tokens) - 1  # regenerated


def test_a_long_chat_sent_at_once_prefills_without_stops_and_its_last_turn_edits_reuse_all(lm):
    chat = [SYSTEM]
    for topic in TOPICS:
        chat += [question(topic), assistant(f"{topic.title()} shape how people live. " * 6)]
    chat.append(question("markets"))
    cache = PrefixCache(lm)
    prompt = build_prompt(lm, messages=chat)
    assert len(prompt.checkpoints) == 12 and len(prompt.tokens) > 500
    cold = ask(lm, chat, cache)
    # dense: the whole prompt in one chunk, then its last token; hybrid: stops at the system
    # prompt's end, the last two message ends and one token short of the end
    assert cold.prefill_calls == (2 if cache.trimmable else 5)
    assert run(lm, chat, chunk=SMALL).prefill_calls > len(prompt.tokens) // SMALL

    edited = chat[:-1] + [user("Markets, in one line.")]
    edit_prompt = build_prompt(lm, messages=edited)
    reply = ask(lm, edited, cache)
    shared = common_prefix(edit_prompt.tokens, prompt.tokens)
    assert reply.cached == (shared if cache.trimmable else edit_prompt.checkpoints[-2])
    assert reply.cached >= prompt.checkpoints[-2]

    # Branching again off the same place resumes at the branch point the first edit left.
    again = chat[:-1] + [user("Markets, in one line, please.")]
    again_prompt = build_prompt(lm, messages=again)
    branch = common_prefix(edit_prompt.tokens, prompt.tokens)
    assert common_prefix(again_prompt.tokens, edit_prompt.tokens) > branch > prompt.checkpoints[-2]
    later = ask(lm, again, cache)
    assert later.cached >= branch if cache.trimmable else later.cached == branch

    # A new conversation with the same system prompt reuses the system prompt's snapshot.
    other = [SYSTEM, user("Something else entirely.")]
    assert ask(lm, other, cache).cached >= build_prompt(lm, messages=other).checkpoints[0]


def test_the_last_token_fed_with_a_short_final_chunk_keeps_tokens_and_reuse(lm):
    """As on a GPU: the last prompt token goes through the model with a short final chunk (one
    call fewer in every time to first token). An edited last turn then prefills in one call on
    the dense model (the hybrid one stops one token before the end, so its last token stays
    alone), with the tokens of the cache-off reference and the reuse of the separate call."""
    chat = [SYSTEM, question("rivers"), assistant("Rivers flow to the sea."), question("tides")]
    edited = chat[:-1] + [question("owls")]
    replies = {}
    for together in (True, False):
        cache = PrefixCache(lm, budget_bytes=2**30)
        first = run(lm, chat, cache, chunk=128, last_with_chunk=together)
        replies[together] = (first, run(lm, edited, cache, chunk=128, last_with_chunk=together))
    (first, on), (first_apart, apart) = replies[True], replies[False]
    assert first.tokens == first_apart.tokens == run(lm, chat, chunk=SMALL).tokens
    assert on.tokens == apart.tokens == run(lm, edited, chunk=SMALL).tokens
    assert on.cached == apart.cached > len(build_prompt(lm, messages=chat[:1]).tokens)
    assert on.prefill_calls == apart.prefill_calls - (1 if cache.trimmable else 0)


def test_a_final_chunk_too_long_for_the_last_token_leaves_a_short_one_that_takes_it(lm):
    """As on a GPU, with chunks larger than a final chunk may be to take the last prompt token
    (every position's logits are computed): a long chat's prefill ends with a chunk short enough
    to take it, not with a call for the last token alone, and gives the cache-off tokens."""
    chat = [SYSTEM] + [m for t in TOPICS * 2 for m in (question(t), assistant("Noted."))]
    chat.append(question("owls"))
    n = len(build_prompt(lm, messages=chat).tokens)
    assert n > LAST_WITH_CHUNK_MAX + 100
    cache = PrefixCache(lm, budget_bytes=2**30)
    start = len(lm.model.calls)
    on = run(lm, chat, cache, chunk=LARGE, last_with_chunk=True)
    calls = lm.model.calls[start:start + on.prefill_calls]
    assert on.tokens == run(lm, chat, chunk=SMALL).tokens
    if cache.trimmable:  # no stop: one large chunk, then the short one with the last token
        assert calls == [n - LAST_WITH_CHUNK_MAX, LAST_WITH_CHUNK_MAX]
    else:  # it stops one token before the end: the last token stays alone
        assert calls[-1] == 1 and sum(calls) == n
