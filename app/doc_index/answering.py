"""Uploaded documents in a chat turn's prompt. A small document (at most `WHOLE_FRACTION` of the
context) goes in whole, as attachments always did; a larger one gives the turn the chunks that best
answer its question: BM25 over FTS5, fused with cosine over chunk embeddings when the document has
them (reciprocal rank fusion), as many as fit the context budget left by the rest of the prompt and
the answer. Retrieval happens once per user turn and its chunk ids are stored on the message
(`Message.retrieved`), so a reload shows the same citations, a regeneration sends the same prompt,
and earlier turns stay byte-identical (the prefix cache keeps working). UI only: the API's
requests carry their own messages."""

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from engine import Engine, EngineError, count_tokens

from ..context_window import overflow
from ..storage import Message, Storage
from ..uploads.store import UploadStore
from .indexing import DOCUMENT_KIND_NAMES
from .store import ChunkStore, StoredChunk

log = logging.getLogger(__name__)

WHOLE_FRACTION = 0.5
MAX_EXCERPTS = 8
EXCERPT_OVERHEAD = 12  # tokens of an excerpt's "[page N]" line and the blank lines around it
RRF_K = 60
CANDIDATES = 50
EMBED_WAIT_S = 60.0  # for the question's embedding


@dataclass(frozen=True)
class Citation:
    """A chunk an answer was given: which file, where in it, and its text (shown escaped)."""

    id: int
    name: str
    page: int | None
    heading: str | None
    text: str

    @property
    def place(self) -> str:
        return f"p. {self.page}" if self.page else (self.heading or "")


def whole(ref: Mapping[str, Any], context_length: int) -> bool:
    """Whether an attached upload goes into the prompt whole (else by retrieval)."""
    return ref.get("tokens") is not None and ref["tokens"] <= context_length * WHOLE_FRACTION


def fused(*rankings: list[int], k: int = RRF_K) -> list[int]:
    """Reciprocal rank fusion of rankings of ids (best first): sum of 1 / (k + rank)."""
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, cid in enumerate(ranking, 1):
            scores[cid] = scores.get(cid, 0.0) + 1.0 / (k + rank)
    return sorted(scores, key=lambda c: -scores[c])


def ranked(chunks: ChunkStore, engine: Engine, shas: list[str], question: str,
           embedding_model: str | None) -> list[int]:
    """Chunk ids of the files `shas`, best answer to `question` first."""
    lexical = chunks.bm25(shas, question, CANDIDATES)
    if embedding_model is None or not chunks.has_vectors(shas, embedding_model):
        return lexical
    try:
        query = engine.embed([question], model=embedding_model, query=True,
                             truncate=True).result(EMBED_WAIT_S)
    except (EngineError, TimeoutError):  # the embedding model cannot answer now: BM25 alone
        log.warning("embedding a question failed; retrieving by BM25 alone", exc_info=True)
        return lexical
    return fused(lexical, chunks.nearest(shas, query.vectors[0], embedding_model, CANDIDATES))


def excerpts(found: list[StoredChunk]) -> str:
    """A large document's retrieved chunks as the model reads them, each after where it is from."""
    if not found:
        return "(no passage of this document matched the question)"
    parts = []
    for c in found:
        place = f"[page {c.page}]" if c.page else f"[{c.heading}]" if c.heading else "[excerpt]"
        parts.append(f"{place}\n{c.text}")
    return "\n\n".join(parts)


