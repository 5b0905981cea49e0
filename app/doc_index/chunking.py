"""A document cut into retrievable chunks of at most `CHUNK_CHARS` characters, each knowing where it
came from: PDFs by page, then paragraph; Markdown by heading (each chunk carries the heading it sits
under), then paragraph; plain text by paragraph. A paragraph longer than a chunk is cut at a line
break or a space."""

import re
from dataclasses import dataclass
from typing import Iterator

CHUNK_CHARS = 1200

_PARAGRAPHS = re.compile(r"\n\s*\n")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)


@dataclass(frozen=True)
class Chunk:
    text: str
    page: int | None = None  # 1-based, PDFs only
    heading: str | None = None  # the Markdown heading the text sits under


def _pieces(text: str, limit: int) -> Iterator[str]:
    """`text` cut at a line break or space (or anywhere, failing both) into pieces ≤ `limit`."""
    while len(text) > limit:
        cut = max(text.rfind("\n", 0, limit), text.rfind(" ", 0, limit))
        cut = cut if cut > limit // 2 else limit
        yield text[:cut].strip()
        text = text[cut:].lstrip()
    if text.strip():
        yield text.strip()


def paragraphs(text: str, limit: int = CHUNK_CHARS) -> Iterator[str]:
    """Consecutive paragraphs of `text` packed into chunks of at most `limit` characters."""
    current = ""
    for para in _PARAGRAPHS.split(text):
        para = para.strip()
        if not para:
            continue
        if current and len(current) + 2 + len(para) > limit:
            yield current
            current = ""
        if len(para) > limit:
            yield from _pieces(para, limit)
        else:
            current = f"{current}\n\n{para}" if current else para
    if current:
        yield current


def pdf_chunks(pages: list[str], limit: int = CHUNK_CHARS) -> list[Chunk]:
    return [Chunk(text, page=number) for number, page in enumerate(pages, 1)
            for text in paragraphs(page, limit)]


def markdown_chunks(text: str, limit: int = CHUNK_CHARS) -> list[Chunk]:
    chunks, heading, start = [], None, 0
    for match in [*_HEADING.finditer(text), None]:
        end = match.start() if match else len(text)
        chunks += [Chunk(t, heading=heading) for t in paragraphs(text[start:end], limit)]
        if match:
            heading, start = match.group(2), match.start()
    return chunks


def text_chunks(text: str, limit: int = CHUNK_CHARS) -> list[Chunk]:
    return [Chunk(t) for t in paragraphs(text, limit)]
