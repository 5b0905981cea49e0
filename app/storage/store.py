"""Conversations and messages in one SQLite file (WAL), its schema migrated on opening (migrations.py).

Messages form a tree: `parent_id` links each message to the one before it, so an edited user
message or a regenerated answer is a sibling of the version it replaces and nothing is ever lost.
The conversation's `leaf_id` marks the branch shown and sent to the model (the "active path").

Every write is its own committed transaction: the user message is durable before generation
starts, and a streaming answer is saved as it grows, so killing the process loses at most the text
since the last save. In WAL mode with `synchronous=NORMAL`, a committed transaction survives a
process crash.
"""

import json
import re
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from engine import data_dir

from .migrations import migrate
from .records import DEFAULT_TITLE, MESSAGE_STATES, Conversation, McpChoice, Message

DB_NAME = "mlxchat.db"


def default_db_path() -> Path:
    return data_dir() / DB_NAME



def connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    # isolation_level=None: we open transactions ourselves (autocommit otherwise).
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.row_factory = sqlite3.Row
    db.execute("PRAGMA busy_timeout = 5000")  # first: another opener may hold the lock
    _set_wal(db)
    db.execute("PRAGMA synchronous = NORMAL")
    db.execute("PRAGMA foreign_keys = ON")
    return db


def _set_wal(db: sqlite3.Connection, attempts: int = 20) -> None:
    """Switch to WAL. The switch needs a moment alone with the file, and SQLite may answer "locked"
    at once rather than wait for a concurrent opener, so it is retried for a few seconds."""
    for attempt in range(attempts):
        try:
            db.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.25)


_WORD = re.compile(r"\w+")


def fts_query(text: str) -> str | None:
    """An FTS5 query matching rows with words that start with each word of `text`, or None when it
    has no words. Every word is quoted, so FTS syntax in user text (quotes, `*`, `-`, `NEAR`,
    `column:`) is searched for, never interpreted."""
    words = _WORD.findall(text)
    return " ".join(f'"{w}"*' for w in words) if words else None


_DAMAGED = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def open_database(path: Path) -> tuple[sqlite3.Connection, Path | None]:
    """The migrated database at `path`, and where a damaged file there was moved (else None).

    A file SQLite cannot read as a database is kept, renamed `<name>.corrupt-<time>` (with its
    -wal and -shm files), and a fresh database takes its place."""
    try:
        db = connect(path)
        try:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
            migrate(db)
        except BaseException:
            db.close()
            raise
        return db, None
    except sqlite3.DatabaseError as exc:
        if getattr(exc, "sqlite_errorcode", None) not in _DAMAGED:
            raise
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
    for suffix in ("", "-wal", "-shm"):
        part = Path(f"{path}{suffix}")
        if part.exists():
            part.rename(f"{aside}{suffix}")
    db = connect(path)
    migrate(db)
    return db, aside


def valid_id(value: int) -> bool:
    """Whether `value` can be a row id (SQLite's are signed 64-bit; larger ones overflow)."""
    return 0 < value < 2**63




def _conversation(row: sqlite3.Row) -> Conversation:
    d = dict(row)
    d["settings"] = json.loads(d["settings"] or "{}")
    return Conversation(**d)


_JSON_COLUMNS = ("sampling", "speculative", "attachments", "tool_calls", "tool_meta", "retrieved")


def _message(row: sqlite3.Row) -> Message:
    d = dict(row)
    for key in _JSON_COLUMNS:
        d[key] = json.loads(d[key]) if d.get(key) else None
    return Message(**d)


# Columns `finish_message` may set once a generation ends.
_RESULT_FIELDS = ("ttft_ms", "tokens_per_s", "prompt_tokens", "completion_tokens", "cached_tokens",
                  "finish_reason", "error", "speculative")


