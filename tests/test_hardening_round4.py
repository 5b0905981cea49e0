"""Issue 54, round 4 of the attack pass, against a real server on 127.0.0.1 (one per module, a tiny
random llama: a text-only model): nothing is decoded before it is counted, nothing CPU-heavy
stalls the event loop, nothing unbounded is stored. Each case measures `/health` against the
idle baseline (tests/loop_probe.py) and, where memory was the fault, the peak resident memory
the request added (tests/rss_probe.py; the server runs in this process)."""

import base64
import io
import json
import struct
import time
import zlib

import httpx
import pytest
from PIL import Image

from app.api import images
from live_server import new_conversation, tiny_serving
from loop_probe import assert_responsive, health_probe, idle_worst
from rss_probe import peak_rss

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_serving(tmp_path_factory.mktemp("round4")) as s:
        s.idle = idle_worst(s.url)
        yield s


@pytest.fixture
def decodes(monkeypatch):
    """How many images the server decodes (app/api/images.py `_decode`)."""
    calls = []
    real = images._decode
    monkeypatch.setattr(images, "_decode", lambda *a: calls.append(a[1]) or real(*a))
    return calls


def gif_canvas(width: int = 9400, height: int = 9400, frames: int = 1) -> bytes:
    """A GIF of `frames` 1×1 frames (29 bytes for one) on a canvas it declares `width` × `height`."""
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02\x44\x01\x00"
    return b"GIF89a" + struct.pack("<HHBBB", width, height, 0, 0, 0) + frame * frames + b"\x3b"


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares `width` × `height` over a few bytes of pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def real_png(size=(64, 48)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (200, 30, 90)).save(out, format="PNG")
    return out.getvalue()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def bodies(model: str, raw: bytes, n: int = 1) -> dict[str, dict]:
    """The same `n` images on every API that takes images, as each sends them."""
    url = f"data:image/png;base64,{b64(raw)}"
    return {
        "/v1/chat/completions": {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}] * n}]},
        "/v1/messages": {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(raw)}}] * n}]},
        "/v1/responses": {"model": model, "max_output_tokens": 2, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url}] * n}]},
        "/api/chat": {"model": model, "stream": False, "messages": [
            {"role": "user", "content": "x", "images": [b64(raw)] * n}]},
        "/api/generate": {"model": model, "stream": False, "prompt": "x", "images": [b64(raw)] * n},
    }


def error_of(r: httpx.Response) -> tuple[str, str | None]:
    """(message, field) of an error in any protocol's shape."""
    body = r.json()
    error = body.get("error")
    if isinstance(error, str):  # Ollama's
        return error, None
    return error["message"], error.get("param")


# --- H2: images counted and checked by their header before anything is decoded -------------------

def test_a_canvas_declared_huge_is_refused_on_every_api_before_decoding(server, decodes):
    """8 GIFs of 29 bytes, each declaring a 9,400² canvas (a 1 KB body), took the server from 289
    to 3,667 MB: each is refused from its header, on every API, and nothing is decoded."""
    for path, body in bodies(server.model, gif_canvas(), 8).items():
        with peak_rss() as rss, health_probe(server.url) as probe:
            r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert r.status_code == 400, (path, r.text)
        message, field = error_of(r)
        assert "9400×9400 pixels" in message and f"{images.MAX_IMAGE_PIXELS:,}" in message, message
        assert field in (None, "messages[0].content"), (path, field)
        assert rss.added_mb < 200, (path, rss.added_mb)
        assert_responsive(probe, server.idle)
    assert decodes == []


