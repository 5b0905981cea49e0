"""Issue 14, cases 4-7, against a real server on 127.0.0.1 with the bundled model: the API key
everywhere, body limits and slow clients, malformed input, and the chat socket's failures."""

import json
import socket
import time

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from app.server import create_app
from live_server import ThreadedServer, frames_until, ws_url

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def engine():
    from engine import Engine

    engine = Engine().start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    s = ThreadedServer(create_app(engine, tmp_path_factory.mktemp("h") / "db.sqlite")).start()
    s.storage = s.app.state.storage
    yield s
    s.stop()


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            **fields}


def new_conversation(server, max_tokens: int = 3) -> int:
    conv = server.storage.create_conversation(
        model=MODEL, settings={"sampling": {"temperature": 0.0, "max_tokens": max_tokens}})
    return conv.id


# --- case 4: the API key guards everything but /health and the static assets ---------------------

def test_api_key_guards_every_route_with_a_login_page_for_the_browser(engine, tmp_path):
    s = ThreadedServer(create_app(engine, tmp_path / "db.sqlite", api_key="s3cret")).start()
    try:
        cid = s.app.state.storage.create_conversation(settings={"sampling": {}}).id
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert httpx.get(f"{s.url}/static/app.js").status_code == 200
        for method, path in [("GET", f"/c/{cid}"), ("GET", "/conversations"),
                             ("POST", f"/c/{cid}/rename"), ("POST", "/conversations"),
                             ("GET", "/v1/models")]:
            r = httpx.request(method, s.url + path)
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
        # A browser is sent to the login page, htmx is told to go there.
        page = httpx.get(f"{s.url}/c/{cid}", headers={"Accept": "text/html"})
        assert page.status_code == 303 and page.headers["location"] == f"/login?next=/c/{cid}"
        assert httpx.get(f"{s.url}/conversations",
                         headers={"HX-Request": "true"}).headers["hx-redirect"].startswith("/login")
        with pytest.raises(InvalidStatus) as refused:
            connect(ws_url(s, cid), origin=s.url)
        assert refused.value.response.status_code == 403

        # Programs use the Bearer key.
        bearer = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{s.url}/c/{cid}", headers=bearer).status_code == 200

        # The login page trades the key for an HttpOnly, SameSite=Strict session cookie.
        assert 'type="password"' in httpx.get(f"{s.url}/login").text
        wrong = httpx.post(f"{s.url}/login", data={"key": "guess", "next": "/"})
        assert wrong.status_code == 401 and "mlxchat_session" not in wrong.headers.get("set-cookie", "")
        ok = httpx.post(f"{s.url}/login", data={"key": "s3cret", "next": f"/c/{cid}"})
        assert ok.status_code == 303 and ok.headers["location"] == f"/c/{cid}"
        cookie = ok.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "s3cret" not in cookie
        # Only a path on this server is a place to go after logging in.
        away = httpx.post(f"{s.url}/login", data={"key": "s3cret", "next": "//evil.example/"})
        assert away.headers["location"] == "/"
        session = {"Cookie": cookie.split(";", 1)[0]}
        assert httpx.get(f"{s.url}/c/{cid}", headers=session).status_code == 200
        with connect(ws_url(s, cid), origin=s.url, additional_headers=session) as ws:
            assert 'id="messages"' in ws.recv(timeout=30)
    finally:
        s.stop()


# --- case 5: body limit, parsing off the loop, slow clients ---------------------------------------

