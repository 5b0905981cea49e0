"""The chat UI in a real Chromium against a real server running the bundled model."""

import re
from pathlib import Path

from playwright.sync_api import expect

from app.storage import Storage
from accessibility import violations
from chat_page import last, new_chat, send, wait_answer

LONG = "Write a very long story about a dragon who learns to cook."
STATS = re.compile(r"reused (\d+) of (\d+) prompt tokens · TTFT \d+ ms")


# Records every distinct text of the newest answer as the page changes, so that what the
# test sees does not depend on how fast it polls (a screenshot can miss a dozen tokens).
RECORD_RENDERINGS = """() => {
    window.renderings = [];
    new MutationObserver(() => {
        const body = [...document.querySelectorAll('#messages article.assistant .body')].pop();
        const text = body ? body.innerText : '';
        if (text.trim() && text !== window.renderings.at(-1)) window.renderings.push(text);
    }).observe(document.body, {childList: true, subtree: true, characterData: true});
}"""


def test_answer_streams_in_token_by_token(page, shot):
    new_chat(page, max_tokens=64)  # long enough to span several of the server's flushes
    page.evaluate(RECORD_RENDERINGS)
    send(page, LONG)
    expect(last(page, "user")).to_contain_text(LONG)
    expect(page.locator("#prompt")).to_have_value("")  # the composer is cleared
    answer = last(page, "assistant")
    expect(answer.locator(".body")).not_to_be_empty()
    shot(page, "01-streaming")
    expect(answer).to_have_attribute("data-state", "done")
    seen: list[str] = page.evaluate("window.renderings")
    assert len(seen) >= 3, seen  # several partial renderings before the end
    assert len(seen[0]) < len(seen[-1])  # (markdown may reflow text in between)
    expect(answer.locator(".stats")).to_contain_text(STATS)
    expect(page.locator("#send")).to_be_visible()
    shot(page, "02-answered")


def test_stop_keeps_the_partial_answer_and_the_next_message_works(page, shot):
    new_chat(page, max_tokens=400)
    send(page, LONG)
    answer = last(page, "assistant")
    expect(answer.locator(".body")).not_to_be_empty()
    page.press("#prompt", "Escape")  # keyboard Stop
    expect(answer).to_have_attribute("data-state", "stopped")
    partial = answer.locator(".body").inner_text()
    assert partial.strip()
    expect(answer.locator(".status.stopped")).to_have_text("stopped")
    shot(page, "03-stopped")

    send(page, "Thanks! Now a short poem.")
    second = last(page, "assistant")
    expect(second.locator(".body")).not_to_be_empty()
    page.click("#stop")
    expect(second).to_have_attribute("data-state", "stopped")
    expect(page.locator("#messages article.assistant").first.locator(".body")).to_have_text(partial)


def test_edit_last_message_reuses_the_cached_prefix_and_keeps_versions(page, shot):
    new_chat(page, max_tokens=8)
    send(page, "Hi there!")
    wait_answer(page)
    last(page, "user").locator("button.edit").click()
    page.fill("article.editing textarea", "Hello there, friend!")
    page.press("article.editing textarea", "Enter")
    expect(last(page, "user").locator(".body")).to_have_text("Hello there, friend!")
    answer = wait_answer(page)
    reused, total = map(int, STATS.search(answer.locator(".stats").inner_text()).groups())
    assert 0 < reused < total
    expect(last(page, "user").locator(".version")).to_have_text("2/2")
    shot(page, "04-edited")

    last(page, "user").locator("button.prev").click()
    expect(last(page, "user").locator(".body")).to_have_text("Hi there!")
    expect(last(page, "user").locator(".version")).to_have_text("1/2")


