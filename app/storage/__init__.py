"""The data folder's database: conversations and messages (store.py), what an imported
conversation may hold (import_schema.py), and the lock that keeps one server per folder
(folder_lock.py). The names below are the storage's public face."""

from .store import (DB_NAME, DEFAULT_TITLE, EXPORT_FORMAT, MESSAGE_STATES, MIGRATIONS, SCHEMA_VERSION,
                    Conversation, DatabaseTooNew, McpChoice, Message, Storage, connect, export_conversation,
                    fts_query, import_conversation, migrate, valid_id)

__all__ = ["DB_NAME", "DEFAULT_TITLE", "EXPORT_FORMAT", "MESSAGE_STATES", "MIGRATIONS", "SCHEMA_VERSION",
           "Conversation", "DatabaseTooNew", "McpChoice", "Message", "Storage", "connect",
           "export_conversation", "fts_query", "import_conversation", "migrate", "valid_id"]