def test_headers_over_the_limits_are_refused_each_with_its_reason(server, decodes):
    big_png = bodies(server.model, png_header(9400, 9400), 8)["/api/chat"]
    r = httpx.post(f"{server.url}/api/chat", json=big_png, timeout=60)
    assert r.status_code == 400 and "9400×9400" in r.json()["error"]
    frames = gif_canvas(1, 1, images.MAX_FRAMES + 1)  # only the first frame would be read
    assert Image.open(io.BytesIO(frames)).n_frames == images.MAX_FRAMES + 1
    many = [("frames", frames, "more than 1000 frames"),
            ("pixels in all", png_header(6000, 6000), "the request's images hold")]
    for name, raw, expected in many:
        body = bodies(server.model, raw, 3)["/v1/chat/completions"]
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, (name, r.text)
        assert expected in r.json()["error"]["message"] and \
            r.json()["error"]["code"] == "image_too_large", (name, r.text)
    assert decodes == []


@pytest.mark.slow
def test_a_hundred_thousand_images_are_counted_before_any_is_read(server, decodes):
    """100,000 1×1 PNGs blocked /health 10-15 s (each decoded, on the event loop, before the
    request was counted): now refused by their count."""
    body = bodies(server.model, real_png((1, 1)), 100_000)["/v1/chat/completions"]
    with health_probe(server.url) as probe:
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400 and "holds 100000 images; the limit is 8" in r.text, r.text
    assert_responsive(probe, server.idle)
    assert decodes == []


def test_a_text_only_model_refuses_images_without_decoding_them(server, decodes):
    for path, body in bodies(server.model, real_png()).items():
        r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert r.status_code == 400, (path, r.text)
        assert "this model cannot see images" in error_of(r)[0], (path, r.text)
    assert decodes == []


def upload(server, http, cid: int, raw: bytes, name: str) -> dict:
    """Upload `raw` into conversation `cid` and wait until it is read; its JSON."""
    up = http.post(f"/c/{cid}/uploads", params={"name": name}, content=raw).json()
    deadline = time.monotonic() + 60
    while up["status"] == "reading" and time.monotonic() < deadline:
        time.sleep(0.05)
        up = http.get(f"/c/{cid}/uploads/{up['id']}").json()
    return up


def test_uploaded_images_are_checked_first_and_their_thumbnail_is_made_once(server, decodes):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        cid = new_conversation(http)
        with peak_rss() as rss:
            bomb = upload(server, http, cid, gif_canvas(), "canvas.gif")
        assert bomb["status"] == "refused" and "9400×9400 pixels" in bomb["error"], bomb
        assert rss.added_mb < 200 and decodes == []
        up = upload(server, http, cid, real_png((600, 300)), "photo.png")
        assert up["status"] == "ready" and up["summary"] == "600×300" and len(decodes) == 1
        page = {"sec-fetch-site": "same-origin"}
        shown = [http.get(f"/c/{cid}/uploads/{up['id']}/image?thumb=1", headers=page)
                 for _ in range(3)]
        assert all(r.status_code == 200 and r.content == shown[0].content for r in shown)
        assert Image.open(io.BytesIO(shown[0].content)).size == (256, 128)
        assert shown[0].headers["cross-origin-resource-policy"] == "same-origin"
        assert len(decodes) == 1  # the thumbnail was stored when the file was read
        full = http.get(f"/c/{cid}/uploads/{up['id']}/image", headers=page)
        assert full.status_code == 200 and Image.open(io.BytesIO(full.content)).size == (600, 300)
        # another site's page (an <img> there) gets nothing, and decodes nothing
        for thumb in ("?thumb=1", ""):
            r = http.get(f"/c/{cid}/uploads/{up['id']}/image{thumb}",
                         headers={"sec-fetch-site": "cross-site", "sec-fetch-dest": "image"})
            assert r.status_code == 403
        assert len(decodes) == 2


# --- M6: a body limit that fits its content; nothing decoded before it is counted ----------------

