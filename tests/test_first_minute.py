"""`mlxchat serve` with a model that cannot load (issue 55), through the real command: the server
stays up saying why, /health 503 `failed`, the page the reason and what to do, the API 503
`model_load_failed`. (The first run as it should go, from an empty data folder and a stand-in for
PyPI to the first answer, each stage in the page, is e2e/test_first_run.py; a signal while the
model loads, tests/test_server_signals.py.)"""

import signal
import time

import httpx

from live_server import answering, linked_home, mlxchat_serve

CHAT = {"model": "smollm2-135m-instruct", "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}]}


def stop(proc, timeout: float = 30) -> str:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout) == 0
    return proc.log.read_text()


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
        again = httpx.post(f"{proc.url}/models/switch", data={"name": str(missing)})  # Try again
        assert again.status_code == 200 and 'class="progress"' in again.text  # loading it again
        while httpx.get(f"{proc.url}/health").json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert "GGUF file not found" in httpx.get(f"{proc.url}/health").json()["error"]
    finally:
        output = stop(proc)
    assert f"  Could not load {missing}: GGUF file not found" in output
    assert "mlxchat stopped." in output and "Traceback" not in output
