"""Uploaded files on disk and in the database: each distinct file once, content-addressed by its
sha256 under the data folder's `uploads/` (`files` rows: kind, size, reading status and progress,
what reading gave), and one `uploads` row per attachment in a conversation (its id is what the
composer and messages refer to). Deleting a conversation deletes its uploads; a file no upload
refers to any more is deleted with its chunks (a trigger, app/storage/migrations.py _V8), and its bytes by
`sweep`."""

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..storage import Conversation, Storage, valid_id

UPLOADS_DIR = "uploads"
PART_PREFIX = ".part-"  # a file still arriving; removed when the upload fails


@dataclass(frozen=True)
class Upload:
    """One attached file, as the chip and the prompt see it."""

    id: int
    conversation_id: int
    name: str
    sha256: str
    kind: str
    size: int
    status: str  # reading | ready | refused
    stage: str | None
    progress: float
    error: str | None
    tokens: int | None
    pages: int | None
    meta: dict[str, Any]

    @property
    def reading(self) -> bool:
        return self.status == "reading"

    def public(self) -> dict[str, Any]:
        """The upload as the endpoint answers it (JSON)."""
        return {"id": self.id, "kind": self.kind, "name": self.name, "size": self.size,
                "status": self.status, "stage": self.stage, "progress": round(self.progress, 3),
                "error": self.error, "tokens": self.tokens, "pages": self.pages,
                "summary": self.meta.get("summary")}

    def reference(self) -> dict[str, Any]:
        """What a message stores of it (the text stays with the file): id, name, kind, tokens."""
        return {"upload": self.id, "name": self.name, "kind": self.kind, "size": self.size,
                "tokens": self.tokens, "pages": self.pages}


_SELECT = """SELECT u.id, u.conversation_id, u.name, u.sha256, f.kind, f.size, f.status, f.stage,
             f.progress, f.error, f.tokens, f.pages, f.meta
             FROM uploads u JOIN files f ON f.sha256 = u.sha256"""


def _upload(row: Any) -> Upload:
    d = dict(row)
    d["meta"] = json.loads(d["meta"]) if d["meta"] else {}
    return Upload(**d)


