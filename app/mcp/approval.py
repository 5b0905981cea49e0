"""The user's approval of a tool call: nothing runs without it, per call or standing.

A call runs at once when its tool is allowed for the whole conversation (`McpChoice.always`, kept
as "server/tool") or when its server is marked `trusted` in mcp.json and the tool declares itself
read-only (MCP's `readOnlyHint`). Otherwise the page asks, and the turn waits for the answer:
"once", "always" (for this conversation) or "deny". Stop answers every pending question "deny".
"""

import asyncio
from dataclasses import dataclass
from typing import Any

from engine import ToolCall

from ..storage import McpChoice
from .config import ServerConfig
from .servers import ToolInfo

DECISIONS = ("once", "always", "deny")


def key(tool: ToolInfo) -> str:
    """How a standing approval names a tool: "server/tool"."""
    return f"{tool.server}/{tool.name}"


def standing(tool: ToolInfo, choice: McpChoice, server: ServerConfig | None) -> bool:
    """Whether the call may run without asking."""
    return key(tool) in choice.always or bool(server and server.trusted and tool.read_only)


@dataclass(frozen=True)
class Question:
    """A call waiting for the user's decision: the call, its tool and its arguments."""

    call: ToolCall
    tool: ToolInfo
    arguments: dict[str, Any]


class Approvals:
    """The questions a running turn is waiting on, by call id; answered from the chat socket."""

    def __init__(self) -> None:
        self._pending: dict[str, asyncio.Future[str]] = {}
        self.asking: Question | None = None  # the question on the page, for a page that (re)connects

    async def ask(self, question: Question) -> str:
        """Wait for the user's decision on `question`'s call."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pending[question.call.id] = future
        self.asking = question
        try:
            return await future
        finally:
            self._pending.pop(question.call.id, None)
            self.asking = None

    def answer(self, call_id: object, decision: object) -> str | None:
        """Record a decision; None when accepted, else why not (shown to the user)."""
        if decision not in DECISIONS:
            return f"Unknown decision {decision!r}."
        future = self._pending.get(call_id) if isinstance(call_id, str) else None
        if future is None or future.done():
            return "That tool call is not waiting for an answer."
        future.set_result(decision)
        return None

    def deny_all(self) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_result("deny")
