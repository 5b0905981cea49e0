"""Documents a client sends inside an API request, one declaration for every API shape: a
`DocumentInput` as the part `document_part` makes, which the adapters produce from their own wire
shapes and `read_documents` turns into the text the model reads, before the one engine request.

Wire shapes (each adapter translates its own):
- Anthropic `document` blocks in user turns and inside `tool_result`: a base64 source (PDF), a
  text source, a content source (its text, and its images as image parts).
- OpenAI chat `file` parts (`{"type": "file", "file": {"filename", "file_data": <data URL>}}`).
- OpenAI Responses `input_file` parts (`filename`, `file_data`: a data URL or base64), in user
  messages and inside `function_call_output`.

Formats: PDF (its text read by the app's PDF reader, in a child process with limits:
app/uploads/pdf_text.py) and UTF-8 text (plain, Markdown, code, CSV, JSON). A part whose media type is
an image is an image (app/api/images.py). Refused with a clear 4xx, the field named: more than
`MAX_DOCUMENT_BYTES` per document (413 `document_too_large`), more than `MAX_DOCUMENTS` in a
request (`too_many_documents`), bad base64 (`invalid_document`), another format
(`unsupported_document_format`), a URL or a file id (`document_url_not_allowed`: the app never
fetches from the network, and keeps no Files API), a PDF that cannot be read or has no text
(`unreadable_document`, the reader's reason).

In the prompt a document is `<document name="...">text</document>` where the client put it
(app/uploads/documents.py `with_documents`, as attachments in the chat UI). A document larger than half
the context (app/doc_index/answering.py `whole`) is given by retrieval instead: its chunks, indexed
once by the file's sha256 and kept with the uploads (app/uploads/request_files.py), that best
answer the question (the text of the nearest user message at or before the document: for a file
attached to the newest turn, the request's last user text), at most `EXCERPT_FRACTION` of the
context each. Both depend only on the document and the messages up to it, so an agent session that
sends the same file round after round renders the same prompt every round and reuses it from the
prefix cache.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from engine import count_tokens

from ..doc_index.answering import MAX_EXCERPTS, excerpts, ranked, whole
from ..state import AppState
from ..uploads.documents import NotAttachable, with_documents
from ..uploads.request_files import ReadFile, read_request_file
from .errors import ApiError
from .images import image_part, read_base64

MAX_DOCUMENT_BYTES = 32 * 1000 * 1000  # as Anthropic's own request limit; the body allows it
MAX_DOCUMENTS = 8
EXCERPT_FRACTION = 0.25  # of the context, for the excerpts of one document given by retrieval
EXCERPT_OVERHEAD = 12  # tokens of an excerpt's "[page N]" line and the blank lines around it

_DATA_URL = re.compile(r"data:([\w/+.-]*)((?:;[\w=.-]+)*?);base64,(.*)", re.S)
_TEXT_TYPES = ("text/", "application/json", "application/x-ndjson", "application/xml",
               "application/yaml", "application/x-yaml", "application/csv")


@dataclass(frozen=True)
class DocumentInput:
    """A document's bytes (text as UTF-8), its name and the sha256 of the bytes; `where` names
    the part in error messages and `param` is the request field they point at."""

    name: str
    data: bytes = field(repr=False)
    sha256: str
    where: str = field(default="", compare=False)
    param: str | None = field(default=None, compare=False)


def document_part(doc: DocumentInput) -> dict[str, Any]:
    """The engine message part of a document, until `read_documents` turns it into text."""
    return {"type": "document", "document": doc}


def is_document(part: Any) -> bool:
    return isinstance(part, dict) and isinstance(part.get("document"), DocumentInput)


def _name(name: Any, default: str) -> str:
    """A name safe to put in the prompt's `name` attribute: one line, bounded."""
    text = name if isinstance(name, str) and name.strip() else default
    return " ".join(text.split())[:200]


def _document(data: bytes, name: Any, where: str, param: str | None) -> DocumentInput:
    if not data:
        raise ApiError(400, f"{where} is empty (0 bytes)", param, "invalid_document")
    if len(data) > MAX_DOCUMENT_BYTES:
        raise ApiError(413, f"{where} is {len(data)} bytes; the limit is {MAX_DOCUMENT_BYTES} "
                            "bytes per document", param, "document_too_large")
    default = "document.pdf" if data.startswith(b"%PDF-") else "document.txt"
    return DocumentInput(_name(name, default), data, hashlib.sha256(data).hexdigest(), where,
                         param)


def _check_media(media: str, where: str, param: str | None) -> None:
    if media and media != "application/pdf" and not media.startswith(_TEXT_TYPES):
        raise ApiError(400, f"{where} has media type {media}; send a PDF or a text document "
                            "(text, Markdown, code, CSV, JSON)", param,
                       "unsupported_document_format")


