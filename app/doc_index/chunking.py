"""A document cut into retrievable chunks of at most `CHUNK_CHARS` characters, each knowing where it
came from: PDFs by page, then paragraph; Markdown by heading (each chunk carries the heading it sits
under), then paragraph; plain text by paragraph. A paragraph longer than a chunk is cut at a line
break or a space (or anywhere, failing both) within each window of a chunk's length.

Linear in the text's length, whatever its shape: one paragraph of 64 MiB without a blank line is
cut window by window (never re-copying what is left), and headings are found line by line (no
pattern that backtracks over a long line)."""

import re
from dataclasses import dataclass
from typing import Iterator

CHUNK_CHARS = 1200

_PARAGRAPHS = re.compile(r"\n\s*\n")
_HEADING_START = re.compile(r"^#{1,6}[ \t]", re.M)


@dataclass(frozen=True)
class Chunk:
    text: str
    page: int | None = None  # 1-based, PDFs only
    heading: str | None = None  # the Markdown heading the text sits under


def _pieces(text: str, limit: int) -> Iterator[str]:
    """`text` cut at a line break or space (or anywhere, failing both) into pieces ≤ `limit`,
    one window at a time (each character looked at a bounded number of times)."""
    start, end = 0, len(text)
    while end - start > limit:
        stop = start + limit
        cut = max(text.rfind("\n", start, stop), text.rfind(" ", start, stop))
        cut = cut if cut > start + limit // 2 else stop
        piece = text[start:cut].strip()
        if piece:
            yield piece
        start = cut
        while start < end and text[start].isspace():
            start += 1
    if text[start:].strip():
        yield text[start:].strip()


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


def _headings(text: str) -> Iterator[tuple[int, str]]:
    """(where it starts, its text) of each ATX heading line (`## Title`, `## Title ##`)."""
    for match in _HEADING_START.finditer(text):
        end = text.find("\n", match.end())
        line = text[match.end():end if end >= 0 else len(text)].strip()
        closed = line.rstrip("#")
        if closed != line and (not closed or closed[-1] in " \t"):  # a closing sequence
            line = closed.rstrip()
        if line:
            yield match.start(), line


def markdown_chunks(text: str, limit: int = CHUNK_CHARS) -> list[Chunk]:
    chunks, heading, start = [], None, 0
    for found in [*_headings(text), None]:
        end = found[0] if found else len(text)
        chunks += [Chunk(t, heading=heading) for t in paragraphs(text[start:end], limit)]
        if found:
            start, heading = found
    return chunks


def text_chunks(text: str, limit: int = CHUNK_CHARS) -> list[Chunk]:
    return [Chunk(t) for t in paragraphs(text, limit)]
