"""Images in the chat UI on a real server (127.0.0.1) running a tiny random-weight Qwen2.5-VL:
an image uploaded through the one upload endpoint is an `image` upload (told by its bytes), shown
as a thumbnail in its chip and in the conversation, served re-encoded without EXIF, and sent with a
turn as image parts (its tokens counted, a follow-up reusing its prefill); a corrupt image is
refused with a reason and its bytes removed."""

import base64
import hashlib
import io
import json
import time

import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image  # noqa: E402

from live_server import engine_serving, new_conversation, turn  # noqa: E402
from bench.vlm_shapes import random_image, tiny_qwen2_5_vl  # noqa: E402

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with engine_serving(tmp_path_factory.mktemp("vision-ui"), tiny_qwen2_5_vl()) as s:
        yield s


def jpeg_with_gps() -> bytes:
    """An 80x60 JPEG whose EXIF says "rotate 90 degrees" and carries a GPS position."""
    exif = Image.Exif()
    exif[0x0112] = 6
    exif[0x8825] = {2: (48.0, 51.0, 0.0)}
    out = io.BytesIO()
    random_image(3, (80, 60)).save(out, format="JPEG", exif=exif)
    return out.getvalue()


def upload(http, cid: int, name: str, body: bytes) -> dict:
    r = http.post(f"/c/{cid}/uploads", params={"name": name}, content=body)
    assert r.status_code == 201, r.text
    deadline = time.monotonic() + 60
    got = r.json()
    while got["status"] == "reading" and time.monotonic() < deadline:
        time.sleep(0.05)
        got = http.get(f"/c/{cid}/uploads/{got['id']}").json()
    return got


def test_an_image_upload_is_shown_without_exif_and_answered(http, server):
    cid = new_conversation(http, max_tokens=4)
    up = upload(http, cid, "photo.jpg", jpeg_with_gps())
    assert up["kind"] == "image" and up["status"] == "ready"
    assert up["summary"] == "60×80"  # the EXIF orientation applied
    chip = http.get(f"/c/{cid}/uploads/{up['id']}", headers={"HX-Request": "true"}).text
    assert f'src="/c/{cid}/uploads/{up["id"]}/image?thumb=1"' in chip

    full = http.get(f"/c/{cid}/uploads/{up['id']}/image")
    assert full.headers["content-type"] == "image/png"
    shown = Image.open(io.BytesIO(full.content))
    assert shown.size == (60, 80) and not shown.getexif() and "exif" not in shown.info
    thumb = Image.open(io.BytesIO(http.get(f"/c/{cid}/uploads/{up['id']}/image?thumb=1").content))
    assert max(thumb.size) <= 256

    frames = turn(server, cid, action="send", content="What is in this photo?",
                  uploads=[str(up["id"])])
    assert "cannot see images" not in "".join(frames)
    user, answer = [m for m in server.storage.active_path(cid)][-2:]
    assert user.attachments[0]["kind"] == "image" and answer.state == "done", answer.error
    assert answer.prompt_tokens > 20 and answer.completion_tokens == 4  # the image's tokens counted
    page = http.get(f"/c/{cid}").text
    assert f'src="/c/{cid}/uploads/{up["id"]}/image?thumb=1"' in page  # in the conversation

    turn(server, cid, action="send", content="And the colours?")
    follow = server.storage.active_path(cid)[-1]
    assert follow.cached_tokens >= answer.prompt_tokens  # the image came from the prefix cache


def test_a_corrupt_image_is_refused_and_not_kept(http, server):
    cid = new_conversation(http)
    broken = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64
    up = upload(http, cid, "broken.png", broken)
    assert up["status"] == "refused" and "not a readable image" in up["error"]
    assert not (server.app.state.uploads.folder / hashlib.sha256(broken).hexdigest()).exists()
    assert http.get(f"/c/{cid}/uploads/{up['id']}/image").status_code == 404


def test_export_carries_the_images_and_import_restores_them(http, server):
    cid = new_conversation(http, max_tokens=2)
    up = upload(http, cid, "photo.jpg", jpeg_with_gps())
    turn(server, cid, action="send", content="What is it?", uploads=[str(up["id"])])
    markdown = http.get(f"/c/{cid}/export.md")
    assert markdown.status_code == 200 and "Attached: photo.jpg" in markdown.text
    exported = http.get(f"/c/{cid}/export.json").json()
    user = next(m for m in exported["messages"] if m["role"] == "user")
    assert not any("upload" in a for a in user["attachments"] or [])  # ids mean nothing elsewhere
    assert [i["name"] for i in user["images"]] == ["photo.jpg"]
    url = user["images"][0]["data_url"]
    assert url.startswith("data:image/png;base64,")
    pixels = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert pixels.size == (60, 80) and not pixels.getexif()  # oriented, no EXIF (no GPS)

    r = http.post("/import", files={"file": ("c.json", json.dumps(exported), "application/json")},
                  follow_redirects=False)
    assert r.status_code == 303, r.text
    new = int(r.headers["location"].rsplit("/", 1)[1])
    restored = next(m for m in server.storage.active_path(new) if m.role == "user")
    ref = restored.attachments[0]
    assert ref["kind"] == "image" and ref["name"] == "photo.jpg"
    shown = http.get(f"/c/{new}/uploads/{ref['upload']}/image")
    assert shown.status_code == 200
    assert Image.open(io.BytesIO(shown.content)).tobytes() == pixels.convert("RGB").tobytes()
    frames = turn(server, new, action="send", content="And now?")  # the imported image is used
    answer = server.storage.active_path(new)[-1]
    assert answer.state == "done", "".join(frames)[-300:]
    first = server.storage.active_path(cid)[-1]
    assert answer.prompt_tokens > first.prompt_tokens  # the image's tokens are in it again


def test_a_text_only_model_says_it_cannot_see_the_image(tmp_path):
    """In the chat and through the API (400 `model_not_vision`, naming the field)."""
    import httpx

    from tiny_models import tiny_llama

    text_model = tiny_llama()
    with engine_serving(tmp_path, text_model) as text_only:
        with httpx.Client(base_url=text_only.url, timeout=60) as client:
            cid = new_conversation(client)
            up = upload(client, cid, "photo.jpg", jpeg_with_gps())
            frames = "".join(turn(text_only, cid, action="send", content="What is it?",
                                  uploads=[str(up["id"])]))
            url = "data:image/jpeg;base64," + base64.b64encode(jpeg_with_gps()).decode()
            r = client.post("/v1/chat/completions", json={
                "model": text_model.name, "max_tokens": 2, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is it?"}]}]})
    assert "cannot see images" in frames
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "model_not_vision" and error["param"] == "messages[0].content"
    assert "cannot see images" in error["message"]
