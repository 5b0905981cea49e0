"""The chat UI's pages and htmx fragments: conversations, their messages and settings."""

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from engine import DEFAULTABLE, PRESETS, Engine

from ..state import app_state
from ..storage import Conversation, Storage
from ..uploads.store import draft_uploads
from .picker import models_context
from .settings import SAMPLING_FIELDS, parse_settings_form, preset_settings, speculative_form
from .views import (conversation_of, current_id, message_views, not_found, parts, read_form,
                    render, settings_context)

async def index(request: Request) -> Response:
    storage, _ = parts(request)
    latest = storage.list_conversations(limit=1)
    conv = latest[0] if latest else _new_conversation(request, None)
    return RedirectResponse(f"/c/{conv.id}", status_code=303)


def _new_conversation(request: Request, copy_from: Conversation | None) -> Conversation:
    """Reuse an empty conversation if there is one; new ones keep the current settings."""
    storage, engine = parts(request)
    settings = copy_from.settings if copy_from else preset_settings("recommended")
    empty = storage.empty_conversation()
    if empty is not None:
        storage.update_conversation(empty.id, settings=settings)
        return storage.get_conversation(empty.id)
    return storage.create_conversation(model=engine.model_name, settings=settings)


async def conversation_page(request: Request) -> Response:
    state = app_state(request)
    storage, _ = parts(request)
    conv = conversation_of(request)
    if conv is None:
        return not_found()
    html = await asyncio.to_thread(lambda: render(  # a long conversation renders off the loop
        "chat.html", conversations=storage.list_conversations(), current_id=conv.id,
        q="", views=message_views(storage, storage.active_path(conv.id)), generating=False,
        draft_uploads=draft_uploads(storage, conv),
        **settings_context(conv, engine=state.engine), **models_context(request, conv.id),
    ))
    # Boosted navigation: make the address bar show the conversation (also after a redirect).
    return HTMLResponse(html, headers={"HX-Push-Url": f"/c/{conv.id}"} if
                        request.headers.get("hx-request") else None)


async def create_conversation(request: Request) -> Response:
    storage, _ = parts(request)
    form = await read_form(request)
    source = storage.get_conversation(int(form["from"])) if str(form.get("from", "")).isdigit() else None
    conv = _new_conversation(request, source)
    return RedirectResponse(f"/c/{conv.id}", status_code=303)


def _list_response(request: Request, q: str = "", extra: str = "") -> HTMLResponse:
    storage, _ = parts(request)
    html = render("_conversation_list.html", conversations=storage.list_conversations(q),
                   current_id=current_id(request), q=q)
    return HTMLResponse(html + extra)


async def conversation_list(request: Request) -> Response:
    return _list_response(request, request.query_params.get("q", ""))


async def rename_conversation(request: Request) -> Response:
    storage, _ = parts(request)
    conv = conversation_of(request)
    title = " ".join(request.headers.get("hx-prompt", "").split())[:200]
    if conv is None:
        return not_found()
    if title:
        storage.rename_conversation(conv.id, title)
    extra = render("_title.html", title=title, oob=True) if title and conv.id == current_id(request) else ""
    return _list_response(request, extra=extra)


async def delete_conversation(request: Request) -> Response:
    storage, _ = parts(request)
    conv = conversation_of(request)
    if conv is None:
        return not_found()
    storage.delete_conversation(conv.id)
    app_state(request).uploads.sweep()  # its files no other conversation has
    if conv.id == current_id(request):
        return Response(headers={"HX-Redirect": "/"})
    return _list_response(request)


async def select_version(request: Request) -> Response:
    storage, _ = parts(request)
    conv = conversation_of(request)
    if conv is None:
        return not_found()
    storage.select_branch(conv.id, int(request.path_params["mid"]))
    return HTMLResponse(render("_messages.html", conv=conv,
                                views=message_views(storage, storage.active_path(conv.id))))


async def message_fragment(request: Request) -> Response:
    """One message, plain (`/m/{id}`) or as an edit form (`/m/{id}/edit`)."""
    storage, _ = parts(request)
    conv = conversation_of(request)
    path = storage.active_path(conv.id) if conv else []
    view = next((v for v in message_views(storage, path) if v.m.id == int(request.path_params["mid"])), None)
    if view is None:
        return not_found()
    editing = request.url.path.endswith("/edit") and view.editable
    return HTMLResponse(render("_edit.html" if editing else "_message.html", conv=conv, v=view))


async def _settings_post(
        request: Request) -> tuple[Storage, Engine, Conversation, dict[str, str]] | None:
    """What a settings form post needs, or None when its conversation does not exist."""
    storage, engine = parts(request)
    conv = conversation_of(request)
    return None if conv is None else (storage, engine, conv, await read_form(request))


async def save_settings(request: Request) -> Response:
    post = await _settings_post(request)
    if post is None:
        return not_found()
    storage, engine, conv, form = post
    settings, errors = _parse_form(form, engine)
    if errors:  # show what was typed, next to what is wrong with it
        settings["sampling"] = {name: form.get(name, "") for name in SAMPLING_FIELDS}
    else:
        storage.update_conversation(conv.id, settings=_kept(conv, settings))
    return HTMLResponse(render("_settings.html", **settings_context(
        conv, errors, settings, saved=not errors, engine=engine)))


def _parse_form(form: dict[str, str], engine: Engine) -> tuple[dict[str, Any], dict[str, str]]:
    """The panel's settings and errors, max tokens also bounded by the model's context length
    (the bound a request meets: prompt + max_tokens must fit the context)."""
    settings, errors = parse_settings_form(form)
    asked, model = settings["sampling"].get("max_tokens"), engine.model
    if not errors and model is not None and asked is not None and asked > model.context_length:
        errors["max_tokens"] = (f"{SAMPLING_FIELDS['max_tokens'].label} must be at most "
                                f"{model.context_length}, this model's context length.")
    return settings, errors


def _not_preset(form: dict[str, str], conv: Conversation, engine: Engine) -> dict[str, Any]:
    """The values no preset sets (max tokens, seed): as the panel shows them where valid, else as
    the conversation has them."""
    saved = (conv.settings or {}).get("sampling") or {}
    kept = {}
    for name in SAMPLING_FIELDS:
        if name in DEFAULTABLE:
            continue
        value = saved.get(name)
        if name in form:
            settings, errors = _parse_form({name: form[name]}, engine)
            value = value if errors else settings["sampling"].get(name)
        if value is not None:
            kept[name] = value
    return kept


def _kept(conv: Conversation, panel: dict[str, Any]) -> dict[str, Any]:
    """The panel's settings over the conversation's: what the panel does not show (the opt-in to
    dropping old turns, a waiting draft) stays as it was."""
    return {**conv.settings, **panel}


async def apply_preset(request: Request) -> Response:
    post = await _settings_post(request)
    if post is None:
        return not_found()
    storage, engine, conv, form = post
    name = str(form.get("preset", ""))
    if name not in PRESETS:
        return HTMLResponse(render("_settings.html", **settings_context(
            conv, {"preset": f"Unknown preset {name!r}."}, engine=engine)))
    settings = preset_settings(name, str(form.get("system_prompt", "")).strip())
    settings["sampling"] = {**_not_preset(form, conv, engine), **settings["sampling"]}
    settings["speculative"] = speculative_form(form)[0]  # a preset sets sampling only
    storage.update_conversation(conv.id, settings=_kept(conv, settings))
    return HTMLResponse(render("_settings.html", **settings_context(conv, settings=settings,
                                                                        saved=True, engine=engine)))


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
]
