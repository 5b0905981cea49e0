"""MCP tools in the chat, end to end on a real server (tiny random-weight model) with the real
test MCP server over stdio and streamable HTTP: the model's call (forced for the test: a tiny
random model cannot choose to call; its arguments are still decoded by the engine under the
tool's schema), the user's approval (once, always, deny), the result back to the model, a
failing tool, Stop during a sleeping tool, a failed server, reload and export, secrets kept out
of pages, exports and logs."""

import json
import logging
import re
import sys

import httpx
import pytest
from websockets.sync.client import connect

from app.ui.prompt import engine_messages
from live_server import engine_serving, new_conversation, ws_url
from mcp_fixtures import SECRET_ENV, SECRET_TOKEN, http_server, stdio_entry
from tiny_models import tiny_llama

pytestmark = pytest.mark.fast


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.text = []

    def emit(self, record):
        self.text.append(self.format(record))


@pytest.fixture(scope="module")
def logs():
    handler = _Records()
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield handler
    root.removeHandler(handler)
    root.setLevel(old)


@pytest.fixture(scope="module")
def server(tmp_path_factory, logs):
    folder = tmp_path_factory.mktemp("mcp-chat")
    with http_server("add") as url:
        (folder / "mcp.json").write_text(json.dumps({"mcpServers": {
            "calc": stdio_entry("add", env={"CALC_SECRET": SECRET_ENV}),
            "web": {"url": url, "token": SECRET_TOKEN},
            "broken": stdio_entry("fail"),
            "slow": stdio_entry("sleep"),
            "crash": {"command": sys.executable, "args": ["-c", "import sys; sys.exit('boom')"]},
        }}))
        with engine_serving(folder, tiny_llama()) as s:
            yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def chat_with(http, *servers: str, max_rounds: int = 1) -> int:
    """A new greedy conversation using `servers`, whose first round must call a tool."""
    cid = new_conversation(http, max_tokens=40)
    form = {f"server:{n}": "on" for n in servers} | {"first_call": "on",
                                                     "max_rounds": str(max_rounds)}
    r = http.post(f"/c/{cid}/tools", data=form)
    assert r.status_code == 200 and "Saved." in r.text
    return cid


def tool_turn(server, cid: int, decision: str | None, message: dict | None = None,
              stop_on: str | None = None, timeout: float = 120) -> list[str]:
    """One turn over the chat socket, answering each approval question with `decision`, pressing
    Stop once a frame holds `stop_on`; the frames until the Send button is back."""
    with connect(ws_url(server, cid), origin=server.url) as ws:
        ws.recv(timeout=60)
        ws.send(json.dumps(message or {"action": "send", "content": "What is 2 + 3?"}))
        frames = []
        while True:
            frames.append(ws.recv(timeout=timeout))
            asked = re.search(r'"call_id": "([^"]+)", "decision": "once"', frames[-1])
            if asked and decision is None:
                assert stop_on, "an approval was asked"
            elif asked:
                ws.send(json.dumps({"action": "tool", "call_id": asked.group(1),
                                    "decision": decision}))
            if stop_on and stop_on in frames[-1]:
                ws.send(json.dumps({"action": "stop"}))
            if 'id="send"' in frames[-1]:
                return frames


def asked(frames: list[str]) -> int:
    return sum('class="allow-once"' in f for f in frames)


def test_allow_once_runs_the_call_and_the_model_answers_from_its_result(server, http):
    cid = chat_with(http, "calc")
    frames = tool_turn(server, cid, "once")
    assert asked(frames) == 1
    user, call, result, answer = server.storage.active_path(cid)
    (tool_call,) = call.tool_calls
    args = json.loads(tool_call["function"]["arguments"])  # decoded under the schema: valid
    assert tool_call["function"]["name"] == "add" and set(args) == {"a", "b"}
    assert all(isinstance(v, int) and 0 <= v <= 99 for v in args.values())
    assert call.finish_reason == "tool_calls" and call.tool_meta["calls"][tool_call["id"]] == \
        {"server": "calc", "tool": "add"}
    assert (result.role, result.tool_call_id, result.content) == \
        ("tool", tool_call["id"], str(args["a"] + args["b"]))
    assert result.tool_meta["outcome"] == "done"
    assert answer.role == "assistant" and answer.state == "done" and answer.parent_id == result.id
    # the second round's prompt extends the first: the prefix cache covers it
    assert answer.cached_tokens >= call.prompt_tokens
    # reloaded, the page shows the call (tool, server, arguments) and the result again
    page = http.get(f"/c/{cid}").text
    assert 'class="tool-call"' in page and "calc" in page and "Result of <code>add" in page
    exported = http.get(f"/c/{cid}/export.json").text
    assert '"tool_calls"' in exported and '"tool_meta"' in exported
    assert SECRET_ENV not in exported and SECRET_TOKEN not in exported
    # editing the question re-runs the tool round on the new branch
    tool_turn(server, cid, "once", {"action": "edit", "message_id": user.id,
                                     "content": "And 4 + 4?"})
    edited = server.storage.active_path(cid)
    assert [m.role for m in edited] == ["user", "assistant", "tool", "assistant"]
    assert edited[0].id != user.id and edited[2].id != result.id


