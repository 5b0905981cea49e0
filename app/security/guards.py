"""Request guards for a server that runs on the user's own machine.

- DNS rebinding: a hostile page can point its own domain at 127.0.0.1, and the browser then sends
  that domain as `Host`. Only the bound host and the loopback names are accepted.
- Cross-site requests: a hostile page may POST forms or open WebSockets to localhost; the browser
  marks those with a foreign `Origin`. State-changing requests and WebSockets must come from our
  own origin, or carry no Origin at all (curl, the openai client, editors).
- The optional API key guards every route but `/health`, the static assets and the login page
  (api_key.py).
- Oversized or slowly trickled request bodies are refused before the app reads them.
"""

import asyncio
import fnmatch
import ipaddress
from typing import Callable, Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ..api.error_shapes import api_error, is_api_path

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
    """`Host`/`Origin` netloc -> lower-case host name without port (IPv6 brackets removed);
    "" for one that does not parse (`[`)."""
    try:
        return (urlsplit(f"//{netloc}").hostname or "").lower()
    except ValueError:
        return ""


def _origin_netloc(origin: str) -> str | None:
    """The host[:port] of an `Origin` header, None for one that does not parse (`http://[`)."""
    try:
        return urlsplit(origin).netloc.lower()
    except ValueError:
        return None


def same_origin(scope: Scope, origin: str, host: str) -> bool:
    """Whether `origin` is this server's own: its host[:port] is the request's `Host` and its
    scheme the one this request came by (`https://127.0.0.1:PORT` is another origin than the
    `http://` one this server serves)."""
    scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
    return origin.lower().startswith(f"{scheme}://") and _origin_netloc(origin) == host.lower()


# The UI never needs inline script, framing, or anything from another origin. `frame-ancestors`
# stops a hostile page from framing the UI to trick clicks (clickjacking). Other sites get no
# referrer; our own pages keep theirs, because under `no-referrer` a browser sends `Origin: null`
# with a plain form post (the login and logout forms), which `OriginGuard` refuses.
SECURITY_HEADERS = [
    (b"content-security-policy",
     b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
     b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
]


class Guard:
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


def refusal(scope: Scope, status: int, text: str, code: str) -> ASGIApp:
    if scope["type"] == "websocket":
        async def close(scope: Scope, receive: Receive, send: Send) -> None:
            # Closing before accepting makes the server answer the handshake with HTTP 403.
            await send({"type": "websocket.close", "code": 1008, "reason": text})
        return close
    if is_api_path(scope["path"]):
        return api_error(status, text, "invalid_request_error", code, path=scope["path"])
    return PlainTextResponse(text, status_code=status)


class HostGuard(Guard):
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
            return refusal(scope, 400, "Invalid Host header", "invalid_host")
        return None


class OriginGuard(Guard):
    """Refuses cross-origin writes and WebSockets (403). `allowed_origins` (`--allow-origin`,
    like Ollama's OLLAMA_ORIGINS; `*` matches any text, e.g. `chrome-extension://*`) lets those
    origins call the programmatic APIs — never the UI's pages, forms or chat socket."""

    def __init__(self, app: ASGIApp, allowed_origins: Iterable[str] = ()):
        super().__init__(app)
        self.allowed_origins = tuple(allowed_origins)

    def allows(self, scope: Scope, origin: str | None) -> bool:
        """Whether `origin` is one the user allowed, on an API path."""
        return origin is not None and is_api_path(scope["path"]) and \
            any(fnmatch.fnmatchcase(origin.lower(), p.lower()) for p in self.allowed_origins)

    def check(self, scope: Scope, headers: Headers) -> ASGIApp | None:
        if scope["type"] == "websocket" or scope["method"] not in _SAFE_METHODS:
            host = headers.get("host", "")
            origin = headers.get("origin")
            if self.allows(scope, origin):
                return None
            if headers.get("sec-fetch-site") == "cross-site" or \
                    (origin is not None and not same_origin(scope, origin, host)):
                return refusal(scope, 403, "Cross-origin request refused", "cross_origin")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origin = Headers(scope=scope).get("origin") if scope["type"] == "http" else None
        if not self.allows(scope, origin):
            return await super().__call__(scope, receive, send)
        if scope["method"] == "OPTIONS":  # a CORS preflight from an allowed origin
            return await PlainTextResponse("", status_code=204, headers={
                "access-control-allow-origin": origin,
                "access-control-allow-methods": "GET, POST, DELETE, OPTIONS",
                "access-control-allow-headers": "authorization, content-type, x-api-key",
                "access-control-max-age": "600", "vary": "Origin"})(scope, receive, send)

        async def with_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"access-control-allow-origin", origin.encode()),
                                                  (b"vary", b"Origin")]}
            await send(message)

        await super().__call__(scope, receive, with_cors)


MAX_BODY_BYTES = 8 * 1024 * 1024
BODY_TIMEOUT_S = 30.0


class BodyLimit:
    """Reads each HTTP request body here, before the app sees it: a `Content-Length` over the
    limit is refused at once (413) without reading anything; a chunked body is refused as soon as
    it grows past the limit; a body that does not arrive within `timeout_s` (a slow client holding
    a connection) gets 408. The app then reads the body from memory. Paths for which `streamed`
    is true (file uploads) pass unread: their route streams the body to disk under its own limits."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES,
                 timeout_s: float = BODY_TIMEOUT_S, streamed: Callable[[str], bool] = lambda p: False,
                 larger: Callable[[str], int | None] = lambda p: None):
        self.app = app
        self.max_bytes = max_bytes
        self.larger = larger  # a path's own, larger limit (requests that may carry images)
        self.timeout_s = timeout_s
        self.streamed = streamed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.streamed(scope["path"]):
            return await self.app(scope, receive, send)
        limit = self.larger(scope["path"]) or self.max_bytes
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await self._too_large(scope, receive, send, limit)
        try:
            body = await asyncio.wait_for(self._read(receive, limit), self.timeout_s)
        except _TooLarge:
            return await self._too_large(scope, receive, send, limit)
        except TimeoutError:
            response = api_error(408, "the request body did not arrive in time",
                                 "invalid_request_error", "request_timeout",
                                 headers={"Connection": "close"}, path=scope["path"])
            return await response(scope, receive, send)
        if body is None:  # the client left
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive, limit: int) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        response = api_error(413, f"the request body is larger than {limit} bytes",
                             "invalid_request_error", "request_too_large",
                             headers={"Connection": "close"}, path=scope["path"])
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass


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
