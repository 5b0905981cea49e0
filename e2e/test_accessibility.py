"""The chat page and the Settings page under axe-core's rules, light and dark, wide and narrow:
no violation (e2e/accessibility.py); and their controls reachable from the keyboard."""

import pytest
from playwright.sync_api import expect

from accessibility import violations
from chat_page import new_chat, send, wait_answer


@pytest.mark.parametrize("scheme, width", [("light", 1200), ("dark", 390)])
def test_the_chat_and_settings_pages_have_no_axe_violations(new_page, scheme, width):
    page = new_page(viewport={"width": width, "height": 800}, color_scheme=scheme)
    new_chat(page, max_tokens=4)
    send(page, "Hello!")
    wait_answer(page)
    for panel in ("#model-menu", "#settings"):  # the header's menus, open
        page.click(f"{panel} summary")
        assert violations(page) == [], panel
        page.click(f"{panel} summary")
    page.click("#open-settings")
    expect(page.locator("#settings-page h1")).to_have_text("Settings")
    assert violations(page) == []
    # every control of Settings is reached with Tab, in order, the back link first
    page.keyboard.press("Tab")
    expect(page.locator("#back-to-chats")).to_be_focused()
    seen = set()
    for _ in range(60):
        page.keyboard.press("Tab")
        seen.add(page.evaluate("document.activeElement.id || document.activeElement.name || ''"))
    assert {"download-spec", "import-file", "theme-toggle"} <= seen, seen
