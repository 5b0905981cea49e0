"""The chat UI: server-rendered pages and htmx fragments, and a WebSocket per open conversation.

The browser sends `{"action": "send" | "edit" | "regenerate" | "stop", ...}` over the socket (htmx
`ws-send`); the server answers with HTML fragments that htmx swaps in by id (out-of-band swaps):
the new messages, the growing answer, the final answer with its statistics, the Stop/Send button.
"""

import asyncio
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator
from urllib.parse import parse_qsl

import jinja2

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from engine import PRESETS, DraftChoice, Engine, EngineError, RequestHandle
from web import __file__ as _web_init

from .chat import (SAMPLING_FIELDS, engine_messages, parse_settings_form, preset_settings,
                   sampling_params, speculative_form, speculative_options, start_turn)
from .markdown import render_markdown, render_plain
from .sse import sse
from .storage import Conversation, Message, Storage

# Autoescaping everywhere: titles and user text are escaped; model output is inserted only after
# `render_markdown` has sanitised it.
templates = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(_web_init).parent / "templates"),
                               autoescape=True)

FLUSH_EVERY_S = 0.05  # coalesce tokens into one swap at most this often
SAVE_EVERY_S = 1.0  # how much streamed text a crash can lose at most


def _size(n: int | None) -> str:
    if not n:
        return "not downloaded"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB") else f"{n:.1f} {unit}"
        n /= 1024
    return ""


templates.filters["filesize"] = _size


# --- view models --------------------------------------------------------------------------------

@dataclass(frozen=True)
class MessageView:
    m: Message
    html: str
    index: int  # 1-based position among its versions
    count: int
    prev_id: int | None
    next_id: int | None
    editable: bool  # the last user message
    regenerable: bool  # the last answer


def message_views(storage: Storage, path: list[Message]) -> list[MessageView]:
    last_user = next((m.id for m in reversed(path) if m.role == "user"), None)
    last_answer = path[-1].id if path and path[-1].role == "assistant" else None
    views = []
    for m in path:
        versions = [s.id for s in storage.siblings(m)]
        i = versions.index(m.id)
        views.append(MessageView(
            m=m,
            html=render_markdown(m.content) if m.role == "assistant" else render_plain(m.content),
            index=i + 1, count=len(versions),
            prev_id=versions[i - 1] if i > 0 else None,
            next_id=versions[i + 1] if i + 1 < len(versions) else None,
            editable=m.id == last_user, regenerable=m.id == last_answer,
        ))
    return views


@dataclass
class ModelSwitch:
    """The one model load that may be in progress, shown in the model picker."""

    name: str | None = None
    stage: str = ""
    started: float = 0.0
    error: str | None = None
    task: asyncio.Task | None = None

    @property
    def loading(self) -> bool:
        return self.task is not None and not self.task.done()

    def describe(self) -> str:
        return f"{self.stage.capitalize() or 'Loading'} {self.name}… {time.time() - self.started:.0f} s"


def _render(name: str, **context: Any) -> str:
    return templates.get_template(name).render(**context)


def _app(conn: Request | WebSocket) -> tuple[Storage, Engine]:
    return conn.app.state.storage, conn.app.state.engine


def _models_context(request: Request) -> dict[str, Any]:
    engine = request.app.state.engine
    return {"models": engine.list_models(), "current_model": engine.model_name,
            "switch": request.app.state.switch}


def _settings_context(conv: Conversation, errors: dict[str, str] | None = None,
                      settings: dict[str, Any] | None = None, saved: bool = False,
                      engine: Engine | None = None) -> dict[str, Any]:
    model = engine.model if engine is not None else None
    return {"conv": conv, "settings": settings or conv.settings, "errors": errors or {},
            "fields": SAMPLING_FIELDS, "presets": PRESETS, "saved": saved,
            "drafts": [(d.draft, draft_label(d)) for d in model.drafts] if model else []}


def draft_label(choice: DraftChoice) -> str:
    """How the settings panel names a draft."""
    if choice.kind == "truncated":
        return f"own first {choice.layers} of {choice.of_layers} layers"
    return {"self-q4": "own 4-bit weights", "mtp": "MTP head"}[choice.kind]


def _family(engine: Engine) -> str | None:
    model = engine.model
    return model.family if model else None


