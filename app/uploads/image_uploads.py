"""Images as uploads of a conversation (the upload endpoint of app/ui/uploads.py): the `image` kind,
the PNG a page is shown, and how a user turn's images enter the prompt.

- Kind: PNG, JPEG, WebP and GIF, told by their first bytes; reading one checks its header with the
  limits of app/api/images.py before decoding anything (more than 20 MB, too many pixels or
  frames, a corrupt file: the chip says why and the bytes are removed), then decodes it once to
  make its thumbnail (at most THUMB_PX on its longest side, PNG), stored in the database. The file
  stays content-addressed in the data folder (`uploads/<sha256>`) and goes when no conversation
  uses it (app/uploads/store.py).
- Shown (`GET /c/{cid}/uploads/{id}/image` in app/ui/uploads.py): the stored thumbnail
  (`thumbnail`: made once, also for an image read before thumbnails were stored), or the full
  image re-encoded as PNG from its pixels (`png_bytes`), one at a time; orientation applied, so
  no EXIF (GPS included) ever leaves the data folder.
- Prompt: a user turn's image references (`kind == "image"`) are resolved to checked images
  (`resolve_images`, decoded only when a vision model needs the pixels) and the turn's content
  becomes text and image parts (`with_images`), which the engine takes for a vision model and
  refuses clearly, before decoding, for a text-only one.
- Export / import: an exported message carries its images as `images: [{name, data_url}]` (PNG
  data URLs of the pixels, no EXIF) instead of upload references, which mean nothing elsewhere
  (`export_images`); importing stores them as uploads of the new conversation again
  (`import_images`), decoded with the same limits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from pathlib import Path
from typing import Any


from engine import ImageInput

from ..api.errors import ApiError
from ..api.images import SentImage, image_part, read_image, read_url, to_data_url
from ..storage import Message, Storage
from .kinds import FileKind, NotAttachable, Processed, Processing, register_kind
from .store import Upload, UploadStore

THUMB_PX = 256
_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a")


def is_image(head: bytes, name: str) -> bool:
    """PNG, JPEG, GIF or WebP by the first bytes (the name is not trusted)."""
    return head.startswith(_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


def load(path: Path, name: str) -> SentImage:
    """The stored image, its header checked with the API's limits (decoded when first needed);
    NotAttachable with the reason if not."""
    try:
        return read_image(path.read_bytes(), name)
    except ApiError as exc:
        raise NotAttachable(exc.message) from None


def decoded(image: SentImage) -> ImageInput:
    """The image's pixels; NotAttachable with the reason when they cannot be decoded."""
    try:
        return image.decode()
    except ApiError as exc:
        raise NotAttachable(exc.message) from None


def process_image(job: Processing) -> Processed:
    """Check the stored image (header first, then its pixels, decoded once) and store its
    thumbnail; its size for the chip."""
    job.progress("checking", 0.2)
    image = decoded(load(job.path, job.name))
    job.progress("thumbnail", 0.6)
    job.uploads.set_thumbnail(job.sha256, png_bytes(image, thumb=True))
    width, height = image.image.size
    return Processed(summary=f"{width}×{height}", meta={"width": width, "height": height})


register_kind(FileKind("image", is_image, process_image), first=True)


def thumbnail(store: UploadStore, up: Upload) -> bytes:
    """The upload's stored thumbnail; made and stored now for an image read before thumbnails
    were kept (NotAttachable, OSError: it can no longer be read)."""
    found = store.thumbnail(up.sha256)
    if found is None:
        found = png_bytes(decoded(load(store.blob(up.sha256), up.name)), thumb=True)
        store.set_thumbnail(up.sha256, found)
    return found


def full_png(store: UploadStore, up: Upload) -> bytes:
    """The whole image as PNG, re-encoded from its pixels (NotAttachable, OSError: it can no
    longer be read)."""
    return png_bytes(decoded(load(store.blob(up.sha256), up.name)))


def png_bytes(image: ImageInput, thumb: bool = False) -> bytes:
    """The image's pixels as PNG (a copy no larger than THUMB_PX with `thumb`)."""
    pixels = image.image
    if thumb:
        pixels = pixels.copy()
        pixels.thumbnail((THUMB_PX, THUMB_PX))
    out = io.BytesIO()
    pixels.save(out, format="PNG")
    return out.getvalue()


