"""The MCP servers of `mcp.json`, each connected through the official SDK (`mcp.Client`: a stdio
command or a streamable HTTP URL) in its own task on the server's event loop, with its state
("starting", "ready", "failed" with the reason, "disabled") and its tools.

A server that crashes, fails its handshake or does not answer within `start_timeout_s` is shown as
failed; the chat goes on with the others. A call's result is plain text, size-capped
(`MAX_RESULT_CHARS`, truncated with a notice); a call that fails comes back as an error result,
never as an exception, except cancellation (Stop), which propagates.

A result is capped as it arrives, never read whole: a stdio server runs behind app/mcp/relay.py
(its own process, which cuts each long string of a message to the cap as it streams through),
and an HTTP server's responses pass through the same pruning (`BoundedTransport`), so a tool
that answers 50 MB costs the app what 16,000 characters cost.
"""

import asyncio
import logging
import re
import sys
import tempfile
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import httpx2
from mcp_types import CONNECTION_CLOSED
from starlette.applications import Starlette

from . import config
from . import relay
from .config import ConfigError, ServerConfig

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 300.0
MAX_RESULT_CHARS = relay.STRING_CHARS
_NOTICE = re.compile(r"\n\[… truncated: (\d+) more characters\]\Z")


@dataclass(frozen=True)
class ToolInfo:
    """One tool a server offers: its name, what it says it does, its arguments' JSON Schema, and
    whether it declares itself read-only (MCP's `readOnlyHint`)."""

    server: str
    name: str
    description: str
    schema: dict[str, Any]
    read_only: bool


@dataclass(frozen=True)
class ToolResult:
    """What a call gave, as the model and the page see it."""

    text: str
    is_error: bool = False
    truncated: bool = False


@dataclass
class Server:
    """One configured server and where it stands."""

    config: ServerConfig
    state: str = "starting"
    reason: str = ""
    tools: tuple[ToolInfo, ...] = ()
    client: Any = None
    task: asyncio.Task | None = None
    watch: asyncio.Task | None = None  # fails it after the start timeout
    errlog: Any = None  # a stdio command's stderr (the last line explains a failed start)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)


def capped(text: str, limit: int = MAX_RESULT_CHARS) -> tuple[str, bool]:
    """`text` cut to `limit` characters with a notice saying how much was left out (counting
    what the relay left out already: its notice ends the text)."""
    cut = _NOTICE.search(text)
    more = int(cut.group(1)) if cut else 0
    text = text[:cut.start()] if cut else text
    if len(text) <= limit and not more:
        return text, False
    return text[:limit] + relay.notice(more + max(len(text) - limit, 0)), True