class Storage:
    """All reads and writes of the database. Thread-safe: one connection behind a lock."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path else default_db_path()
        self._db, self.moved_aside = open_database(self.path)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _write(self, sql: str, args: tuple = ()) -> int:
        """One statement (autocommitted); returns the last inserted row id."""
        with self._lock:
            return self._db.execute(sql, args).lastrowid

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # conversations

    def create_conversation(self, model: str | None = None, settings: dict[str, Any] | None = None,
                            title: str = DEFAULT_TITLE) -> Conversation:
        now = time.time()
        cid = self._write(
            "INSERT INTO conversations (title, created, updated, model, settings) VALUES (?,?,?,?,?)",
            (title, now, now, model, json.dumps(settings or {})),
        )
        return self.get_conversation(cid)

    def get_conversation(self, cid: int) -> Conversation | None:
        if not valid_id(cid):
            return None
        rows = self._query("SELECT * FROM conversations WHERE id = ?", (cid,))
        return _conversation(rows[0]) if rows else None

    def list_conversations(self, search: str = "", limit: int = 200) -> list[Conversation]:
        """Newest first; `search` keeps those whose title or any message (any version) holds
        words starting with each of its words, accents and case aside (FTS5)."""
        query = fts_query(search)
        if query is None and not search.strip():
            rows = self._query("SELECT * FROM conversations ORDER BY updated DESC LIMIT ?", (limit,))
        elif query is None:  # no word characters at all (say "++" or an emoji): plain substring
            pattern = "%" + search.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            rows = self._query(
                """SELECT * FROM conversations c WHERE c.title LIKE ?1 ESCAPE '\\'
                   OR EXISTS (SELECT 1 FROM messages m WHERE m.conversation_id = c.id
                              AND m.content LIKE ?1 ESCAPE '\\')
                   ORDER BY updated DESC LIMIT ?2""",
                (pattern, limit),
            )
        else:
            rows = self._query(
                """SELECT * FROM conversations WHERE id IN
                       (SELECT rowid FROM conversations_fts WHERE conversations_fts MATCH ?1)
                   OR id IN (SELECT conversation_id FROM messages WHERE id IN
                       (SELECT rowid FROM messages_fts WHERE messages_fts MATCH ?1))
                   ORDER BY updated DESC LIMIT ?2""",
                (query, limit),
            )
        return [_conversation(r) for r in rows]

    def empty_conversation(self) -> Conversation | None:
        """The newest conversation without messages, reused by "new chat" instead of piling up."""
        rows = self._query(
            """SELECT * FROM conversations c WHERE NOT EXISTS
               (SELECT 1 FROM messages m WHERE m.conversation_id = c.id)
               ORDER BY updated DESC LIMIT 1""")
        return _conversation(rows[0]) if rows else None

    def rename_conversation(self, cid: int, title: str) -> None:
        self._write("UPDATE conversations SET title = ?, updated = ? WHERE id = ?",
                    (title, time.time(), cid))

    def update_conversation(self, cid: int, *, settings: dict[str, Any] | None = None,
                            model: str | None = None) -> None:
        if settings is not None:
            self._write("UPDATE conversations SET settings = ? WHERE id = ?", (json.dumps(settings), cid))
        if model is not None:
            self._write("UPDATE conversations SET model = ? WHERE id = ?", (model, cid))

    def delete_conversation(self, cid: int) -> None:
        self._write("DELETE FROM conversations WHERE id = ?", (cid,))

    def insert_conversation(self, fields: dict[str, Any],
                            tree: list[tuple[int, int | None, dict[str, Any]]],
                            leaf: int | None) -> Conversation:
        """A whole conversation in one transaction (an import): `fields` are its title, created,
        updated, model and settings; `tree` its messages as (local id, local id of the parent,
        columns), each parent before its children (an unknown parent: a first message); `leaf`
        the local id of the branch shown."""
        with self._transaction() as db:
            cid = db.execute(
                "INSERT INTO conversations (title, created, updated, model, settings) VALUES (?,?,?,?,?)",
                (fields["title"], fields["created"], fields["updated"], fields["model"],
                 json.dumps(fields["settings"]))).lastrowid
            ids: dict[int, int] = {}
            for local, parent, columns in tree:
                row = {k: json.dumps(v) if k in _JSON_COLUMNS and v is not None else v
                       for k, v in columns.items()}
                ids[local] = db.execute(
                    f"INSERT INTO messages (conversation_id, parent_id, {', '.join(row)}) "
                    f"VALUES ({', '.join('?' * (len(row) + 2))})",
                    (cid, ids.get(parent), *row.values())).lastrowid
            db.execute("UPDATE conversations SET leaf_id = ? WHERE id = ?", (ids.get(leaf), cid))
        return self.get_conversation(cid)

    # messages

    def add_message(self, cid: int, parent_id: int | None, role: str, content: str, *,
                    state: str = "done", model: str | None = None,
                    sampling: dict[str, Any] | None = None,
                    attachments: list[dict[str, Any]] | None = None,
                    tool_call_id: str | None = None,
                    tool_meta: dict[str, Any] | None = None) -> Message:
        """Insert a message under `parent_id` and make it the conversation's active leaf."""
        assert state in MESSAGE_STATES, state
        now = time.time()
        with self._transaction() as db:
            mid = db.execute(
                """INSERT INTO messages (conversation_id, parent_id, role, content, model, sampling,
                   state, created, attachments, tool_call_id, tool_meta)
                   VALUES (?,?,?,?,?,?,?,?,?,?,?)""",
                (cid, parent_id, role, content, model,
                 json.dumps(sampling) if sampling is not None else None, state, now,
                 json.dumps(attachments) if attachments else None, tool_call_id,
                 json.dumps(tool_meta) if tool_meta else None),
            ).lastrowid
            db.execute("UPDATE conversations SET leaf_id = ?, updated = ? WHERE id = ?",
                             (mid, now, cid))
        return self.get_message(mid)

    def messages(self, cid: int) -> list[Message]:
        """Every message of conversation `cid` (all versions), oldest first."""
        rows = self._query("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (cid,))
        return [_message(r) for r in rows]

    def get_message(self, mid: int) -> Message | None:
        if not valid_id(mid):
            return None
        rows = self._query("SELECT * FROM messages WHERE id = ?", (mid,))
        return _message(rows[0]) if rows else None

    def save_partial(self, mid: int, content: str) -> None:
        """Store the text streamed so far (called periodically while generating)."""
        self._write("UPDATE messages SET content = ? WHERE id = ?", (content, mid))

    def finish_message(self, mid: int, content: str, state: str, **result: Any) -> Message:
        """Final text, state and generation results (see `_RESULT_FIELDS`) of a message."""
        assert state in MESSAGE_STATES, state
        unknown = set(result) - set(_RESULT_FIELDS)
        assert not unknown, unknown
        if result.get("speculative") is not None:
            result["speculative"] = json.dumps(result["speculative"])
        fields = ["content = ?", "state = ?"] + [f"{k} = ?" for k in result]
        self._write(f"UPDATE messages SET {', '.join(fields)} WHERE id = ?",
                    (content, state, *result.values(), mid))
        return self.get_message(mid)

    def set_tool_calls(self, mid: int, calls: list[dict[str, Any]],
                       meta: dict[str, Any] | None = None) -> None:
        """An answer's tool calls (OpenAI's shape) and what the app knows of them."""
        self._write("UPDATE messages SET tool_calls = ?, tool_meta = ? WHERE id = ?",
                    (json.dumps(calls) if calls else None, json.dumps(meta) if meta else None, mid))

    # MCP tool settings of a conversation

    def mcp_choice(self, cid: int) -> McpChoice:
        rows = self._query("SELECT * FROM mcp_conversations WHERE conversation_id = ?", (cid,))
        if not rows:
            return McpChoice()
        r = rows[0]
        return McpChoice(tuple(json.loads(r["servers"])), tuple(json.loads(r["always"])),
                         bool(r["first_call"]), r["max_rounds"])

    def save_mcp_choice(self, cid: int, choice: McpChoice) -> None:
        self._write(
            """INSERT INTO mcp_conversations (conversation_id, servers, always, first_call, max_rounds)
               VALUES (?,?,?,?,?) ON CONFLICT(conversation_id) DO UPDATE SET servers = excluded.servers,
               always = excluded.always, first_call = excluded.first_call,
               max_rounds = excluded.max_rounds""",
            (cid, json.dumps(list(choice.servers)), json.dumps(list(choice.always)),
             int(choice.first_call), choice.max_rounds))

    def set_retrieved(self, mid: int, chunk_ids: list[int]) -> None:
        """Record the chunks a user turn was answered with (app/doc_index/answering.py)."""
        self._write("UPDATE messages SET retrieved = ? WHERE id = ?", (json.dumps(chunk_ids), mid))

    def interrupt_streaming(self) -> int:
        """At startup: answers left `streaming` by a crash keep their text and become `stopped`."""
        with self._lock:
            return self._db.execute(
                "UPDATE messages SET state = 'stopped', finish_reason = 'interrupted' "
                "WHERE state = 'streaming'"
            ).rowcount

    # branches

    def active_path(self, cid: int) -> list[Message]:
        """Messages from the first to the conversation's leaf, following parent links."""
        rows = self._query(
            """WITH RECURSIVE path(id, depth) AS (
                   SELECT leaf_id, 0 FROM conversations WHERE id = ?
                   UNION ALL
                   SELECT m.parent_id, path.depth + 1 FROM messages m JOIN path ON m.id = path.id
                   WHERE m.parent_id IS NOT NULL)
               SELECT messages.* FROM path JOIN messages ON messages.id = path.id
               ORDER BY path.depth DESC""",
            (cid,),
        )
        return [_message(r) for r in rows]

    def siblings(self, message: Message) -> list[Message]:
        """All versions of `message`: messages of its role under the same parent, oldest first."""
        rows = self._query(
            "SELECT * FROM messages WHERE conversation_id = ? AND parent_id IS ? AND role = ? "
            "ORDER BY id",
            (message.conversation_id, message.parent_id, message.role),
        )
        return [_message(r) for r in rows]

    def select_branch(self, cid: int, mid: int) -> None:
        """Show the branch through message `mid`, down to its newest descendant."""
        if not valid_id(mid):
            return
        leaf = mid
        while True:
            rows = self._query("SELECT max(id) FROM messages WHERE parent_id = ?", (leaf,))
            child = rows[0][0]
            if child is None:
                break
            leaf = child
        self._write("UPDATE conversations SET leaf_id = ? WHERE id = ? AND "
                    "EXISTS (SELECT 1 FROM messages WHERE id = ? AND conversation_id = ?)",
                    (leaf, cid, mid, cid))
