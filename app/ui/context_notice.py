"""The chat UI when a conversation outgrows the model's context: before a message is recorded, a
notice offers to drop the oldest turns (the conversation then keeps doing so) or to continue in a
new conversation with the same settings, the message waiting there in the composer."""

import json
from typing import Any, Mapping

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from engine import Engine

from ..context_window import TRUNCATE_MODES, overflow
from ..doc_index.answering import DocumentPrompt
from ..storage import Conversation, Storage
from ..uploads.documents import parse_attachments, with_documents
from ..uploads.store import attached_uploads, carry_uploads
from .prompt import engine_messages
from .views import conversation_of, not_found, parts, read_form, render


def prepare_send(engine: Engine, storage: Storage, conv: Conversation, action: str,
                 data: Mapping[str, Any], max_tokens: int,
                 docs: DocumentPrompt) -> tuple[Conversation, str | None]:
    """Before a message is recorded: the conversation (with the opt-in to dropping old turns saved
    and a waiting draft cleared) and, when the message would not fit, the notice to show instead.
    `docs` resolves uploaded documents (a large one counts nothing: it retrieves what fits)."""
    if action != "send":
        return conv, None
    settings = {k: v for k, v in conv.settings.items() if k != "draft"}
    if data.get("truncate") in TRUNCATE_MODES:
        settings["truncate"] = data["truncate"]
    if settings != conv.settings:
        storage.update_conversation(conv.id, settings=settings)
        conv = storage.get_conversation(conv.id)
    content = str(data.get("content") or "").strip()
    if settings.get("truncate") in TRUNCATE_MODES or not content:
        return conv, None
    attachments = parse_attachments(data.get("attachments"))
    uploads = attached_uploads(storage, conv.id, data.get("uploads"))
    new = {"role": "user", "content": with_documents(content, docs.documents(attachments + uploads, []))}
    too_long = overflow(engine, engine_messages(settings, docs.resolve(storage.active_path(conv.id)))
                        + [new], max_tokens)
    if too_long is None:
        return conv, None
    retry = {"action": "send", "content": content, "truncate": "oldest",
             "attachments": [json.dumps(a, ensure_ascii=False) for a in attachments],
             "uploads": [u["upload"] for u in uploads]}
    return conv, render("_context_notice.html", conv=conv, need=too_long[0], limit=too_long[1],
                        retry=retry, content=content, attachments=retry["attachments"])


async def continue_in_new(request: Request) -> Response:
    """A new conversation with this one's settings, the message waiting in its composer."""
    storage, _ = parts(request)
    conv = conversation_of(request)
    if conv is None:
        return not_found()
    form = await read_form(request)
    try:
        attachments = parse_attachments(json.loads(form.get("attachments") or "[]"))
    except (ValueError, TypeError):
        attachments = []
    settings = {k: v for k, v in conv.settings.items() if k not in ("draft", "truncate")}
    new = storage.create_conversation(model=conv.model, settings=settings)
    uploads = carry_uploads(storage, conv.id, new.id, form.get("uploads"))  # attached there too
    settings["draft"] = {"content": form.get("content", ""), "attachments": attachments,
                         "uploads": uploads}
    storage.update_conversation(new.id, settings=settings)
    return RedirectResponse(f"/c/{new.id}", status_code=303)


routes = [Route("/c/{cid:int}/continue", continue_in_new, methods=["POST"])]