class DocumentPrompt:
    """Resolves the uploads a conversation's user turns refer to into the documents the model
    reads (`resolve`), retrieving for the newest turn first when it needs it (`retrieve`)."""

    def __init__(self, storage: Storage, chunks: ChunkStore, engine: Engine,
                 embedding_model: str | None = None):
        self.storage = storage
        self.uploads = UploadStore(storage)
        self.chunks = chunks
        self.engine = engine
        self.embedding_model = embedding_model

    def _large(self, m: Message) -> list[dict[str, Any]]:
        limit = self.engine.model.context_length
        return [a for a in m.attachments or () if "upload" in a
                and a.get("kind") in DOCUMENT_KIND_NAMES and not whole(a, limit)]

    def resolve(self, path: list[Message]) -> list[Message]:
        """`path` with each user turn's upload references replaced by `{name, text}` documents:
        the whole text, or the chunks stored as retrieved for that turn."""
        return [self._resolved(m) if any("upload" in a for a in m.attachments or ()) else m
                for m in path]

    def _resolved(self, m: Message) -> Message:
        return replace(m, attachments=self.documents(m.attachments or [], m.retrieved or []))

    def documents(self, attachments: list[dict[str, Any]], retrieved: list[int]) -> list[dict[str, Any]]:
        """`attachments` as documents the model reads (`{name, text, tokens}`): inline ones as
        they are, uploaded documents whole or as their chunks among `retrieved`; uploads of other
        kinds stay references (`{"upload": id, "kind", ...}`) for their own prompt hook."""
        limit = self.engine.model.context_length
        found = self.chunks.get(retrieved)
        docs = []
        for a in attachments:
            if "upload" not in a or a.get("kind") not in DOCUMENT_KIND_NAMES:
                docs.append(a)  # inline documents as they are; other kinds (images) left as refs
                continue
            up = self.uploads.get(a["upload"])
            if up is None:
                text = "(this file was deleted)"
            elif whole(a, limit):
                text = self.uploads.text(up.sha256)
            else:
                text = excerpts([c for c in found if c.sha256 == up.sha256])
            docs.append({"name": a["name"], "text": text, "tokens": a.get("tokens") or 0})
        return docs

    def retrieve(self, settings: Mapping[str, Any], path: list[Message], max_tokens: int,
                 messages_of: Callable[[Mapping[str, Any], list[Message]], list[dict[str, Any]]]
                 ) -> list[Message]:
        """`path` (ending with a user turn) with that turn's chunks retrieved and stored when it
        has large documents and none yet; `messages_of(settings, path)` builds the prompt.
        CPU-bound (ranking, counting): call it off the event loop."""
        if not path or path[-1].role != "user" or path[-1].retrieved is not None:
            return path
        turn = path[-1]
        large = self._large(turn)
        if not large:
            return path
        shas = [up.sha256 for a in large if (up := self.uploads.get(a["upload"])) is not None]
        order = ranked(self.chunks, self.engine, shas, turn.content, self.embedding_model)
        candidates = self.chunks.get(order[:CANDIDATES])
        base = messages_of(settings, self.resolve([*path[:-1], replace(turn, retrieved=[])]))
        room = self.engine.model.context_length - max_tokens - count_tokens(self.engine, messages=base)
        chosen: list[int] = []
        for c in candidates:
            if len(chosen) == MAX_EXCERPTS:
                break
            cost = count_tokens(self.engine, text=c.text) + EXCERPT_OVERHEAD
            if cost <= room:
                chosen.append(c.id)
                room -= cost
        # The estimate above counts pieces apart; the prompt as rendered is the judge.
        while chosen and overflow(self.engine, messages_of(settings, self.resolve(
                [*path[:-1], replace(turn, retrieved=chosen)])), max_tokens) is not None:
            chosen.pop()
        self.storage.set_retrieved(turn.id, chosen)
        return [*path[:-1], replace(turn, retrieved=chosen)]


def citations(storage: Storage, m: Message) -> list[Citation]:
    """The chunks user turn `m` was answered with, named by file and page or heading."""
    if not m.retrieved:
        return []
    uploads, names = UploadStore(storage), {}
    for a in m.attachments or ():
        up = uploads.get(a["upload"]) if "upload" in a else None
        if up is not None:
            names.setdefault(up.sha256, a["name"])
    return [Citation(c.id, names.get(c.sha256, "document"), c.page, c.heading, c.text)
            for c in ChunkStore(storage).get(m.retrieved)]
