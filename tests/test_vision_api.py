"""Images through every API shape on a real server (127.0.0.1, one per module) running a tiny
random-weight Qwen2.5-VL (bench/vlm_shapes.py): OpenAI `image_url` data URLs (the openai SDK),
Anthropic `image` blocks (the anthropic SDK), Ollama `images`, Responses `input_image`; the same
limits and clear 4xx errors everywhere (app/api/images.py). (A text-only model's refusal:
tests/test_vision_ui.py.)"""

import base64
import io

import httpx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image  # noqa: E402

from app.api import images as images_api  # noqa: E402
from app.api.errors import ApiError  # noqa: E402
from app.api.images import MAX_IMAGES, decode_image  # noqa: E402
from engine.decoding.generate import build_prompt  # noqa: E402
from engine.decoding.vision import ImageInput  # noqa: E402
from live_server import anthropic_client, engine_serving, openai_client  # noqa: E402
from bench.vlm_shapes import random_image, tiny_qwen2_5_vl  # noqa: E402

pytestmark = pytest.mark.fast


def png(seed: int = 0, size=(80, 60)) -> bytes:
    out = io.BytesIO()
    random_image(seed, size).save(out, format="PNG")
    return out.getvalue()


def data_url(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(raw).decode()


def image_message(url: str, text: str = "What is in this image?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def prompt_tokens(lm, seed: int, text: str) -> int:
    """Tokens of a one-image question, as the engine counts them (the image's tokens included)."""
    return len(build_prompt(lm, messages=[{"role": "user", "content": [
        {"type": "image", "image": ImageInput.from_pil(random_image(seed))},
        {"type": "text", "text": text}]}]).tokens)


@pytest.fixture(scope="module")
def lm():
    return tiny_qwen2_5_vl()


@pytest.fixture(scope="module")
def server(lm, tmp_path_factory):
    with engine_serving(tmp_path_factory.mktemp("vision-api"), lm=lm) as s:
        yield s


def test_openai_image_url_answers_and_counts_the_image_tokens(server, lm):
    client = openai_client(server)
    messages = image_message(data_url(png(0)))
    first = client.chat.completions.create(model=lm.name, messages=messages, max_tokens=5,
                                           temperature=0)
    assert first.choices[0].message.content and first.usage.completion_tokens == 5
    expected = prompt_tokens(lm, 0, "What is in this image?")
    assert first.usage.prompt_tokens == expected  # the image's tokens counted
    # a follow-up about the same image reuses its prefill
    follow = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And its colours?"}]
    second = client.chat.completions.create(model=lm.name, messages=follow, max_tokens=3,
                                            temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > expected - 3


def test_models_list_the_vision_capability(server, lm):
    listed = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert "vision" in next(m for m in listed if m.get("capabilities"))["capabilities"]
    shown = httpx.post(f"{server.url}/api/show", json={"model": lm.name}).json()
    assert "vision" in shown["capabilities"]


def test_anthropic_ollama_and_responses_take_images(server, lm):
    raw = png(1)
    b64 = base64.b64encode(raw).decode()
    client = anthropic_client(server, timeout=60)
    answer = client.messages.create(model=lm.name, max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        {"type": "text", "text": "Describe it."}]}])
    expected = prompt_tokens(lm, 1, "Describe it.")
    assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) == expected
    assert answer.content[0].text

    r = httpx.post(f"{server.url}/api/chat", timeout=60, json={
        "model": lm.name, "stream": False, "options": {"num_predict": 4},
        "messages": [{"role": "user", "content": "Describe it.", "images": [b64]}]})
    assert r.status_code == 200 and r.json()["done"], r.text
    # Ollama counts the tokens it evaluated: the same image and text as the Anthropic request
    # (Ollama puts images before the text), so its image came from the prefix cache
    assert r.json()["prompt_eval_count"] < expected - 4

    responses = openai_client(server).responses
    first = responses.create(model=lm.name, max_output_tokens=4, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(raw)},
        {"type": "input_text", "text": "Describe it."}]}])
    assert first.usage.input_tokens == expected
    # the stored conversation keeps the image: a follow-up by previous_response_id sees it
    second = responses.create(model=lm.name, max_output_tokens=2, input="More?",
                              previous_response_id=first.id)
    assert second.usage.input_tokens > first.usage.input_tokens