def _current_id(request: Request) -> int | None:
    """The conversation the page shows, from htmx's HX-Current-URL header."""
    match = re.search(r"/c/(\d+)", request.headers.get("hx-current-url", ""))
    return int(match.group(1)) if match else None


async def _form(request: Request) -> dict[str, str]:
    """The url-encoded form htmx and plain forms post (no multipart: nothing is uploaded)."""
    return dict(parse_qsl((await request.body()).decode("utf-8", "replace"), keep_blank_values=True))


def _conversation(request: Request) -> Conversation | None:
    return request.app.state.storage.get_conversation(int(request.path_params["cid"]))


def _not_found() -> HTMLResponse:
    return HTMLResponse("Conversation not found", status_code=404)


# --- pages and fragments ------------------------------------------------------------------------

async def index(request: Request) -> Response:
    storage, _ = _app(request)
    latest = storage.list_conversations(limit=1)
    conv = latest[0] if latest else _new_conversation(request, None)
    return RedirectResponse(f"/c/{conv.id}", status_code=303)


def _new_conversation(request: Request, copy_from: Conversation | None) -> Conversation:
    """Reuse an empty conversation if there is one; new ones keep the current settings."""
    storage, engine = _app(request)
    settings = copy_from.settings if copy_from else preset_settings("recommended", _family(engine))
    empty = storage.empty_conversation()
    if empty is not None:
        storage.update_conversation(empty.id, settings=settings)
        return storage.get_conversation(empty.id)
    return storage.create_conversation(model=engine.model_name, settings=settings)


async def conversation_page(request: Request) -> Response:
    storage, _ = _app(request)
    conv = _conversation(request)
    if conv is None:
        return _not_found()
    html = _render(
        "chat.html", conversations=storage.list_conversations(), current_id=conv.id,
        q="", views=message_views(storage, storage.active_path(conv.id)), generating=False,
        **_settings_context(conv, engine=request.app.state.engine), **_models_context(request),
    )
    # Boosted navigation: make the address bar show the conversation (also after a redirect).
    return HTMLResponse(html, headers={"HX-Push-Url": f"/c/{conv.id}"} if
                        request.headers.get("hx-request") else None)


async def create_conversation(request: Request) -> Response:
    storage, _ = _app(request)
    form = await _form(request)
    source = storage.get_conversation(int(form["from"])) if str(form.get("from", "")).isdigit() else None
    conv = _new_conversation(request, source)
    return RedirectResponse(f"/c/{conv.id}", status_code=303)


def _list_response(request: Request, q: str = "", extra: str = "") -> HTMLResponse:
    storage, _ = _app(request)
    html = _render("_conversation_list.html", conversations=storage.list_conversations(q),
                   current_id=_current_id(request), q=q)
    return HTMLResponse(html + extra)


async def conversation_list(request: Request) -> Response:
    return _list_response(request, request.query_params.get("q", ""))


async def rename_conversation(request: Request) -> Response:
    storage, _ = _app(request)
    conv = _conversation(request)
    title = " ".join(request.headers.get("hx-prompt", "").split())[:200]
    if conv is None:
        return _not_found()
    if title:
        storage.rename_conversation(conv.id, title)
    extra = _render("_title.html", title=title, oob=True) if title and conv.id == _current_id(request) else ""
    return _list_response(request, extra=extra)


async def delete_conversation(request: Request) -> Response:
    storage, _ = _app(request)
    conv = _conversation(request)
    if conv is None:
        return _not_found()
    storage.delete_conversation(conv.id)
    if conv.id == _current_id(request):
        return Response(headers={"HX-Redirect": "/"})
    return _list_response(request)


async def select_version(request: Request) -> Response:
    storage, _ = _app(request)
    conv = _conversation(request)
    if conv is None:
        return _not_found()
    storage.select_branch(conv.id, int(request.path_params["mid"]))
    return HTMLResponse(_render("_messages.html", conv=conv,
                                views=message_views(storage, storage.active_path(conv.id))))


async def message_fragment(request: Request) -> Response:
    """One message, plain (`/m/{id}`) or as an edit form (`/m/{id}/edit`)."""
    storage, _ = _app(request)
    conv = _conversation(request)
    path = storage.active_path(conv.id) if conv else []
    view = next((v for v in message_views(storage, path) if v.m.id == int(request.path_params["mid"])), None)
    if view is None:
        return _not_found()
    editing = request.url.path.endswith("/edit") and view.editable
    return HTMLResponse(_render("_edit.html" if editing else "_message.html", conv=conv, v=view))


