"""Driving the chat page in Playwright, as a person would: open a chat, send, wait for the answer."""

import re

from playwright.sync_api import Page, expect


def open_new_chat(page: Page) -> None:
    """Click "New chat" and wait until the page shows the new, empty conversation."""
    page.goto("/")
    if page.locator("#sidebar-toggle").is_visible():  # narrow window: the sidebar is folded away
        page.click("#sidebar-toggle")
    # New chat may reuse this very (empty) conversation, so wait for the page to be replaced,
    # not for a URL or an empty chat: both can already be there before the click lands.
    page.evaluate("document.getElementById('settings').dataset.stale = '1'")
    page.click("#new-chat")
    expect(page.locator("#settings:not([data-stale])")).to_be_attached()
    expect(page.locator("#empty-chat")).to_be_visible()


def new_chat(page: Page, max_tokens: int = 12) -> int:
    """Open a fresh conversation with greedy sampling and a short answer length."""
    open_new_chat(page)
    page.click("#settings summary")
    expect(page.locator("select[name=preset]")).to_be_visible()
    page.select_option("select[name=preset]", "greedy")
    expect(page.locator("#settings-form .saved")).to_be_visible()
    page.fill("input[name=max_tokens]", str(max_tokens))
    # The preset's "saved" mark is still showing: wait for the form the save sends back.
    page.evaluate("document.getElementById('settings-form').dataset.stale = '1'")
    page.click("#settings-form button[type=submit]")
    expect(page.locator("#settings-form:not([data-stale]) .saved")).to_be_visible()
    expect(page.locator("input[name=max_tokens]")).to_have_value(str(max_tokens))
    page.click("#settings summary")  # close the panel
    return int(re.search(r"/c/(\d+)", page.url).group(1))


def send(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last(page: Page, role: str):
    return page.locator(f"#messages article.{role}").last


def wait_answer(page: Page, state: str = "done"):
    answer = last(page, "assistant")
    expect(answer).to_have_attribute("data-state", state)
    return answer