BAD = [
    ("http URL", "https://example.com/cat.png", "image_url_not_allowed"),
    ("SVG", data_url(b'<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml"),
     "unsupported_image_format"),
    ("0 bytes", "data:image/png;base64,", "invalid_image"),
    ("corrupt", data_url(png(0)[:40]), "invalid_image"),
    ("not base64", "data:image/png;base64,@@@", "invalid_image"),
    ("a BMP", None, "unsupported_image_format"),
]


@pytest.mark.parametrize("name,url,code", BAD, ids=[b[0] for b in BAD])
def test_bad_images_are_clear_4xx(server, lm, name, url, code):
    if url is None:
        out = io.BytesIO()
        random_image(0).save(out, format="BMP")
        url = data_url(out.getvalue(), "")
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": lm.name, "max_tokens": 2, "messages": image_message(url)})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["param"] == "messages[0].content"


def test_too_many_images_and_the_pixel_limit(server, lm, monkeypatch):
    url = data_url(png(0, (16, 16)))
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": lm.name, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}] * (MAX_IMAGES + 1)}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_images"
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # a bomb, by Pillow's own limit
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": lm.name, "max_tokens": 2, "messages": image_message(data_url(png(0)))})
    assert r.status_code == 400 and r.json()["error"]["code"] == "image_too_large"


def test_exif_orientation_applied_and_stripped():
    out = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: shown 90 degrees clockwise
    exif[0x8825] = {2: (48.0, 51.0, 0.0)}  # GPS latitude
    random_image(0, (80, 60)).save(out, format="JPEG", exif=exif)
    image = decode_image(out.getvalue(), "image")
    assert image.image.size == (60, 80)
    assert not image.image.info.get("exif") and not image.image.getexif()
    with pytest.raises(ApiError) as err:
        decode_image(b"GIF89a\x01", "image")
    assert err.value.status == 400


def test_image_tokens_count_where_the_context_is_checked(server, lm):
    """`count_tokens`, which the context check and "truncate oldest" use (app/context_window.py),
    counts an image's tokens; the picker says the model sees images."""
    from engine import count_tokens

    messages = [{"role": "user", "content": [
        {"type": "image", "image": ImageInput.from_pil(random_image(0))},
        {"type": "text", "text": "What is in this image?"}]}]
    assert count_tokens(server.app.state.engine, messages=messages) == \
        prompt_tokens(lm, 0, "What is in this image?")
    assert "sees images" in httpx.get(f"{server.url}/", follow_redirects=True).text


def test_an_image_request_goes_through_the_scheduler_and_cancels(server):
    from engine import SamplingParams

    messages = [{"role": "user", "content": [
        {"type": "image", "image": ImageInput.from_pil(random_image(7))},
        {"type": "text", "text": "Describe it at length."}]}]
    handle = server.app.state.engine.submit(messages, SamplingParams(max_tokens=2000))
    handle.cancel()
    done = [e for e in handle.events(timeout=60) if e.kind == "done"][0]
    assert done.finish_reason == "cancelled" and handle.state == "cancelled"


def test_text_requests_on_a_vision_model_batch_with_an_image_request(server, lm, monkeypatch):
    """Text-only requests on a vision model decode batched (multimodal RoPE positions per row
    from the batch cache) beside an image request that runs alone: each answer equals the same
    request run alone."""
    from engine import SamplingParams
    from engine.decoding.generate import generate
    from engine.scheduling.batch import DecodeBatch

    widths = []
    step = DecodeBatch.step
    monkeypatch.setattr(DecodeBatch, "step", lambda self, *rider: widths.append(len(self.rows)) or step(self, *rider))
    greedy = SamplingParams(max_tokens=8)
    texts = [[{"role": "user", "content": q}] for q in ("Count to five.", "Name a colour, then why.")]
    pictured = [{"role": "user", "content": [
        {"type": "image", "image": ImageInput.from_pil(random_image(8))},
        {"type": "text", "text": "Describe it."}]}]
    requests = texts + [pictured]
    handles = [server.app.state.engine.submit(m, greedy) for m in requests]
    together = [[e.token for e in h.events(timeout=60) if e.kind == "token" and e.token is not None]
                for h in handles]
    alone = [[e.token for e in generate(lm, build_prompt(lm, messages=m), greedy)
              if e.kind == "token" and e.token is not None] for m in requests]
    assert together == alone and all(len(t) == 8 for t in together)
    assert widths and max(widths) == 2  # the two text requests, batched; the image one alone


def test_an_image_larger_than_the_json_body_limit_goes_through_the_image_routes(server, lm):
    """A 10 MB image is 13 MB as base64: over the 8 MiB body limit of other routes, within the
    image routes' own (app/api/images.py MAX_IMAGE_BODY_BYTES); past that, a clear 413."""
    noise = Image.frombytes("RGB", (1900, 1800), bytes(range(256)) * (1900 * 1800 * 3 // 256 + 1))
    out = io.BytesIO()
    noise.save(out, format="PNG", compress_level=0)
    raw = out.getvalue()
    assert 9_000_000 < len(raw) < 20_000_000
    body = {"model": lm.name, "messages": image_message(data_url(raw)), "max_tokens": 2}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 2
    elsewhere = httpx.post(f"{server.url}/v1/embeddings", json={"model": lm.name, "input":
                           "x" * (9 * 1024 * 1024)}, timeout=60)
    assert elsewhere.status_code == 413  # other routes keep the 8 MiB limit
    huge = httpx.post(f"{server.url}/v1/messages", content=b"{" + b" " * (65 * 1024 * 1024),
                      headers={"content-type": "application/json"}, timeout=60)
    assert huge.status_code == 413 and str(64 * 1024 * 1024) in huge.text


# --- issue 54: decoding off the event loop (M2), stored images kept as sent (M3) -----------------

def test_images_are_decoded_off_the_event_loop_on_every_api(server, lm, monkeypatch):
    """Issue 54 M2: /v1/messages, /v1/responses and /api/chat decoded images on the event loop
    (eight 88-Mpx PNGs blocked /health 8.8-13.5 s; 100,000 1×1 PNGs 10-15 s): each image is now
    decoded once, where the engine needs its pixels, on a thread that is not the event loop's."""
    import threading

    decoded = []
    real = images_api._decode
    monkeypatch.setattr(images_api, "_decode",
                        lambda *a: decoded.append(threading.current_thread()) or real(*a))
    raws = [png(i, (96, 64)) for i in range(8)]
    shapes = {
        "/v1/messages": {"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(r).decode()}} for r in raws]}]},
        "/v1/responses": {"max_output_tokens": 1, "store": False, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(r)} for r in raws]}]},
        "/api/chat": {"stream": False, "options": {"num_predict": 1}, "messages": [
            {"role": "user", "content": "x", "images": [base64.b64encode(r).decode() for r in raws]}]}}
    for path, body in shapes.items():
        decoded.clear()
        r = httpx.post(f"{server.url}{path}", json={"model": lm.name, **body}, timeout=300)
        assert r.status_code == 200, (path, r.text)
        assert len(decoded) == 8 and server.thread not in decoded, path  # once each, off the loop


