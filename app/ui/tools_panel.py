"""MCP servers in the UI. A conversation's Tools panel: the MCP servers of mcp.json with their
state and tools, which of them this conversation uses, whether its first round must call a tool,
the most tool rounds of a turn. Settings › MCP servers: the servers themselves, and, when
mlxchat listens on 127.0.0.1 without --allow-remote, adding servers (an mcp.json or its entries,
pasted), trusting and removing them. Otherwise adding a stdio command is refused (it runs code on
this machine) and the section names the file to edit. Secrets never reach the page: servers are
shown through `ServerConfig.public()`."""

import dataclasses
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from ..mcp import config
from ..mcp.config import ConfigError
from ..state import app_state
from ..storage import Conversation, McpChoice
from .views import conversation_of, not_found, read_form, render

MAX_ROUNDS_LIMIT = 64


def servers_context(request: Request) -> dict[str, Any]:
    """The servers as the page shows them (starting them on first sight), and the file."""
    app = app_state(request)
    servers = app.mcp
    servers.ensure_started()
    shown = [{**s.config.public(), "state": s.state, "reason": s.reason, "tools": s.tools}
             for s in servers.servers.values()]
    return {"servers": shown, "edit": app.mcp_edit, "path": str(servers.path),
            "file_error": servers.error}


def _panel(request: Request, conv: Conversation, *, error: str = "", saved: str = "",
           status: int = 200) -> HTMLResponse:
    return HTMLResponse(render("_tools_panel.html", conv=conv,
                               choice=app_state(request).storage.mcp_choice(conv.id),
                               error=error, saved=saved, max_rounds_limit=MAX_ROUNDS_LIMIT,
                               **servers_context(request)), status_code=status)


def _section(request: Request, *, error: str = "", saved: str = "",
             status: int = 200) -> HTMLResponse:
    """Settings › MCP servers."""
    return HTMLResponse(render("_mcp_servers.html", error=error, saved=saved,
                               **servers_context(request)), status_code=status)


async def tools_panel(request: Request) -> Response:
    conv = conversation_of(request)
    if conv is None:
        return not_found()
    await app_state(request).mcp.current()  # mcp.json edited by hand: read again
    return _panel(request, conv)


def choice_form(form: dict[str, str], known: set[str], always: tuple[str, ...]) -> McpChoice:
    """The panel's choices; raises ValueError with the message to show. A tool allowed for the
    whole conversation stays so while its box stays ticked."""
    try:
        rounds = int(form.get("max_rounds") or 8)
    except ValueError:
        raise ValueError("Most tool rounds must be a whole number.") from None
    if not 1 <= rounds <= MAX_ROUNDS_LIMIT:
        raise ValueError(f"Most tool rounds must be from 1 to {MAX_ROUNDS_LIMIT}.")
    servers = tuple(sorted(n for n in known if form.get(f"server:{n}") == "on"))
    kept = tuple(k for k in always if form.get(f"always:{k}") == "on")
    return McpChoice(servers, kept, form.get("first_call") == "on", rounds)


async def save_choice(request: Request) -> Response:
    state = app_state(request)
    conv = conversation_of(request)
    if conv is None:
        return not_found()
    storage = state.storage
    state.mcp.ensure_started()
    try:
        choice = choice_form(await read_form(request), set(state.mcp.servers),
                             storage.mcp_choice(conv.id).always)
    except ValueError as exc:
        return _panel(request, conv, error=str(exc), status=400)
    storage.save_mcp_choice(conv.id, choice)
    return _panel(request, conv, saved="Saved.")


def _edited(request: Request, change: Any) -> dict[str, config.ServerConfig]:
    """mcp.json after `change(servers)`, written; raises ConfigError."""
    path = app_state(request).mcp.path
    servers = config.load(path)
    change(servers)
    config.save(path, servers)
    return servers


async def add_servers(request: Request) -> Response:
    """Add (or replace, by name) the servers of a pasted mcp.json."""
    state = app_state(request)
    form = await read_form(request)
    try:
        pasted = config.parse(form.get("config") or "")
        if not pasted:
            raise ConfigError("paste an mcp.json, or the entries of its mcpServers")
        if not state.mcp_edit and any(s.command for s in pasted.values()):
            return _section(request, status=403, error=(
                "Adding a command from the page is allowed only when mlxchat listens on "
                f"127.0.0.1 without --allow-remote: edit {state.mcp.path} instead."))
        _edited(request, lambda servers: servers.update(pasted))
    except ConfigError as exc:
        return _section(request, error=f"Not added: {exc}", status=400)
    await state.mcp.restart()
    return _section(request, saved=f"Added {', '.join(pasted)}.")


async def _server_edit(request: Request, what: str, change: Any) -> Response:
    """A change to one server of mcp.json from Settings (`change(servers, name, form)`: the
    message to show); only where the page may edit the file."""
    state = app_state(request)
    form = await read_form(request)
    name = form.get("name", "")
    if not state.mcp_edit:
        return _section(request, status=403, error=f"Edit mcp.json to {what}.")
    done: list[str] = []
    try:
        _edited(request, lambda servers: done.append(change(servers, name, form)))
    except ConfigError as exc:
        return _section(request, error=str(exc), status=400)
    await state.mcp.restart()
    return _section(request, saved=done[0])


async def remove_server(request: Request) -> Response:
    """Remove a server from mcp.json (a chat that used it no longer offers its tools)."""
    def remove(servers: dict[str, config.ServerConfig], name: str, form: dict[str, str]) -> str:
        servers.pop(name, None)
        return f"Removed {name}."
    return await _server_edit(request, "remove a server", remove)


async def trust_server(request: Request) -> Response:
    """Mark a server trusted (its read-only tools run without asking) or not, in mcp.json."""
    def trust(servers: dict[str, config.ServerConfig], name: str, form: dict[str, str]) -> str:
        if name not in servers:
            raise ConfigError(f"there is no server {name!r}")
        trusted = form.get("trusted") == "on"
        servers[name] = dataclasses.replace(servers[name], trusted=trusted)
        return f"{name}: read-only tools {'run without asking' if trusted else 'ask first'}."
    return await _server_edit(request, "trust a server", trust)


async def retry_server(request: Request) -> Response:
    """Start a failed server again (its command or URL as mcp.json has it); answered with the
    Tools panel of the conversation it was asked from, or Settings › MCP servers."""
    name = (await read_form(request)).get("name", "")
    await app_state(request).mcp.retry(name)
    if "cid" not in request.path_params:
        return _section(request)
    conv = conversation_of(request)
    return _panel(request, conv) if conv is not None else not_found()


async def servers_section(request: Request) -> Response:
    await app_state(request).mcp.current()  # mcp.json edited by hand: read again
    return _section(request)


routes = [
    Route("/c/{cid:int}/tools", tools_panel),
    Route("/c/{cid:int}/tools", save_choice, methods=["POST"]),
    Route("/c/{cid:int}/tools/servers/retry", retry_server, methods=["POST"]),
    Route("/settings/mcp", servers_section),
    Route("/settings/mcp/servers", add_servers, methods=["POST"]),
    Route("/settings/mcp/servers/remove", remove_server, methods=["POST"]),
    Route("/settings/mcp/servers/trust", trust_server, methods=["POST"]),
    Route("/settings/mcp/servers/retry", retry_server, methods=["POST"]),
]
