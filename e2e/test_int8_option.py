"""Settings › Model's int8-activation checkbox in a real Chromium: on the CPU kernels it reloads
the bundled model on the int8 path (the progress above, then the path named) and back."""

import time

import httpx
from playwright.sync_api import Page, expect

from chat_page import new_chat, send, wait_answer


def test_the_int8_checkbox_reloads_the_model_and_names_the_path(page: Page, server, shot):
    cid = new_chat(page, max_tokens=6)
    page.click("#open-settings")
    box, path = page.locator("#int8-activations"), page.locator("#model-settings .compute-path")
    expect(box).not_to_be_checked()
    expect(path).to_contain_text("quantized CPU kernels (")
    expect(path).not_to_contain_text("int8 activations")
    try:
        with page.expect_response("**/models/options") as posted:
            box.check()
        assert 'class="progress"' in posted.value.text()  # loading, as a model switch shows it
        expect(path).to_contain_text("int8 activations)")
        expect(page.locator("#int8-activations")).to_be_checked()
        shot(page, "int8-activations-on")
        page.goto(f"/c/{cid}")
        send(page, "Hi!")
        expect(wait_answer(page).locator(".body")).not_to_be_empty()
        page.click("#open-settings")
        page.locator("#int8-activations").uncheck()
        expect(path).not_to_contain_text("int8 activations")
        expect(page.locator("#int8-activations")).not_to_be_checked()
    finally:  # the session's other tests expect the exact path, loaded
        with httpx.Client(base_url=server.url, timeout=120) as http:
            deadline = time.time() + 120
            while time.time() < deadline:
                health = http.get("/health").json()
                if health["status"] == "ok" and "int8" not in health["device"]["compute_path"]:
                    break
                if health["status"] == "ok":
                    http.post("/models/options", data={})
                time.sleep(0.2)
