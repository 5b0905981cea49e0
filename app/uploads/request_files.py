"""Files that arrive inside API requests (app/api/documents.py): read once per distinct file, by
its sha256, through the readers uploads use (the documents kinds of app/doc_index/indexing.py: a
PDF's pages in a child process with limits, the text counted, chunked and indexed), and kept with
the uploads: its `files` row (text, tokens) and its chunks. The next round of an agent session
sends the same file again and reads nothing; a file attached in the chat later is already read.

An API request has no conversation, so its file has no `uploads` row, and the bytes are not kept
(the text and the chunks are what a prompt needs). Files that no upload refers to are forgotten
`KEEP_DAYS` after they were read (`forget_stale`, on each new read); sent again, they are read
again."""

import logging
import threading
import time
from dataclasses import dataclass

from ..doc_index.indexing import DOCUMENT_KIND_NAMES, NOT_TEXT
from ..state import AppState
from .documents import NotAttachable
from .kinds import HEAD_BYTES, Processing, kind_of
from .store import UploadStore

log = logging.getLogger(__name__)

KEEP_DAYS = 7.0

# One file is read by one thread at a time (two requests with the same new file: the second
# waits, then finds it read); files hash onto a fixed set of locks.
_LOCKS = tuple(threading.Lock() for _ in range(64))


@dataclass(frozen=True)
class ReadFile:
    """What a prompt needs of a read file: its text and token count (and its sha256, which its
    chunks are stored under)."""

    sha256: str
    text: str
    tokens: int


def _lock(sha256: str) -> threading.Lock:
    return _LOCKS[int(sha256[:8], 16) % len(_LOCKS)]


def _known(store: UploadStore, sha256: str) -> ReadFile | None:
    rows = store.storage._query("SELECT status, text, tokens FROM files WHERE sha256 = ?",
                                (sha256,))
    if rows and rows[0]["status"] == "ready" and rows[0]["text"] is not None:
        return ReadFile(sha256, rows[0]["text"], rows[0]["tokens"] or 0)
    return None


def _begin(store: UploadStore, sha256: str, kind: str, size: int) -> None:
    """The file's row, status `reading` (a new one, or one refused before: read again)."""
    with store.storage._transaction() as db:
        db.execute("INSERT INTO files (sha256, kind, size, status, created) VALUES (?,?,?,?,?) "
                   "ON CONFLICT(sha256) DO UPDATE SET kind = excluded.kind, status = 'reading', "
                   "stage = NULL, progress = 0, error = NULL, created = excluded.created",
                   (sha256, kind, size, "reading", time.time()))


def forget_stale(store: UploadStore, now: float | None = None) -> int:
    """Forget the files no upload refers to that were read more than KEEP_DAYS ago (their chunks
    go with them); how many went."""
    cutoff = (now or time.time()) - KEEP_DAYS * 86400
    with store.storage._transaction() as db:
        return db.execute("DELETE FROM files WHERE created < ? AND status != 'reading' AND NOT "
                          "EXISTS (SELECT 1 FROM uploads u WHERE u.sha256 = files.sha256)",
                          (cutoff,)).rowcount


def _referenced(store: UploadStore, sha256: str) -> bool:
    return bool(store.storage._query("SELECT 1 FROM uploads WHERE sha256 = ? LIMIT 1", (sha256,)))


def read_request_file(state: AppState, name: str, data: bytes, sha256: str) -> ReadFile:
    """The text of the file `data` (sha256 `sha256`), read now or before; raises NotAttachable
    with the reason (not a PDF or text, unreadable, no text). Slow on a new file: call it on a
    reader thread (`AppState.readers`), as app/uploads/reading.py reads uploads."""
    store = state.uploads
    with _lock(sha256):
        known = _known(store, sha256)
        if known is not None:
            return known
        kind = kind_of(data[:HEAD_BYTES], name)
        if kind is None or kind.name not in DOCUMENT_KIND_NAMES:
            raise NotAttachable(NOT_TEXT)
        _begin(store, sha256, kind.name, len(data))
        blob = store.blob(sha256)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        job = Processing(engine=state.engine, path=blob, sha256=sha256, name=name, kind=kind.name,
                         progress=lambda stage, fraction: None, index=state.chunks,
                         embedding_model=state.document_embeddings)
        try:
            done = kind.process(job)
        except NotAttachable as exc:
            store.refused(sha256, str(exc))
            raise
        except Exception as exc:  # noqa: BLE001 - a reader's bug: the request says so
            log.exception("reading a file sent to the API failed")
            store.refused(sha256, f"it could not be read ({type(exc).__name__})")
            raise NotAttachable(f"it could not be read ({type(exc).__name__})") from None
        store.ready(sha256, summary=done.summary, tokens=done.tokens, pages=done.pages,
                    text=done.text, meta={**done.meta, "source": "api"})
        if not _referenced(store, sha256):
            blob.unlink(missing_ok=True)
        forget_stale(store)
        return ReadFile(sha256, done.text or "", done.tokens or 0)
