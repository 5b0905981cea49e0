"""The API key's guard: with `--api-key`, every route but the liveness probe, the page's assets
and the login page needs the key (programs) or a login session's cookie (the browser: HttpOnly,
SameSite=Strict, a random token kept server-side and revoked at logout; the login page is
app/ui/login.py). Failed attempts are limited per client address and in all (key_access.py)."""

import math
from urllib.parse import quote

from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse, RedirectResponse
from starlette.types import ASGIApp, Scope

from ..api.error_shapes import api_error
from .guards import Guard, refusal
from .key_access import KeyAccess

SESSION_COOKIE = "mlxchat_session"
LOGIN_PATH = "/login"
LOGOUT_PATH = "/logout"
# Reachable without the key: the liveness probe, the page's assets, the login page itself, and
# logging out (it only clears the cookie, so a stale one can be cleared too).
_OPEN_PATHS = ("/health", LOGIN_PATH, LOGOUT_PATH)
_OPEN_PREFIXES = ("/static/",)


class ApiKeyGuard(Guard):
    """With a key set, every route but `_OPEN_PATHS` needs the key (`Authorization: Bearer <key>`
    or `x-api-key: <key>`) or a session cookie from the login page (`access`: key_access.py,
    which also limits failed attempts: 429 with Retry-After). A browser navigating to a page is
    sent to the login page; htmx is told to go there (`HX-Redirect`); anything else gets 401 in
    the OpenAI format; a WebSocket handshake is refused (403)."""

    def __init__(self, app: ASGIApp, access: KeyAccess):
        super().__init__(app)
        self.access = access

    def check(self, scope: Scope, headers: Headers) -> ASGIApp | None:
        path = scope["path"]
        if not self.access.api_key or path in _OPEN_PATHS or path.startswith(_OPEN_PREFIXES):
            return None
        if self.access.session_valid(session_cookie(headers)):
            return None
        auth = headers.get("authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else headers.get("x-api-key")
        if given is not None:
            client = client_address(scope)
            wait = self.access.retry_after(client)
            if wait is not None:
                return api_error(429, "Too many wrong API keys; try again later.", "rate_limit_exceeded",
                                 "too_many_attempts", headers={"Retry-After": str(math.ceil(wait))},
                                 path=path)
            if self.access.matches(given.encode("latin-1", "replace")):  # header bytes as sent
                return None
            self.access.failed(client)
        if scope["type"] == "websocket":
            return refusal(scope, 403, "Log in first", "invalid_api_key")
        login = f"{LOGIN_PATH}?next={quote(path)}"
        if headers.get("hx-request"):
            return PlainTextResponse("Log in first", status_code=401, headers={"HX-Redirect": login})
        if scope["method"] == "GET" and "text/html" in headers.get("accept", ""):
            return RedirectResponse(login, status_code=303)
        return api_error(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>' "
                              "or 'x-api-key: <key>').", "invalid_request_error",
                         "invalid_api_key", path=path)


def client_address(scope: Scope) -> str:
    """The peer's address: what failed attempts are counted by."""
    client = scope.get("client")
    return client[0] if client else "unknown"


def session_cookie(headers: Headers) -> str:
    """The login session token the request carries (its cookie), or ""."""
    for part in headers.get("cookie", "").split(";"):
        key, _, value = part.strip().partition("=")
        if key == SESSION_COOKIE:
            return value
    return ""
