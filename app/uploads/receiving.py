"""A file's bytes as the composer's upload endpoint (app/ui/uploads.py) receives them: streamed to
a part file in the data folder while their sha256 is computed (never held in memory), up to
`UPLOAD_MAX_BYTES`, each piece within `IDLE_TIMEOUT_S` and the whole within `UPLOAD_TIMEOUT_S`;
and the name the file is shown and stored under."""

import asyncio
import hashlib
import re
import time
import unicodedata
from pathlib import Path

from starlette.requests import Request

UPLOAD_MAX_BYTES = 64 * 1024 * 1024
IDLE_TIMEOUT_S = 30.0  # the most a body may pause
UPLOAD_TIMEOUT_S = 600.0  # the most a whole upload may take (64 MiB at ~110 KB/s)
NAME_LENGTH = 200


class TooLarge(Exception):
    """The body grew past `UPLOAD_MAX_BYTES`."""


def clean_name(raw: str | None) -> str:
    """A file name safe to show and store: its last path part, no control characters, bounded."""
    name = re.split(r"[\\/]", raw or "")[-1]
    name = "".join(c for c in name if unicodedata.category(c)[0] != "C").strip()
    return name[:NAME_LENGTH] or "upload"


async def receive(request: Request, part: Path) -> tuple[int, str]:
    """Stream the body into `part`: (size, sha256). Raises TooLarge, TimeoutError or
    ClientDisconnect; the caller removes `part`."""
    digest, size = hashlib.sha256(), 0
    chunks = request.stream().__aiter__()
    deadline = time.monotonic() + UPLOAD_TIMEOUT_S
    with open(part, "wb") as out:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), IDLE_TIMEOUT_S)
            except StopAsyncIteration:
                break
            size += len(chunk)
            if size > UPLOAD_MAX_BYTES:
                raise TooLarge
            digest.update(chunk)
            out.write(chunk)
    return size, digest.hexdigest()
