"""The documents kinds of upload (`pdf`, `markdown`, `text`, told from the content) and how one is
read: its text extracted (a PDF page by page in a child process with limits: app/uploads/pdf_text.py),
counted with the loaded model's tokenizer, cut into chunks (app/doc_index/chunking.py) and stored
in the index with progress; with an embedding model chosen (`Processing.embedding_model`), each
chunk's vector too. Runs in a worker thread (app/uploads/reading.py)."""

import codecs
import logging
import re
import numpy as np

from engine import Engine, EngineError, count_tokens

from ..uploads.documents import NotAttachable
from ..uploads.kinds import FileKind, Processed, Processing, register_kind
from ..uploads.pdf_text import PdfUnreadable, pdf_pages
from .chunking import Chunk, markdown_chunks, pdf_chunks, text_chunks

log = logging.getLogger(__name__)

PDF_TIME_BUDGET_S = 60.0  # a 1,000-page PDF on a slow machine
COUNT_CHARS = 400_000  # texts longer than this are counted in pieces (chunks), not whole
EMBED_BATCH = 64
EMBED_TIMEOUT_S = 600.0  # one batch; a stopped engine must not hold a reader thread forever
NOT_TEXT = "not a text file (only text, Markdown, code, CSV, JSON and PDF)"
_MD_HEADING = re.compile(rb"^#{1,6} \S", re.M)


def _is_pdf(head: bytes, name: str) -> bool:
    return head.startswith(b"%PDF-")


def _is_text(head: bytes, name: str) -> bool:
    try:  # the head may end inside a character: decode it as a stream that has not ended
        codecs.getincrementaldecoder("utf-8-sig")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return b"\x00" not in head


def _is_markdown(head: bytes, name: str) -> bool:
    return _is_text(head, name) and (_MD_HEADING.search(head) is not None
                                     or name.lower().endswith((".md", ".markdown")))


def read_text(job: Processing) -> str:
    try:
        text = job.path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError:
        raise NotAttachable(NOT_TEXT) from None
    if "\x00" in text:
        raise NotAttachable(NOT_TEXT)
    if not text.strip():
        raise NotAttachable("the file is empty")
    return text


def document_tokens(engine: Engine, text: str) -> tuple[int, bool]:
    """The document's token count and whether it is exact: texts up to COUNT_CHARS are counted,
    longer ones estimated from their first COUNT_CHARS (such a document is retrieved from, never
    sent whole, so only the chip shows the figure)."""
    if len(text) <= COUNT_CHARS:
        return count_tokens(engine, text=text), True
    return round(count_tokens(engine, text=text[:COUNT_CHARS]) * len(text) / COUNT_CHARS), False


def index_document(job: Processing, text: str, chunks: list[Chunk], pages: int | None) -> Processed:
    """Count, chunk, store (and embed) one document; what its chip shows."""
    if not chunks:
        raise NotAttachable("this document has no text")
    job.progress("counting", 0.0)
    tokens, exact = document_tokens(job.engine, text)
    job.progress("indexing", 0.0)
    ids = job.index.replace(job.sha256, chunks, lambda f: job.progress("indexing", f))
    model = job.embedding_model
    if model is not None:
        try:
            embed_chunks(job, ids, chunks, model)
        except (EngineError, TimeoutError):  # cannot embed now: BM25 alone still finds the chunks
            log.warning("embedding %s failed; it is searched by BM25 only", job.name, exc_info=True)
            model = None
    counted = f"{tokens:,} tokens" if exact else f"about {tokens:,} tokens"
    summary = f"{pages} pages · {counted}" if pages else counted
    return Processed(summary=summary, tokens=tokens, pages=pages, text=text,
                     meta={"chunks": len(chunks), "vectors": model})


def embed_chunks(job: Processing, ids: list[int], chunks: list[Chunk], model: str) -> None:
    """Each chunk's vector from the embedding model, in batches, with progress."""
    for start in range(0, len(chunks), EMBED_BATCH):
        texts = [c.text for c in chunks[start:start + EMBED_BATCH]]
        vectors = job.engine.embed(texts, model=model, truncate=True).result(EMBED_TIMEOUT_S)
        job.index.set_vectors(ids[start:start + EMBED_BATCH], np.asarray(vectors.vectors), model)
        job.progress("embedding", (start + len(texts)) / len(chunks))


def process_pdf(job: Processing) -> Processed:
    job.progress("reading pages", 0.0)
    try:
        pages = pdf_pages(job.path, PDF_TIME_BUDGET_S,
                          lambda fraction: job.progress("reading pages", fraction))
    except PdfUnreadable as exc:
        raise NotAttachable(str(exc)) from None
    if not any(p.strip() for p in pages):
        raise NotAttachable("this PDF has no text (a scan?)")
    return index_document(job, "\n\n".join(p.strip() for p in pages), pdf_chunks(pages), len(pages))


def process_markdown(job: Processing) -> Processed:
    text = read_text(job)
    return index_document(job, text, markdown_chunks(text), None)


def process_text(job: Processing) -> Processed:
    text = read_text(job)
    return index_document(job, text, text_chunks(text), None)


DOCUMENT_KINDS = (FileKind("pdf", _is_pdf, process_pdf),
                  FileKind("markdown", _is_markdown, process_markdown),
                  FileKind("text", _is_text, process_text))
for _kind in DOCUMENT_KINDS:
    register_kind(_kind)
DOCUMENT_KIND_NAMES: tuple[str, ...] = tuple(k.name for k in DOCUMENT_KINDS)
