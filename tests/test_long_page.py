"""Issue 24 M5 (pages): the page of a conversation of 50,000 messages renders off the event loop;
`/health` keeps answering while it is built. A real server on 127.0.0.1 (tiny random llama), the
conversation imported through the real import route."""

import json

import httpx
import pytest

from live_server import tiny_serving
from loop_probe import STALL_S, health_probe

pytestmark = pytest.mark.fast



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_serving(tmp_path_factory.mktemp("longpage")) as s:
        yield s


@pytest.mark.slow  # seconds of compute by design: the second tier
def test_the_page_of_fifty_thousand_messages_does_not_stall_the_server(server):
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message *{i}*"}
                for i in range(50_000)]
    r = httpx.post(f"{server.url}/import", follow_redirects=False, timeout=300,
                   files={"file": ("long.json", json.dumps(messages).encode())})
    assert r.status_code == 303, r.text
    with health_probe(server.url) as probe:
        page = httpx.get(f"{server.url}{r.headers['location']}", timeout=300)
    assert page.status_code == 200 and "message <em>49999</em>" in page.text
    assert probe.latencies and probe.worst < STALL_S, probe.worst
