"""Conversations longer than the model's context: whether a prompt fits, and the opt-in way to
make it fit by dropping the oldest turns (the system prompt is kept). Both the chat UI and the API
(`"truncate": "oldest"`) use it; without the opt-in the engine refuses with
`context_length_exceeded`."""

from typing import Any

from engine import Engine, InvalidRequest, ToolRequest, count_tokens


TRUNCATE_MODES = ("oldest",)


def overflow(engine: Engine, messages: list[dict[str, Any]], max_tokens: int,
             tools: ToolRequest | None = None) -> tuple[int, int] | None:
    """(prompt tokens + max_tokens, context length) when `messages` do not fit, else None."""
    need = count_tokens(engine, messages=messages, tools=tools) + max_tokens
    limit = engine.model.context_length
    return (need, limit) if need > limit else None


def drop_oldest(engine: Engine, messages: list[dict[str, Any]], max_tokens: int,
                tools: ToolRequest | None = None) -> list[dict[str, Any]]:
    """`messages` without their oldest turns, as few dropped as make the prompt and `max_tokens`
    fit; a leading system message stays and the rest starts at a user message. Raises
    InvalidRequest (`context_length_exceeded`) when even the last turn alone does not fit.
    CPU-bound (it renders the prompt a few times): call it off the event loop."""
    system = messages[:1] if messages and messages[0].get("role") == "system" else []
    rest = messages[len(system):]
    # Where the kept part may start: as it is, or at any later user message (a turn starts there).
    starts = [0] + [i for i in range(1, len(rest)) if rest[i].get("role") == "user"]
    # Dropping more never lengthens the prompt, so the fewest dropped is found by binary search:
    # O(log n) renders of at most n messages, where dropping one turn at a time was quadratic.
    lo, hi = 0, len(starts)  # starts[hi:] fit (hi == len(starts): none known to fit yet)
    while lo < hi:
        mid = (lo + hi) // 2
        if overflow(engine, system + rest[starts[mid]:], max_tokens, tools) is None:
            hi = mid
        else:
            lo = mid + 1
    if hi < len(starts):
        return system + rest[starts[hi]:]
    raise InvalidRequest("even the last message alone does not fit this model's context of "
                         f"{engine.model.context_length} tokens with max_tokens {max_tokens}",
                         field="messages", code="context_length_exceeded")
