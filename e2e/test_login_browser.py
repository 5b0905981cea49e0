"""Logging in and out in a real Chromium against a server started with an API key."""

import re

import pytest
from playwright.sync_api import Browser, expect

from live_server import ServerProcess

KEY = "e2e-s3cret"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("e2e-login") / "home", api_key=KEY).start()
    yield s
    s.stop()


def test_log_in_then_log_out_needs_the_key_again(browser: Browser, keyed_server, shot):
    context = browser.new_context(base_url=keyed_server.url)
    try:
        page = context.new_page()
        page.goto("/")
        expect(page).to_have_url(re.compile(r"/login"))
        page.fill("#key", KEY)
        page.click("button[type=submit]")
        expect(page.locator("#prompt")).to_be_visible()
        page.click("#open-settings")  # Settings › API key
        logout = page.get_by_role("button", name="Log out")
        expect(logout).to_be_visible()
        shot(page, "login-logged-in")
        logout.click()
        expect(page).to_have_url(re.compile(r"/login$"))
        expect(page.locator("#key")).to_be_visible()
        assert not [c for c in context.cookies() if c["name"] == "mlxchat_session"]
        page.goto("/")  # the chat needs the key again
        expect(page).to_have_url(re.compile(r"/login"))
    finally:
        context.close()
