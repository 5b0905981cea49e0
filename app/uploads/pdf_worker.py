"""Reads one PDF's text with pypdf: run as a child process by `app/uploads/pdf_text.py`, never imported by
the server. The PDF comes on stdin; one JSON object goes to stdout: `{"pages": [text, ...]}` or
`{"error": ...}`; a line `page <n> <pages>` goes to stderr as each page is read. Arguments: memory
limit (bytes), most pages, most characters of text.

The child caps its own address space, so a decompression bomb ends in MemoryError here, not in the
server; pypdf's own limits (stream length, inflated size, array sizes) apply too, and anything
pypdf raises, recursion too deep included, becomes the error message."""

import io
import json
import resource
import sys


def _text(raw: bytes, max_pages: int, max_chars: int) -> dict:
    from pypdf import PdfReader

    reader = PdfReader(io.BytesIO(raw))
    pages = len(reader.pages)
    if pages > max_pages:
        return {"error": f"this PDF has {pages} pages; at most {max_pages} can be attached"}
    parts, size = [], 0
    for number, page in enumerate(reader.pages, 1):
        part = (page.extract_text() or "").strip()
        sys.stderr.write(f"page {number} {pages}\n")  # progress, for the reader's chip
        sys.stderr.flush()
        size += len(part)
        if size > max_chars:
            return {"error": f"this PDF has more than {max_chars} characters of text"}
        parts.append(part)
    return {"pages": parts}


def main() -> None:
    memory, max_pages, max_chars = (int(a) for a in sys.argv[1:4])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    raw = sys.stdin.buffer.read()
    try:
        result = _text(raw, max_pages, max_chars)
    except RecursionError:
        result = {"error": "this PDF is nested too deeply"}
    except MemoryError:
        result = {"error": "this PDF inflates to more than the memory allowed for reading it"}
    except Exception as exc:  # pypdf's many errors, on hostile input: all mean "cannot be read"
        result = {"error": f"this PDF cannot be read ({type(exc).__name__}: {str(exc)[:200]})"}
    sys.stdout.write(json.dumps(result))


if __name__ == "__main__":
    main()
