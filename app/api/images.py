"""Images a client sends, one set of limits and errors for every API shape (OpenAI `image_url`
data URLs, Anthropic `image` blocks, Ollama `images`, Responses `input_image`) and for uploads.

An image is counted and checked before anything is decoded: its encoded size, then its header
(app/api/image_headers.py: format, declared size, frames, read with bounded work), then the
request's image count and pixel total. What passes is a `SentImage`: the bytes as sent, decoded
only when the engine first needs the pixels (on a vision model, in `Engine.submit`, which
app/submission.py runs off the event loop for a request with images). A text-only model refuses
the request before any image is decoded.

Limits (named here, documented in docs/vision.md):
- `MAX_IMAGE_BYTES` per image (20 MB, encoded size).
- `MAX_IMAGE_PIXELS` per image (declared width × height, the largest frame's extent for a GIF or
  WebP) and `MAX_REQUEST_PIXELS` for all the images of a request; `MAX_FRAMES` per image (only
  the first frame is read).
- `MAX_IMAGE_BODY_BYTES`: the request body limit of the API routes that may carry images
  (`IMAGE_PATHS`; 64 MiB, so one image at its limit fits as base64 with room to spare); the text
  of such a body (everything but its images) keeps the limit of every other route
  (`MAX_TEXT_BYTES`, `check_text_share`).
- `MAX_IMAGES` per request (8).
- `FORMATS`: PNG, JPEG (MPO: its first picture), WebP and GIF (their first frame). SVG and
  anything else is refused.
The model's processor downscales the longest side to what the model takes.

Decoding applies the EXIF orientation and keeps only the pixels (RGB): EXIF, GPS included, never
goes further. `http(s)` URLs are refused: the app never fetches from the network on a client's
behalf. Every refusal is an `ApiError` 4xx with the offending field; nothing is stored.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import threading
import warnings
from typing import Any, Iterable

from engine import ImageInput

from ..security.guards import MAX_BODY_BYTES
from ..storage import StoredImage, image_ref
from .errors import ApiError
from .image_headers import HeaderError, ImageHeader, read_header

MAX_IMAGE_BYTES = 20 * 1000 * 1000
MAX_IMAGES = 8
MAX_IMAGE_PIXELS = 40_000_000  # 8000 × 5000; a decoded image takes 3 bytes a pixel
MAX_REQUEST_PIXELS = 80_000_000
MAX_FRAMES = 1000
MAX_IMAGE_BODY_BYTES = 64 * 1024 * 1024
MAX_TEXT_BYTES = MAX_BODY_BYTES
IMAGE_PATHS = frozenset({"/v1/chat/completions", "/v1/messages", "/v1/responses", "/api/chat",
                         "/api/generate"})
FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF")
MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"}

_DATA_URL = re.compile(r"data:([\w/+.-]*)((?:;[\w=.-]+)*?);base64,(.*)", re.S)


def body_limit(path: str) -> int | None:
    """The body limit of `path` when it is an API route that may carry images (else None)."""
    return MAX_IMAGE_BODY_BYTES if path in IMAGE_PATHS else None


class SentImage(ImageInput):
    """An image as a client sent it (`data`, its checked `header`), decoded when `image` or
    `digest` is first read, once: an engine `ImageInput` whose pixels cost nothing until a vision
    model needs them. A decoding failure raises the ApiError (400 `invalid_image`) naming
    `param`."""

    def __init__(self, data: bytes, header: ImageHeader, where: str, param: str):
        for name, value in (("data", data), ("header", header), ("where", where), ("param", param),
                            ("_lock", threading.Lock()), ("_decoded", None)):
            object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        h = self.header
        return f"SentImage({h.format} {h.width}×{h.height}, {len(self.data)} bytes)"

    @property
    def media_type(self) -> str:
        return self.header.media_type

    @property
    def decoded(self) -> bool:
        return self._decoded is not None

    def decode(self) -> ImageInput:
        """The decoded image (decoded once, whichever thread asks first)."""
        with self._lock:
            if self._decoded is None:
                object.__setattr__(self, "_decoded", _decode(self.data, self.where, self.param))
            return self._decoded

    @property
    def image(self) -> Any:  # the engine's field, decoded on first use
        return self.decode().image

    @property
    def digest(self) -> str:
        return self.decode().digest


def read_image(data: bytes, where: str, param: str | None = None) -> SentImage:
    """`data` checked without decoding: its size, format, declared pixels and frames.
    `where` names it in messages; `param` (default `where`) is the field errors point at."""
    param = param or where
    if not data:
        raise ApiError(400, f"{where} is empty (0 bytes)", param, "invalid_image")
    if len(data) > MAX_IMAGE_BYTES:
        raise ApiError(413, f"{where} is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES} bytes "
                            "per image", param, "image_too_large")
    if data.lstrip()[:5].lower() in (b"<?xml", b"<svg ", b"<svg>") or b"<svg" in data[:512].lower():
        raise ApiError(400, f"{where} is an SVG; send PNG, JPEG, WebP or GIF", param,
                       "unsupported_image_format")
    try:
        header = read_header(data, MAX_FRAMES)
    except HeaderError as exc:
        code = "unsupported_image_format" if str(exc).startswith("not a PNG") else "invalid_image"
        raise ApiError(400, f"{where} is {exc}; send PNG, JPEG, WebP or GIF"
                       if code == "unsupported_image_format"
                       else f"{where} is not a readable image ({exc})", param, code) from None
    if header.pixels > MAX_IMAGE_PIXELS:
        raise ApiError(400, f"{where} is {header.width}×{header.height} pixels; the limit is "
                            f"{MAX_IMAGE_PIXELS:,} pixels per image", param, "image_too_large")
    if header.frames > MAX_FRAMES:
        raise ApiError(400, f"{where} has more than {MAX_FRAMES} frames (only the first is "
                            "read); send a still image", param, "image_too_large")
    return SentImage(data, header, where, param)


def decode_image(data: bytes, where: str, param: str | None = None) -> ImageInput:
    """The image in `data`, checked (`read_image`) and decoded now."""
    return read_image(data, where, param).decode()


def _decode(data: bytes, where: str, param: str) -> ImageInput:
    """Decode checked bytes: the first frame, orientation applied, pixels only."""
    from PIL import Image, ImageOps

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in FORMATS:
                raise ApiError(400, f"{where} is {image.format or 'not an image'}; send PNG, JPEG, "
                                    "WebP or GIF", param, "unsupported_image_format")
            if image.width * image.height > MAX_IMAGE_PIXELS:  # as Pillow reads it, frames included
                raise ApiError(400, f"{where} is {image.width}×{image.height} pixels; the limit "
                                    f"is {MAX_IMAGE_PIXELS:,} pixels per image", param,
                               "image_too_large")
            image.seek(0)  # a GIF's first frame
            image.load()
            image = ImageOps.exif_transpose(image)
            if image.mode != "RGB":
                image = image.convert("RGB")
    except ApiError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ApiError(400, f"{where} has more pixels than the limit of {MAX_IMAGE_PIXELS:,}",
                       param, "image_too_large") from None
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds on corrupt data
        raise ApiError(400, f"{where} is not a readable image ({type(exc).__name__}: {exc})",
                       param, "invalid_image") from None
    return ImageInput.from_pil(image)


def read_base64(value: Any, where: str, param: str | None = None) -> SentImage:
    """An image sent as base64 text (its encoded size checked before decoding the base64)."""
    param = param or where
    if not isinstance(value, str):
        raise ApiError(400, f"{where} must be a base64 string", param, "invalid_image")
    if len(value) * 3 // 4 > MAX_IMAGE_BYTES + 3:
        raise ApiError(413, f"{where} is larger than the limit of {MAX_IMAGE_BYTES} bytes per image",
                       param, "image_too_large")
    try:
        data = base64.b64decode(value.strip(), validate=False)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where} is not valid base64", param, "invalid_image") from None
    return read_image(data, where, param)


def read_url(url: Any, where: str, param: str | None = None) -> SentImage:
    """An image given as a URL: only `data:` URLs with base64 content."""
    param = param or where
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"{where} must be a data URL string", param, "invalid_image")
    if re.match(r"https?://", url, re.I):
        raise ApiError(400, f"{where} is an http(s) URL: this app does not fetch images from the "
                            "network; send it inline as a data URL (data:image/png;base64,...)",
                       param, "image_url_not_allowed")
    match = _DATA_URL.fullmatch(url)
    if not match:
        raise ApiError(400, f"{where} must be a base64 data URL (data:image/png;base64,...)",
                       param, "invalid_image")
    media = match.group(1).lower()
    if media and media not in MEDIA_TYPES:
        raise ApiError(400, f"{where} has media type {media}; send PNG, JPEG, WebP or GIF", param,
                       "unsupported_image_format")
    return read_base64(match.group(3), where, param)


def check_count(n: int, where: str = "messages") -> None:
    """At most MAX_IMAGES images in one request (checked before any is read)."""
    if n > MAX_IMAGES:
        raise ApiError(400, f"the request holds {n} images; the limit is {MAX_IMAGES}", where,
                       "too_many_images")


def check_pixels(images: Iterable[SentImage], where: str = "messages") -> None:
    """The request's images hold at most MAX_REQUEST_PIXELS between them (declared)."""
    total = sum(im.header.pixels for im in images if isinstance(im, SentImage))
    if total > MAX_REQUEST_PIXELS:
        raise ApiError(400, f"the request's images hold {total:,} pixels; the limit is "
                            f"{MAX_REQUEST_PIXELS:,} per request", where, "image_too_large")


