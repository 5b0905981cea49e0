"""Images a client sends, one set of limits and errors for every API shape (OpenAI `image_url`
data URLs, Anthropic `image` blocks, Ollama `images`, Responses `input_image`) and for uploads.

Limits (named here, documented in docs/vision.md):
- `MAX_IMAGE_BYTES` per image (20 MB, encoded size).
- `MAX_IMAGE_BODY_BYTES`: the request body limit of the API routes that may carry images
  (`IMAGE_PATHS`; 64 MiB, so one image at its limit fits as base64 with room to spare; every other
  route keeps app/security/guards.py's 8 MiB).
- `MAX_IMAGES` per request (8).
- `FORMATS`: PNG, JPEG, WebP and GIF (its first frame). SVG and anything else is refused.
- Pillow's decompression-bomb limit (`Image.MAX_IMAGE_PIXELS`): a bigger image is refused, never
  decoded.
The model's processor downscales the longest side to what the model takes.

Decoding applies the EXIF orientation and keeps only the pixels (RGB): EXIF, GPS included, never
goes further. `http(s)` URLs are refused: the app never fetches from the network on a client's
behalf. Every refusal is an `ApiError` 4xx with the offending field; nothing is stored.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from typing import Any

from engine import ImageInput

from .errors import ApiError

MAX_IMAGE_BYTES = 20 * 1000 * 1000
MAX_IMAGES = 8
MAX_IMAGE_BODY_BYTES = 64 * 1024 * 1024
IMAGE_PATHS = frozenset({"/v1/chat/completions", "/v1/messages", "/v1/responses", "/api/chat",
                         "/api/generate"})
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"}

_DATA_URL = re.compile(r"data:([\w/+.-]*)((?:;[\w=.-]+)*?);base64,(.*)", re.S)


def body_limit(path: str) -> int | None:
    """The body limit of `path` when it is an API route that may carry images (else None)."""
    return MAX_IMAGE_BODY_BYTES if path in IMAGE_PATHS else None


def decode_image(data: bytes, where: str, param: str | None = None) -> ImageInput:
    """The image in `data` (PNG, JPEG, WebP, GIF first frame), orientation applied, pixels only.
    `where` names it in messages; `param` (default `where`) is the field errors point at."""
    param = param or where
    from PIL import Image, ImageOps

    if not data:
        raise ApiError(400, f"{where} is empty (0 bytes)", param, "invalid_image")
    if len(data) > MAX_IMAGE_BYTES:
        raise ApiError(413, f"{where} is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES} bytes "
                            "per image", param, "image_too_large")
    if data.lstrip()[:5].lower() in (b"<?xml", b"<svg ", b"<svg>") or b"<svg" in data[:512].lower():
        raise ApiError(400, f"{where} is an SVG; send PNG, JPEG, WebP or GIF", param,
                       "unsupported_image_format")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in FORMATS:
                raise ApiError(400, f"{where} is {image.format or 'not an image'}; send PNG, JPEG, "
                                    "WebP or GIF", param, "unsupported_image_format")
            image.seek(0)  # a GIF's first frame
            image.load()
            image = ImageOps.exif_transpose(image).convert("RGB")
    except ApiError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ApiError(400, f"{where} has more pixels than the limit of {Image.MAX_IMAGE_PIXELS}",
                       param, "image_too_large") from None
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds on corrupt data
        raise ApiError(400, f"{where} is not a readable image ({type(exc).__name__}: {exc})",
                       param, "invalid_image") from None
    return ImageInput.from_pil(image)


def decode_base64(value: Any, where: str, param: str | None = None) -> ImageInput:
    """An image sent as base64 text (its encoded size checked before decoding)."""
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
    return decode_image(data, where, param)


def decode_url(url: Any, where: str, param: str | None = None) -> ImageInput:
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
    return decode_base64(match.group(3), where, param)


def check_count(n: int, where: str = "messages") -> None:
    """At most MAX_IMAGES images in one request."""
    if n > MAX_IMAGES:
        raise ApiError(400, f"the request holds {n} images; the limit is {MAX_IMAGES}", where,
                       "too_many_images")


def image_part(image: ImageInput) -> dict[str, Any]:
    """The engine's message part for an image (engine/decoding/vision.py)."""
    return {"type": "image", "image": image}


def count_images(messages: list[dict[str, Any]]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for p in m["content"] if p.get("type") == "image")


def to_data_url(image: ImageInput) -> str:
    """The image's pixels as a PNG data URL (nothing but pixels: no EXIF)."""
    out = io.BytesIO()
    image.image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode("ascii")


def storable(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with each image part as an OpenAI `image_url` part (a PNG data URL), as JSON can
    hold them and parse_messages reads them back."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [{"type": "image_url", "image_url": {"url": to_data_url(p["image"])}}
                       if p.get("type") == "image" else p for p in content]
            m = {**m, "content": content}
        out.append(m)
    return out
