"""`AppState`: everything the app's routes share, typed, built once by `create_app` (app/server.py)
as the Starlette app's `state`; a route reads it through `app_state(request)` (a WebSocket the
same way), as vLLM's routes reach their serving objects through one accessor each.

New shared state is a field here (with a default where `create_app` need not pass it), never an
attribute set on the app elsewhere."""

import asyncio
from dataclasses import dataclass, field

from starlette.requests import HTTPConnection

from engine import Cluster, Engine

from .doc_index.store import ChunkStore
from .mcp.servers import McpServers
from .metrics import Metrics
from .model_jobs import ModelDownload, ModelSwitch
from .runs import Runs
from .security.key_access import KeyAccess
from .storage import Storage, StoredResponses
from .ui.conversation_pages import ConversationPages
from .uploads.reader_threads import ReaderThreads
from .uploads.store import UploadStore


@dataclass(eq=False)
class AppState:
    """The app's shared state (one per app)."""

    engine: Engine
    storage: Storage
    access: KeyAccess  # the API key (`access.api_key`, None: no key), sessions, failed attempts
    mcp: McpServers  # the MCP servers of mcp.json, beside the database
    uploads: UploadStore
    chunks: ChunkStore  # uploaded documents' index
    readers: ReaderThreads  # the threads uploads are read on (app/uploads/reading.py)
    metrics: Metrics  # this app's Prometheus registry (GET /metrics)
    responses: StoredResponses  # stored Responses API answers (expiring, capped)
    aliases: dict[str, str] = field(default_factory=dict)  # `--model-alias`: a name -> a local model
    mcp_edit: bool = True  # whether the page may add MCP servers (run commands)
    document_embeddings: str | None = None  # the model that embeds uploaded documents besides BM25
    cluster: Cluster | None = None  # a sharded model's cluster (engine/distributed/)
    runs: Runs = field(default_factory=Runs)  # every generation in flight
    pages: ConversationPages = field(default_factory=ConversationPages)  # open pages, running turns
    switch: ModelSwitch = field(default_factory=ModelSwitch)  # the one model load
    download: ModelDownload = field(default_factory=ModelDownload)  # the one model download
    reading: set[asyncio.Future[None]] = field(default_factory=set)  # uploads being read
    # full-size upload images decoded at once (app/ui/uploads.py; thumbnails are stored)
    full_images: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))

    @property
    def api_key(self) -> str | None:
        return self.access.api_key


def app_state(connection: HTTPConnection) -> AppState:
    """The state of the app that `connection` (a request or a WebSocket) came to."""
    return connection.app.state