def test_always_for_this_conversation_asks_once_over_http(server, http):
    cid = chat_with(http, "web")
    assert asked(tool_turn(server, cid, "always")) == 1
    assert server.storage.mcp_choice(cid).always == ("web/add",)
    assert asked(tool_turn(server, cid, None)) == 0  # allowed standing: runs without asking
    path = server.storage.active_path(cid)
    results = [m for m in path if m.role == "tool"]
    assert len(results) == 2 and all(m.tool_meta["outcome"] == "done" for m in results)
    assert all(m.content.isdigit() for m in results)
    # the panel lists the standing approval; unticking it takes it back
    panel = http.get(f"/c/{cid}/tools").text
    assert 'name="always:web/add" checked' in panel
    http.post(f"/c/{cid}/tools", data={"server:web": "on", "first_call": "on", "max_rounds": "1"})
    assert server.storage.mcp_choice(cid).always == ()
    assert asked(tool_turn(server, cid, "deny")) == 1


def test_a_denied_call_does_not_run_and_the_model_is_told(server, http):
    cid = chat_with(http, "calc")
    tool_turn(server, cid, "deny")
    _, _, result, answer = server.storage.active_path(cid)
    assert result.content == "The user denied this call." and result.tool_meta["outcome"] == "denied"
    assert answer.state == "done"
    # regenerating the answer after the round is not a first round again (max rounds: 1)
    frames = tool_turn(server, cid, None, {"action": "regenerate", "message_id": answer.id})
    assert asked(frames) == 0
    again = server.storage.active_path(cid)[-1]
    assert again.id != answer.id and again.parent_id == result.id and not again.tool_calls


def test_a_failing_tools_error_reaches_the_model(server, http):
    cid = chat_with(http, "broken")
    tool_turn(server, cid, "once")
    path = server.storage.active_path(cid)
    result = path[2]
    assert "the tool failed on purpose" in result.content and result.tool_meta["outcome"] == "error"
    prompt = engine_messages({}, path[:-1])  # what the last answer was generated from
    assert prompt[-1] == {"role": "tool", "content": result.content,
                          "tool_call_id": result.tool_call_id}


def test_stop_cancels_the_running_tool_and_the_turn(server, http):
    cid = chat_with(http, "slow")
    frames = tool_turn(server, cid, "once", stop_on="Running sleep", timeout=30)
    assert any("Running sleep" in f for f in frames)
    path = server.storage.active_path(cid)
    assert [m.role for m in path] == ["user", "assistant", "tool"]  # no answer after Stop
    assert path[-1].tool_meta["outcome"] == "stopped"


def test_stop_while_asked_denies_and_ends_the_turn_and_a_new_page_sees_the_question(server, http):
    cid = chat_with(http, "calc")
    with connect(ws_url(server, cid), origin=server.url) as ws:
        ws.recv(timeout=60)
        ws.send(json.dumps({"action": "send", "content": "What is 2 + 3?"}))
        while 'class="allow-once"' not in ws.recv(timeout=120):
            pass
        with connect(ws_url(server, cid), origin=server.url) as again:  # a reload meanwhile
            assert 'class="allow-once"' in again.recv(timeout=60)
        ws.send(json.dumps({"action": "stop"}))
        while 'id="send"' not in ws.recv(timeout=30):
            pass
    path = server.storage.active_path(cid)
    assert [m.role for m in path] == ["user", "assistant", "tool"]
    assert path[-1].tool_meta["outcome"] == "stopped"


