"""Attachments, export/import and search in a real Chromium against a real server (bundled model)."""

import json
import re

from playwright.sync_api import Page, expect

from app.storage import Storage, export_conversation
from chat_page import last, new_chat, send, wait_answer

NOTES = "Shopping list\n- quinces\n- 3 leeks\n"


def test_attach_a_file_see_its_tokens_send_and_the_answer_streams(page: Page, server, shot):
    cid = new_chat(page, max_tokens=12)
    page.set_input_files("#attach-file", files=[{"name": "list.md", "mimeType": "text/markdown",
                                                 "buffer": NOTES.encode()}])
    chip = page.locator("#attachments .chip")
    expect(chip).to_contain_text(re.compile(r"list\.md · \d+ tokens"))
    tokens = int(chip.get_attribute("data-tokens"))
    assert 0 < tokens < 40
    # A dropped file goes through the same form; a binary one is refused with its reason.
    page.evaluate("""() => {
        const list = new DataTransfer();
        list.items.add(new File([new Uint8Array([137, 80, 78, 71, 0, 0, 1])], "photo.png"));
        document.getElementById("prompt").dispatchEvent(
            new DragEvent("drop", {dataTransfer: list, bubbles: true, cancelable: true}));
    }""")
    refused = page.locator("#attachments .chip.refused")
    expect(refused).to_contain_text("photo.png: not a text file")
    refused.locator(".remove-chip").click()
    expect(refused).to_have_count(0)
    shot(page, "20-attachment-chip")

    send(page, "What is on the list?")
    expect(page.locator("#attachments .chip")).to_have_count(0)  # the composer is cleared
    user = last(page, "user")
    expect(user.locator(".attachments .chip")).to_contain_text(f"list.md · {tokens} tokens")
    answer = last(page, "assistant")
    expect(answer.locator(".body")).not_to_be_empty()
    wait_answer(page)
    shot(page, "21-attachment-answered")
    storage = Storage(server.home / "data" / "mlxchat.db")
    try:
        first = storage.active_path(cid)[0]
        # The message refers to the upload; its text stays with the file (app/ui/uploads.py).
        assert [(a["name"], a["tokens"], "text" in a) for a in first.attachments] == [("list.md", tokens, False)]
        assert storage.active_path(cid)[1].prompt_tokens > tokens
    finally:
        storage.close()


def test_export_then_import_gives_an_equal_copy_and_search_finds_it(page: Page, server, tmp_path, shot):
    cid = new_chat(page, max_tokens=6)
    send(page, "Tell me about axolotls.")
    wait_answer(page)
    page.click("#export summary")
    with page.expect_download() as json_download:
        page.click("#export-json")
    with page.expect_download() as md_download:
        page.click("#export-md")
    exported = tmp_path / "chat.json"
    json_download.value.save_as(exported)
    md_path = tmp_path / "chat.md"
    md_download.value.save_as(md_path)
    assert "Tell me about axolotls." in md_path.read_text()

    page.click("#open-settings")  # Settings › Import and export
    page.set_input_files("#import-file", str(exported))
    page.click("#import-form button[type=submit]")
    expect(page).to_have_url(re.compile(r"/c/\d+$"))
    expect(page).not_to_have_url(re.compile(f"/c/{cid}$"))
    copy = int(re.search(r"/c/(\d+)", page.url).group(1))
    expect(last(page, "user").locator(".body")).to_have_text("Tell me about axolotls.")
    storage = Storage(server.home / "data" / "mlxchat.db")
    try:
        assert export_conversation(storage, copy) == export_conversation(storage, cid) == \
            json.loads(exported.read_text())
    finally:
        storage.close()
    shot(page, "22-imported")

    page.fill("#search", "axolot")
    results = page.locator("#conversation-list .conversation a")
    expect(results).to_have_count(2)
    expect(results.first).to_have_text("Tell me about axolotls.")
    page.fill("#search", '"axolotls" NEAR(')  # FTS syntax is searched for, not parsed
    expect(results).to_have_count(2)
    page.click("#open-settings")
    page.set_input_files("#import-file", files=[{"name": "bad.json", "mimeType": "application/json",
                                                 "buffer": b"{not json"}])
    page.click("#import-form button[type=submit]")
    expect(page.locator("#import-result")).to_contain_text("Could not import")
