"""A conversation as JSON and back: `export_conversation` writes every message version with the
settings, model and times (message ids local to the export); `import_conversation` makes a new
conversation of such a file, or of a plain OpenAI `messages` list, each checked against
import_schema.py before anything is stored."""

import time
from typing import Any

from .import_schema import validated, validated_message
from .records import DEFAULT_TITLE, Conversation
from .store import Storage

EXPORT_FORMAT = "mlxchat.conversation/1"
_MESSAGE_COLUMNS = ("role", "content", "model", "sampling", "ttft_ms", "tokens_per_s",
                    "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "state",
                    "error", "created", "speculative", "attachments", "tool_calls", "tool_call_id",
                    "tool_meta")


def export_conversation(storage: Storage, cid: int) -> dict[str, Any]:
    """Everything about one conversation; message ids are local to the export (`parent` refers to
    an earlier entry's `id`) and `leaf` is the branch shown."""
    conv = storage.get_conversation(cid)
    if conv is None:
        raise KeyError(cid)
    messages = storage.messages(cid)
    local = {m.id: i for i, m in enumerate(messages)}
    return {"format": EXPORT_FORMAT, "title": conv.title, "created": conv.created,
            "updated": conv.updated, "model": conv.model, "settings": conv.settings,
            "leaf": local.get(conv.leaf_id),
            "messages": [{"id": local[m.id], "parent": local.get(m.parent_id),
                          **{k: getattr(m, k) for k in _MESSAGE_COLUMNS}} for m in messages]}


def import_conversation(storage: Storage, data: dict[str, Any], model: str | None = None,
                        settings: dict[str, Any] | None = None) -> Conversation:
    """A new conversation from `export_conversation`'s JSON, or from a plain OpenAI `messages`
    list (`{"messages": [{"role", "content"}, ...]}`); raises ValueError on anything else.
    A plain list carries no model or settings: it gets `model` and `settings`."""
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise ValueError("not a conversation: expected an object with 'messages'")
    now = time.time()
    if data.get("format") == EXPORT_FORMAT:
        data = validated(data)
        fields = {"title": str(data.get("title") or DEFAULT_TITLE), "created": data["created"] or now,
                  "updated": data["updated"] or now, "model": data.get("model"),
                  "settings": data["settings"]}
        tree = [(m["id"] if m["id"] is not None else i, m["parent"],
                 {k: m[k] for k in _MESSAGE_COLUMNS}) for i, m in enumerate(data["messages"])]
        leaf = data.get("leaf")
    else:  # a plain list: one branch, each message under the one before
        messages = [validated_message(i, m) for i, m in enumerate(data["messages"])]
        fields = {"title": str(data.get("title") or DEFAULT_TITLE), "created": now, "updated": now,
                  "model": model, "settings": settings or {}}
        tree = [(i, i - 1 if i else None,
                 {"role": m["role"], "content": m["content"], "tool_calls": m["tool_calls"],
                  "tool_call_id": m["tool_call_id"]}) for i, m in enumerate(messages)]
        leaf = len(tree) - 1 if tree else None
    for i, (_, _, row) in enumerate(tree):
        if not (isinstance(row["content"], str) or row["content"] is None and row["tool_calls"]):
            raise ValueError(f"messages[{i}] must have text content (or tool calls)")
        row["content"] = row["content"] or ""
        row["created"] = row.get("created") or now
        row["state"] = row.get("state") or "done"
    return storage.insert_conversation(fields, tree, leaf)