def test_a_failed_server_is_shown_and_does_not_block_the_chat(server, http):
    cid = chat_with(http, "crash", "calc")
    tool_turn(server, cid, "once")
    assert [m.role for m in server.storage.active_path(cid)] == \
        ["user", "assistant", "tool", "assistant"]
    panel = http.get(f"/c/{cid}/tools").text
    crash = re.search(r'data-server="crash" data-state="(\w+)".*?</fieldset>', panel, re.S)
    assert crash.group(1) == "failed" and "boom" in crash.group(0)
    retried = http.post(f"/c/{cid}/tools/servers/retry", data={"name": "crash"}).text
    assert 'data-server="crash" data-state="starting"' in retried  # started again (it fails again)
    assert 'data-server="calc" data-state="ready"' in panel


def test_settings_add_servers_only_when_local_and_never_show_secrets(server, http, logs):
    cid = new_conversation(http)
    pasted = json.dumps({"mcpServers": {"extra": stdio_entry("add", env={"K": SECRET_ENV})}})
    server.app.state.mcp_edit = False
    try:
        r = http.post("/settings/mcp/servers", data={"config": pasted})
        assert r.status_code == 403 and "--allow-remote" in r.text
        assert "edit <code>" in http.get("/settings").text
        for action in ("remove", "trust"):
            assert http.post(f"/settings/mcp/servers/{action}",
                             data={"name": "calc", "trusted": "on"}).status_code == 403
    finally:
        server.app.state.mcp_edit = True
    r = http.post("/settings/mcp/servers", data={"config": "{broken"})
    assert r.status_code == 400 and "Not added: not JSON" in r.text
    r = http.post("/settings/mcp/servers", data={"config": pasted})
    assert r.status_code == 200 and 'data-server="extra"' in r.text
    saved = json.loads((server.storage.path.parent / "mcp.json").read_text())
    assert saved["mcpServers"]["extra"]["env"] == {"K": SECRET_ENV}  # the file keeps it
    r = http.post("/settings/mcp/servers/trust", data={"name": "extra", "trusted": "on"})
    assert r.status_code == 200 and "Stop trusting" in r.text
    saved = json.loads((server.storage.path.parent / "mcp.json").read_text())
    assert saved["mcpServers"]["extra"]["trusted"] is True
    assert http.post("/settings/mcp/servers/trust", data={"name": "nope"}).status_code == 400
    r = http.post("/settings/mcp/servers/remove", data={"name": "extra"})
    assert r.status_code == 200 and 'data-server="extra"' not in r.text
    assert "extra" not in json.loads((server.storage.path.parent / "mcp.json").read_text())["mcpServers"]
    for text in (r.text, http.get(f"/c/{cid}/tools").text, http.get("/settings").text,
                 "\n".join(logs.text)):
        assert SECRET_ENV not in text and SECRET_TOKEN not in text


def test_tool_results_and_names_are_escaped_never_markup():
    from app.ui.markdown import render_tool_calls, render_tool_result

    shown = render_tool_result('<img src=x onerror="alert(1)"><script>x()</script>', "c1",
                               {"tool": "<b>t</b>", "outcome": "<i>error</i>", "truncated": True})
    assert "<img" not in shown and "<script" not in shown and "<b>" not in shown
    assert "&lt;img" in shown and "(truncated)" in shown
    call = render_tool_calls([{"id": "c1", "function": {"name": "add", "arguments": "{}"}}],
                             {"c1": {"server": "<svg onload=x()>", "tool": "add"}})
    assert "<svg" not in call and "&lt;svg" in call
    # what an imported file may hold instead of the shapes mlxchat writes
    calls = [{"id": "c1", "function": {"name": "add", "arguments": "{}"}}]
    for odd in ([1], "x", {"c1": [1]}, {"c1": "x"}):
        assert "Tool call: <code>add" in render_tool_calls(calls, odd)
    assert "Tool result" in render_tool_result("r", "c1", ["odd"])


def test_only_standing_approvals_and_trusted_read_only_tools_skip_the_question():
    from app.mcp.approval import standing
    from app.mcp.config import ServerConfig
    from app.mcp.servers import ToolInfo
    from app.storage import McpChoice

    reader = ToolInfo("s", "read", "", {}, read_only=True)
    writer = ToolInfo("s", "write", "", {}, read_only=False)
    trusted, plain = ServerConfig("s", command="x", trusted=True), ServerConfig("s", command="x")
    assert standing(reader, McpChoice(), trusted) and not standing(writer, McpChoice(), trusted)
    assert not standing(reader, McpChoice(), plain)
    assert standing(writer, McpChoice(always=("s/write",)), plain)
