"""Export and import over HTTP: one conversation as Markdown (the branch shown) or JSON (every
version, see `export_conversation`), all of them as one zip of those JSON files, and an upload
form that imports our JSON, such a zip, or a plain OpenAI `messages` list as new conversations."""

import asyncio
import io
import json
import re
import zipfile
import zlib
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from engine import Engine

from ..doc_index.answering import DocumentPrompt, citations
from ..doc_index.exporting import self_contained
from ..doc_index.store import ChunkStore
from ..storage import EXPORT_FORMAT, Storage, export_conversation, import_conversation
from ..uploads.image_uploads import export_images, import_images
from .settings import preset_settings
from .user_turn import chat_title
from .views import conversation_of, not_found, parts, render

def _filename(title: str, suffix: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", title).strip("-.")[:60] or "conversation"
    return f"{stem}{suffix}"


def _download(body: str | bytes, media_type: str, filename: str) -> Response:
    return Response(body, media_type=media_type,
                    headers={"Content-Disposition": f'attachment; filename="{filename}"'})


def conversation_markdown(storage: Storage, cid: int, engine: Engine) -> str:
    """The branch shown, as a person would read it (documents as the model read them, and the
    sources a turn was answered from)."""
    docs = DocumentPrompt(storage, ChunkStore(storage), engine)
    conv = storage.get_conversation(cid)
    lines = [f"# {conv.title}", ""]
    if conv.model:
        lines += [f"Model: {conv.model}", ""]
    if conv.settings.get("system_prompt"):
        lines += ["## System", "", conv.settings["system_prompt"], ""]
    for m in storage.active_path(cid):
        lines += [f"## {m.role.capitalize()}", ""]
        for doc in docs.documents(m.attachments or [], m.retrieved or []):
            if "text" in doc:
                lines += [f"Attached: {doc['name']}", "", "```", doc["text"], "```", ""]
            elif "name" in doc:  # an image is a reference (app/uploads/image_uploads.py)
                lines += [f"Attached: {doc['name']}", ""]
        if m.content:
            lines += [m.content, ""]
        for c in citations(storage, m):
            lines += [f"Source: {c.name}{', ' + c.place if c.place else ''}", "",
                      *(f"> {line}" for line in c.text.splitlines()), ""]
        for call in m.tool_calls or ():
            fn = call.get("function", {})
            lines += [f"Tool call `{fn.get('name')}`:", "", "```json", str(fn.get("arguments")), "```", ""]
    return "\n".join(lines)


async def export_json(request: Request) -> Response:
    conv = conversation_of(request)
    if conv is None:
        return not_found()
    storage, engine = parts(request)
    data = await asyncio.to_thread(exported, storage, engine, conv.id)
    return _download(json.dumps(data, ensure_ascii=False, indent=1), "application/json",
                     _filename(conv.title, ".json"))


async def export_markdown(request: Request) -> Response:
    conv = conversation_of(request)
    if conv is None:
        return not_found()
    storage, engine = parts(request)
    return _download(await asyncio.to_thread(conversation_markdown, storage, conv.id, engine),
                     "text/markdown; charset=utf-8", _filename(conv.title, ".md"))


def exported(storage: Storage, engine: Engine, cid: int) -> dict[str, Any]:
    """A conversation's JSON export, its uploaded documents carried as the model read them."""
    data = self_contained(storage, engine, export_conversation(storage, cid), storage.messages(cid))
    return export_images(storage, data, cid)  # app/uploads/image_uploads.py


def all_conversations_zip(storage: Storage, engine: Engine) -> bytes:
    """Every conversation's JSON export in one zip (CPU-bound: call it off the event loop)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for conv in storage.list_conversations(limit=-1):
            data = exported(storage, engine, conv.id)
            archive.writestr(f"conversation-{conv.id}.json",
                             json.dumps(data, ensure_ascii=False, indent=1))
    return buffer.getvalue()


async def export_all(request: Request) -> Response:
    storage, engine = parts(request)
    return _download(await asyncio.to_thread(all_conversations_zip, storage, engine), "application/zip",
                     "mlxchat-conversations.zip")


# An upload's zip may hold at most this many JSON members, each and all together inflating to at
# most these sizes (a zip bomb is refused as its members are read, whatever they declare).
MAX_MEMBERS = 20_000
MAX_MEMBER_BYTES = 64 << 20
MAX_TOTAL_BYTES = 256 << 20


def _read_member(archive: zipfile.ZipFile, name: str, budget: int) -> bytes:
    limit = min(MAX_MEMBER_BYTES, budget)
    with archive.open(name) as member:
        data = member.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{name} inflates to more than {limit >> 20} MiB"
                         + ("" if limit == MAX_MEMBER_BYTES else " (the archive's total)"))
    return data


def _documents(raw: bytes) -> list[Any]:
    """The JSON documents in an upload: each member of a zip archive, or the file itself; raises
    ValueError for what cannot be read (bombs, encrypted or unknown compression, deep nesting)."""
    try:
        if not zipfile.is_zipfile(io.BytesIO(raw)):
            return [json.loads(raw)]
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            names = sorted(n for n in archive.namelist() if n.endswith(".json"))
            if len(names) > MAX_MEMBERS:
                raise ValueError(f"the archive holds {len(names)} files; at most {MAX_MEMBERS}")
            documents, budget = [], MAX_TOTAL_BYTES
            for name in names:
                data = _read_member(archive, name, budget)
                budget -= len(data)
                documents.append(json.loads(data))
            return documents
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError, zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise ValueError(f"not a JSON file or a zip of them ({exc})") from None
    except (RuntimeError, NotImplementedError) as exc:  # encrypted, or a compression we lack
        raise ValueError(f"this zip cannot be read ({exc})") from None


def _titled(data: Any) -> Any:
    """A plain `messages` list without a title gets one as a new chat would: by its first question."""
    if not isinstance(data, dict) or data.get("format") == EXPORT_FORMAT or data.get("title") \
            or not isinstance(data.get("messages"), list):
        return data
    first = next((m["content"] for m in data["messages"] if isinstance(m, dict)
                  and m.get("role") == "user" and isinstance(m.get("content"), str)
                  and m["content"].strip()), None)
    return {**data, "title": chat_title(first)} if first else data


def import_documents(storage: Storage, raw: bytes, model: str | None) -> list[int]:
    """Import every conversation of an upload, all or nothing; raises ValueError. A plain
    `messages` list opens like a new chat: `model`, the recommended settings, titled by its
    first question. CPU-bound on large uploads: call it off the event loop."""
    documents = _documents(raw)
    if not documents:
        raise ValueError("the archive holds no conversation")
    # A bare list is a plain OpenAI `messages` list.
    documents = [{"messages": d} if isinstance(d, list) else d for d in documents]
    imported = []
    try:
        for data in documents:
            imported.append(import_conversation(storage, _titled(data), model=model,
                                                settings=preset_settings("recommended")).id)
            import_images(storage, imported[-1], data)  # app/uploads/image_uploads.py
    except ValueError:
        for cid in imported:  # all or nothing
            storage.delete_conversation(cid)
        raise
    return imported


async def import_upload(request: Request) -> Response:
    storage, engine = parts(request)
    async with request.form(max_files=1) as form:
        upload = form.get("file")
        raw = await upload.read() if isinstance(upload, UploadFile) else b""  # BodyLimit bounds it
    error = None
    if not raw:
        error = "Choose a file to import."
    else:
        try:
            cid = (await asyncio.to_thread(import_documents, storage, raw, engine.model_name))[0]
        except ValueError as exc:
            error = f"Could not import: {exc}"
    if error:
        return HTMLResponse(render("_import_result.html", error=error),
                            status_code=200 if request.headers.get("hx-request") else 400)
    if request.headers.get("hx-request"):
        return Response(headers={"HX-Redirect": f"/c/{cid}"})
    return RedirectResponse(f"/c/{cid}", status_code=303)


routes = [
    Route("/c/{cid:int}/export.json", export_json),
    Route("/c/{cid:int}/export.md", export_markdown),
    Route("/export.zip", export_all),
    Route("/import", import_upload, methods=["POST"]),
]
