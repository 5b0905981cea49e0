"""What the UI's pages, picker and socket share: the templates, view models and request helpers."""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.websockets import WebSocket

from engine import PRESETS, DraftChoice, Engine
from web import __file__ as _web_init

from ..doc_index.answering import Citation, citations
from ..security.socket_limits import WS_MAX_BYTES
from ..state import app_state
from ..storage import Conversation, Message, Storage
from .markdown import render_markdown, render_plain, render_tool_calls, render_tool_result
from .settings import SAMPLING_FIELDS, default_sources, preset_settings

# Autoescaping everywhere: titles and user text are escaped; model output is inserted only after
# `render_markdown` has sanitised it.
templates = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(_web_init).parent / "templates"),
                               autoescape=True)

def _size(n: int | None) -> str:
    if not n:
        return "not downloaded"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB") else f"{n:.1f} {unit}"
        n /= 1024
    return ""


templates.filters["filesize"] = _size
templates.globals["ws_max_bytes"] = WS_MAX_BYTES  # the page refuses larger frames itself


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
    citations: tuple[Citation, ...] = ()  # an answer's document chunks (app/doc_index)


def _body(m: Message) -> str:
    """A message's HTML: answers as sanitised markdown (with their tool calls), the rest as typed."""
    if m.role == "assistant":
        return render_markdown(m.content) + render_tool_calls(m.tool_calls or [],
                                                              (m.tool_meta or {}).get("calls"))
    if m.role == "tool":
        return render_tool_result(m.content, m.tool_call_id, m.tool_meta)
    return render_plain(m.content)


def message_views(storage: Storage, path: list[Message]) -> list[MessageView]:
    last_user = next((m.id for m in reversed(path) if m.role == "user"), None)
    last_answer = path[-1].id if path and path[-1].role == "assistant" else None
    views, previous = [], None
    for m in path:
        versions = [s.id for s in storage.siblings(m)]
        i = versions.index(m.id)
        views.append(MessageView(
            m=m,
            html=_body(m),
            index=i + 1, count=len(versions),
            prev_id=versions[i - 1] if i > 0 else None,
            next_id=versions[i + 1] if i + 1 < len(versions) else None,
            editable=m.id == last_user, regenerable=m.id == last_answer,
            citations=tuple(citations(storage, previous))
            if m.role == "assistant" and previous is not None and previous.role == "user" else (),
        ))
        previous = m
    return views


def render(template: str, **context: Any) -> str:
    return templates.get_template(template).render(**context)


def parts(conn: Request | WebSocket) -> tuple[Storage, Engine]:
    state = app_state(conn)
    return state.storage, state.engine


def settings_context(conv: Conversation, errors: dict[str, str] | None = None,
                      settings: dict[str, Any] | None = None, saved: bool = False,
                      engine: Engine | None = None) -> dict[str, Any]:
    model = engine.model if engine is not None else None
    # Conversations from old versions or foreign imports may lack keys: fill them as a new chat has.
    settings = {**preset_settings("recommended"), **(settings or conv.settings or {})}
    if not isinstance(settings.get("sampling"), dict):
        settings["sampling"] = {}
    return {"conv": conv, "settings": settings, "errors": errors or {},
            "fields": SAMPLING_FIELDS, "presets": PRESETS, "saved": saved,
            "sources": default_sources(settings, model.defaults if model else None),
            "defaults": model.defaults if model else None,
            "drafts": [(d.draft, draft_label(d)) for d in model.drafts] if model else []}


def draft_label(choice: DraftChoice) -> str:
    """How the settings panel names a draft."""
    if choice.kind == "truncated":
        return f"own first {choice.layers} of {choice.of_layers} layers"
    return {"self-q4": "own 4-bit weights", "mtp": "MTP head"}[choice.kind]


def current_id(request: Request) -> int | None:
    """The conversation the page shows, from htmx's HX-Current-URL header."""
    match = re.search(r"/c/(\d+)", request.headers.get("hx-current-url", ""))
    return int(match.group(1)) if match else None


async def read_form(request: Request) -> dict[str, str]:
    """The url-encoded form htmx and plain forms post (no multipart: nothing is uploaded)."""
    return dict(parse_qsl((await request.body()).decode("utf-8", "replace"), keep_blank_values=True))


def conversation_of(request: Request) -> Conversation | None:
    return app_state(request).storage.get_conversation(int(request.path_params["cid"]))


def not_found() -> HTMLResponse:
    return HTMLResponse("Conversation not found", status_code=404)