class UploadStore:
    """The `files` and `uploads` rows of `storage`'s database, and the bytes beside it."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.folder = storage.path.parent / UPLOADS_DIR

    def blob(self, sha256: str) -> Path:
        return self.folder / sha256

    def add(self, cid: int, name: str, sha256: str, kind: str, size: int) -> tuple[Upload, bool]:
        """Attach the stored file `sha256` in conversation `cid`; True when it must be read (new,
        or refused before: a retry reads it again)."""
        now = time.time()
        with self.storage._transaction() as db:
            row = db.execute("SELECT status FROM files WHERE sha256 = ?", (sha256,)).fetchone()
            fresh = row is None or row["status"] == "refused"
            if row is None:
                db.execute("INSERT INTO files (sha256, kind, size, status, created) VALUES (?,?,?,?,?)",
                           (sha256, kind, size, "reading", now))
            elif fresh:
                db.execute("UPDATE files SET kind = ?, status = 'reading', stage = NULL, progress = 0,"
                           " error = NULL WHERE sha256 = ?", (kind, sha256))
            uid = db.execute("INSERT INTO uploads (conversation_id, sha256, name, created) "
                             "VALUES (?,?,?,?)", (cid, sha256, name, now)).lastrowid
        return self.get(uid), fresh

    def get(self, uid: int, cid: int | None = None) -> Upload | None:
        """Upload `uid` (in conversation `cid` when given), or None."""
        if not valid_id(uid):
            return None
        rows = self.storage._query(_SELECT + " WHERE u.id = ?", (uid,))
        up = _upload(rows[0]) if rows else None
        return up if up is not None and (cid is None or up.conversation_id == cid) else None

    def text(self, sha256: str) -> str:
        rows = self.storage._query("SELECT text FROM files WHERE sha256 = ?", (sha256,))
        return rows[0]["text"] or "" if rows else ""

    def progress(self, sha256: str, stage: str, fraction: float) -> None:
        self.storage._write("UPDATE files SET stage = ?, progress = ? WHERE sha256 = ?",
                            (stage, max(0.0, min(1.0, fraction)), sha256))

    def ready(self, sha256: str, *, summary: str, tokens: int | None, pages: int | None,
              text: str | None, meta: dict[str, Any]) -> None:
        self.storage._write(
            "UPDATE files SET status = 'ready', stage = NULL, progress = 1, tokens = ?, pages = ?,"
            " text = ?, meta = ? WHERE sha256 = ?",
            (tokens, pages, text, json.dumps({**meta, "summary": summary}), sha256))

    def set_thumbnail(self, sha256: str, png: bytes) -> None:
        """Keep an image's thumbnail (PNG), made once when the file is read."""
        self.storage._write("UPDATE files SET thumbnail = ? WHERE sha256 = ?", (png, sha256))

    def thumbnail(self, sha256: str) -> bytes | None:
        rows = self.storage._query("SELECT thumbnail FROM files WHERE sha256 = ?", (sha256,))
        return rows[0]["thumbnail"] if rows else None

    def refused(self, sha256: str, reason: str) -> None:
        """Reading failed: the chip says why; the bytes are removed (an upload again retries)."""
        self.storage._write("UPDATE files SET status = 'refused', stage = NULL, error = ?, "
                            "text = NULL, thumbnail = NULL WHERE sha256 = ?", (reason, sha256))
        with self.storage._transaction() as db:
            db.execute("DELETE FROM chunks WHERE sha256 = ?", (sha256,))
        self.blob(sha256).unlink(missing_ok=True)

    def interrupted(self) -> int:
        """At startup: files a stopped server was still reading are refused (attaching the file
        again reads it again)."""
        rows = self.storage._query("SELECT sha256 FROM files WHERE status = 'reading'")
        for row in rows:
            self.refused(row["sha256"], "reading it was interrupted by a restart; attach it again")
        return len(rows)

    def sweep(self, starting: bool = False) -> int:
        """Remove bytes no `files` row refers to (their conversations were deleted) and uploads
        that never finished arriving: a part file an hour old, or any when `starting` (no upload
        can be arriving before the server serves; one server per data folder); returns how many
        files went."""
        if not self.folder.is_dir():
            return 0
        known = {r["sha256"] for r in self.storage._query("SELECT sha256 FROM files")}
        gone = 0
        for path in self.folder.iterdir():
            if path.name not in known and path.is_file():
                if path.name.startswith(PART_PREFIX) and not starting \
                        and time.time() - path.stat().st_mtime < 3600:
                    continue  # may still be arriving
                path.unlink(missing_ok=True)
                gone += 1
        return gone


def attached_uploads(storage: Storage, cid: int, value: Any) -> list[dict[str, Any]]:
    """The references a message stores for the upload ids its form carries (one id or a list);
    raises ValueError, for the user, on an unknown id or a file not read (yet)."""
    ids = [value] if isinstance(value, (str, int)) else value or []
    store, refs = UploadStore(storage), []
    for raw in ids:
        try:
            up = store.get(int(raw), cid)
        except (TypeError, ValueError, OverflowError):
            up = None
        if up is None:
            raise ValueError("An attached file is no longer there; attach it again.")
        if up.reading:
            raise ValueError(f"“{up.name}” is still being read; send once its chip shows its size.")
        if up.status == "refused":
            raise ValueError(f"“{up.name}” cannot be attached: {up.error}")
        refs.append(up.reference())
    return refs


def carry_uploads(storage: Storage, from_cid: int, to_cid: int, value: Any) -> list[int]:
    """Attach conversation `from_cid`'s uploads `value` (a JSON list of ids, as the context
    notice's form sends it) in conversation `to_cid` too; their new ids. Unknown ids are skipped."""
    try:
        ids = json.loads(value or "[]")
    except ValueError:
        return []
    store, carried = UploadStore(storage), []
    for raw in ids if isinstance(ids, list) else []:
        up = store.get(raw, from_cid) if isinstance(raw, int) else None
        if up is not None and up.status == "ready":
            carried.append(store.add(to_cid, up.name, up.sha256, up.kind, up.size)[0].id)
    return carried


def draft_uploads(storage: Storage, conv: Conversation) -> list[Upload]:
    """The uploads waiting in a conversation's composer (its draft, from the context notice)."""
    draft = conv.settings.get("draft")
    ids = draft.get("uploads") if isinstance(draft, dict) else None
    store = UploadStore(storage)
    found = [store.get(i, conv.id) for i in ids if isinstance(i, int)] if isinstance(ids, list) else []
    return [up for up in found if up is not None]
