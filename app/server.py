"""The Starlette application and `serve()`, which runs it with uvicorn around the engine.

Start-up checks everything that can fail before the model loads (the address, the data folder,
its lock, the port) and answers each fault with one line and a non-zero exit. Then the server
listens at once and opens the browser, while the first model loads in the background as the one
model load (app/model_jobs.py): its stages show in the page and on the terminal, a line each;
`/health` says `loading` with the stage; a request that needs the model waits for it (the API a
bounded while); a load that fails leaves the page up, saying why. A sharded model (a `cluster`)
still loads before the server listens: its ranks load in step.

SIGINT, SIGTERM and SIGHUP all shut down the same way: generations are cancelled (each stream
ends with its final event and its answer is saved), the engine stops and persists its prefix
cache, the database closes, and the process exits 0. One that comes while the model still loads
exits 0 at once too (the database closed, nothing cached yet to persist).
"""

import errno
import signal
import socket
import sys
import threading
import time
import webbrowser
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

import static
from engine import (BUNDLED_MODEL, DEFAULT_KEEP_ALIVE_S, MODEL_SETTINGS_FILE, Cluster, Engine,
                    LoadProgress, ModelSettingsFile, data_dir, describe_device)

from . import api, metrics
from .api import audio, images
from .api.errors import http_error
from .doc_index.store import ChunkStore
from .mcp.config import FILE_NAME as MCP_FILE
from .mcp.servers import McpServers
from .model_jobs import StageLines, begin_switch
from .runs import Runs
from .security.api_key import ApiKeyGuard
from .security.guards import (LOOPBACK_NAMES, BodyLimit, HostGuard, OriginGuard, SecurityHeaders,
                              is_loopback)
from .security.header_timeout import HeaderTimeoutProtocol
from .security.key_access import KeyAccess
from .security.socket_limits import WS_MAX_BYTES
from .state import AppState
from .storage import DEFAULT_TTL_DAYS, Storage, StoredResponses
from .storage.folder_lock import FolderBusy, FolderLock
from .ui import routes as ui_routes
from .ui import uploads
from .uploads.reader_threads import ReaderThreads
from .uploads.store import UploadStore

STATIC_DIR = Path(static.__file__).parent
WILDCARD_HOSTS = ("0.0.0.0", "::")
SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACEFUL_SHUTDOWN_S = 5
KEEP_ALIVE_S = 5
WS_PING_S = 20.0


def create_app(engine: Engine, db_path: Path | None = None, *,
               allowed_hosts: Iterable[str] | None = LOOPBACK_NAMES,
               api_key: str | None = None, storage: Storage | None = None,
               aliases: dict[str, str] | None = None,
               allowed_origins: Iterable[str] = (), mcp_edit: bool = True,
               document_embeddings: str | None = None, cluster: Cluster | None = None,
               responses_ttl_days: float = DEFAULT_TTL_DAYS) -> Starlette:
    """The whole app around a started `engine`. `allowed_hosts=None` accepts any Host header.
    `aliases`: model names clients send (`claude-*`) and the local model each stands for.
    `allowed_origins`: browser origins (patterns) that may call the APIs (`--allow-origin`).
    `mcp_edit`: whether the page may add MCP servers (run commands): only on 127.0.0.1 without
    `--allow-remote`. mcp.json lives beside the database.
    `document_embeddings`: the embedding model that indexes uploaded documents besides BM25.
    `cluster`: the cluster of a sharded model, served as its rank 0.
    `responses_ttl_days`: how long a stored Responses answer is kept (`--responses-ttl`).
    The app's `state` is an `AppState` (app/state.py)."""
    storage = storage or Storage(db_path)
    mcp = McpServers(storage.path.parent / MCP_FILE)
    storage.interrupt_streaming()  # answers cut off by a crash: keep their text, mark them
    access = KeyAccess(api_key)
    counts = metrics.Metrics(engine)  # this app's Prometheus registry (GET /metrics)
    app = Starlette(
        routes=[*api.routes, *ui_routes.routes,
                Mount("/static", StaticFiles(directory=STATIC_DIR))],
        lifespan=mcp.lifespan,
        exception_handlers={HTTPException: http_error},
        # The security policy, outermost first; a refusal carries no security headers.
        middleware=[
            Middleware(HostGuard, allowed_hosts=allowed_hosts),  # DNS rebinding: 400
            Middleware(OriginGuard, allowed_origins=allowed_origins),  # cross-site writes: 403
            Middleware(metrics.CountRequests, metrics=counts),  # API requests by protocol, outcome
            Middleware(ApiKeyGuard, access=access),  # with --api-key, all but /health: 401
            # oversized bodies 413, slow ones 408, before the app reads (uploads bound their own)
            Middleware(BodyLimit, streamed=uploads.is_upload_path,
                       larger=lambda path: images.body_limit(path) or audio.body_limit(path)),
            Middleware(SecurityHeaders),  # CSP, nosniff, no framing, no referrer to other sites
        ],
    )
    upload_store = UploadStore(storage)
    upload_store.interrupted()  # files a stopped server was reading: refused, attach again
    upload_store.sweep(starting=True)  # and the parts of uploads a stopped server was receiving
    responses = StoredResponses(storage, ttl_s=responses_ttl_days * 86400)
    responses.expire()
    app.state = AppState(
        engine=engine, storage=storage, access=access, mcp=mcp, uploads=upload_store,
        chunks=ChunkStore(storage),
        readers=ReaderThreads(), metrics=counts, responses=responses,
        aliases=dict(aliases or {}), mcp_edit=mcp_edit, document_embeddings=document_embeddings,
        cluster=cluster)
    return app


