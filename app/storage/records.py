"""What the database holds, as records: a conversation, a message (a node of the conversation's
tree; its `state` one of `MESSAGE_STATES`) and a conversation's MCP tool settings. The store
(store.py) reads rows into them; the import schema (import_schema.py) checks an upload against
the same states."""

from dataclasses import dataclass
from typing import Any

DEFAULT_TITLE = "New chat"
MESSAGE_STATES = ("streaming", "done", "stopped", "failed")


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    created: float
    updated: float
    model: str | None
    settings: dict[str, Any]
    leaf_id: int | None


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: int
    parent_id: int | None
    role: str
    content: str
    model: str | None
    sampling: dict[str, Any] | None
    ttft_ms: float | None
    tokens_per_s: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    finish_reason: str | None
    state: str
    error: str | None
    created: float
    speculative: dict[str, Any] | None = None  # statistics, when it was decoded speculatively
    attachments: list[dict[str, Any]] | None = None  # documents of a user turn: name, text, tokens
    tool_calls: list[dict[str, Any]] | None = None  # an answer's calls, as OpenAI sends them
    tool_call_id: str | None = None  # the call a `tool` message answers
    tool_meta: dict[str, Any] | None = None  # MCP: a call's server and outcome (app/mcp)

    retrieved: list[int] | None = None  # chunk ids a user turn's large documents gave it

@dataclass(frozen=True)
class McpChoice:
    """A conversation's MCP tool settings (app/mcp): the servers switched on, the tools allowed
    for the whole conversation ("server/tool"), whether the first round must call a tool, and
    the most tool rounds one turn may take."""

    servers: tuple[str, ...] = ()
    always: tuple[str, ...] = ()
    first_call: bool = False
    max_rounds: int = 8