async def save_settings(request: Request) -> Response:
    storage, engine = _app(request)
    conv = _conversation(request)
    if conv is None:
        return _not_found()
    form = await _form(request)
    settings, errors = parse_settings_form(form)
    if errors:  # show what was typed, next to what is wrong with it
        settings["sampling"] = {name: form.get(name, "") for name in SAMPLING_FIELDS}
    else:
        storage.update_conversation(conv.id, settings=settings)
    return HTMLResponse(_render("_settings.html", **_settings_context(
        conv, errors, settings, saved=not errors, engine=engine)))


async def apply_preset(request: Request) -> Response:
    storage, engine = _app(request)
    conv = _conversation(request)
    if conv is None:
        return _not_found()
    form = await _form(request)
    name = str(form.get("preset", ""))
    if name not in PRESETS:
        return HTMLResponse(_render("_settings.html", **_settings_context(
            conv, {"preset": f"Unknown preset {name!r}."}, engine=engine)))
    settings = preset_settings(name, _family(engine),
                               str(form.get("system_prompt", "")).strip())
    settings["speculative"] = speculative_form(form)[0]  # a preset sets sampling only
    storage.update_conversation(conv.id, settings=settings)
    return HTMLResponse(_render("_settings.html", **_settings_context(conv, settings=settings,
                                                                        saved=True, engine=engine)))


# --- model picker -------------------------------------------------------------------------------

async def switch_model(request: Request) -> Response:
    engine = request.app.state.engine
    switch: ModelSwitch = request.app.state.switch
    name = str((await _form(request)).get("name", ""))
    if not switch.loading and name != engine.model_name:
        if name not in {m.name for m in engine.list_models()}:
            switch.error = f"Unknown model {name!r}."
        else:
            switch.name, switch.stage, switch.started, switch.error = name, "", time.time(), None

            def progress(stage: str) -> None:
                switch.stage = stage

            async def load() -> None:
                try:
                    await asyncio.to_thread(engine.switch_model, name, progress=progress)
                except EngineError as exc:
                    switch.error = f"Could not load {name}: {exc}"

            switch.task = asyncio.create_task(load())
    return HTMLResponse(_render("_models.html", **_models_context(request)))


async def model_progress(request: Request) -> Response:
    """Server-sent events while a model loads: `progress` text, then `done` with the new picker."""
    switch: ModelSwitch = request.app.state.switch

    async def events() -> AsyncIterator[str]:
        while switch.loading:
            yield sse(switch.describe(), "progress")
            await asyncio.sleep(0.5)
        yield sse(_render("_models.html", **_models_context(request)), "done")

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# --- the chat socket ----------------------------------------------------------------------------

@dataclass
class _Generation:
    """The answer a socket is generating: the task streaming it and, once submitted, its handle."""

    task: asyncio.Task | None = None
    handle: RequestHandle | None = None
    stop_requested: bool = False

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def stop(self) -> None:
        self.stop_requested = True
        if self.handle is not None:
            self.handle.cancel()


async def chat_socket(ws: WebSocket) -> None:
    storage, _ = _app(ws)
    conv = storage.get_conversation(int(ws.path_params["cid"]))
    if conv is None:
        await ws.close(code=4404)
        return
    await ws.accept()
    current: _Generation | None = None
    try:
        while True:
            data = await ws.receive_json()
            action = data.get("action") if isinstance(data, dict) else None
            if action == "stop":
                if current:
                    current.stop()
            elif current and current.running:
                await _notice(ws, "Still answering: stop it first or wait for the end.")
            else:
                current = _Generation()
                current.task = asyncio.create_task(_respond(ws, conv.id, action, data, current))
    except (WebSocketDisconnect, ValueError):  # closed, or not JSON
        pass
    finally:
        if current and current.running:
            current.stop()
            await asyncio.wait([current.task])  # let it save the partial answer


async def _notice(ws: WebSocket, text: str) -> None:
    await ws.send_text(_render("_notice.html", text=text))


