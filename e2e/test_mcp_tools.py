"""MCP tools in Chromium: add the test MCP server in Settings, use it from the Tools panel, ask a question the model
answers with the calculator (the call forced by "The model must call a tool first": the bundled
model is too small to choose to), approve it, see the call, the result and the final answer;
reload and see them again."""

import json
import time

from playwright.sync_api import Page, expect

from chat_page import last, new_chat, send
from mcp_fixtures import stdio_entry


def open_tools(page: Page) -> None:
    page.click("#tools summary")
    expect(page.locator("#tools-form")).to_be_visible()


def wait_ready(page: Page, name: str, timeout_s: float = 60) -> None:
    """Refresh the panel until the server has started."""
    deadline = time.monotonic() + timeout_s
    server = page.locator(f'.mcp-server[data-server="{name}"]')
    while server.get_attribute("data-state") != "ready":
        assert time.monotonic() < deadline, server.inner_text()
        page.evaluate("document.getElementById('tools-panel').dataset.stale = '1'")
        page.click("#tools-form button:has-text('Refresh')")
        expect(page.locator("#tools-panel:not([data-stale])")).to_be_attached()


def test_add_a_server_approve_a_call_and_see_it_after_reload(page: Page, shot):
    cid = new_chat(page, max_tokens=40)
    page.click("#open-settings")  # servers are added in Settings › MCP servers
    pasted = {"mcpServers": {"calc": stdio_entry("add", env={"CALC_KEY": "e2e-secret"})}}
    page.fill("#mcp-add textarea[name=config]", json.dumps(pasted))
    page.click("#mcp-add-button")
    expect(page.locator("#mcp-servers .saved")).to_have_text("Added calc.")
    expect(page.locator("#mcp-servers")).not_to_contain_text("e2e-secret")  # env keys only
    page.goto(f"/c/{cid}")
    open_tools(page)
    wait_ready(page, "calc")
    expect(page.locator('.mcp-server[data-server="calc"] .mcp-tools')).to_contain_text("add")
    expect(page.locator("#tools-panel")).not_to_contain_text("e2e-secret")  # env keys only
    page.check('input[name="server:calc"]')
    page.check("input[name=first_call]")
    page.fill("input[name=max_rounds]", "1")
    page.click("#tools-save")
    expect(page.locator("#tools-panel .saved")).to_have_text("Saved.")
    shot(page, "mcp-panel")
    page.click("#tools summary")  # close the panel

    send(page, "What is 2 + 3? Use the calculator.")
    approval = page.locator("#tool-approval")
    expect(approval.locator(".allow-once")).to_be_visible()
    expect(approval.locator("code.tool")).to_have_text("add")
    expect(approval.locator(".server")).to_have_text("calc")
    shot(page, "mcp-approval")
    approval.locator(".allow-once").click()
    result = page.locator("#messages article.tool").last
    expect(result).to_contain_text("Result of add")
    answer = last(page, "assistant")
    expect(answer).to_have_attribute("data-state", "done")
    expect(page.locator("#send")).to_be_visible()
    call = page.locator("#messages details.tool-call").last
    expect(call).to_contain_text("add on calc")
    call.locator("summary").click()
    args = json.loads(call.locator("pre").inner_text())
    result.locator("summary").click()
    expect(result.locator("pre")).to_have_text(str(args["a"] + args["b"]))
    shot(page, "mcp-result")

    page.reload()
    expect(page.locator("#messages details.tool-call").last).to_contain_text("add on calc")
    expect(page.locator("#messages article.tool").last).to_contain_text("Result of add")
    expect(page.locator("#tool-approval")).to_be_empty()