def _reason(exc: BaseException) -> str:
    """The innermost exception's message (the SDK raises exception groups)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _result_text(result: Any) -> str:
    parts = []
    for item in result.content or ():
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind == "resource" and getattr(item.resource, "text", None) is not None:
            parts.append(item.resource.text)
        else:
            parts.append(f"[{kind or 'content'} not shown]")
    if not parts and result.structured_content is not None:
        import json

        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


class BoundedTransport(httpx2.AsyncBaseTransport):
    """An HTTP transport (httpx2's, as the SDK uses) whose responses are pruned as they arrive:
    a JSON body through one `relay.JsonPruner`, server-sent events line by line."""

    def __init__(self, inner: httpx2.AsyncBaseTransport):
        self.inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        kind = response.headers.get("content-type", "")
        if "json" not in kind and "event-stream" not in kind:
            return response
        return httpx2.Response(response.status_code, headers=response.headers,
                               stream=_Pruned(response.stream, "event-stream" in kind),
                               extensions=response.extensions, request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> "BoundedTransport":
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.inner.__aexit__(*exc)


class _Pruned(httpx2.AsyncByteStream):
    """A response body stream pruned on its way (see `BoundedTransport`)."""

    def __init__(self, inner: httpx2.AsyncByteStream, events: bool):
        self.inner, self.ready = inner, []
        self.feed = relay.LinePruner(self.ready.append, prefix="data:").feed if events \
            else relay.DocumentPruner(self.ready.append).feed

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            self.feed(chunk)
            while self.ready:
                yield self.ready.pop(0).encode("utf-8")
        self.feed(b"", final=True)
        while self.ready:
            yield self.ready.pop(0).encode("utf-8")

    async def aclose(self) -> None:
        await self.inner.aclose()


class McpServers:
    """The servers of one `mcp.json`, started on first use (`ensure_started`, on the event loop)."""

    def __init__(self, path: Path, start_timeout_s: float = START_TIMEOUT_S):
        self.path = path
        self.start_timeout_s = start_timeout_s
        self.servers: dict[str, Server] = {}
        self.error = ""  # why mcp.json could not be read, if it could not
        self._started = False
        self._read: float | None = None  # mcp.json's modification time when it was read

    # --- lifecycle ---------------------------------------------------------------------------

    def ensure_started(self) -> None:
        """Read mcp.json and start its servers, once (call on the event loop)."""
        if self._started:
            return
        self._started = True
        for cfg in self._load().values():
            self._start(cfg)

    def _load(self) -> dict[str, ServerConfig]:
        """mcp.json's servers as the file is now (none, and `error` says why, if unusable)."""
        self._read = self._mtime()
        try:
            configs = config.load(self.path)
            self.error = ""
        except ConfigError as exc:
            configs, self.error = {}, str(exc)
        return configs

    def _mtime(self) -> float | None:
        try:
            return self.path.stat().st_mtime
        except OSError:
            return None

    async def current(self) -> None:
        """Started, and on the file as it is now (an mcp.json edited by hand since it was read:
        `restart`)."""
        if self._started and self._mtime() != self._read:
            await self.restart()
        self.ensure_started()

    async def retry(self, name: str) -> None:
        """Start a failed server again."""
        server = self.servers.get(name)
        if server is not None and server.state == "failed":
            del self.servers[name]
            await self._close([server])
            self._start(server.config)

    def _start(self, cfg: ServerConfig) -> None:
        server = Server(cfg)
        self.servers[cfg.name] = server
        if cfg.disabled:
            server.state = "disabled"
            server.ready.set()
            return
        server.task = asyncio.create_task(self._run(server), name=f"mcp:{cfg.name}")
        server.watch = asyncio.create_task(self._watch_start(server))

    async def _watch_start(self, server: Server) -> None:
        try:
            await asyncio.wait_for(server.ready.wait(), self.start_timeout_s)
        except asyncio.TimeoutError:
            server.state, server.reason = "failed", \
                f"did not start within {self.start_timeout_s:g} s"
            if server.task is not None:
                server.task.cancel()
            server.ready.set()

    def _transport(self, server: Server) -> Any:
        cfg = server.config
        if cfg.command:
            from mcp.client.stdio import StdioServerParameters, stdio_client

            server.errlog = tempfile.TemporaryFile("w+", prefix="mlxchat-mcp-")
            params = StdioServerParameters(command=sys.executable,
                                           args=[relay.__file__, "--", cfg.command, *cfg.args],
                                           env=dict(cfg.env) or None, cwd=cfg.cwd)
            return stdio_client(params, errlog=server.errlog)
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT

        headers = dict(cfg.headers)
        if cfg.token:
            headers["Authorization"] = f"Bearer {cfg.token}"
        client = httpx2.AsyncClient(  # as the SDK's create_mcp_http_client makes it, pruned
            headers=headers, transport=BoundedTransport(httpx2.AsyncHTTPTransport()),
            timeout=httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT))
        return streamable_http_client(cfg.url, http_client=client)

    @staticmethod
    def _stderr_tail(server: Server) -> str:
        if server.errlog is None:
            return ""
        with suppress(OSError, ValueError):
            server.errlog.seek(0)
            lines = server.errlog.read().strip().splitlines()
            return lines[-1][:300] if lines else ""
        return ""

    async def _run(self, server: Server) -> None:
        from mcp import Client

        cfg = server.config
        try:
            async with Client(self._transport(server), read_timeout_seconds=CALL_TIMEOUT_S) as client:
                listing = await client.list_tools()
                server.tools = tuple(
                    ToolInfo(cfg.name, t.name, t.description or "", dict(t.input_schema or {}),
                             bool(t.annotations and t.annotations.read_only_hint))
                    for t in listing.tools)
                server.client, server.state = client, "ready"
                server.ready.set()
                await server.stop.wait()
        except asyncio.CancelledError:
            if server.state != "failed":  # stopped, not timed out
                server.state = "stopped"
            raise
        except BaseException as exc:  # noqa: BLE001 - any failure is the server's state
            tail = self._stderr_tail(server)
            server.state = "failed"
            server.reason = cfg.redact(_reason(exc) + (f" ({tail})" if tail else ""))
            log.warning("MCP server %s failed: %s", cfg.name, server.reason)
        finally:
            server.client = None
            server.ready.set()
            if server.errlog is not None:
                server.errlog.close()

    async def stop(self) -> None:
        """Close every server (stdio commands end with their pipes)."""
        await self._close(list(self.servers.values()))
        self.servers = {}
        self._started = False

    @staticmethod
    async def _close(servers: list[Server]) -> None:
        tasks = []
        for server in servers:
            server.stop.set()
            if server.task is not None:
                tasks.append(server.task)
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=5)
            for task in pending:
                task.cancel()

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """The app's lifespan: servers start on first use and stop with the app."""
        yield
        await self.stop()

    async def restart(self) -> None:
        """Read mcp.json again (after an edit): servers removed or changed are closed, new or
        changed ones started; the others run on."""
        if not self._started:
            self.ensure_started()
            return
        configs = self._load()
        gone = [s for name, s in self.servers.items() if configs.get(name) != s.config]
        for server in gone:
            del self.servers[server.config.name]
        await self._close(gone)
        for name, cfg in configs.items():
            if name not in self.servers:
                self._start(cfg)

    # --- what the chat uses ------------------------------------------------------------------

    def configs(self) -> dict[str, ServerConfig]:
        return {name: s.config for name, s in self.servers.items()}

    async def wait_ready(self, names: list[str]) -> None:
        """Until each named server has started or failed."""
        waits = [self.servers[n].ready.wait() for n in names if n in self.servers]
        if waits:
            await asyncio.gather(*waits)

    def tools(self, names: list[str]) -> list[ToolInfo]:
        """The tools of the named servers that are ready, in order."""
        return [t for n in names if n in self.servers and self.servers[n].state == "ready"
                for t in self.servers[n].tools]

    async def call(self, server_name: str, tool: str, arguments: dict[str, Any]) -> ToolResult:
        """Call a tool; failures come back as error results. Cancellation propagates."""
        server = self.servers.get(server_name)
        if server is None or server.client is None:
            state = server.reason if server else "it is not configured"
            return ToolResult(f"The MCP server {server_name!r} is not available ({state}).", True)
        try:
            result = await server.client.call_tool(tool, arguments)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the model and the page get the reason
            reason = server.config.redact(_reason(exc))
            if getattr(exc, "code", None) == CONNECTION_CLOSED:  # the server has gone
                server.state, server.reason = "failed", f"the server stopped ({reason})"
                server.stop.set()
            return ToolResult(f"The call failed: {reason}", True)
        text, truncated = capped(_result_text(result))
        return ToolResult(text, bool(result.is_error), truncated)
