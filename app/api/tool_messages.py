"""The tool-calling parts of a chat request's messages: an assistant message's `tool_calls` and a
`tool` message's `tool_call_id` (the request's `tools` and `tool_choice` are checked by the
engine's `tool_request`), and where a tool result's images go (`add_tool_result`)."""

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


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image_url", "image")


def add_tool_result(out: list[dict[str, Any]], call_id: str, content: Any) -> None:
    """A tool's result appended to `out` as a tool message. Its images (image parts of `content`)
    go into a user turn after the tool results, one for a run of results, since not every chat
    template takes images in a tool message but every vision model's takes them from the user."""
    images = [p for p in content if _is_image(p)] if isinstance(content, list) else []
    if images:
        rest = [p for p in content if not _is_image(p)]
        text_only = all(p.get("type") == "text" for p in rest)
        content = "".join(p["text"] for p in rest) if text_only else rest
    tool = {"role": "tool", "tool_call_id": call_id, "content": content}
    if out and out[-1].get("tool_images"):  # the images of the results before this one
        out.insert(len(out) - 1, tool)
        out[-1]["content"] += images
    else:
        out.append(tool)
        if images:
            out.append({"role": "user", "content": images, "tool_images": True})