async def _respond(ws: WebSocket, cid: int, action: str, data: dict[str, Any],
                   gen: _Generation) -> None:
    """One turn: record the user's side, create the answer, stream it, finalise it."""
    storage, engine = _app(ws)
    conv = storage.get_conversation(cid)
    title = conv.title
    try:
        turn = start_turn(storage, conv, action, data)
        params = sampling_params(conv.settings)
        speculative = speculative_options(conv.settings)
    except (ValueError, EngineError) as exc:
        await _notice(ws, str(exc))
        return
    answer = storage.add_message(cid, turn.parent_id, "assistant", "", state="streaming",
                                 model=engine.model_name, sampling=params.to_dict())
    storage.update_conversation(cid, model=engine.model_name)  # the model it last talked to
    path = storage.active_path(cid)
    views = message_views(storage, path)
    if turn.rerender:
        opening = _render("_messages.html", conv=conv, views=views, oob=True)
    else:
        opening = _render("_append.html", conv=conv, views=views[-2:], first=len(views) == 2)
    conv = storage.get_conversation(cid)
    if conv.title != title:  # the first message named the conversation
        opening += _render("_title.html", title=conv.title, oob=True)
        opening += _render("_conversation_list.html", conversations=storage.list_conversations(),
                           current_id=cid, q="", oob=True)
    opening += _render("_composer_actions.html", generating=True, oob=True)

    text, final, error = "", None, None
    try:
        await ws.send_text(opening)
        gen.handle = engine.submit(messages=engine_messages(conv.settings, path[:-1]), params=params,
                                   speculative=speculative)
        if gen.stop_requested:  # Stop pressed before the request existed
            gen.handle.cancel()
        with ws.app.state.runs.track(gen.handle):
            last_flush = last_save = time.monotonic()
            async for event in gen.handle.stream():
                if event.kind == "done":
                    final = event
                    break
                text += event.text
                now = time.monotonic()
                if now - last_save >= SAVE_EVERY_S:
                    storage.save_partial(answer.id, text)
                    last_save = now
                if now - last_flush >= FLUSH_EVERY_S:
                    await ws.send_text(_render("_answer_body.html", mid=answer.id,
                                               html=render_markdown(text)))
                    last_flush = now
    except EngineError as exc:
        error = str(exc)
    except (WebSocketDisconnect, RuntimeError):
        pass  # the page went away: what we have is saved below
    finally:
        _finish(storage, answer.id, text, final, error)
    views = message_views(storage, storage.active_path(cid))
    try:
        await ws.send_text(_render("_message.html", conv=conv, v=views[-1], oob=True)
                           + _render("_composer_actions.html", generating=False, oob=True))
    except (WebSocketDisconnect, RuntimeError):
        pass


def _finish(storage: Storage, mid: int, text: str, final: Any, error: str | None) -> None:
    if final is None:
        storage.finish_message(mid, text, "failed" if error else "stopped",
                                      finish_reason="failed" if error else "cancelled", error=error)
        return
    reason = final.finish_reason
    state = {"cancelled": "stopped", "failed": "failed"}.get(reason, "done")
    t = final.timings
    storage.finish_message(
        mid, text, state, finish_reason=reason, error=final.error,
        ttft_ms=t.ttft_s * 1000 if t.ttft_s is not None else None, tokens_per_s=t.tokens_per_s,
        prompt_tokens=final.usage.prompt_tokens, completion_tokens=final.usage.completion_tokens,
        cached_tokens=final.usage.cached_tokens, speculative=final.stats.get("speculative"),
    )


routes = [
    Route("/", index),
    Route("/conversations", conversation_list),
    Route("/conversations", create_conversation, methods=["POST"]),
    Route("/c/{cid:int}", conversation_page),
    Route("/c/{cid:int}/rename", rename_conversation, methods=["POST"]),
    Route("/c/{cid:int}/delete", delete_conversation, methods=["POST"]),
    Route("/c/{cid:int}/select/{mid:int}", select_version, methods=["POST"]),
    Route("/c/{cid:int}/m/{mid:int}", message_fragment),
    Route("/c/{cid:int}/m/{mid:int}/edit", message_fragment),
    Route("/c/{cid:int}/settings", save_settings, methods=["POST"]),
    Route("/c/{cid:int}/settings/preset", apply_preset, methods=["POST"]),
    Route("/models/switch", switch_model, methods=["POST"]),
    Route("/models/progress", model_progress),
    WebSocketRoute("/c/{cid:int}/ws", chat_socket),
]
