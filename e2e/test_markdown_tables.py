"""A table in an answer keeps its columns' alignment in the browser, under the page's CSP."""

from playwright.sync_api import Page, expect

from app.storage import Storage
from chat_page import last, new_chat


def test_table_columns_are_aligned_as_the_markdown_says(page: Page, server):
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    cid = new_chat(page)
    storage = Storage(server.home / "data" / "mlxchat.db")
    user = storage.add_message(cid, None, "user", "A table, please.")
    storage.add_message(cid, user.id, "assistant",
                        "| left | right | center | plain |\n|:--|--:|:-:|---|\n| a | 1 | x | p |")
    storage.close()
    page.reload()
    cells = last(page, "assistant").locator(".body td")
    expect(cells).to_have_count(4)
    aligns = cells.evaluate_all("cells => cells.map(c => getComputedStyle(c).textAlign)")
    assert aligns[:3] == ["left", "right", "center"] and aligns[3] in ("start", "left"), aligns
    assert not errors, errors