def resolve_images(store: UploadStore, path: list[Message]) -> list[Message]:
    """`path` with each image reference of a user turn holding its decoded image (`image`).
    An image that can no longer be read stays a reference (the prompt leaves it out)."""
    out = []
    for m in path:
        refs = m.attachments or []
        if not any(a.get("kind") == "image" and "upload" in a for a in refs):
            out.append(m)
            continue
        resolved = []
        for a in refs:
            up = store.get(a["upload"], m.conversation_id) if a.get("kind") == "image" else None
            if up is not None and up.status == "ready":
                try:
                    a = {**a, "image": load(store.blob(up.sha256), up.name)}
                except (NotAttachable, OSError):
                    pass
            resolved.append(a)
        out.append(dataclasses.replace(m, attachments=resolved))
    return out


def with_images(content: str, attachments: list[dict[str, Any]] | None) -> str | list[dict[str, Any]]:
    """A turn's content with its resolved images: image parts first (as the composer shows them
    above the text), then the text; the text alone when it has none."""
    images = [a["image"] for a in attachments or [] if isinstance(a.get("image"), ImageInput)]
    if not images:
        return content
    return [image_part(im) for im in images] + [{"type": "text", "text": content}]


def _is_ref(a: dict[str, Any]) -> bool:
    return a.get("kind") == "image" and "upload" in a


def export_images(storage: Storage, data: dict[str, Any], cid: int) -> dict[str, Any]:
    """`data` (export_conversation's JSON of conversation `cid`) with each message's image
    references replaced by `images`: `[{name, data_url}]` (an image that can no longer be read
    is left out)."""
    store = UploadStore(storage)
    rows = storage._query("SELECT attachments FROM messages WHERE conversation_id = ? ORDER BY id",
                          (cid,))
    for out, row in zip(data["messages"], rows):
        refs = [a for a in json.loads(row[0] or "null") or [] if _is_ref(a)]
        if not refs:
            continue
        images = []
        for a in refs:
            up = store.get(a["upload"], cid)
            if up is not None and up.status == "ready":
                try:
                    images.append({"name": up.name, "data_url": to_data_url(
                        decoded(load(store.blob(up.sha256), up.name)))})
                except (NotAttachable, OSError):
                    pass
        rest = [a for a in out.get("attachments") or [] if not _is_ref(a)]
        out["attachments"] = rest or None
        out["images"] = images
    return data


def import_images(storage: Storage, cid: int, data: dict[str, Any]) -> None:
    """Store the `images` of an imported export (`data`, imported as conversation `cid`, its
    messages in the same order) as uploads of `cid`, referenced by their messages. Raises
    ValueError for an image that does not pass the limits."""
    exported = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(exported, list) or not any(isinstance(m, dict) and m.get("images")
                                                 for m in exported):
        return
    store = UploadStore(storage)
    store.folder.mkdir(parents=True, exist_ok=True)
    rows = storage._query("SELECT id, attachments FROM messages WHERE conversation_id = ? "
                          "ORDER BY id", (cid,))
    for i, ((mid, attachments), m) in enumerate(zip(rows, exported)):
        images = m.get("images") if isinstance(m, dict) else None
        if not isinstance(images, list) or not images:
            continue
        refs = json.loads(attachments or "null") or []
        for j, item in enumerate(images):
            where = f"messages[{i}].images[{j}]"
            if not isinstance(item, dict):
                raise ValueError(f"{where} must be an object with name and data_url")
            try:
                image = read_url(item.get("data_url"), where).decode()
            except ApiError as exc:
                raise ValueError(exc.message) from None
            body = png_bytes(image)
            sha = hashlib.sha256(body).hexdigest()
            if not store.blob(sha).exists():
                store.blob(sha).write_bytes(body)
            up, fresh = store.add(cid, str(item.get("name") or "image.png")[:200], sha, "image",
                                  len(body))
            if fresh or up.status != "ready":
                w, h = image.image.size
                store.set_thumbnail(sha, png_bytes(image, thumb=True))
                store.ready(sha, summary=f"{w}×{h}", tokens=None, pages=None, text=None,
                            meta={"width": w, "height": h})
            refs.append((store.get(up.id) or up).reference())
        storage._write("UPDATE messages SET attachments = ? WHERE id = ?", (json.dumps(refs), mid))