def uvicorn_config(app: Starlette, **options: Any) -> uvicorn.Config:
    """How uvicorn serves the app: deadlines for slow clients (request heads, idle keep-alive
    connections, unanswered WebSocket pings), a cap on WebSocket messages, a bounded shutdown."""
    return uvicorn.Config(app, log_level="warning", access_log=False,
                          http=HeaderTimeoutProtocol, timeout_keep_alive=KEEP_ALIVE_S,
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                          ws_ping_interval=WS_PING_S, ws_ping_timeout=WS_PING_S,
                          ws_max_size=WS_MAX_BYTES, **options)


class _Server(uvicorn.Server):
    """On a shutdown signal, cancel generations first: each then ends and saves its partial answer
    while uvicorn closes the connections, instead of uvicorn waiting for them to finish. Unlike
    uvicorn's own handling, the signal is not raised again afterwards, so `serve()` gets to stop
    the engine and close the database."""

    def __init__(self, config: uvicorn.Config, runs: Runs, on_started: Callable[[], None]):
        super().__init__(config)
        self.runs = runs
        self.on_started = on_started
        self.signalled: str | None = None  # the shutdown signal's name, once one came

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SHUTDOWN_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.signalled = signal.Signals(sig).name
        self.runs.cancel_all()
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started()


class _StoppedStarting(BaseException):
    """A shutdown signal that came before uvicorn took the signals over (the model loading)."""

    def __init__(self, sig: int):
        super().__init__(sig)
        self.name = signal.Signals(sig).name


