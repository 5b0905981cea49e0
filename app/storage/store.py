"""Conversations and messages in one SQLite file (WAL), with versioned schema migrations.

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
from dataclasses import dataclass
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Iterator

from engine import data_dir

DB_NAME = "mlxchat.db"
DEFAULT_TITLE = "New chat"
MESSAGE_STATES = ("streaming", "done", "stopped", "failed")


def default_db_path() -> Path:
    return data_dir() / DB_NAME


# --- schema -------------------------------------------------------------------------------------

# The first schema: conversations and a tree of messages.
_V1 = """
        CREATE TABLE conversations (
            id INTEGER PRIMARY KEY,
            title TEXT NOT NULL,
            created REAL NOT NULL,
            updated REAL NOT NULL,
            model TEXT,
            settings TEXT NOT NULL DEFAULT '{}'
        );
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,
            role TEXT NOT NULL,
            content TEXT NOT NULL DEFAULT '',
            model TEXT,
            sampling TEXT,
            ttft_ms REAL,
            tokens_per_s REAL,
            prompt_tokens INTEGER,
            completion_tokens INTEGER,
            cached_tokens INTEGER,
            finish_reason TEXT,
            state TEXT NOT NULL DEFAULT 'done',
            error TEXT,
            created REAL NOT NULL
        );
        CREATE INDEX messages_conversation ON messages(conversation_id);
"""

# Remember the branch the user looks at; before this, the newest message was the leaf.
_V2 = """
        ALTER TABLE conversations ADD COLUMN leaf_id INTEGER REFERENCES messages(id) ON DELETE SET NULL;
        UPDATE conversations SET leaf_id =
            (SELECT max(id) FROM messages WHERE messages.conversation_id = conversations.id);
        CREATE INDEX messages_parent ON messages(parent_id);
"""

# Speculative decoding statistics of an answer (JSON: drafted, accepted, acceptance_rate, ...).
_V3 = """
        ALTER TABLE messages ADD COLUMN speculative TEXT;
"""

# Full-text search of titles and message text (FTS5 tables over the real ones, kept in step by
# triggers, filled from the rows already there). Answers are saved as they stream, so only a change
# of the indexed column touches the index.
_V4 = """
        CREATE VIRTUAL TABLE conversations_fts USING fts5(
            title, content='conversations', content_rowid='id', tokenize='unicode61 remove_diacritics 2');
        CREATE VIRTUAL TABLE messages_fts USING fts5(
            content, content='messages', content_rowid='id', tokenize='unicode61 remove_diacritics 2');
        CREATE TRIGGER conversations_fts_insert AFTER INSERT ON conversations BEGIN
            INSERT INTO conversations_fts(rowid, title) VALUES (new.id, new.title);
        END;
        CREATE TRIGGER conversations_fts_delete AFTER DELETE ON conversations BEGIN
            INSERT INTO conversations_fts(conversations_fts, rowid, title) VALUES ('delete', old.id, old.title);
        END;
        CREATE TRIGGER conversations_fts_update AFTER UPDATE OF title ON conversations BEGIN
            INSERT INTO conversations_fts(conversations_fts, rowid, title) VALUES ('delete', old.id, old.title);
            INSERT INTO conversations_fts(rowid, title) VALUES (new.id, new.title);
        END;
        CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
            INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
        END;
        CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
            INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
        END;
        CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN
            INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
            INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
        END;
        INSERT INTO conversations_fts(conversations_fts) VALUES ('rebuild');
        INSERT INTO messages_fts(messages_fts) VALUES ('rebuild');
"""

# A user turn's attached documents (JSON: [{name, text, tokens}]), an answer's tool calls (JSON,
# OpenAI's shape) and the call a tool result answers.
_V5 = """
        ALTER TABLE messages ADD COLUMN attachments TEXT;
        ALTER TABLE messages ADD COLUMN tool_calls TEXT;
        ALTER TABLE messages ADD COLUMN tool_call_id TEXT;
"""

# Stored answers of the OpenAI Responses API (`store`, `previous_response_id`): the response as
# sent, and the whole conversation it ends (engine messages, JSON) for a follow-up to continue.
_V6 = """
        CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            created REAL NOT NULL,
            body TEXT NOT NULL,
            messages TEXT NOT NULL
        );
"""

# MCP tools in the chat (app/mcp): per conversation, the servers switched on, the tools allowed
# for the whole conversation ("server/tool", JSON), whether the first round must call a tool, and
# the most tool rounds a turn may take; on a message, what the app knows of its tool calls or of
# the result it holds (JSON: server, tool, outcome, is_error, truncated).
_V7 = """
        CREATE TABLE mcp_conversations (
            conversation_id INTEGER PRIMARY KEY REFERENCES conversations(id) ON DELETE CASCADE,
            servers TEXT NOT NULL DEFAULT '[]',
            always TEXT NOT NULL DEFAULT '[]',
            first_call INTEGER NOT NULL DEFAULT 0,
            max_rounds INTEGER NOT NULL DEFAULT 8
        );
        ALTER TABLE messages ADD COLUMN tool_meta TEXT;