def test_oversized_body_is_refused_before_it_is_read(server):
    """On a route without images (8 MiB; the image routes' 64 MiB: tests/test_vision_api.py)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 20000000\r\n\r\n{")
        head = sock.recv(4096).decode()
    assert head.startswith("HTTP/1.1 413")
    # Chunked, without a length: refused once it grows past the limit.
    def chunks():
        for _ in range(40):
            yield b" " * 1_000_000
    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_large_body_is_parsed_and_checked_in_full(server):
    """Bodies this large are parsed in a worker thread; the answer is the same as inline."""
    from app.api.serving import INLINE_BODY_BYTES

    body = json.dumps(chat(messages=[{"role": "user", "content": "x"}] * 60000,
                           model="another-model")).encode()
    assert INLINE_BODY_BYTES < len(body) < 8 * 1024 * 1024
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    deep = b'{"model": "x", "metadata": ' + _nested(2000).encode() + b', "pad": "' + \
        b"y" * INLINE_BODY_BYTES + b'"}'
    r = httpx.post(f"{server.url}/v1/chat/completions", content=deep, timeout=60)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]


def test_a_client_that_trickles_its_headers_is_disconnected(server):
    from app.security.header_timeout import HEADER_TIMEOUT_S

    with socket.create_connection(("127.0.0.1", server.port), timeout=HEADER_TIMEOUT_S * 3) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < HEADER_TIMEOUT_S * 2.5:
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:
                closed = True
                break
            sock.settimeout(1.0)
            try:
                if sock.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except OSError:  # a reset: the server closed with our last header lines unread
                closed = True
                break
        assert closed
        assert time.monotonic() - started >= HEADER_TIMEOUT_S * 0.9


# --- case 6: malformed input -> 4xx in OpenAI's error shape ---------------------------------------

def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _deep_schema(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + "{}" + "}" * depth


MALFORMED = {
    "role is a list": json.dumps(chat(messages=[{"role": ["user"], "content": "x"}])),
    "lone surrogate in content": json.dumps(chat(messages=[{"role": "user", "content": "\ud800"}])),
    "lone surrogate in model": json.dumps(chat(model="\ud800")),
    "JSON nested 100,000 deep": _nested(100_000),
    "messages nested deep": json.dumps(chat())[:-1] + ', "metadata": ' + _nested(5000) + "}",
    "schema nested 3,000 deep": json.dumps(chat())[:-1] + ', "response_format": {"type": '
        '"json_schema", "json_schema": {"name": "x", "schema": ' + _deep_schema(3000) + "}}}",
    "self-referencing $ref": json.dumps(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}}}})),
    "$ref to the root": json.dumps(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#"}}})),
    "n: true": json.dumps(chat(n=True)),
    "logprobs: 0": json.dumps(chat(logprobs=0)),
    "not UTF-8": b'{"model": "\xff"}',
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_chat_requests_are_4xx_in_openai_shape(server, name):
    body = MALFORMED[name]
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   content=body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body,
                   headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "<state>" not in error["message"] and "Parser" not in error["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("path", ["/c/9223372036854775808", "/c/99999999999999999999999",
                                  "/c/1/m/9223372036854775808", "/c/1/m/9223372036854775808/edit"])
def test_ids_beyond_64_bits_are_not_found(server, path):
    assert httpx.get(server.url + path).status_code == 404
    cid = new_conversation(server)
    r = httpx.post(f"{server.url}/c/{cid}/select/9223372036854775808")
    assert r.status_code == 200 and server.storage.get_conversation(cid).leaf_id is None


@pytest.mark.parametrize("headers", [{"Host": "["}, {"Host": "[::1"},
                                     {"Origin": "http://["}, {"Origin": "http://[::1"}])
def test_unparsable_host_or_origin_is_refused_not_a_crash(server, headers):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat(), headers=headers)
    assert r.status_code in (400, 403)


# --- case 7: the chat socket: every failure has a notice; one turn at a time ----------------------

def test_websocket_frames_it_cannot_use_get_a_notice(server):
    cid = new_conversation(server)
    with connect(ws_url(server, cid), origin=server.url) as ws:
        ws.recv(timeout=30)  # the current state
        for frame, notice in [(b"\x00\x01", "Binary"), (_nested(100_000), "nested too deeply"),
                              ("not json", "not JSON"), ("[1]", "not a JSON object"),
                              (json.dumps({"action": "regenerate", "message_id": 2**63}),
                               "not in this conversation"),
                              (json.dumps({"action": "edit", "message_id": "1e999"}),
                               "not in this conversation")]:
            ws.send(frame)
            assert notice in ws.recv(timeout=30)
        ws.send(json.dumps({"action": "send", "content": "Hi"}))  # still usable
        final = frames_until(ws, 'id="send"')[-1]
        assert 'data-state="done"' in final


def test_a_big_id_over_the_websocket_is_refused_at_the_handshake(server):
    with pytest.raises(InvalidStatus):
        connect(ws_url(server, 2**63), origin=server.url)


def test_a_turn_in_a_conversation_deleted_meanwhile_gets_a_notice(server):
    cid = new_conversation(server)
    with connect(ws_url(server, cid), origin=server.url) as ws:
        ws.recv(timeout=30)
        server.storage.delete_conversation(cid)
        ws.send(json.dumps({"action": "send", "content": "Hi"}))
        frames = frames_until(ws, 'id="send"')
        assert any("This conversation has been deleted." in f for f in frames)


def test_two_pages_on_one_conversation_never_interleave_turns(server):
    cid = new_conversation(server, max_tokens=12)
    with connect(ws_url(server, cid), origin=server.url) as one, \
            connect(ws_url(server, cid), origin=server.url) as two:
        one.recv(timeout=30)
        two.recv(timeout=30)
        one.send(json.dumps({"action": "send", "content": "Count to ten."}))
        frames_until(two, 'id="stop"')  # the second page sees the turn start
        two.send(json.dumps({"action": "send", "content": "Say hi."}))
        assert "Still answering" in frames_until(two, "notice-text")[-1]
        final_two = frames_until(two, 'id="send"')[-1]  # it also sees the turn end
        final_one = frames_until(one, 'id="send"')[-1]
        assert 'data-state="done"' in final_one and 'data-state="done"' in final_two
        assert '<div id="notice" hx-swap-oob="innerHTML"></div>' in final_two  # notice cleared
    path = server.storage.active_path(cid)
    assert [(m.role, m.content) for m in path][0] == ("user", "Count to ten.")
    assert [m.role for m in path] == ["user", "assistant"] and path[1].content
    assert cid not in [c.id for c in server.storage.list_conversations("Say hi.")]


def test_a_page_that_reconnects_gets_the_database_state(server):
    """A page left showing "answering…" (the server restarted, the connection dropped) is
    brought in line with the database as soon as its socket connects again."""
    cid = new_conversation(server)
    user = server.storage.add_message(cid, None, "user", "Hello")
    answer = server.storage.add_message(cid, user.id, "assistant", "Half an ans",
                                        state="streaming")
    server.storage.finish_message(answer.id, "Half an ans", "stopped", finish_reason="interrupted")
    with connect(ws_url(server, cid), origin=server.url) as ws:
        state = ws.recv(timeout=30)
    assert f'id="m-{answer.id}"' in state and 'hx-swap-oob="true"' in state
    assert "answering…" not in state and "interrupted" in state and 'id="send"' in state
