"""DNS rebinding (Host), cross-site requests (Origin) and WebSockets, against a real server."""

import socket

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from app.server import serve
from live_server import serving


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from engine.scheduling.service import Engine

    engine = Engine().start()
    with serving(engine, tmp_path_factory.mktemp("sec") / "db.sqlite") as s:
        yield s


@pytest.fixture(scope="module")
def conversation(server):
    """The id of a conversation (the index page redirects to one)."""
    r = httpx.get(server.url + "/", follow_redirects=False)
    return int(r.headers["location"].rsplit("/", 1)[1])


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example",
                                  "localhost.evil.example", "192.168.1.5:{port}", ""])
def test_foreign_host_is_refused(server, host):
    r = httpx.get(server.url + "/health", headers={"Host": host.format(port=server.port)})
    assert r.status_code == 400


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST:{port}", "[::1]:{port}"])
def test_loopback_hosts_are_accepted(server, host):
    r = httpx.get(server.url + "/health", headers={"Host": host.format(port=server.port)})
    assert r.status_code == 200


def test_cross_origin_post_is_refused(server, conversation):
    url = f"{server.url}/c/{conversation}/rename"
    for origin in ("http://evil.example", f"http://localhost:{server.port + 1}", "null"):
        r = httpx.post(url, headers={"Origin": origin, "HX-Prompt": "pwned"})
        assert r.status_code == 403, origin
    r = httpx.post(url, headers={"Sec-Fetch-Site": "cross-site", "HX-Prompt": "pwned"})
    assert r.status_code == 403
    r = httpx.post(f"{server.url}/v1/chat/completions", json={}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403
    # Same origin, and programs that send no Origin at all, are served.
    ok = httpx.post(url, headers={"Origin": server.url, "HX-Prompt": "renamed"})
    assert ok.status_code == 200 and "renamed" in ok.text
    assert httpx.post(url, headers={"HX-Prompt": "renamed again"}).status_code == 200


def test_cross_origin_get_is_served_but_cannot_be_framed(server):
    r = httpx.get(server.url + "/", headers={"Origin": "http://evil.example"}, follow_redirects=True)
    assert r.status_code == 200
    assert r.headers["x-frame-options"] == "DENY"
    csp = r.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp


def _ws_status(url: str, origin: str) -> int | str:
    """101-accepted ("open") or the HTTP status the handshake was refused with."""
    try:
        with connect(url, origin=origin):
            return "open"
    except InvalidStatus as exc:
        return exc.response.status_code


def test_foreign_origin_websocket_is_refused(server, conversation):
    ws = f"ws://127.0.0.1:{server.port}/c/{conversation}/ws"
    assert _ws_status(ws, origin="http://evil.example") == 403
    assert _ws_status(ws, origin=f"http://127.0.0.1:{server.port + 1}") == 403
    assert _ws_status(ws, origin=f"http://127.0.0.1:{server.port}") == "open"


def test_websocket_with_foreign_host_is_refused(server, conversation):
    def handshake(host: str) -> str:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall((f"GET /c/{conversation}/ws HTTP/1.1\r\nHost: {host}\r\n"
                          "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                          "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n").encode())
            return sock.recv(200).split(b"\r\n", 1)[0].decode()  # a frame may follow

    assert handshake("evil.example") == "HTTP/1.1 403 Forbidden"
    assert handshake(f"127.0.0.1:{server.port}") == "HTTP/1.1 101 Switching Protocols"


def test_binding_beyond_loopback_needs_allow_remote():
    with pytest.raises(SystemExit, match="allow-remote"):
        serve(host="0.0.0.0", port=1, open_browser=False)