"""

# Uploaded files (app/ui/uploads.py) and their document index (app/doc_index/): `files` holds each
# distinct file once (content-addressed by sha256; the bytes live in the data folder's uploads/),
# `uploads` ties a file to the conversation it was attached in (deleting the conversation deletes
# them, and a file no upload refers to any more goes with its chunks), `chunks` are a document's
# retrievable pieces (page or heading, text, an optional embedding) with an FTS5 index for BM25,
# and `messages.retrieved` records which chunks a user turn was answered with (JSON list of ids).
_V8 = """
        CREATE TABLE files (
            sha256 TEXT PRIMARY KEY,
            kind TEXT NOT NULL,
            size INTEGER NOT NULL,
            status TEXT NOT NULL DEFAULT 'reading',
            stage TEXT,
            progress REAL NOT NULL DEFAULT 0,
            error TEXT,
            tokens INTEGER,
            pages INTEGER,
            text TEXT,
            meta TEXT,
            created REAL NOT NULL
        );
        CREATE TABLE uploads (
            id INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            sha256 TEXT NOT NULL,
            name TEXT NOT NULL,
            created REAL NOT NULL
        );
        CREATE INDEX uploads_conversation ON uploads(conversation_id);
        CREATE INDEX uploads_sha256 ON uploads(sha256);
        CREATE TRIGGER uploads_unused AFTER DELETE ON uploads
        WHEN NOT EXISTS (SELECT 1 FROM uploads WHERE sha256 = old.sha256) BEGIN
            DELETE FROM files WHERE sha256 = old.sha256;
        END;
        CREATE TABLE chunks (
            id INTEGER PRIMARY KEY,
            sha256 TEXT NOT NULL REFERENCES files(sha256) ON DELETE CASCADE,
            seq INTEGER NOT NULL,
            page INTEGER,
            heading TEXT,
            text TEXT NOT NULL,
            vector BLOB,
            vector_model TEXT
        );
        CREATE INDEX chunks_file ON chunks(sha256, seq);
        CREATE VIRTUAL TABLE chunks_fts USING fts5(
            text, content='chunks', content_rowid='id', tokenize='unicode61 remove_diacritics 2');
        CREATE TRIGGER chunks_fts_insert AFTER INSERT ON chunks BEGIN
            INSERT INTO chunks_fts(rowid, text) VALUES (new.id, new.text);
        END;
        CREATE TRIGGER chunks_fts_delete AFTER DELETE ON chunks BEGIN
            INSERT INTO chunks_fts(chunks_fts, rowid, text) VALUES ('delete', old.id, old.text);
        END;
        ALTER TABLE messages ADD COLUMN retrieved TEXT;
"""

# Append only: the schema version of a database (PRAGMA user_version) is how many have run.
MIGRATIONS: list[str] = [_V1, _V2, _V3, _V4, _V5, _V6, _V7, _V8]
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(db: sqlite3.Connection, target: int = SCHEMA_VERSION) -> int:
    """Apply the migrations `db` lacks, each in its own transaction; return the new version.

    Each step takes the database's write lock (BEGIN IMMEDIATE) before it reads the version, so
    two processes opening one database at once cannot both apply the same migration."""
    version = _version(db)
    for number in range(version + 1, target + 1):
        # One step, one transaction: a failed migration leaves the previous version intact.
        db.execute("BEGIN IMMEDIATE")
        try:
            version = _version(db)
            if version < number:
                for statement in _statements(MIGRATIONS[number - 1]):
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {number}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
    return max(_version(db), target)


class DatabaseTooNew(RuntimeError):
    """The database was written by a newer mlxchat; the message says so, for one `Error:` line."""


def _version(db: sqlite3.Connection) -> int:
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise DatabaseTooNew(
            f"the database is schema version {version}, newer than this mlxchat ({SCHEMA_VERSION})"
        )
    return version


def _statements(script: str) -> Iterator[str]:
    """The SQL statements of a migration script, one by one (so that they share a transaction)."""
    current = ""
    for piece in script.split(";"):
        current += piece + ";"
        if sqlite3.complete_statement(current):
            if current.strip(" \n\t;"):
                yield current
            current = ""


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


# --- records ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    created: float
    updated: float
    model: str | None
    settings: dict[str, Any]
    leaf_id: int | None


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: int
    parent_id: int | None
    role: str
    content: str
    model: str | None
    sampling: dict[str, Any] | None
    ttft_ms: float | None
    tokens_per_s: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    finish_reason: str | None
    state: str
    error: str | None
    created: float
    speculative: dict[str, Any] | None = None  # statistics, when it was decoded speculatively
    attachments: list[dict[str, Any]] | None = None  # documents of a user turn: name, text, tokens
    tool_calls: list[dict[str, Any]] | None = None  # an answer's calls, as OpenAI sends them
    tool_call_id: str | None = None  # the call a `tool` message answers
    tool_meta: dict[str, Any] | None = None  # MCP: a call's server and outcome (app/mcp)

    retrieved: list[int] | None = None  # chunk ids a user turn's large documents gave it

@dataclass(frozen=True)
class McpChoice:
    """A conversation's MCP tool settings (app/mcp): the servers switched on, the tools allowed
    for the whole conversation ("server/tool"), whether the first round must call a tool, and
    the most tool rounds one turn may take."""

    servers: tuple[str, ...] = ()
    always: tuple[str, ...] = ()
    first_call: bool = False
    max_rounds: int = 8


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

    # stored Responses API answers

    def save_response(self, rid: str, body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._write("INSERT OR REPLACE INTO responses (id, created, body, messages) VALUES (?,?,?,?)",
                    (rid, time.time(), json.dumps(body), json.dumps(messages)))

    def get_response(self, rid: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(the response as sent, the conversation it ends) or None."""
        rows = self._query("SELECT body, messages FROM responses WHERE id = ?", (rid,))
        return (json.loads(rows[0]["body"]), json.loads(rows[0]["messages"])) if rows else None

    def delete_response(self, rid: str) -> bool:
        with self._transaction() as db:
            return db.execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount > 0

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


