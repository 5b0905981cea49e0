"""The one upload endpoint for the composer's files (documents, and any kind registered in
app/uploads/kinds.py such as images):

- `POST /c/{cid}/uploads?name=<file name>`: the request body is the file itself (any
  Content-Type; `curl --data-binary @report.pdf`). It is streamed to the data folder while its
  sha256 is computed (never held in memory; app/uploads/receiving.py), up to `UPLOAD_MAX_BYTES`
  (413 beyond it, at once when Content-Length says so; the partial file is removed), each piece
  within `IDLE_TIMEOUT_S` and the whole within `UPLOAD_TIMEOUT_S` (408).
  The kind comes from the content (415 when no kind accepts it). Answers 201 with
  `{id, kind, name, size, status, ...}` (`Upload.public`), or, to htmx (`HX-Request`), the chip.
  Reading the file (a PDF's text, the index) then runs on the reader thread of its size class
  (app/uploads/reading.py).
- `GET /c/{cid}/uploads/{id}`: the same JSON, or the chip, which polls this route while the file
  is being read (its stage and progress) and then shows its size and tokens, or why it was refused.
- `GET /c/{cid}/uploads/{id}/image` (`?thumb=1`: its thumbnail, stored when the file was read):
  an image upload re-encoded as PNG from its pixels (app/uploads/image_uploads.py), so no EXIF
  ever leaves the data folder. Served with limits: only to this app's own pages (a page of
  another site gets 403, and `Cross-Origin-Resource-Policy` keeps browsers from showing it
  there), and one full-size image decoded at a time.

Messages refer to uploads by id (app/ui/user_turn.py); the file's text never travels in a form.
Every route is guarded like the rest (Host, Origin, the API key); the JSON body limit
(security.BodyLimit) does not buffer these bodies: this module bounds them itself."""

import asyncio
import os
import re
import uuid

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..state import app_state
from ..uploads import receiving
from ..uploads.documents import NotAttachable
from ..uploads.image_uploads import full_png, thumbnail
from ..uploads.kinds import HEAD_BYTES, kind_of
from ..uploads.reading import start_reading
from ..uploads.store import PART_PREFIX, Upload
from .views import conversation_of, render, templates

POLL_S = 1  # how often a reading chip asks again
UPLOAD_PATH = re.compile(r"^/c/\d+/uploads$")


def is_upload_path(path: str) -> bool:
    """Whether `path` is the upload endpoint (security.BodyLimit leaves its body to it)."""
    return UPLOAD_PATH.match(path) is not None


def upload_error(status: int, message: str, code: str, field: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": code, "field": field}},
                        status_code=status, headers={"Connection": "close"} if status == 413 else None)


templates.globals["upload_poll_s"] = POLL_S


def chip(up: Upload, conv_id: int) -> str:
    return render("_upload.html", u=up, cid=conv_id)


def _answer(request: Request, up: Upload, status: int = 200) -> Response:
    if request.headers.get("hx-request"):
        return HTMLResponse(chip(up, up.conversation_id), status_code=status)
    return JSONResponse(up.public(), status_code=status)


async def create(request: Request) -> Response:
    """`POST /c/{cid}/uploads?name=...`: store the body as a file of the conversation."""
    conv = conversation_of(request)
    if conv is None:
        return upload_error(404, "no such conversation", "not_found", "conversation")
    limit = receiving.UPLOAD_MAX_BYTES
    too_large = upload_error(413, f"the file is larger than {limit // (1024 * 1024)} MB",
                             "file_too_large", "file")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        return too_large
    state = app_state(request)
    store = state.uploads
    store.folder.mkdir(parents=True, exist_ok=True)
    part = store.folder / f"{PART_PREFIX}{uuid.uuid4().hex}"
    try:
        size, sha256 = await receiving.receive(request, part)
    except receiving.TooLarge:
        part.unlink(missing_ok=True)
        return too_large
    except TimeoutError:
        part.unlink(missing_ok=True)
        return upload_error(408, "the file did not arrive in time", "request_timeout", "file")
    except ClientDisconnect:  # nobody to answer; nothing kept
        part.unlink(missing_ok=True)
        return Response(status_code=400)
    except OSError as exc:  # the disk is full, or the folder went away
        part.unlink(missing_ok=True)
        return upload_error(507, f"the data folder cannot take the file ({exc.strerror or exc})",
                            "storage_unavailable", "file")
    name = receiving.clean_name(request.query_params.get("name"))
    if size == 0:
        part.unlink(missing_ok=True)
        return upload_error(400, "the file is empty", "empty_file", "file")
    with open(part, "rb") as f:
        kind = kind_of(f.read(HEAD_BYTES), name)
    if kind is None:
        part.unlink(missing_ok=True)
        return upload_error(415, "not a text file (only text, Markdown, code, CSV, JSON and PDF) "
                            "nor an image (PNG, JPEG, WebP, GIF)",
                            "unsupported_file", "file")
    os.replace(part, store.blob(sha256))  # the same bytes again: one copy
    up, fresh = await asyncio.to_thread(store.add, conv.id, name, sha256, kind.name, size)
    if fresh:
        start_reading(state, up)
    return _answer(request, up, 201)


async def show(request: Request) -> Response:
    """`GET /c/{cid}/uploads/{id}`: the upload (JSON) or its chip (htmx)."""
    # Off the loop: a file being indexed holds the database lock for a batch at a time.
    up = await asyncio.to_thread(app_state(request).uploads.get, int(request.path_params["uid"]),
                                 int(request.path_params["cid"]))
    if up is None:
        return upload_error(404, "no such upload in this conversation", "not_found", "id")
    return _answer(request, up)


async def show_image(request: Request) -> Response:
    """`GET /c/{cid}/uploads/{id}/image`: the image as PNG (pixels only): its stored thumbnail
    with `?thumb=1`, else the whole image, one at a time."""
    if request.headers.get("sec-fetch-site") == "cross-site":  # another site's <img>
        return Response("images are shown on this app's pages only", status_code=403,
                        media_type="text/plain")
    state = app_state(request)
    store = state.uploads
    up = await asyncio.to_thread(store.get, int(request.path_params["uid"]),
                                 int(request.path_params["cid"]))
    if up is None or up.kind != "image" or up.status != "ready":
        return Response("no such image in this conversation", status_code=404,
                        media_type="text/plain")
    try:
        if request.query_params.get("thumb") == "1":
            body = await run_in_threadpool(thumbnail, store, up)
        else:
            async with state.full_images:
                body = await run_in_threadpool(full_png, store, up)
    except (NotAttachable, OSError):
        return Response("the image can no longer be read", status_code=410, media_type="text/plain")
    return Response(body, media_type="image/png",
                    headers={"Cache-Control": "private, max-age=3600",
                             "Content-Security-Policy": "default-src 'none'",
                             "Cross-Origin-Resource-Policy": "same-origin"})


routes = [Route("/c/{cid:int}/uploads", create, methods=["POST"]),
          Route("/c/{cid:int}/uploads/{uid:int}", show, methods=["GET"]),
          Route("/c/{cid:int}/uploads/{uid:int}/image", show_image, methods=["GET"])]