def test_a_huge_text_prompt_is_refused_before_it_is_tokenised(server):
    """A 60 MB text prompt cost 7.5 GB before its 400 (the image routes take 64 MiB bodies, text
    included): text past the text limit is a 413, and a prompt longer than the context can hold
    is refused from its characters, before the tokenizer sees it."""
    text = "hello " * 3_500_000  # 21 MB: over the text limit of an image route
    with peak_rss() as rss, health_probe(server.url) as probe:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": server.model, "max_tokens": 2, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 413 and "the request's text is" in r.text, r.text
    assert rss.added_mb < 1024, rss.added_mb
    assert_responsive(probe, server.idle)
    text = "hello " * 1_000_000  # 6 MB: within the text limit, far over 8,192 tokens
    for path, body in {
            "/v1/chat/completions": {"model": server.model, "max_tokens": 2,
                                     "messages": [{"role": "user", "content": text}]},
            "/infill": {"input_prefix": text, "input_suffix": "x", "n_predict": 2},
            "/v1/completions": {"model": server.model, "max_tokens": 2, "prompt": text}}.items():
        with peak_rss() as rss, health_probe(server.url) as probe:
            r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
        assert r.status_code == 400 and "more than this model's context of" in r.text, (path, r.text)
        assert rss.added_mb < 512, (path, rss.added_mb)
        assert_responsive(probe, server.idle)


# --- M1: tool schemas compile off the event loop, once per schema ---------------------------------

def big_tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"fn_{i}", "parameters": {
        "type": "object", "properties": {
            "a": {"type": "string", "enum": [f"v{i}_{k}" for k in range(300)]},
            "b": {"type": "string", "pattern": "^[a-z]{3,8}-[0-9]+$"}}}}} for i in range(n)]


@pytest.mark.slow
def test_a_thousand_large_tool_schemas_stall_no_protocol(server):
    """1,000 tools each with a 300-string enum and a pattern (3.6 MB) froze /health 37-76 s on
    every protocol: compiled off the event loop (once: later requests find them cached), and the
    prompt they would make refused from its size before any tokenising."""
    from engine.decoding import constrained

    tools = big_tools(1000)
    shapes = {
        "/v1/chat/completions": {"tools": tools, "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2},
        "/v1/messages": {"tools": [{"name": t["function"]["name"],
                                    "input_schema": t["function"]["parameters"]} for t in tools],
                         "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/responses": {"tools": [{"type": "function", **t["function"]} for t in tools],
                          "input": "hi", "max_output_tokens": 2},
        "/api/chat": {"tools": tools, "messages": [{"role": "user", "content": "hi"}],
                      "stream": False}}
    for path, body in shapes.items():
        with peak_rss() as rss, health_probe(server.url) as probe:
            r = httpx.post(f"{server.url}{path}", json={"model": server.model, **body}, timeout=300)
        assert r.status_code == 400 and "more than this model's context of" in r.text, (path, r.text)
        assert rss.added_mb < 1024, (path, rss.added_mb)
        assert_responsive(probe, server.idle)
        if path == "/v1/chat/completions":
            compiled = len(constrained._grammars.items)
    assert len(constrained._grammars.items) == compiled  # the same schemas: compiled once


def test_tool_schemas_compile_within_a_time_budget(server, monkeypatch):
    from engine.decoding import tools

    monkeypatch.setattr(tools, "COMPILE_BUDGET_S", 0.0)
    fresh = [{"type": "function", "function": {"name": "budget", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 77}}}}}] * 2
    fresh[1] = {"type": "function", "function": {**fresh[1]["function"], "name": "other"}}
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": server.model, "max_tokens": 2, "tools": fresh,
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "to compile" in r.json()["error"]["message"]


# --- M4: the Responses API stores what it echoes only checked and bounded --------------------------

@pytest.mark.parametrize("fields, status, param", [
    ({"metadata": {"a": "x" * 1_000_000}}, 400, "metadata.a"),
    ({"metadata": {"a": "x" * 50_000_000}}, 413, None),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
    ({"reasoning": {"effort": {"nested": 1}}}, 400, "reasoning.effort"),
    ({"reasoning": "high"}, 400, "reasoning"),
    ({"text": {"format": {"type": "text"}, "junk": "x" * 100}}, 400, "text"),
    ({"tools": [{"type": "web_search", "junk": "x" * 100_000}]}, 400, "tools[0]"),
    ({"parallel_tool_calls": "yes"}, 400, "parallel_tool_calls"),
], ids=["metadata value", "metadata 50 MB", "metadata pairs", "effort object", "reasoning string",
        "text field", "hosted tool", "parallel"])