# --- export / import (a conversation as JSON: every message version, settings, model, times) -----

EXPORT_FORMAT = "mlxchat.conversation/1"
_MESSAGE_COLUMNS = ("role", "content", "model", "sampling", "ttft_ms", "tokens_per_s",
                    "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "state",
                    "error", "created", "speculative", "attachments", "tool_calls", "tool_call_id",
                    "tool_meta")
_ROLES = ("system", "user", "assistant", "tool")


def export_conversation(storage: Storage, cid: int) -> dict[str, Any]:
    """Everything about one conversation; message ids are local to the export (`parent` refers to
    an earlier entry's `id`) and `leaf` is the branch shown."""
    conv = storage.get_conversation(cid)
    if conv is None:
        raise KeyError(cid)
    messages = storage.messages(cid)
    local = {m.id: i for i, m in enumerate(messages)}
    return {"format": EXPORT_FORMAT, "title": conv.title, "created": conv.created,
            "updated": conv.updated, "model": conv.model, "settings": conv.settings,
            "leaf": local.get(conv.leaf_id),
            "messages": [{"id": local[m.id], "parent": local.get(m.parent_id),
                          **{k: getattr(m, k) for k in _MESSAGE_COLUMNS}} for m in messages]}


def import_conversation(storage: Storage, data: dict[str, Any], model: str | None = None,
                        settings: dict[str, Any] | None = None) -> Conversation:
    """A new conversation from `export_conversation`'s JSON, or from a plain OpenAI `messages`
    list (`{"messages": [{"role", "content"}, ...]}`); raises ValueError on anything else.
    A plain list carries no model or settings: it gets `model` and `settings`."""
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise ValueError("not a conversation: expected an object with 'messages'")
    from .import_schema import validated, validated_message  # it imports this module's names

    ours = data.get("format") == EXPORT_FORMAT
    if ours:
        data = validated(data)
    messages = data["messages"] if ours else [validated_message(i, m) for i, m in enumerate(data["messages"])]
    now = time.time()
    with storage._transaction() as db:
        cid = db.execute(
            "INSERT INTO conversations (title, created, updated, model, settings) VALUES (?,?,?,?,?)",
            (str(data.get("title") or DEFAULT_TITLE), (data["created"] or now) if ours else now,
             (data["updated"] or now) if ours else now, data.get("model") if ours else model,
             json.dumps(data["settings"] if ours else settings or {}))).lastrowid
        ids: dict[int, int] = {}
        previous = None
        for i, m in enumerate(messages):
            if not (isinstance(m["content"], str) or m["content"] is None and m["tool_calls"]):
                raise ValueError(f"messages[{i}] must have text content (or tool calls)")
            row = {k: m[k] for k in _MESSAGE_COLUMNS} if ours else \
                {"role": m["role"], "content": m["content"] or "",
                 "tool_calls": m["tool_calls"], "tool_call_id": m["tool_call_id"]}
            row["content"] = row["content"] or ""
            row["created"] = row.get("created") or now
            row["state"] = row.get("state") or "done"
            for key in _JSON_COLUMNS:
                if key in row:
                    row[key] = json.dumps(row[key]) if row[key] is not None else None
            parent = ids.get(m["parent"]) if ours else previous
            cols = ", ".join(("conversation_id", "parent_id", *row))
            marks = ", ".join("?" * (len(row) + 2))
            previous = ids[m["id"] if m["id"] is not None else i] = db.execute(
                f"INSERT INTO messages ({cols}) VALUES ({marks})", (cid, parent, *row.values())
            ).lastrowid
        leaf = ids.get(data.get("leaf")) if ours else previous
        db.execute("UPDATE conversations SET leaf_id = ? WHERE id = ?", (leaf, cid))
    return storage.get_conversation(cid)
