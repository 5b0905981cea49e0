"""The tool-calling parts of a chat request's messages: an assistant message's `tool_calls` and a
`tool` message's `tool_call_id` (the request's `tools` and `tool_choice` are checked by the
engine's `tool_request`)."""

import json
from typing import Any

from .errors import ApiError


def _bad(i: int, what: str) -> ApiError:
    return ApiError(400, f"messages[{i}].{what}", f"messages[{i}]", "invalid_value")


def tool_fields(i: int, role: str, m: dict[str, Any]) -> dict[str, Any]:
    """The tool-call fields to keep from message `i` (already known to be an object)."""
    out: dict[str, Any] = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise _bad(i, "tool_calls must be an array, on an assistant message")
        for c in calls:
            fn = c.get("function") if isinstance(c, dict) else None
            if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                    or not isinstance(fn.get("arguments", "{}"), str)):
                raise _bad(i, "tool_calls entries must be {\"id\": ..., \"type\": \"function\", "
                              "\"function\": {\"name\": ..., \"arguments\": \"<JSON text>\"}}")
            try:
                json.loads(fn.get("arguments", "{}"))
            except json.JSONDecodeError:
                raise _bad(i, "tool_calls[].function.arguments must be JSON text") from None
        if calls:
            out["tool_calls"] = [{"id": str(c.get("id", "")), "type": "function",
                                  "function": {"name": c["function"]["name"],
                                               "arguments": c["function"].get("arguments", "{}")}}
                                 for c in calls]
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise _bad(i, "tool_call_id (a string) is required on a tool message")
        out["tool_call_id"] = m["tool_call_id"]
    return out
