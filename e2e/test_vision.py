"""An image in real Chromium against a real server (127.0.0.1) running a tiny random-weight
Qwen2.5-VL: paste it into the composer, see its thumbnail, get an answer, reload and see it
again, click it to open it full size."""

import io
import os

import pytest
from playwright.sync_api import Page, expect

pytest.importorskip("mlx_vlm")

from chat_page import last, new_chat, send, wait_answer  # noqa: E402
from live_server import MODEL_HOME, engine_serving  # noqa: E402

os.environ.setdefault("MLXCHAT_HOME", str(MODEL_HOME))  # the shared tiny-model cache

from bench.vlm_shapes import random_image, tiny_qwen2_5_vl  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """This module's own server: the tiny vision model (the session's serves the bundled one)."""
    with engine_serving(tmp_path_factory.mktemp("e2e-vision"), tiny_qwen2_5_vl()) as s:
        yield s


def png() -> list[int]:
    out = io.BytesIO()
    random_image(5, (96, 64)).save(out, format="PNG")
    return list(out.getvalue())


def loaded(image) -> bool:
    return image.evaluate("img => img.complete && img.naturalWidth > 0")


def test_paste_an_image_see_it_get_an_answer_and_see_it_after_a_reload(page: Page, server):
    cid = new_chat(page, max_tokens=4)
    page.focus("#prompt")
    page.evaluate("""bytes => {
        const list = new DataTransfer();
        list.items.add(new File([new Uint8Array(bytes)], "screenshot.png", {type: "image/png"}));
        document.getElementById("prompt").dispatchEvent(
            new ClipboardEvent("paste", {clipboardData: list, bubbles: true, cancelable: true}));
    }""", png())
    chip = page.locator("#attachments .chip.ready")
    expect(chip).to_contain_text("screenshot.png")
    expect(chip).to_contain_text("96×64")
    thumb = chip.locator("img.thumb")
    expect(thumb).to_be_visible()
    assert loaded(thumb)

    send(page, "What is in this picture?")
    wait_answer(page)
    user = last(page, "user")
    expect(user.locator("img.thumb")).to_be_visible()
    expect(last(page, "assistant").locator(".body")).not_to_be_empty()
    expect(page.locator(".notice-text")).to_have_count(0)

    page.reload()
    again = last(page, "user").locator("img.thumb")
    expect(again).to_be_visible()
    assert loaded(again)
    with page.expect_popup() as popup:
        again.click()
    full = popup.value
    full.wait_for_load_state()
    assert full.url.endswith("/image") and f"/c/{cid}/uploads/" in full.url
    assert full.evaluate("document.images.length && document.images[0].naturalWidth") == 96
