"""The Starlette application and `serve()`, which runs it with uvicorn around a loaded engine."""

import sys
import threading
import webbrowser
from pathlib import Path
from typing import Any, Iterable

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

import static
from engine import Cluster, Engine, describe_device

from . import api, ui
from .runs import Runs
from .security import (LOOPBACK_NAMES, ApiKeyGuard, HostGuard, OriginGuard, SecurityHeaders,
                       is_loopback)
from .storage import Storage

STATIC_DIR = Path(static.__file__).parent
WILDCARD_HOSTS = ("0.0.0.0", "::")


def create_app(engine: Engine, db_path: Path | None = None, *,
               allowed_hosts: Iterable[str] | None = LOOPBACK_NAMES,
               api_key: str | None = None) -> Starlette:
    """The whole app around a started `engine`. `allowed_hosts=None` accepts any Host header."""
    storage = Storage(db_path)
    storage.interrupt_streaming()  # answers cut off by a crash: keep their text, mark them
    app = Starlette(
        routes=[*api.routes, *ui.routes, Mount("/static", StaticFiles(directory=STATIC_DIR))],
        # The security policy, outermost first; a refusal carries no security headers.
        middleware=[
            Middleware(HostGuard, allowed_hosts=allowed_hosts),  # DNS rebinding: 400
            Middleware(OriginGuard),  # cross-site writes and WebSockets: 403
            Middleware(ApiKeyGuard, api_key=api_key),  # /v1 with --api-key: 401
            Middleware(SecurityHeaders),  # CSP, nosniff, no framing, no referrer
        ],
    )
    app.state.engine = engine
    app.state.storage = storage
    app.state.runs = Runs()
    app.state.switch = ui.ModelSwitch()
    return app


class _Server(uvicorn.Server):
    """On Ctrl-C, cancel generations first: each then ends and saves its partial answer while
    uvicorn closes the connections, instead of uvicorn waiting for them to finish."""

    def __init__(self, config: uvicorn.Config, runs: Runs, on_started: Any):
        super().__init__(config)
        self.runs = runs
        self.on_started = on_started

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.runs.cancel_all()
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started()


def serve(host: str = "127.0.0.1", port: int = 8321, model: str | None = None,
          open_browser: bool = True, allow_remote: bool = False, api_key: str | None = None,
          cluster: Cluster | None = None) -> None:
    """Load `model`, then serve the UI and the API until Ctrl-C; with a `cluster`, as its rank 0."""
    if not is_loopback(host) and not allow_remote:
        raise SystemExit(f"Refusing to listen on {host}: other machines could reach your chats. "
                         "Pass --allow-remote to do it anyway.")
    if not is_loopback(host):
        print(f"WARNING: listening on {host}; anyone who can reach this address can use the chat"
              f"{'' if api_key else ' and the API (no API key set)'}.", file=sys.stderr)
    engine = Engine(model=model, **(cluster.engine_options() if cluster else
                                    {"persist_prefix_cache": True}))
    if cluster is not None:
        cluster.watch(engine)
    print(f"Loading model {model or 'smollm2-135m-instruct (bundled)'} ...", file=sys.stderr)
    engine.start(progress=lambda stage: print(f"  {stage}", file=sys.stderr))
    allowed = None if host in WILDCARD_HOSTS else {*LOOPBACK_NAMES, host}
    app = create_app(engine, allowed_hosts=allowed, api_key=api_key)
    app.state.cluster = cluster
    shown = "127.0.0.1" if host in WILDCARD_HOSTS else host
    url = f"http://{f'[{shown}]' if ':' in shown else shown}:{port}/"

    def started() -> None:
        print(f"mlxchat is running at {url}  (model: {engine.model_name} on {describe_device()}; "
              "Ctrl-C to quit)",
              file=sys.stderr, flush=True)
        if open_browser:
            threading.Thread(target=webbrowser.open, args=(url,), daemon=True).start()

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5)
    try:
        _Server(config, app.state.runs, started).run()
    except KeyboardInterrupt:
        pass  # uvicorn re-raises Ctrl-C once its own clean shutdown is done
    finally:
        engine.stop()
        if cluster is not None:
            cluster.stop()
        app.state.storage.close()
