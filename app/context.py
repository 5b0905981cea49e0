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
    InvalidRequest (`context_length_exceeded`) when even the last turn alone does not fit."""
    system = messages[:1] if messages and messages[0].get("role") == "system" else []
    rest = messages[len(system):]
    while rest:
        if overflow(engine, system + rest, max_tokens, tools) is None:
            return system + rest
        rest = rest[1:]
        while rest and rest[0].get("role") != "user":  # a turn starts with the user
            rest = rest[1:]
    raise InvalidRequest("even the last message alone does not fit this model's context of "
                         f"{engine.model.context_length} tokens with max_tokens {max_tokens}",
                         field="messages", code="context_length_exceeded")

