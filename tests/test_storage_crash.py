"""A server killed mid-answer loses at most the last moments of text, never a conversation."""

import json
import time

import httpx
from websockets.sync.client import ClientConnection, connect

from app.storage import Storage
from app.ui.chat_turn import SAVE_EVERY_S
from live_server import ServerProcess

PROMPT = "Write a very long story about a dragon who learns to cook."


def new_conversation(url: str) -> int:
    r = httpx.get(url + "/", follow_redirects=False)
    return int(r.headers["location"].rsplit("/", 1)[1])


def chat_socket(url: str, cid: int) -> ClientConnection:
    return connect(url.replace("http://", "ws://") + f"/c/{cid}/ws", origin=url)


def stream_for(ws: ClientConnection, seconds: float) -> int:
    """Send PROMPT; return the number of answer updates seen once tokens have streamed for
    `seconds` (the answer goes on)."""
    ws.send(json.dumps({"action": "send", "content": PROMPT}))
    first, updates = None, 0
    while first is None or time.monotonic() - first < seconds:
        if '-body" hx-swap-oob="innerHTML"' in ws.recv(timeout=120):
            updates += 1
            first = first or time.monotonic()
    return updates


def answer(home) -> tuple:
    storage = Storage(home / "data" / "mlxchat.db")
    try:
        conv = storage.list_conversations()[0]
        return conv, storage.active_path(conv.id)
    finally:
        storage.close()


def test_sigkill_during_stream_keeps_conversation_and_partial_answer(tmp_path):
    server = ServerProcess(tmp_path / "home").start()
    try:
        cid = new_conversation(server.url)
        with chat_socket(server.url, cid) as ws:
            assert stream_for(ws, 2.5 * SAVE_EVERY_S) >= 2
            server.kill()
        _, path = answer(tmp_path / "home")
        user, partial = path
        assert user.content == PROMPT and user.state == "done"
        assert partial.state == "streaming" and partial.content  # saved while streaming
    finally:
        server.stop()

    again = ServerProcess(tmp_path / "home").start()
    try:
        page = httpx.get(f"{again.url}/c/{cid}").text
        assert PROMPT in page and "interrupted" in page
        assert partial.content.split()[0] in page
        _, (_, recovered) = answer(tmp_path / "home")
        assert recovered.content == partial.content
        assert (recovered.state, recovered.finish_reason) == ("stopped", "interrupted")
    finally:
        again.stop()


def test_ctrl_c_during_stream_saves_the_partial_answer_and_exits(tmp_path):
    server = ServerProcess(tmp_path / "home").start()
    try:
        cid = new_conversation(server.url)
        with chat_socket(server.url, cid) as ws:
            updates = stream_for(ws, 1.0)
            assert server.interrupt() == 0
    finally:
        server.stop()
    conv, (_, stopped) = answer(tmp_path / "home")
    assert conv.id == cid and updates >= 1
    assert (stopped.state, stopped.finish_reason) == ("stopped", "cancelled")
    assert stopped.content  # everything generated before Ctrl-C, not only the last periodic save
