"""Every generation endpoint reads its body through the serving core (app/api/serving.py), so each
refuses what would break later alike: a body that is not JSON, JSON nested 100,000 deep, a lone
surrogate. Each answers 400 in its own protocol's error shape and the server keeps serving.
A real server on 127.0.0.1 with a tiny random llama."""

import httpx
import pytest

from live_server import tiny_serving

pytestmark = pytest.mark.fast

DEEP = 100_000
BODIES = {
    "nested 100,000 deep": ("[" * DEEP + "]" * DEEP).encode(),
    "nested 100,000 deep inside an object": b'{"prompt": "x", "messages": [], "metadata": '
                                             + b"[" * DEEP + b"]" * DEEP + b"}",
    "not JSON": b'{"model": ',
    "not UTF-8": b'{"model": "\xff"}',
    "lone surrogate": b'{"prompt": "\\ud800", "messages": [{"role": "user", "content": "\\ud800"}]}',
}
# Each endpoint with how its errors look: OpenAI's {"error": {message, type, param, code}},
# Anthropic's {"type": "error", "error": {type, message}}, Ollama's {"error": message}.
ENDPOINTS = {
    "/v1/chat/completions": lambda body: body["error"]["message"],
    "/v1/completions": lambda body: body["error"]["message"],
    "/v1/responses": lambda body: body["error"]["message"],
    "/v1/messages": lambda body: body["type"] == "error" and body["error"]["message"],
    "/api/chat": lambda body: body["error"],
    "/api/generate": lambda body: body["error"],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_serving(tmp_path_factory.mktemp("bodies")) as s:
        yield s


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("name", BODIES)
def test_a_body_that_would_break_parsing_is_a_400_in_the_protocols_shape(server, path, name):
    r = httpx.post(f"{server.url}{path}", content=BODIES[name], timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    message = ENDPOINTS[path](r.json())
    assert message and ("nested" in message) == name.startswith("nested"), message
    assert httpx.get(f"{server.url}/health").status_code == 200
