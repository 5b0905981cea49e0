"""Request guards for a server that runs on the user's own machine.

- DNS rebinding: a hostile page can point its own domain at 127.0.0.1, and the browser then sends
  that domain as `Host`. Only the bound host and the loopback names are accepted.
- Cross-site requests: a hostile page may POST forms or open WebSockets to localhost; the browser
  marks those with a foreign `Origin`. State-changing requests and WebSockets must come from our
  own origin, or carry no Origin at all (curl, the openai client, editors).
- The optional API key guards `/v1` for other local programs, compared in constant time.
"""

import hmac
import ipaddress
from typing import Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _hostname(netloc: str) -> str:
    """`Host`/`Origin` netloc -> lower-case host name without port (IPv6 brackets removed)."""
    return (urlsplit(f"//{netloc}").hostname or "").lower()


def api_error(status: int, message: str, type_: str, code: str | None = None,
              param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in the OpenAI format: `{"error": {"message", "type", "param", "code"}}`."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# The UI never needs inline script, framing, or anything from another origin. `frame-ancestors`
# stops a hostile page from framing the UI to trick clicks (clickjacking).
SECURITY_HEADERS = [
    (b"content-security-policy",
     b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
     b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
]


class _Guard:
    """One check on every HTTP request and WebSocket handshake; `refuse` answers in its place."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            refusal = self.check(scope, Headers(scope=scope))
            if refusal is not None:
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    def check(self, scope: Scope, headers: Headers) -> ASGIApp | None:
        """None to let the request through, else the response that refuses it."""
        raise NotImplementedError


def _refusal(scope: Scope, status: int, text: str) -> ASGIApp:
    if scope["type"] == "websocket":
        async def close(scope: Scope, receive: Receive, send: Send) -> None:
            # Closing before accepting makes the server answer the handshake with HTTP 403.
            await send({"type": "websocket.close", "code": 1008, "reason": text})
        return close
    return PlainTextResponse(text, status_code=status)


class HostGuard(_Guard):
    """Refuses a `Host` that is not ours (400): DNS rebinding. `allowed_hosts=None` accepts any
    Host: only for `--allow-remote` on a wildcard address, where the server is meant to be reached
    under names we cannot know."""

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str] | None):
        super().__init__(app)
        self.allowed_hosts = (
            None if allowed_hosts is None else {h.lower().strip("[]") for h in allowed_hosts}
        )

    def check(self, scope: Scope, headers: Headers) -> ASGIApp | None:
        if self.allowed_hosts is not None and \
                _hostname(headers.get("host", "")) not in self.allowed_hosts:
            return _refusal(scope, 400, "Invalid Host header")
        return None


class OriginGuard(_Guard):
    """Refuses cross-origin writes and WebSockets (403)."""

    def check(self, scope: Scope, headers: Headers) -> ASGIApp | None:
        if scope["type"] == "websocket" or scope["method"] not in _SAFE_METHODS:
            host = headers.get("host", "")
            origin = headers.get("origin")
            if headers.get("sec-fetch-site") == "cross-site" or \
                    (origin is not None and urlsplit(origin).netloc.lower() != host.lower()):
                return _refusal(scope, 403, "Cross-origin request refused")
        return None


class ApiKeyGuard(_Guard):
    """With a key set, `/v1/` requires `Authorization: Bearer <key>` (401), compared in constant
    time."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        super().__init__(app)
        self.api_key = api_key

    def check(self, scope: Scope, headers: Headers) -> ASGIApp | None:
        if self.api_key and scope["path"].startswith("/v1/"):
            auth = headers.get("authorization", "")
            given = auth[7:] if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                return api_error(401, "Incorrect or missing API key (send 'Authorization: "
                                      "Bearer <key>').", "invalid_request_error", "invalid_api_key")
        return None


class SecurityHeaders:
    """Adds SECURITY_HEADERS to every HTTP response of the app inside it."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        await self.app(scope, receive, with_headers)