def test_regenerate_switch_versions_and_reload(page, shot):
    cid = new_chat(page, max_tokens=8)
    page.click("#settings summary")
    page.fill("input[name=temperature]", "1.5")  # so that the two versions differ
    page.click("#settings-form button[type=submit]")
    expect(page.locator("#settings-form .saved")).to_be_visible()
    page.click("#settings summary")
    send(page, "Tell me a joke.")
    first = wait_answer(page).locator(".body").inner_text()
    last(page, "assistant").locator("button.regenerate").click()
    expect(last(page, "assistant").locator(".version")).to_have_text("2/2")
    wait_answer(page)
    second = last(page, "assistant").locator(".body").inner_text()

    last(page, "assistant").locator("button.prev").click()
    expect(last(page, "assistant").locator(".version")).to_have_text("1/2")
    expect(last(page, "assistant").locator(".body")).to_have_text(first)
    last(page, "assistant").locator("button.next").click()
    expect(last(page, "assistant").locator(".version")).to_have_text("2/2")
    shot(page, "05-versions")

    page.reload()
    expect(page).to_have_url(re.compile(f"/c/{cid}$"))
    expect(page.locator("#chat-title")).to_have_text("Tell me a joke.")
    expect(page.locator(".conversation.current a")).to_have_text("Tell me a joke.")
    expect(last(page, "assistant").locator(".body")).to_have_text(second)
    expect(last(page, "assistant").locator(".version")).to_have_text("2/2")
    page.click("#settings summary")
    expect(page.locator("input[name=temperature]")).to_have_value("1.5")


def test_settings_are_validated_with_clear_messages(page, shot):
    new_chat(page)
    page.click("#settings summary")
    for field, value, message in [
        ("temperature", "hot", "Temperature must be a number."),
        ("temperature", "9", "temperature must be in [0, 5]"),
        ("top_k", "2.5", "Top k must be a whole number."),
        ("max_tokens", "0", "max_tokens must be a positive integer"),
    ]:
        page.fill(f"input[name={field}]", value)
        page.click("#settings-form button[type=submit]")
        expect(page.locator("#settings-form .field-error")).to_contain_text(message)
        expect(page.locator(f"input[name={field}]")).to_have_attribute("aria-invalid", "true")
        page.fill(f"input[name={field}]", {"temperature": "0", "top_k": "0", "max_tokens": "12"}[field])
    shot(page, "06-settings-error")
    page.fill("textarea[name=system_prompt]", "You are terse.")
    page.click("#settings-form button[type=submit]")
    expect(page.locator("#settings-form .saved")).to_be_visible()
    page.reload()
    page.click("#settings summary")
    expect(page.locator("textarea[name=system_prompt]")).to_have_value("You are terse.")


def test_model_output_cannot_inject_script(page, server, shot):
    cid = new_chat(page)
    storage = Storage(server.home / "data" / "mlxchat.db")
    user = storage.add_message(cid, None, "user", "Show me some HTML.")
    storage.add_message(cid, user.id, "assistant",
                        '<script>window.pwned = 1; alert("xss")</script>\n\n'
                        '<img src=x onerror="window.pwned = 2">\n\n[click](javascript:window.pwned=3)')
    storage.close()
    page.reload()
    body = last(page, "assistant").locator(".body")
    expect(body).to_contain_text('<script>window.pwned = 1; alert("xss")</script>')
    expect(body).to_contain_text('<img src=x onerror="window.pwned = 2">')
    assert page.locator("#messages script, #messages img, #messages a[href^=javascript]").count() == 0
    assert page.evaluate("window.pwned") is None
    shot(page, "07-script-as-text")

    # And straight from the model, streamed over the socket.
    send(page, "Repeat exactly: <script>alert('xss')</script>")
    wait_answer(page)
    assert page.locator("#messages script").count() == 0


def test_sidebar_search_rename_delete_and_keyboard(page, prompt_answer):
    new_chat(page, max_tokens=4)
    send(page, "Zebra facts please")
    wait_answer(page)
    page.keyboard.press("Control+k")
    expect(page.locator("#search")).to_be_focused()
    page.keyboard.type("zebra")
    expect(page.locator("#conversation-list .conversation")).to_have_count(1)
    expect(page.locator("#conversation-list")).to_contain_text("Zebra facts please")
    page.fill("#search", "no-such-words-anywhere")
    expect(page.locator("#conversation-list")).to_contain_text("No conversation matches")

    page.reload()
    page.locator(".conversation.current button.rename").click()  # prompt answered by the fixture
    expect(page.locator("#chat-title")).to_have_text(prompt_answer)
    expect(page.locator(".conversation.current a")).to_have_text(prompt_answer)
    expect(page).to_have_title(f"{prompt_answer} · mlxchat")  # the tab follows

    page.locator("#prompt").focus()
    page.keyboard.press("Control+Shift+O")
    expect(page.locator("#empty-chat")).to_be_visible()
    page.goto("/")
    entry = page.locator(".conversation", has_text=prompt_answer)
    entry.hover()
    entry.locator("button.delete").click()  # the confirm dialog is accepted by the fixture
    expect(page.locator("#conversation-list")).not_to_contain_text(prompt_answer)


