"""Attached documents: the text of a file (text files as UTF-8, PDFs through pypdf) counted with
the loaded model's tokenizer, and how documents sit inside a user turn for the model."""

import json
from typing import Any

from engine import Engine, count_tokens

from .pdf_text import PdfUnreadable, pdf_text


class NotAttachable(ValueError):
    """A file that cannot be attached; the message says why, for the user."""


def extract_text(raw: bytes) -> str:
    """The text of a PDF (read in a child process with limits: app/uploads/pdf_text.py) or of a UTF-8 text
    file (plain text, Markdown, code, CSV, JSON, ...). Slow on large input: call it off the loop."""
    if raw.startswith(b"%PDF-"):
        try:
            text = pdf_text(raw)
        except PdfUnreadable as exc:
            raise NotAttachable(str(exc)) from None
        if not text.strip():
            raise NotAttachable("this PDF has no text (a scan?)")
        return text.strip()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise NotAttachable("not a text file (only text, Markdown, code, CSV, JSON and PDF)") from None
    if "\x00" in text:
        raise NotAttachable("not a text file (only text, Markdown, code, CSV, JSON and PDF)")
    if not text.strip():
        raise NotAttachable("the file is empty")
    return text


def attachment(engine: Engine, name: str, raw: bytes) -> dict[str, Any]:
    """`{name, text, tokens}` for a file, or NotAttachable when it is not text or cannot fit.
    CPU-bound (parsing, tokenising): call it off the event loop."""
    text = extract_text(raw)
    tokens = count_tokens(engine, text=text)
    limit = engine.model.context_length
    if tokens >= limit:
        raise NotAttachable(f"{tokens} tokens, more than this model's context of {limit} tokens")
    return {"name": name, "text": text, "tokens": tokens}


def with_documents(content: str, attachments: list[dict[str, Any]] | None) -> str:
    """A user turn's text for the model: its documents first, then what was typed. The documents
    lead, so a later turn's edit reuses them from the prefix cache."""
    blocks = [f'<document name="{a["name"].replace(chr(34), chr(39))}">\n{a["text"]}\n</document>\n\n'
              for a in attachments or () if "text" in a]  # other uploads (images) are not text
    return "".join(blocks) + content


def parse_attachments(value: Any) -> list[dict[str, Any]]:
    """The chips' payloads a message carries (one JSON string, or a list of them); raises
    ValueError on anything else."""
    items = [value] if isinstance(value, str) else value or []
    out = []
    for item in items:
        try:
            doc = json.loads(item) if isinstance(item, str) else None
        except json.JSONDecodeError:
            doc = None
        if not (isinstance(doc, dict) and isinstance(doc.get("name"), str)
                and isinstance(doc.get("text"), str) and isinstance(doc.get("tokens"), int)):
            raise ValueError("An attachment is damaged; remove it and attach the file again.")
        out.append({"name": doc["name"], "text": doc["text"], "tokens": doc["tokens"]})
    return out
