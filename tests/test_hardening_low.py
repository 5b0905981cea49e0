"""Issue 24's LOW findings on the API and the chat socket, against a real server on 127.0.0.1
with a tiny random llama: each a clear 4xx or a right answer, never a 5xx or a confusing message."""


import httpx
import pytest
from websockets.sync.client import connect

from live_server import frames_until, tiny_serving, ws_url

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_serving(tmp_path_factory.mktemp("low")) as s:
        yield s


def test_n_choices_at_the_largest_seed_are_answered(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "n": 2, "seed": 2**63 - 1, "temperature": 1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


@pytest.mark.parametrize("mid", ["1e400", "99999999999999999999999999", '"x"', "null", "-1"])
def test_editing_a_message_id_that_is_no_id_says_so(server, mid):
    r = httpx.post(f"{server.url}/conversations", data={}, follow_redirects=False)
    cid = int(r.headers["location"].rsplit("/", 1)[1])
    with connect(ws_url(server, cid), origin=server.url) as ws:
        ws.recv(timeout=30)
        ws.send('{"action": "edit", "content": "x", "message_id": %s}' % mid)
        frames = frames_until(ws, "notice", timeout=30)
    assert "That message is not in this conversation." in frames[-1]
    assert "infinity" not in frames[-1]