def test_narrow_dark_layout(new_page, shot):
    page = new_page(viewport={"width": 390, "height": 780}, color_scheme="dark")
    new_chat(page, max_tokens=6)
    send(page, "Hello! Reply with a code block.")
    wait_answer(page)
    expect(page.locator("#sidebar")).not_to_be_in_viewport()
    bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert bg == "rgb(23, 23, 23)"
    shot(page, "08-narrow-dark")
    page.click("#sidebar-toggle")
    expect(page.locator("#sidebar")).to_be_in_viewport()
    shot(page, "09-narrow-sidebar")
    # the open sidebar covers its toggle: Escape or a tap beside it closes it
    page.keyboard.press("Escape")
    expect(page.locator("#sidebar")).not_to_be_in_viewport()
    page.click("#sidebar-toggle")
    expect(page.locator("#sidebar")).to_be_in_viewport()
    page.mouse.click(380, 400)  # the chat, beside the sidebar
    expect(page.locator("#sidebar")).not_to_be_in_viewport()
    page.click("#settings summary")  # the settings panel fits the screen, scrolling inside
    form = page.locator("#settings-form")
    expect(form).to_be_visible()
    box = form.bounding_box()
    assert box["y"] + box["height"] <= 780, box
    expect(form.locator("button[type=submit]")).to_be_visible()
    page.click("#settings summary")
    # the composer and the conversation keep the window's whole width
    for part in (".composer", "#messages"):
        assert page.locator(part).bounding_box()["width"] >= 380, part
    assert page.locator("#prompt").bounding_box()["width"] >= 200
    # the sidebar holds the chats and search only; the rest is in Settings
    page.click("#sidebar-toggle")
    assert page.locator("#sidebar button, #sidebar input, #sidebar a").evaluate_all(
        "els => els.every(e => e.closest('.new-chat, #conversation-list') || e.id === 'search')")
    page.keyboard.press("Escape")
    for menu in ("#model-menu", "#settings"):  # axe-core: no violation, the header's menus open
        page.click(f"{menu} summary")
        assert violations(page) == [], menu
        page.click(f"{menu} summary")
    page.click("#open-settings")
    expect(page.locator("#download-spec")).to_be_visible()
    assert page.locator("#download-spec").bounding_box()["width"] >= 200  # a usable field
    shot(page, "09b-narrow-settings")
    assert violations(page) == []
    page.keyboard.press("Tab")  # every control of Settings is reached with Tab, the way back first
    expect(page.locator("#back-to-chats")).to_be_focused()
    reached = set()
    for _ in range(40):
        page.keyboard.press("Tab")
        reached.add(page.evaluate("document.activeElement.id"))
    assert {"download-spec", "import-file", "theme-toggle"} <= reached, reached
    page.click("#theme-toggle")
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(255, 255, 255)"


def test_switch_model_shows_progress_and_answers_with_it(page, hf_cache: Path, server, shot):
    # A second model: a Hugging Face cache entry holding the bundled model's converted files.
    converted = next((server.home / "cache" / "converted").glob("SmolLM2-135M-Instruct*/config.json")).parent
    snapshot = hf_cache / "models--local--smollm2-copy" / "snapshots" / "main"
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in converted.iterdir():
        if not (snapshot / f.name).exists():
            (snapshot / f.name).symlink_to(f)
    new_chat(page, max_tokens=6)
    page.click("#model-menu summary")
    other = page.locator("#models button.model", has_text="local/smollm2-copy")
    expect(other).to_be_enabled()
    with page.expect_response("**/models/switch") as switched:
        other.click()
    # The load may end before a poll could see the progress line, so read it from the response.
    assert 'class="progress"' in switched.value.text()
    assert "local/smollm2-copy" in switched.value.text()
    shot(page, "10-model-loading")
    expect(page.locator("#load-status")).to_contain_text("local/smollm2-copy is ready")
    expect(page.locator("#models button.model.current")).to_contain_text("local/smollm2-copy")
    expect(page.locator("#model-name")).to_have_text("local/smollm2-copy")
    page.click("#model-menu summary")  # close the menu
    send(page, "Hi!")
    expect(wait_answer(page).locator(".stats")).to_contain_text("local/smollm2-copy")
    shot(page, "11-model-switched")
    page.click("#model-menu summary")
    page.locator("#models button.model", has_text="smollm2-135m-instruct").click()
    expect(page.locator("#models button.model.current")).to_contain_text("smollm2-135m-instruct")
