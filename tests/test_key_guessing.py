"""Issue 24 M4 and the non-ASCII key case, against a real server on 127.0.0.1 (tiny model): wrong
API keys as `Bearer`, `x-api-key` or through the login form are limited per client address (429
with Retry-After, even for the right key, until the window passes), and a session cookie is a
random token that logging out revokes, so a copy of it stops working."""

import concurrent.futures

import httpx
import pytest

from app.security.key_access import PER_CLIENT
from live_server import app_serving

pytestmark = pytest.mark.fast

KEY = "s3cret-ключ"  # non-ASCII: sent as UTF-8 bytes in a header, it must still match


@pytest.fixture
def server(tiny_engine, tmp_path):
    with app_serving(tiny_engine, tmp_path / "db.sqlite", api_key=KEY) as s:
        yield s


def bearer(key: str) -> dict:
    return {"Authorization": b"Bearer " + key.encode()}


def test_the_right_non_ascii_key_works_as_bearer_and_x_api_key(server):
    assert httpx.get(f"{server.url}/v1/models", headers=bearer(KEY)).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY.encode()}).status_code == 200


@pytest.mark.parametrize("how", ["bearer", "x-api-key", "login"])
def test_guessing_is_cut_off_per_client(server, how):
    def guess(i: int) -> int:
        if how == "login":
            return httpx.post(f"{server.url}/login", data={"key": f"guess{i}", "next": "/"},
                              timeout=60).status_code
        headers = bearer(f"guess{i}") if how == "bearer" else {"x-api-key": f"guess{i}"}
        return httpx.get(f"{server.url}/v1/models", headers=headers, timeout=60).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(guess, range(PER_CLIENT + 30)))
    assert codes.count(401) <= PER_CLIENT + 8  # a few in flight when the limit was reached
    assert codes.count(429) >= 20
    refused = httpx.get(f"{server.url}/v1/models", headers=bearer(KEY))
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) > 0
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_logging_out_revokes_the_session_token(server):
    with httpx.Client(base_url=server.url) as client:
        assert client.post("/login", data={"key": KEY, "next": "/"}).status_code == 303
        token = client.cookies.get("mlxchat_session")
        assert token and KEY not in token
        copy = {"Cookie": f"mlxchat_session={token}"}
        assert httpx.get(f"{server.url}/v1/models", headers=copy).status_code == 200
        client.post("/logout", headers={"Origin": server.url})
    assert httpx.get(f"{server.url}/v1/models", headers=copy).status_code == 401
    with httpx.Client(base_url=server.url) as again:  # a new login gets a different token
        again.post("/login", data={"key": KEY, "next": "/"})
        assert again.cookies.get("mlxchat_session") not in (None, token)
