"""Files attached in the composer: chips showing each file's token count (or why it was refused),
carrying the text back with the message, which stores it as documents inside the user turn.
Uploads are bounded by the server's body limit (security.BodyLimit: 413 beyond it); each file is
read and counted off the event loop (a PDF in a child process with a time budget)."""

import asyncio
import json

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from ..uploads.documents import NotAttachable, attachment
from .views import parts, render

MAX_FILES = 10


async def attach(request: Request) -> HTMLResponse:
    """Chips for the uploaded files: each with its token count, or why it was refused."""
    _, engine = parts(request)
    chips = []
    async with request.form(max_files=MAX_FILES) as form:
        for upload in form.getlist("files"):
            if not isinstance(upload, UploadFile):
                continue
            name = upload.filename or "attachment"
            try:
                raw = await upload.read()  # BodyLimit bounds it
                doc = await asyncio.to_thread(attachment, engine, name, raw)
            except NotAttachable as exc:
                chips.append(render("_attachment.html", name=name, error=str(exc)))
            else:
                chips.append(render("_attachment.html", name=name, tokens=doc["tokens"],
                                    payload=json.dumps(doc, ensure_ascii=False)))
    return HTMLResponse("".join(chips))


routes = [Route("/attachments", attach, methods=["POST"])]
