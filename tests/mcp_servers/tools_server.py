"""A real MCP server for the tests, written with the official SDK (`MCPServer`): a calculator, a
reader of files in one folder, a tool that sleeps, one that fails, one that ends the process and
one that answers millions of characters.

    python tests/mcp_servers/tools_server.py stdio [--tools add,fail] [--folder DIR]
    python tests/mcp_servers/tools_server.py http PORT [--token TOKEN] [--tools ...] [--folder DIR]

`--tools` keeps only the named tools (a test that forces a call picks the tool that way). Over
HTTP, `--token` makes every request need `Authorization: Bearer TOKEN` (401 otherwise). The `env`
tool returns the variable that MCP_TEST_ECHO_ENV names (mcp.json's `env` reaching the command).
"""

import argparse
import asyncio
import os
from pathlib import Path
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import Field

FOLDER = Path(".")
READ_ONLY = ToolAnnotations(readOnlyHint=True)
Small = Annotated[int, Field(ge=0, le=99)]


def add(a: Small, b: Small) -> str:
    """Add two whole numbers from 0 to 99."""
    return str(a + b)


def read_file(name: Annotated[str, Field(pattern=r"^[a-z]{1,8}\.txt$")]) -> str:
    """The text of a file in the server's folder."""
    return (FOLDER / name).read_text()


async def sleep(seconds: Annotated[int, Field(ge=1, le=9)]) -> str:
    """Sleep that long (and a minute more), then say so."""
    await asyncio.sleep(seconds + 60)
    return "slept"


def fail(reason: Annotated[str, Field(max_length=8)]) -> str:
    """Always fails."""
    raise ToolError(f"the tool failed on purpose ({reason})")


def crash(code: Annotated[int, Field(ge=1, le=9)]) -> str:
    """Ends the server's process at once (a server that crashes mid-call)."""
    os._exit(code)


def big(megabytes: Annotated[int, Field(ge=1, le=64)]) -> str:
    """A text of that many million characters (a tool that answers far more than is shown)."""
    return "y" * (megabytes * 1_000_000)


def env(name: Annotated[str, Field(max_length=8)]) -> str:
    """The environment variable MCP_TEST_ECHO_ENV names."""
    return os.environ.get(os.environ.get("MCP_TEST_ECHO_ENV", ""), "")


TOOLS = {"add": (add, READ_ONLY), "read_file": (read_file, READ_ONLY), "sleep": (sleep, None),
         "fail": (fail, None), "crash": (crash, None), "env": (env, None), "big": (big, None)}


def build(names: list[str]) -> MCPServer:
    server = MCPServer("test-tools")
    for name in names:
        fn, annotations = TOOLS[name]
        server.tool(annotations=annotations)(fn)
    return server


def serve_http(server: MCPServer, port: int, token: str | None) -> None:
    import uvicorn
    from starlette.responses import PlainTextResponse

    inner = server.streamable_http_app()

    async def app(scope, receive, send):
        if token and scope["type"] == "http" and \
                dict(scope["headers"]).get(b"authorization") != f"Bearer {token}".encode():
            await PlainTextResponse("no", status_code=401)(scope, receive, send)
            return
        await inner(scope, receive, send)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("transport", choices=["stdio", "http"])
    parser.add_argument("port", nargs="?", type=int)
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--folder", default=".")
    parser.add_argument("--token")
    options = parser.parse_args()
    FOLDER = Path(options.folder)
    mcp_server = build(options.tools.split(","))
    if options.transport == "http":
        serve_http(mcp_server, options.port, options.token)
    else:
        mcp_server.run("stdio")
