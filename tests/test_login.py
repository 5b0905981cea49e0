"""Logging out of a server started with an API key, against a real server on 127.0.0.1 (a tiny
model behind it): the chat page offers it only when a key is set; the POST clears the session
cookie and leads to the login page, after which the pages need the key again; another site
cannot log the user out."""

from contextlib import contextmanager
from typing import Iterator

import httpx
import pytest

from live_server import app_serving

pytestmark = pytest.mark.fast

KEY = "s3cret"


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    with app_serving(tiny_engine, tmp_path_factory.mktemp("login") / "db.sqlite", api_key=KEY) as s:
        yield s


@contextmanager
def logged_in(server) -> Iterator[httpx.Client]:
    """A client with a cookie jar, as a browser has, after logging in with the key."""
    with httpx.Client(base_url=server.url, headers={"Accept": "text/html"}) as client:
        r = client.post("/login", data={"key": KEY, "next": "/"}, follow_redirects=True)
        assert r.status_code == 200 and client.cookies.get("mlxchat_session")
        yield client


def test_logout_clears_the_session_and_leads_to_the_login_page(server):
    with logged_in(server) as client:
        page = client.get("/settings")  # Settings › API key
        assert 'action="/logout"' in page.text and "Log out" in page.text
        r = client.post("/logout", headers={"Origin": server.url})
        assert r.status_code == 303 and r.headers["location"] == "/login"
        cleared = r.headers["set-cookie"]
        assert cleared.startswith("mlxchat_session=") and "Max-Age=0" in cleared
        assert "HttpOnly" in cleared and "SameSite=strict" in cleared and "Path=/" in cleared
        assert not client.cookies.get("mlxchat_session")
        # The pages need the key again.
        again = client.get("/", follow_redirects=False)
        assert again.status_code == 303 and again.headers["location"].startswith("/login")
        assert 'type="password"' in client.get("/", follow_redirects=True).text


def test_another_site_cannot_log_the_user_out(server):
    with logged_in(server) as client:
        for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
            r = client.post("/logout", headers=headers)
            assert r.status_code == 403 and "set-cookie" not in r.headers
        assert client.get("/", follow_redirects=False).status_code in (200, 303)
        assert client.get("/conversations").status_code == 200  # still logged in


def test_a_stale_cookie_can_be_cleared(server):
    """Logging out needs no valid session: a cookie from another key is cleared all the same."""
    r = httpx.post(f"{server.url}/logout", headers={"Cookie": "mlxchat_session=stale"})
    assert r.status_code == 303 and "Max-Age=0" in r.headers["set-cookie"]


def test_no_logout_control_without_a_key(tiny_engine, tmp_path):
    with app_serving(tiny_engine, tmp_path / "db.sqlite") as s:
        page = httpx.get(s.url + "/", follow_redirects=True)
        assert page.status_code == 200 and "/logout" not in page.text
        # nothing to log in to: the login page sends the browser on
        login = httpx.get(s.url + "/login?next=/c/1", follow_redirects=False)
        assert login.status_code == 303 and login.headers["location"] == "/c/1"
