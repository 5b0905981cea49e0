"""The tool rounds of a chat turn: the model's calls to the conversation's MCP tools, each approved
by the user (approval.py), run, and its result given back to the model, round after round until
the model answers in text or `McpChoice.max_rounds` rounds have run (the next answer is then
generated without tools).

Every round is an ordinary engine request through `Engine.submit` (same scheduler, same prefix
cache: a round's prompt extends the previous one's). The tools are offered as OpenAI functions;
once the model opens a call, the engine decodes its arguments under the tool's JSON Schema, so
they are valid. With `first_call` the first round must be a call (decoded wholly under the
grammar, as `tool_choice: "required"`); later rounds are "auto".

What is stored: the answer that called keeps its calls (`tool_calls`, OpenAI's shape) and, in
`tool_meta`, each call's server and tool; each result is a `tool` message (capped, see
servers.py) whose `tool_meta` says how it ended: "done", "error", "denied" or "stopped". Tool
results are untrusted text: escaped wherever they are shown.

What the user sees of the rounds goes through a `RoundsView`, which the chat UI implements
(app/ui/tool_rounds.py); nothing here writes HTML.
"""

import asyncio
import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from engine import InvalidRequest, ToolCall, ToolRequest, tool_request

from ..storage import Conversation, McpChoice, Message, Storage
from .approval import Approvals, Question, key, standing
from .servers import McpServers, ToolInfo, ToolResult

log = logging.getLogger(__name__)

DENIED = "The user denied this call."
STOPPED = "The call was stopped by the user."


class RoundsView(Protocol):
    """What the user sees of a turn's tool rounds, on every page of the conversation."""

    async def notice(self, text: str) -> None:
        """A passing notice ("Running x on y…"); "" clears it."""
        ...

    async def calls(self, conv: Conversation, path: list[Message]) -> None:
        """The answer at the end of `path` with the calls it made (more of the turn to come)."""
        ...

    async def question(self, question: Question | None) -> None:
        """The call waiting for the user's decision; None: no question (any shown goes)."""
        ...


def _model_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)[:64] or "tool"


def offered_tools(tools: list[ToolInfo]) -> dict[str, ToolInfo]:
    """The tools by the name the model sees: the tool's own name, or "server__tool" where two
    servers offer one name."""
    counts: dict[str, int] = {}
    for t in tools:
        counts[_model_name(t.name)] = counts.get(_model_name(t.name), 0) + 1
    out: dict[str, ToolInfo] = {}
    for t in tools:
        name = _model_name(t.name)
        if counts[name] > 1:
            name = _model_name(f"{t.server}__{t.name}")
        out.setdefault(name, t)
    return out


