"""Playwright with Debian's Chromium against `serve()` in a child process with the bundled model."""

import os
import sys
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the shared live-server helper

from live_server import ServerProcess  # noqa: E402

ARTIFACTS = REPO / "test-artifacts"
TIMEOUT_MS = 120_000  # the model answers at a few tokens a second on a busy CI CPU
expect.set_options(timeout=TIMEOUT_MS)
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]


@pytest.fixture(scope="session")
def hf_cache(tmp_path_factory) -> Path:
    """An empty Hugging Face cache for the server; a test may add a model to it."""
    return tmp_path_factory.mktemp("hf-hub")


@pytest.fixture(scope="session")
def server(tmp_path_factory, hf_cache):
    s = ServerProcess(tmp_path_factory.mktemp("e2e") / "home", env={"HF_HUB_CACHE": str(hf_cache)})
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def browser():
    with sync_playwright() as p:
        # scripts/test preloads OpenBLAS for MLX; Chromium's GPU process dies with it preloaded.
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, env=env)
        yield b
        b.close()


@pytest.fixture
def chromium_with(browser: Browser):
    """`chromium_with(*args, **context_options)`: a page in a Chromium of its own (launched by
    the session's Playwright) with extra command-line `args`, such as a fake microphone
    (e2e/test_voice.py); closed after the test."""
    launched = []

    def make(*args: str, **context_options) -> Page:
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        b = browser.browser_type.launch(executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, *args],
                                        env=env)
        launched.append(b)
        page = b.new_context(**context_options).new_page()
        page.set_default_timeout(TIMEOUT_MS)
        return page

    yield make
    for b in launched:
        b.close()


@pytest.fixture
def new_page(browser: Browser, server):
    """Pages in fresh browser contexts; script errors and alert() dialogs fail the test.
    Prompt and confirm dialogs (rename, delete) are accepted."""
    contexts, problems = [], []

    def make(**options) -> Page:
        context = browser.new_context(**{"viewport": {"width": 1200, "height": 800}, **options},
                                      base_url=server.url)
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))

        def dialog(d):
            if d.type == "alert":
                problems.append(f"alert: {d.message}")
            d.accept(PROMPT_ANSWER if d.type == "prompt" else None)
        page.on("dialog", dialog)
        return page

    yield make
    for context in contexts:
        context.close()
    assert not problems, problems


@pytest.fixture
def page(new_page) -> Page:
    return new_page()


PROMPT_ANSWER = "Renamed by the test"


@pytest.fixture
def prompt_answer() -> str:
    """What the fixture types into prompt() dialogs (the rename prompt)."""
    return PROMPT_ANSWER


@pytest.fixture
def shot():
    """`shot(page, name)` saves a screenshot under test-artifacts/ for people to look at."""
    def save(page: Page, name: str) -> None:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{name}.png"))
    return save