def from_base64(value: Any, media: str, name: Any, where: str,
                param: str | None = None) -> dict[str, Any]:
    """The part for a document sent as base64 with its media type: a document, or an image part
    when `media` is an image's."""
    param = param or where
    media = (media or "").lower()
    if media.startswith("image/"):
        return image_part(read_base64(value, where, param))  # checked; decoded when needed
    _check_media(media, where, param)
    if not isinstance(value, str):
        raise ApiError(400, f"{where} must be a base64 string", param, "invalid_document")
    if len(value) * 3 // 4 > MAX_DOCUMENT_BYTES + 3:
        raise ApiError(413, f"{where} is larger than the limit of {MAX_DOCUMENT_BYTES} bytes per "
                            "document", param, "document_too_large")
    try:
        data = base64.b64decode(value.strip(), validate=False)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where} is not valid base64", param, "invalid_document") from None
    return document_part(_document(data, name, where, param))


def from_data(value: Any, name: Any, where: str, param: str | None = None) -> dict[str, Any]:
    """The part for OpenAI's `file_data`: a base64 data URL (or bare base64, as some clients
    send); an http(s) URL or anything else is refused."""
    param = param or where
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{where} must be a base64 data URL (data:application/pdf;base64,...)",
                       param, "invalid_document")
    if re.match(r"https?://", value, re.I):
        raise url_refused(where, param)
    match = _DATA_URL.fullmatch(value)
    if match:
        return from_base64(match.group(3), match.group(1), name, where, param)
    if value.startswith("data:"):
        raise ApiError(400, f"{where} must be a base64 data URL (data:application/pdf;base64,...)",
                       param, "invalid_document")
    return from_base64(value, "", name, where, param)


def from_text(text: Any, name: Any, where: str, param: str | None = None) -> dict[str, Any]:
    """The part for a document given as text."""
    param = param or where
    if not isinstance(text, str):
        raise ApiError(400, f"{where} must be a string", param, "invalid_document")
    return document_part(_document(text.encode("utf-8"), name, where, param))


def url_refused(where: str, param: str | None = None) -> ApiError:
    return ApiError(400, f"{where} is a URL or a file id: this app does not fetch documents from "
                         "the network and keeps no Files API; send the document inline (base64 "
                         "data or text)", param or where, "document_url_not_allowed")


def count_documents(messages: list[dict[str, Any]]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for p in m["content"] if is_document(p))


def check_count(n: int, where: str = "messages") -> None:
    """At most MAX_DOCUMENTS documents in one request."""
    if n > MAX_DOCUMENTS:
        raise ApiError(400, f"the request holds {n} documents; the limit is {MAX_DOCUMENTS}", where,
                       "too_many_documents")


# --- reading them ---------------------------------------------------------------------------------

def _plain(content: Any) -> str:
    """The text of a message's content, documents left out."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or () if isinstance(p, dict)
                   and p.get("type") == "text")


def question_for(messages: list[dict[str, Any]], i: int) -> str:
    """The retrieval query of a document in message `i`: the text of the nearest user message at or
    before it (its own text first), else the request's last user text."""
    for m in reversed(messages[:i + 1]):
        if m.get("role") == "user" and _plain(m.get("content")).strip():
            return _plain(m["content"])
    return next((_plain(m["content"]) for m in reversed(messages) if m.get("role") == "user"
                 and _plain(m.get("content")).strip()), "")


def _excerpts(state: AppState, read: ReadFile, question: str) -> str:
    """A large document's chunks that best answer `question`, within EXCERPT_FRACTION of the
    context (at most MAX_EXCERPTS). CPU-bound: off the event loop."""
    engine, chunks = state.engine, state.chunks
    budget = int(engine.model.context_length * EXCERPT_FRACTION)
    order = ranked(chunks, engine, [read.sha256], question, state.document_embeddings)
    chosen = []
    for c in chunks.get(order[:MAX_EXCERPTS * 4]):
        if len(chosen) == MAX_EXCERPTS:
            break
        cost = count_tokens(engine, text=c.text) + EXCERPT_OVERHEAD
        if cost <= budget:
            chosen.append(c)
            budget -= cost
    return excerpts(chosen)


async def read_documents(state: AppState, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each document part as the text the model reads (whole, or its excerpts
    when larger than half the context); content left with text parts alone becomes a string.
    Files are read on the app's reader threads; raises ApiError (400 `unreadable_document`) with
    the reader's reason."""
    if not count_documents(messages):
        return messages
    loop = asyncio.get_running_loop()
    reads: dict[str, ReadFile] = {}
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list) or not any(is_document(p) for p in content):
            out.append(m)
            continue
        parts = []
        for p in content:
            if not is_document(p):
                parts.append(p)
                continue
            doc: DocumentInput = p["document"]
            if doc.sha256 not in reads:
                try:
                    reads[doc.sha256] = await loop.run_in_executor(  # its size class's
                        state.readers.for_size(len(doc.data)), read_request_file, state,
                        doc.name, doc.data, doc.sha256)
                except NotAttachable as exc:
                    raise ApiError(400, f"{doc.where} cannot be read: {exc}", doc.param,
                                   "unreadable_document") from None
            read = reads[doc.sha256]
            if whole({"tokens": read.tokens}, state.engine.model.context_length):
                text = read.text
            else:
                text = await loop.run_in_executor(state.readers, _excerpts, state, read,
                                                  question_for(messages, i))
            parts.append({"type": "text", "text": with_documents("", [{"name": doc.name,
                                                                       "text": text}])})
        text_only = all(p.get("type") == "text" for p in parts)
        out.append({**m, "content": "".join(p["text"] for p in parts) if text_only else parts})
    return out
