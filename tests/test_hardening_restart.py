"""Issue 14, case 3 (and 9, 10 with a model): every way the server stops keeps the prefix cache.

SIGTERM, SIGINT and SIGHUP shut down gracefully (exit 0, a stream in flight ends with its final
event: SIGTERM by default, the other two opt-in with `-m extended`); after SIGKILL the write-behind
copy survives. Each restarted server continues the
conversation from the persisted prefix (cached tokens) with the same answer as a cold server.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from live_server import (MODEL_HOME, REPO, ServerProcess, engine_serving, free_port, linked_home,
                         wait_healthy)

MODEL = "smollm2-135m-instruct"
SYSTEM = ("You are a careful assistant. Answer in one short sentence. " * 8).strip()
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]


def private_home(path: Path) -> Path:
    """An MLXCHAT_HOME sharing the model files but with a prompt cache of its own."""
    return linked_home(path, *(entry.name for entry in (MODEL_HOME / "cache").iterdir()
                               if entry.is_dir() and entry.name != "prompt-cache"))


def ask(url: str, messages: list[dict], **fields) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=180, json={
        "model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def snapshots(home: Path) -> list[Path]:
    return list((home / "cache" / "prompt-cache").rglob("*.safetensors"))


def second_turn(first: dict) -> list[dict]:
    return [*FIRST, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And another one?"}]


@pytest.fixture(scope="module")
def cold(tmp_path_factory, lm) -> dict:
    """The answers of servers that have nothing cached: each turn asked of a fresh one. These run
    in this process on the session's loaded model (a fresh engine has an empty, unpersisted prefix
    cache), sparing two cold starts of a server process; the app and engine are the same."""
    answers = {}
    for turn in ("first", "second"):
        with engine_serving(tmp_path_factory.mktemp("cold"), lm) as server:
            answers[turn] = ask(server.url, FIRST if turn == "first" else second_turn(answers["first"]))
    return answers


@pytest.mark.timeout(600)
# SIGINT and SIGHUP take SIGTERM's path (one handler; tests/test_server_signals.py sends each while
# the model loads): opt-in here, two server starts each.
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.extended),
                                 pytest.param(signal.SIGHUP, marks=pytest.mark.extended),
                                 signal.SIGKILL], ids=lambda s: s.name)
def test_restart_after_a_signal_reuses_the_persisted_prefix(tmp_path, cold, sig):
    home = private_home(tmp_path / "home")
    server = ServerProcess(home).start()
    try:
        first = ask(server.url, FIRST)
        assert first["choices"][0]["message"] == cold["first"]["choices"][0]["message"]
        if sig == signal.SIGKILL:  # only what write-behind has saved by then survives
            deadline = time.monotonic() + 60
            while not snapshots(home) and time.monotonic() < deadline:
                time.sleep(0.2)
            server.kill()
        else:
            # A stream in flight ends with its final event, then the process exits 0.
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120, json={
                    "model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
                    "max_tokens": 400, "stream": True}) as stream:
                lines = stream.iter_lines()
                assert next(l for l in lines if l.startswith("data: "))
                server.proc.send_signal(sig)
                rest = [l for l in lines if l.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "cancelled"
            assert server.proc.wait(60) == 0
            assert "mlxchat stopped." in server.output()
        assert snapshots(home)
    finally:
        server.stop()

    again = ServerProcess(home).start()
    try:
        second = ask(again.url, second_turn(first))
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert second["choices"][0]["message"] == cold["second"]["choices"][0]["message"]
        assert cold["second"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        again.stop()


def test_damaged_database_and_a_second_server_on_the_folder(tmp_path):
    home = private_home(tmp_path / "home")
    (home / "data").mkdir()
    (home / "data" / "mlxchat.db").write_bytes(os.urandom(4096))
    server = ServerProcess(home).start()
    try:
        assert "The database was damaged: kept it as" in server.output()
        assert list((home / "data").glob("mlxchat.db.corrupt-*"))
        assert httpx.get(server.url + "/", follow_redirects=True).status_code == 200
        second = subprocess.run(
            [sys.executable, "-m", "app.cli", "serve", "--no-browser", "--port", str(free_port())],
            cwd=REPO, env={**os.environ, "MLXCHAT_HOME": str(home)}, capture_output=True,
            text=True, timeout=120)
        assert second.returncode == 1 and "Traceback" not in second.stderr
        assert f"another mlxchat server (pid {server.proc.pid})" in second.stderr
        wait_healthy(server.url, timeout=10)  # the first is unharmed
    finally:
        server.stop()


def test_chat_with_max_tokens_beyond_the_context_says_so(tmp_path):
    result = subprocess.run([sys.executable, "-m", "app.cli", "chat", "-n", "9000"], cwd=REPO,
                            env={**os.environ, "MLXCHAT_HOME": str(private_home(tmp_path / "h"))},
                            input="hi\n", capture_output=True, text=True, timeout=180)
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert "exceeds this model's context" in result.stderr
