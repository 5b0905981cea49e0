"""The data folder's database: the records it holds (records.py), the store that reads and writes
them (store.py) over a schema kept by migrations (migrations.py), a conversation as JSON and back
(export_import.py, checked by import_schema.py), the stored Responses API answers (responses.py),
and the lock that keeps one server per folder
(folder_lock.py). The names below are the storage's public face."""

from .export_import import EXPORT_FORMAT, export_conversation, import_conversation
from .migrations import MIGRATIONS, SCHEMA_VERSION, DatabaseTooNew, migrate
from .records import DEFAULT_TITLE, MESSAGE_STATES, Conversation, McpChoice, Message
from .responses import DEFAULT_TTL_DAYS, MAX_STORE_BYTES, StoredImage, StoredResponses, image_ref
from .store import DB_NAME, Storage, connect, fts_query, valid_id

__all__ = ["DB_NAME", "DEFAULT_TITLE", "EXPORT_FORMAT", "MESSAGE_STATES", "MIGRATIONS", "SCHEMA_VERSION",
           "Conversation", "DatabaseTooNew", "McpChoice", "Message", "Storage", "connect",
           "DEFAULT_TTL_DAYS", "MAX_STORE_BYTES", "StoredImage", "StoredResponses", "image_ref",
           "export_conversation", "fts_query", "import_conversation", "migrate", "valid_id"]
