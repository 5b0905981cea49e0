"""The test MCP server (tests/mcp_servers/tools_server.py) as mcp.json entries and as a streamable
HTTP process, for the MCP tests."""

import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from live_server import free_port

SERVER = Path(__file__).parent / "mcp_servers" / "tools_server.py"
SECRET_ENV = "env-secret-4f1c"
SECRET_TOKEN = "token-secret-9d2e"


def stdio_entry(tools: str, folder: Path | None = None, **extra) -> dict:
    """An mcp.json entry running the test server over stdio with only `tools`."""
    args = [str(SERVER), "stdio", "--tools", tools] + (["--folder", str(folder)] if folder else [])
    return {"command": sys.executable, "args": args, **extra}


@contextmanager
def http_server(tools: str, token: str | None = SECRET_TOKEN) -> Iterator[str]:
    """The test server over streamable HTTP with only `tools`; yields its URL."""
    port = free_port()
    args = [sys.executable, str(SERVER), "http", str(port), "--tools", tools]
    proc = subprocess.Popen(args + (["--token", token] if token else []))
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
