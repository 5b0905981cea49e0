"""The login page for a server started with `--api-key`: the browser trades the key for a session
cookie (HttpOnly: scripts cannot read it; SameSite=Strict: other sites cannot send it), and
logging out clears it (a POST, so `OriginGuard` refuses it from another site)."""

import asyncio
import math

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from ..security.api_key import LOGIN_PATH, LOGOUT_PATH, SESSION_COOKIE, client_address, session_cookie
from ..state import app_state
from .views import read_form, render

FAILED_LOGIN_DELAY_S = 1.0  # slows down guessing


def _next(target: str | None) -> str:
    """Where to go after logging in: a path on this server only (no `//host` or scheme)."""
    if target and target.startswith("/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/"


async def login_page(request: Request) -> Response:
    target = _next(request.query_params.get("next"))
    if not app_state(request).api_key:  # nothing to log in to
        return RedirectResponse(target, status_code=303)
    return HTMLResponse(render("login.html", next=target, error=None))


async def login(request: Request) -> Response:
    """A right key gets a new session token as the cookie; wrong ones count against this client's
    and everyone's failed attempts (429 past the limit, whatever the key)."""
    access = app_state(request).access
    form = await read_form(request)
    target = _next(form.get("next"))
    if not access.api_key:
        return RedirectResponse(target, status_code=303)
    client = client_address(request.scope)
    wait = access.retry_after(client)
    if wait is not None:
        return HTMLResponse(render("login.html", next=target,
                                   error="Too many wrong keys; try again in a minute."),
                            status_code=429, headers={"Retry-After": str(math.ceil(wait))})
    if not access.matches(str(form.get("key", "")).encode()):
        access.failed(client)
        await asyncio.sleep(FAILED_LOGIN_DELAY_S)
        return HTMLResponse(render("login.html", next=target, error="That is not this server's key."),
                            status_code=401)
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(SESSION_COOKIE, access.new_session(), httponly=True, samesite="strict",
                        path="/")
    return response


async def logout(request: Request) -> Response:
    """Revokes this browser's session token and clears its cookie."""
    state = app_state(request)
    state.access.revoke(session_cookie(request.headers))
    response = RedirectResponse(LOGIN_PATH if state.api_key else "/", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return response


routes = [
    Route(LOGIN_PATH, login_page),
    Route(LOGIN_PATH, login, methods=["POST"]),
    Route(LOGOUT_PATH, logout, methods=["POST"]),
]