@contextmanager
def _stop_on_signals() -> Iterator[None]:
    """While the server starts, a shutdown signal raises `_StoppedStarting` in the main thread,
    which is only waiting for the engine's thread to load the model; the default handlers would
    kill the process (SIGTERM, SIGHUP) or wait for the load and print a traceback (SIGINT)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(sig: int, frame: Any) -> None:
        raise _StoppedStarting(sig)

    previous = {sig: signal.signal(sig, stop) for sig in SHUTDOWN_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so that a taken port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = "it is in use (another mlxchat?)" if exc.errno == errno.EADDRINUSE \
            else exc.strerror or str(exc)
        raise SystemExit(f"Cannot listen on {host}:{port}: {reason}. "
                         "Choose another with --port.") from None
    sock.set_inheritable(True)
    return sock


def _check_remote(host: str, allow_remote: bool, api_key: str | None, no_api_key: bool) -> None:
    if is_loopback(host):
        return
    if not allow_remote:
        raise SystemExit(f"Refusing to listen on {host}: other machines could reach your chats. "
                         "Pass --allow-remote to do it anyway.")
    if not api_key and not no_api_key:
        raise SystemExit(f"Refusing to listen on {host} without --api-key: anyone who can reach "
                         "it could read your chats. Set a key, or pass --no-api-key to allow "
                         "it anyway.")
    print(f"WARNING: listening on {host}; anyone who can reach this address can "
          f"{'use the chat if they have the API key' if api_key else 'use the chat and the API'}.",
          file=sys.stderr)


def serve(host: str = "127.0.0.1", port: int = 8321, model: str | None = None,
          open_browser: bool = True, allow_remote: bool = False, api_key: str | None = None,
          no_api_key: bool = False, keep_alive: float | str | None = DEFAULT_KEEP_ALIVE_S,
          cluster: Cluster | None = None, aliases: dict[str, str] | None = None,
          allowed_origins: Iterable[str] = (), extra_hosts: Iterable[str] = (),
          max_running: int | None = None, document_embeddings: str | None = None,
          responses_ttl_days: float = DEFAULT_TTL_DAYS, pinned: Sequence[str] = (),
          max_loaded: int | None = None) -> None:
    """Serve the UI and the API until Ctrl-C or SIGTERM/SIGHUP, loading `model` (None: the
    bundled one; then the `pinned` ones, kept loaded; `max_loaded`: at most this many models in
    memory at once, engine/scheduling/pool.py) in the background from the moment the server
    listens; a model's weights are unloaded after `keep_alive` idle seconds (None: never) and
    reloaded by the next request. With a `cluster`, serve as its rank 0 (the only rank that opens the data folder).
    `aliases`, `allowed_origins`: see `create_app`; `extra_hosts`: Host names accepted besides
    the bound one and loopback (`--allow-host`, e.g. host.docker.internal);
    `document_embeddings`, `responses_ttl_days`: see `create_app`."""
    _check_remote(host, allow_remote, api_key, no_api_key)
    try:
        folder = data_dir()
    except OSError as exc:
        raise SystemExit(f"Cannot use the data folder: {exc.strerror or exc} "
                         f"({exc.filename or 'MLXCHAT_HOME'}); check MLXCHAT_HOME.") from None
    try:
        lock = FolderLock(folder).acquire()
    except FolderBusy as exc:
        raise SystemExit(str(exc)) from None
    try:
        _run(_bind(host, port), host, port, model, open_browser, api_key, keep_alive, cluster,
             {"max_running": max_running, "pinned": tuple(pinned), "max_loaded": max_loaded},
             {"aliases": aliases or {}, "allowed_origins": tuple(allowed_origins),
              "mcp_edit": host == "127.0.0.1" and not allow_remote,
              "document_embeddings": document_embeddings,
              "responses_ttl_days": responses_ttl_days},
             tuple(extra_hosts))
    finally:
        lock.release()


def _run(sock: socket.socket, host: str, port: int, model: str | None, open_browser: bool,
         api_key: str | None, keep_alive: float | str | None, cluster: Cluster | None,
         pool_options: dict[str, Any],
         app_options: dict[str, Any], extra_hosts: tuple[str, ...]) -> None:
    storage = Storage()
    if storage.moved_aside is not None:
        print(f"The database was damaged: kept it as {storage.moved_aside} and started a new one.",
              file=sys.stderr)
    # models.json beside the database: each model's settings (engine/scheduling/model_settings.py)
    settings = ModelSettingsFile(storage.path.parent / MODEL_SETTINGS_FILE)
    # A sharded model stays loaded: its followers cannot unload and reload in step yet.
    engine = Engine(model=model, model_settings=settings, **{
        **pool_options, **(cluster.engine_options() if cluster else
                           {"persist_prefix_cache": True, "keep_alive": keep_alive})})
    if cluster is not None:
        cluster.watch(engine)
    echo = _Ready(engine, model or BUNDLED_MODEL)
    started, stopped = False, ""
    server: _Server | None = None
    try:
        with _stop_on_signals():
            if cluster is not None:  # its ranks load in step, before it serves
                echo.header()
                engine.start(progress=echo.stage)
            else:  # the model loads once the server listens (`_listening`)
                engine.start(load=False)
            started = True
            allowed = None if host in WILDCARD_HOSTS else {*LOOPBACK_NAMES, host, *extra_hosts}
            app = create_app(engine, allowed_hosts=allowed, api_key=api_key, storage=storage,
                             cluster=cluster, **app_options)
        server = _Server(uvicorn_config(app), app.state.runs,
                         _listening(app, _url(host, port), echo, cluster is None, open_browser))
        server.run(sockets=[sock])
    except _StoppedStarting as signalled:  # an exit as clean as a served one's, with status 0
        stopped = f" ({signalled.name} while {'starting' if started else 'loading the model'})"
    finally:
        # the first load still running? (the loop that awaited it is gone: ask the engine)
        loading = server is not None and engine.model_name is None and not app.state.switch.error
        if server is not None and server.signalled and loading:
            stopped = f" ({server.signalled} while loading the model)"
        if started and not loading:  # else the load runs on in the engine's (daemon) thread
            engine.stop()  # persists the prefix cache
        if cluster is not None:
            cluster.stop()
        storage.close()
        sock.close()
        print(f"mlxchat stopped{stopped}.", file=sys.stderr, flush=True)


def _url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in WILDCARD_HOSTS else host
    return f"http://{f'[{shown}]' if ':' in shown else shown}:{port}/"


def _listening(app: Starlette, url: str, echo: "_Ready", load: bool,
               open_browser: bool) -> Callable[[], None]:
    """What happens once the socket listens (in the event loop): the address said, the first
    model's load begun (`load`) as the one model load, its progress in the page, and the
    browser opened on a page that answers."""
    def listening() -> None:
        print(f"mlxchat is running at {url}  (Ctrl-C to quit)", file=sys.stderr, flush=True)
        if load:
            echo.header()
            begin_switch(app.state.switch, app.state.engine, echo.name, echo=echo)
        if open_browser:
            threading.Thread(target=webbrowser.open, args=(url,), daemon=True).start()
    return listening


class _Ready(StageLines):
    """The terminal's lines about the server's model: the load's stages, then where it runs."""

    def __init__(self, engine: Engine, name: str):
        super().__init__()
        self.engine, self.name, self.began = engine, name, time.monotonic()

    def header(self) -> None:
        self.began = time.monotonic()
        bundled = " (bundled)" if self.name == BUNDLED_MODEL else ""
        print(f"Loading model {self.name}{bundled} ...", file=self.out, flush=True)

    def stage(self, p: LoadProgress) -> None:
        super().stage(p)
        if p.stage == "ready":
            self.ready()

    def ready(self) -> None:
        self._line(f"Model ready: {self.engine.model_name} on {describe_device()} "
                   f"({time.monotonic() - self.began:.0f} s)")
