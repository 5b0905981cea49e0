"""Issue 24 M3 in a real Chromium against a real server: a message larger than the chat socket's
frame limit is not sent; a notice says why, the composer keeps the text, and the chat still
works (before, the server closed the socket under it and the page's chat stayed dead)."""

from playwright.sync_api import Page, expect

from app.security.socket_limits import WS_MAX_BYTES
from chat_page import last, new_chat, send, wait_answer


def test_an_oversized_message_gets_a_notice_and_the_chat_keeps_working(page: Page, shot):
    new_chat(page, max_tokens=4)
    big = "x" * (WS_MAX_BYTES + 1000)
    page.fill("#prompt", big)
    page.press("#prompt", "Enter")
    expect(page.locator("#notice")).to_contain_text("too large to send")
    assert page.input_value("#prompt") == big  # nothing lost
    expect(page.locator("#messages article.user")).to_have_count(0)
    shot(page, "60-oversized-message")
    send(page, "Hi")
    expect(last(page, "user")).to_contain_text("Hi")
    wait_answer(page)