def test_echoed_responses_fields_are_checked_before_anything_is_stored(server, fields, status, param):
    before = server.storage.path.stat().st_size
    r = httpx.post(f"{server.url}/v1/responses", timeout=120, json={
        "model": server.model, "input": "hi", "max_output_tokens": 2, **fields})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert server.storage.path.stat().st_size - before < 1_000_000


def test_stored_responses_expire_and_the_store_has_a_cap(server, monkeypatch):
    stored = server.app.state.responses
    first = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "model": server.model, "input": "remember", "max_output_tokens": 2}).json()
    assert httpx.get(f"{server.url}/v1/responses/{first['id']}").status_code == 200
    monkeypatch.setattr(stored, "ttl_s", 0.0)  # `--responses-ttl` that has passed
    assert httpx.get(f"{server.url}/v1/responses/{first['id']}").status_code == 404
    r = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "model": server.model, "input": "and?", "previous_response_id": first["id"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    monkeypatch.setattr(stored, "ttl_s", 3600.0)
    monkeypatch.setattr(stored, "max_bytes", 1)  # a full store keeps only the newest
    ids = [httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "model": server.model, "input": f"n{i}", "max_output_tokens": 2}).json()["id"]
        for i in range(3)]
    found = [httpx.get(f"{server.url}/v1/responses/{rid}").status_code for rid in ids]
    assert found == [404, 404, 200]
    rows = server.storage._query("SELECT count(*) FROM responses")[0][0]
    assert rows == 1


# --- LOW: each a 4xx naming its field --------------------------------------------------------------

def chat(server, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": server.model, "max_tokens": 24, "messages": [{"role": "user", "content": "hi"}],
        **fields})


def test_low_findings_are_4xx_with_the_field(server):
    r = chat(server, reasoning_effort={"x": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    r = httpx.post(f"{server.url}/api/chat", timeout=60, json={
        "model": server.model, "stream": False, "format": {"$ref": "#"},
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "refers to itself" in r.text, r.text
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
            "properties": {"a": {"type": "string", "pattern": "^a{1000}{1000}$"}}}}}
    r = chat(server, tools=[tool], tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters"
    assert "repeats to 1,000,000 pieces" in r.text
    for name in ("x" * 10_000, "/proc/self/mem", "a\u0000b"):
        r = httpx.post(f"{server.url}/v1/embeddings", timeout=60,
                       json={"model": name, "input": "hi"})
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == "model", r.text
        assert len(r.text) < 2000
    port = server.url.rsplit(":", 1)[1]
    for origin in (f"https://127.0.0.1:{port}", f"ws://127.0.0.1:{port}"):
        r = httpx.post(f"{server.url}/conversations", headers={"Origin": origin})
        assert r.status_code == 403, origin
    assert httpx.post(f"{server.url}/conversations", headers={"Origin": server.url},
                      follow_redirects=False).status_code == 303


def test_defs_schemas_are_enforced_when_the_call_is_forced(server):
    """What pydantic writes (`$defs`, `$ref`) was refused for a forced call, so such an MCP tool
    failed every forced turn: each function's definitions now resolve inside the call grammar."""
    params = {"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}},
                                  "required": ["x"], "additionalProperties": False}},
              "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": name, "parameters": params}}
             for name in ("first", "second")]
    for choice in ("required", {"type": "function", "function": {"name": "second"}}):
        r = chat(server, tools=tools, tool_choice=choice, max_tokens=60, temperature=0)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        if r.json()["choices"][0]["finish_reason"] == "length":
            continue  # a tiny random model may not finish the call; it was still enforced
        for call in message["tool_calls"]:
            assert isinstance(json.loads(call["function"]["arguments"])["p"]["x"], int)