def noise_jpeg(size=(3200, 2200)) -> bytes:
    """A 7 Mpx photo-sized JPEG (~6 MB) whose pixels as PNG would be over the 20 MB limit."""
    pixels = np.random.RandomState(5).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def database_bytes(server) -> int:
    """The database file's size with its write-ahead log folded in."""
    server.storage._query("PRAGMA wal_checkpoint(TRUNCATE)")
    return server.storage.path.stat().st_size


@pytest.mark.slow
def test_a_stored_response_keeps_its_jpeg_as_sent_and_can_be_continued(server, lm):
    """Issue 54 M3: a stored Response with a 5.7 MB JPEG blocked /health 58 s, grew the database
    173 MB, and could never be continued (its pixels were stored as a PNG over the 20 MB limit):
    the JPEG is kept once, as sent, off the loop; the follow-up decodes the same pixels."""
    from loop_probe import assert_responsive, health_probe, idle_worst

    raw = noise_jpeg()
    assert 4_000_000 < len(raw) < images_api.MAX_IMAGE_BYTES
    idle = idle_worst(server.url)
    before = database_bytes(server)
    with health_probe(server.url) as probe:
        first = httpx.post(f"{server.url}/v1/responses", timeout=300, json={
            "model": lm.name, "max_output_tokens": 2, "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": data_url(raw, "image/jpeg")},
                {"type": "input_text", "text": "Describe it."}]}]})
    assert first.status_code == 200, first.text
    assert_responsive(probe, idle)
    grown = database_bytes(server) - before
    assert grown <= 2 * len(raw), (grown, len(raw))
    with health_probe(server.url) as probe:
        second = httpx.post(f"{server.url}/v1/responses", timeout=300, json={
            "model": lm.name, "max_output_tokens": 2, "input": "And the colours?",
            "previous_response_id": first.json()["id"]})
    assert second.status_code == 200, second.text
    assert_responsive(probe, idle)
    usage = second.json()["usage"]
    assert usage["input_tokens"] > first.json()["usage"]["input_tokens"]
    assert usage["input_tokens_details"]["cached_tokens"] > 0  # the same pixels: the same keys
    # the two stored responses hold the JPEG once, as it was sent
    import hashlib

    rows = server.storage._query("SELECT data FROM response_images WHERE sha256 = ?",
                                 (hashlib.sha256(raw).hexdigest(),))
    assert len(rows) == 1 and rows[0]["data"] == raw
