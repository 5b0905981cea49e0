"""The database's schema as versioned migrations: `MIGRATIONS` (append only) and `migrate`, which
brings a database to `SCHEMA_VERSION` one transaction per step. A database written by a newer
mlxchat is refused (`DatabaseTooNew`), never downgraded."""

import sqlite3
from typing import Iterator

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

# Bounded storage (issue 54): an image upload's thumbnail, made once when the file is read
# (`files.thumbnail`, PNG); stored Responses carry their size and expire oldest first
# (`responses.size`, the index on `created`), and their images are kept once each, as sent
# (`response_images`, content-addressed by the sha256 of the bytes), referenced by the responses
# that hold them (`response_image_refs`): an image no response refers to any more goes with the
# last one.
_V9 = """
        ALTER TABLE files ADD COLUMN thumbnail BLOB;
        ALTER TABLE responses ADD COLUMN size INTEGER NOT NULL DEFAULT 0;
        UPDATE responses SET size = length(body) + length(messages);
        CREATE INDEX responses_created ON responses(created);
        CREATE TABLE response_images (
            sha256 TEXT PRIMARY KEY,
            media_type TEXT NOT NULL,
            data BLOB NOT NULL
        );
        CREATE TABLE response_image_refs (
            response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
            sha256 TEXT NOT NULL REFERENCES response_images(sha256),
            PRIMARY KEY (response_id, sha256)
        );
        CREATE INDEX response_image_refs_sha256 ON response_image_refs(sha256);
        CREATE TRIGGER response_images_unused AFTER DELETE ON response_image_refs
        WHEN NOT EXISTS (SELECT 1 FROM response_image_refs WHERE sha256 = old.sha256) BEGIN
            DELETE FROM response_images WHERE sha256 = old.sha256;
        END;
"""

# Append only: the schema version of a database (PRAGMA user_version) is how many have run.
MIGRATIONS: list[str] = [_V1, _V2, _V3, _V4, _V5, _V6, _V7, _V8, _V9]
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
