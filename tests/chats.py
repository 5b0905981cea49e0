"""Conversations the tests share, and asking a loaded model directly (no engine, no server).

    reply = ask(lm, long_chat(2), SamplingParams(max_tokens=4), prefix_cache)
    reply = same_without_cache(lm, messages, params, prefix_cache)  # also checks cache on == off
    written, other = persisted_apart(writer, reader, folder, messages, params)
"""

from dataclasses import dataclass

from engine.decoding.generate import build_prompt, generate


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "You are a terse assistant."}

# The prompts whose greedy tokens must equal mlx-lm's on the real model (English, Chinese, a turn
# after a system prompt and an emoji).
CONVERSATIONS = {
    "english": [user("Explain in two sentences why the sky is blue.")],
    "chinese": [user("请用中文介绍一下巴黎。")],
    "multi-turn": [SYSTEM, user("Name a fruit."), assistant("Apple."),
                   user("Another one, with an emoji 🍎?")],
}


def long_chat(turns: int = 8) -> list[dict]:
    """A system prompt and `turns` long user turns (~280 tokens each) with long answers between."""
    topics = ["rivers", "bridges", "volcanoes", "libraries", "tides", "glaciers", "markets", "owls"]
    messages = [SYSTEM]
    for i, topic in enumerate(topics[:turns]):
        messages.append(user(f"Tell me about {topic}. " + f"I want history, science and stories about "
                             f"{topic}, with examples from many countries. " * 8))
        if i < turns - 1:
            messages.append(assistant(f"Here is what I know about {topic}. " + f"{topic.title()} "
                                      "have shaped how people live, trade and travel for centuries; "
                                      "each region tells its own story. " * 8))
    return messages


@dataclass
class Reply:
    tokens: list[int]
    text: str
    cached: int  # prompt tokens the prefix cache reused


def ask(lm, messages, params, cache=None) -> Reply:
    """Generate an answer to `messages` on `lm` (with the prefix cache `cache`, if given)."""
    events = list(generate(lm, build_prompt(lm, messages=messages), params, prefix_cache=cache))
    return Reply([e.token for e in events if e.kind == "token"], "".join(e.text for e in events),
                 events[-1].usage.cached_tokens)


def same_without_cache(lm, messages, params, cache) -> Reply:
    """Ask with the cache, check the tokens equal a cache-off run, return the cached reply."""
    on = ask(lm, messages, params, cache)
    off = ask(lm, messages, params)
    assert on.tokens == off.tokens, f"cache on {on.tokens} != cache off {off.tokens}"
    assert off.cached == 0
    return on


def persisted_apart(writer, reader, folder, messages, params):
    """`writer`'s prefix cache persists `messages` under `folder`; `reader` (the same weights in
    another variant: KV format, int8 activations) finds none of those files, recomputes and
    answers as without a cache; a new cache of `writer` finds them all. Returns the files written
    and `reader`'s prefix cache."""
    from engine.prefix_cache.store import PrefixCache

    first = PrefixCache(writer, persist_dir=folder)
    ask(writer, messages, params, first)
    written = first.persist()
    other = PrefixCache(reader, persist_dir=folder)
    assert written and other.stats().disk_entries == 0
    assert same_without_cache(reader, messages, params, other).cached == 0
    assert PrefixCache(writer, persist_dir=folder).stats().disk_entries == len(written)
    return written, other
