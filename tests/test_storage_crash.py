"""A server killed mid-answer loses at most the last moments of text, never a conversation."""

import asyncio
import json
import time

import httpx
import pytest
import websockets

from app.storage import Storage
from app.ui import SAVE_EVERY_S
from live_server import ServerProcess

PROMPT = "Write a very long story about a dragon who learns to cook."


def new_conversation(url: str) -> int:
    r = httpx.get(url + "/", follow_redirects=False)
    return int(r.headers["location"].rsplit("/", 1)[1])


async def stream_for(url: str, cid: int, seconds: float) -> int:
    """Send PROMPT over the chat socket; return after tokens have streamed for `seconds`.
    Returns the number of answer updates seen; the socket stays open (the answer is running)."""
    ws_url = url.replace("http://", "ws://") + f"/c/{cid}/ws"
    ws = await websockets.connect(ws_url, origin=url)
    await ws.send(json.dumps({"action": "send", "content": PROMPT}))
    first, updates = None, 0
    while first is None or time.monotonic() - first < seconds:
        message = await asyncio.wait_for(ws.recv(), 120)
        if '-body" hx-swap-oob="innerHTML"' in message:
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
        assert asyncio.run(stream_for(server.url, cid, 2.5 * SAVE_EVERY_S)) >= 2
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
        updates = asyncio.run(stream_for(server.url, cid, 1.0))
        started = time.monotonic()
        assert server.interrupt() == 0
        assert time.monotonic() - started < 15
    finally:
        server.stop()
    conv, (_, stopped) = answer(tmp_path / "home")
    assert conv.id == cid and updates >= 1
    assert (stopped.state, stopped.finish_reason) == ("stopped", "cancelled")
    assert stopped.content  # everything generated before Ctrl-C, not only the last periodic save
