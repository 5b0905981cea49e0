"""Issue 24 M5 (tools): a request offering hundreds of tools has their schemas compiled off the
event loop, and more than `MAX_TOOLS` is a 400 naming `tools`; a real server on 127.0.0.1 with a
tiny random llama, `/health` polled throughout."""

import httpx
import pytest

from engine.decoding.tools import MAX_TOOLS
from live_server import tiny_serving
from loop_probe import STALL_S, health_probe

pytestmark = pytest.mark.fast



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_serving(tmp_path_factory.mktemp("tools")) as s:
        yield s


def tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {
        "name": f"fn_{i}", "description": "does a thing",
        "parameters": {"type": "object", "required": ["a"], "properties": {
            "a": {"type": "string", "enum": [f"v{i}", "w"]}, "b": {"type": "integer", "minimum": i},
            "c": {"type": "array", "items": {"type": "number"}}}}}} for i in range(n)]


def test_hundreds_of_tools_do_not_stall_the_server(server):
    body = {"model": server.model, "max_tokens": 2, "tool_choice": "none",
            "messages": [{"role": "user", "content": "hi"}], "tools": tools(MAX_TOOLS)}
    with health_probe(server.url) as probe:
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code in (200, 400), r.text  # 400: the tool block overflows the context
    assert probe.latencies and probe.worst < STALL_S, probe.worst


def test_more_than_the_most_tools_is_refused_with_the_field(server):
    body = {"model": server.model, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}], "tools": tools(MAX_TOOLS + 1)}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools"