def image_part(image: ImageInput) -> dict[str, Any]:
    """The engine's message part for an image (engine/decoding/vision.py)."""
    return {"type": "image", "image": image}


def images_of(messages: list[dict[str, Any]]) -> list[ImageInput]:
    """The image parts' images, in order."""
    return [p["image"] for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and p.get("type") == "image"]


def count_images(messages: list[dict[str, Any]]) -> int:
    return len(images_of(messages))


def storable(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, StoredImage]]:
    """Messages as JSON can hold them, and the images they refer to: each image part becomes an
    OpenAI `image_url` part referring to the image as it was sent, stored once by its sha256
    (app/storage/responses.py), which a follow-up's parse_messages reads back with the same
    limits. (An image the app decoded itself is kept as a PNG data URL of its pixels.)"""
    out, images = [], {}
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") != "image":
                    parts.append(p)
                    continue
                image = p["image"]
                if isinstance(image, SentImage):
                    sha = hashlib.sha256(image.data).hexdigest()
                    images[sha] = StoredImage(image.media_type, image.data)
                    url = image_ref(sha)
                else:
                    url = to_data_url(image)
                parts.append({"type": "image_url", "image_url": {"url": url}})
            m = {**m, "content": parts}
        out.append(m)
    return out, images


def to_data_url(image: ImageInput) -> str:
    """The image's pixels as a PNG data URL (nothing but pixels: no EXIF)."""
    out = io.BytesIO()
    image.image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode("ascii")


TEXT_KEYS_OF_IMAGES = ("url", "image_url", "data", "images")


def check_text_share(body: Any, size: int, path: str) -> None:
    """A body over MAX_TEXT_BYTES on an image route holds that much in images, not text: its
    text (every string but image payloads) stays within MAX_TEXT_BYTES, so a 60 MB prompt gets
    its 413 before anything reads it (app/api/serving.py `read_body`)."""
    if size <= MAX_TEXT_BYTES or path not in IMAGE_PATHS:
        return
    images = 0
    pending: list[tuple[Any, bool]] = [(body, False)]
    while pending:
        value, payload = pending.pop()
        if isinstance(value, dict):
            pending.extend((v, k in TEXT_KEYS_OF_IMAGES) for k, v in value.items())
        elif isinstance(value, list):
            pending.extend((v, payload) for v in value)
        elif isinstance(value, str) and payload:
            images += len(value)
    if size - images > MAX_TEXT_BYTES:
        raise ApiError(413, f"the request's text is {size - images} bytes; the limit is "
                            f"{MAX_TEXT_BYTES} bytes (only images may make a body larger)",
                       None, "request_too_large")