def _parameters(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's arguments schema as the model must follow it: no keys beyond the declared ones
    unless the schema asks for them (MCP servers rarely say; a small model then invents keys)."""
    schema = schema or {"type": "object"}
    return {**schema, "additionalProperties": schema.get("additionalProperties", False)}


def _functions(offered: dict[str, ToolInfo]) -> list[dict[str, Any]]:
    """The tools as OpenAI functions, leaving out any whose schema the engine cannot enforce."""
    functions = []
    for name, t in offered.items():
        fn = {"type": "function", "function": {"name": name, "description": t.description,
                                               "parameters": _parameters(t.schema)}}
        try:
            tool_request([fn])
        except InvalidRequest as exc:
            log.warning("MCP tool %s left out: %s", key(t), exc)
            continue
        functions.append(fn)
    return functions


@dataclass
class TurnTools:
    """The MCP tools of one turn: what the model is offered, the conversation's choices, and the
    approvals the page answers."""

    servers: McpServers
    choice: McpChoice
    offered: dict[str, ToolInfo]
    auto: ToolRequest
    forced: ToolRequest
    approvals: Approvals
    running: asyncio.Task | None = None

    def request(self, round_number: int) -> ToolRequest:
        """The tools of round `round_number` (0 first): a call forced first if asked; after the
        last allowed round still shown to the model (the prompt, and so the prefix cache, stays
        the same) but no call is taken (`tool_choice: "none"`)."""
        if round_number >= self.choice.max_rounds:
            return dataclasses.replace(self.auto, choice="none")
        return self.forced if round_number == 0 and self.choice.first_call else self.auto

    def request_after(self, path: list[Message]) -> ToolRequest:
        """The tools of the answer that follows `path`: its round is the number of answers that
        called tools since the last user message (a regenerated last answer continues the
        rounds before it; it is not a first round again)."""
        rounds = 0
        for m in reversed(path):
            if m.role == "user":
                break
            rounds += m.role == "assistant" and bool(m.tool_calls)
        return self.request(rounds)

    def stop(self) -> None:
        """Stop: pending questions denied, the running call cancelled."""
        self.approvals.deny_all()
        if self.running is not None:
            self.running.cancel()


async def turn_tools(servers: McpServers, storage: Storage, cid: int,
                     view: RoundsView) -> TurnTools | None:
    """The conversation's tools for a turn, or None (no server switched on, or none ready)."""
    choice = storage.mcp_choice(cid)
    if not choice.servers:
        return None
    await servers.current()
    starting = [n for n in choice.servers if n in servers.servers
                and servers.servers[n].state == "starting"]
    if starting:
        await view.notice(f"Starting MCP servers: {', '.join(starting)}…")
        await servers.wait_ready(starting)
        await view.notice("")
    offered = offered_tools(servers.tools(list(choice.servers)))
    functions = await asyncio.to_thread(_functions, offered)
    if not functions:
        return None
    offered = {f["function"]["name"]: offered[f["function"]["name"]] for f in functions}
    auto, forced = await asyncio.to_thread(
        lambda: (tool_request(functions, "auto", False), tool_request(functions, "required", False)))
    return TurnTools(servers, choice, offered, auto, forced, Approvals())


def _arguments(call: ToolCall) -> dict[str, Any] | None:
    try:
        args = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:
        return None
    return args if isinstance(args, dict) else None


async def run_calls(tools: TurnTools, storage: Storage, conv: Conversation, answer_id: int,
                    calls: tuple[ToolCall, ...], view: RoundsView, stopped: Callable[[], bool]) -> int:
    """Ask for, run and store each call of the answer `answer_id`; returns the id of the last
    result (where the next answer goes)."""
    meta = {"calls": {c.id: {"server": t.server, "tool": t.name} for c in calls
                      if (t := tools.offered.get(c.name))}}
    storage.set_tool_calls(answer_id, [{"id": c.id, "type": "function",
                                        "function": {"name": c.name, "arguments": c.arguments}}
                                       for c in calls], meta)
    await view.calls(conv, storage.active_path(conv.id))
    parent = answer_id
    for call in calls:
        tool = tools.offered.get(call.name)
        result, outcome = await _one_call(tools, storage, conv, call, tool, view, stopped)
        shown = {"server": tool.server, "tool": tool.name} if tool else {"tool": call.name}
        message = storage.add_message(conv.id, parent, "tool", result.text, tool_call_id=call.id,
                                      tool_meta={**shown, "outcome": outcome,
                                                 "truncated": result.truncated})
        parent = message.id
    await view.question(None)
    return parent


async def _one_call(tools: TurnTools, storage: Storage, conv: Conversation, call: ToolCall,
                    tool: ToolInfo | None, view: RoundsView,
                    stopped: Callable[[], bool]) -> tuple[ToolResult, str]:
    """One call: checked, approved (or not), run; its result and how it ended."""
    if stopped():
        return ToolResult(STOPPED, True), "stopped"
    if tool is None:
        return ToolResult(f"There is no tool named {call.name!r}.", True), "error"
    args = _arguments(call)
    if args is None:
        return ToolResult("The arguments are not a JSON object.", True), "error"
    server = tools.servers.configs().get(tool.server)
    if not standing(tool, tools.choice, server):
        decision = await _ask(tools, storage, conv, Question(call, tool, args), view)
        if stopped():
            return ToolResult(STOPPED, True), "stopped"
        if decision == "deny":
            return ToolResult(DENIED, True), "denied"
    return await _run(tools, tool, args, view, stopped)


async def _ask(tools: TurnTools, storage: Storage, conv: Conversation, question: Question,
               view: RoundsView) -> str:
    """The user's decision on the call, asked on the page; "always" is kept for the
    conversation's later calls and turns."""
    tool = question.tool
    await view.question(question)
    decision = await tools.approvals.ask(question)
    await view.question(None)
    if decision == "always":
        saved = storage.mcp_choice(conv.id)
        storage.save_mcp_choice(conv.id, dataclasses.replace(
            saved, always=tuple(sorted({*saved.always, key(tool)}))))
        tools.choice = dataclasses.replace(tools.choice, always=(*tools.choice.always, key(tool)))
    return decision


async def _run(tools: TurnTools, tool: ToolInfo, args: dict[str, Any], view: RoundsView,
               stopped: Callable[[], bool]) -> tuple[ToolResult, str]:
    """The approved call, run on its server (Stop cancels it)."""
    await view.notice(f"Running {tool.name} on {tool.server}…")
    if stopped():  # Stop pressed while the notice went out
        return ToolResult(STOPPED, True), "stopped"
    tools.running = asyncio.create_task(tools.servers.call(tool.server, tool.name, args))
    try:
        result = await asyncio.shield(tools.running)
    except asyncio.CancelledError:
        if tools.running.cancelled() and stopped():
            return ToolResult(STOPPED, True), "stopped"
        tools.running.cancel()
        raise
    finally:
        await view.notice("")
    return result, "error" if result.is_error else "done"
