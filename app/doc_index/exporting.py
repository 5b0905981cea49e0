"""Uploaded documents in exports. A message stores upload ids, which mean nothing outside this
data folder, so an export carries each document as the model read it (`{name, text, tokens}`: the
whole text, or the chunks retrieved for that turn) and, on a turn answered from retrieved chunks,
its `sources` (file, page or heading, text). Importing such an export gives ordinary attached
documents (app/storage/import_schema.py ignores `sources`)."""

from typing import Any

from engine import Engine

from ..storage import Message, Storage
from .answering import DocumentPrompt, citations
from .store import ChunkStore


def sources(storage: Storage, m: Message) -> list[dict[str, Any]]:
    return [{"name": c.name, "page": c.page, "heading": c.heading, "text": c.text}
            for c in citations(storage, m)]


def self_contained(storage: Storage, engine: Engine, data: dict[str, Any],
                   messages: list[Message]) -> dict[str, Any]:
    """`data` (export_conversation's JSON of `messages`, in the same order) with upload references
    replaced by the documents they gave the model, and each such turn's sources."""
    docs = DocumentPrompt(storage, ChunkStore(storage), engine)
    for out, m in zip(data["messages"], messages):
        if any("upload" in a for a in m.attachments or ()):
            out["attachments"] = [a for a in docs.documents(m.attachments, m.retrieved or [])
                                  if "text" in a]
        if m.retrieved:
            out["sources"] = sources(storage, m)
    return data
