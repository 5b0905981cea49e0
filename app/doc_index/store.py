"""A conversation's document index in SQLite (tables of app/storage/migrations.py _V8): each file's chunks
with their page or heading, an FTS5 index over their text (BM25), and, when an embedding model
indexed them, one float32 vector per chunk. Vectors are searched by brute-force cosine over a numpy
matrix (one per file and model, cached), which stays within milliseconds up to ~100k chunks."""

import threading
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from ..storage import Storage, fts_query
from .chunking import Chunk

# Chunks per transaction while indexing (progress is reported between them). Small, because the
# database lock is held meanwhile and the server's own reads and writes (a streaming answer's
# saves, a chip's poll) wait for it.
BATCH = 100
# Words that say nothing about which chunk answers a question (English). Left in, every chunk that
# has one matches, and a second ranking fused with BM25 (the vectors) can outvote the one chunk
# that has the question's real words.
STOPWORDS = frozenset("""a about an and are as at be but by can could did do does for from had has
have how i if in is it its me my of on or our so than that the their them then there these they
this those to was we were what when where which who whom why will with would you your""".split())


@dataclass(frozen=True)
class StoredChunk:
    id: int
    sha256: str
    seq: int
    page: int | None
    heading: str | None
    text: str


def _marks(values: list) -> str:
    return ",".join("?" * len(values))


class ChunkStore:
    """Chunks of the uploaded documents in `storage`'s database."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self._matrices: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def replace(self, sha256: str, chunks: list[Chunk],
                progress: Callable[[float], None] = lambda f: None) -> list[int]:
        """Store `chunks` as file `sha256`'s (dropping any it had); returns their ids in order."""
        ids: list[int] = []
        with self.storage._transaction() as db:
            db.execute("DELETE FROM chunks WHERE sha256 = ?", (sha256,))
        for start in range(0, len(chunks), BATCH):
            with self.storage._transaction() as db:
                for seq, c in enumerate(chunks[start:start + BATCH], start):
                    ids.append(db.execute(
                        "INSERT INTO chunks (sha256, seq, page, heading, text) VALUES (?,?,?,?,?)",
                        (sha256, seq, c.page, c.heading, c.text)).lastrowid)
            progress(min(1.0, (start + BATCH) / len(chunks)))
        self._forget(sha256)
        return ids

    def set_vectors(self, ids: list[int], vectors: np.ndarray, model: str) -> None:
        """Store one embedding per chunk (`vectors[i]` for `ids[i]`), made by `model`."""
        rows = [(np.asarray(v, dtype="<f4").tobytes(), model, i) for i, v in zip(ids, vectors)]
        with self.storage._transaction() as db:
            db.executemany("UPDATE chunks SET vector = ?, vector_model = ? WHERE id = ?", rows)
        shas = {r["sha256"] for r in self.storage._query(
            f"SELECT DISTINCT sha256 FROM chunks WHERE id IN ({_marks(ids)})", tuple(ids))} if ids else set()
        for sha in shas:
            self._forget(sha)

    def count(self, sha256s: Iterable[str]) -> int:
        shas = list(sha256s)
        return self.storage._query(f"SELECT count(*) FROM chunks WHERE sha256 IN ({_marks(shas)})",
                                   tuple(shas))[0][0] if shas else 0

    def bm25(self, sha256s: Iterable[str], question: str, limit: int = 50) -> list[int]:
        """Ids of the chunks of these files that best match `question` (FTS5 BM25), best first.
        Any of its words may match, stopwords aside (each quoted: FTS syntax in the question is
        just text)."""
        shas = list(sha256s)
        words = fts_query(question)
        if not shas or words is None:
            return []
        terms = [w.rstrip("*") for w in words.split(" ")]
        terms = [t for t in terms if t.strip('"').lower() not in STOPWORDS] or terms
        query = " OR ".join(dict.fromkeys(terms))
        rows = self.storage._query(
            f"""SELECT c.id FROM chunks_fts JOIN chunks c ON c.id = chunks_fts.rowid
                WHERE chunks_fts MATCH ? AND c.sha256 IN ({_marks(shas)})
                ORDER BY bm25(chunks_fts) LIMIT ?""", (query, *shas, limit))
        return [r["id"] for r in rows]

    def nearest(self, sha256s: Iterable[str], query: np.ndarray, model: str,
                limit: int = 50) -> list[int]:
        """Ids of the chunks whose `model` vectors are closest to `query` (cosine), best first."""
        ids, matrix = self._matrix(list(sha256s), model)
        if not len(ids):
            return []
        q = np.asarray(query, dtype=np.float32)
        q = q / (np.linalg.norm(q) or 1.0)
        scores = matrix @ q
        top = np.argpartition(-scores, limit)[:limit] if len(scores) > limit else np.arange(len(scores))
        return [int(ids[i]) for i in top[np.argsort(-scores[top])]]

    def has_vectors(self, sha256s: Iterable[str], model: str) -> bool:
        shas = list(sha256s)
        return bool(shas) and bool(self.storage._query(
            f"SELECT 1 FROM chunks WHERE vector_model = ? AND sha256 IN ({_marks(shas)}) LIMIT 1",
            (model, *shas)))

    def get(self, ids: Iterable[int]) -> list[StoredChunk]:
        """The chunks `ids` (those that still exist), in the order given."""
        ids = list(ids)
        if not ids:
            return []
        rows = self.storage._query(f"SELECT id, sha256, seq, page, heading, text FROM chunks "
                                   f"WHERE id IN ({_marks(ids)})", tuple(ids))
        found = {r["id"]: StoredChunk(**dict(r)) for r in rows}
        return [found[i] for i in ids if i in found]

    def _matrix(self, shas: list[str], model: str) -> tuple[np.ndarray, np.ndarray]:
        parts = [self._file_matrix(sha, model) for sha in shas]
        parts = [p for p in parts if len(p[0])]
        if not parts:
            return np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.float32)
        if len(parts) == 1:  # one document: its cached matrix as it is, not a copy
            return parts[0]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _file_matrix(self, sha: str, model: str) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            cached = self._matrices.get((sha, model))
        if cached is not None:
            return cached
        rows = self.storage._query("SELECT id, vector FROM chunks WHERE sha256 = ? AND "
                                   "vector_model = ? ORDER BY seq", (sha, model))
        ids = np.array([r["id"] for r in rows], dtype=np.int64)
        matrix = np.stack([np.frombuffer(r["vector"], dtype="<f4") for r in rows]) if rows \
            else np.zeros((0, 0), dtype=np.float32)
        if len(matrix):
            matrix = matrix / np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)
        with self._lock:
            self._matrices[(sha, model)] = (ids, matrix)
        return ids, matrix

    def _forget(self, sha256: str) -> None:
        with self._lock:
            for key in [k for k in self._matrices if k[0] == sha256]:
                del self._matrices[key]
