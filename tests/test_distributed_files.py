"""A sharded server's prefix-cache files and model switches, 2 ranks over loopback (ring).

Every rank keeps its own shard's snapshot files in its own home; a restart reuses them exactly
as one process reuses its files, a damaged shard on one rank costs a recomputation on all, and a
model switch from the UI keeps the ranks in step. The models are tiny random llamas laid out as
hub-cache entries, so that the model picker lists them.
"""

import shutil
import time

import httpx
import pytest

from tests.sharded_server import ShardedServer
from tests.tiny_models import LLAMA, build_folder

A, B = "test/tiny-a", "test/tiny-b"


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hub")
    for name, seed in ((A, 0), (B, 1)):
        snapshot = root / f"models--{name.replace('/', '--')}" / "snapshots" / "0"
        shutil.copytree(build_folder(LLAMA, seed), snapshot)
    return {"HF_HUB_CACHE": str(root)}


@pytest.fixture(scope="module")
def single(hub, tmp_path_factory):
    server = ShardedServer(tmp_path_factory.mktemp("single"), A, ranks=1, env=hub).start()
    yield server
    server.stop()


def ask(server: ShardedServer, messages: list[dict], max_tokens: int = 16) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=240)
    assert reply.status_code == 200, reply.text
    return reply.json()


def text(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"]


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def stop(server: ShardedServer) -> None:
    assert server.stop() == [0, 0], (server.output(0)[-3000:], server.output(1)[-3000:])


@pytest.mark.timeout(900)
def test_a_restart_reuses_every_ranks_snapshot_files(hub, single, tmp_path):
    first = [{"role": "user", "content": "What is a lighthouse for?"}]
    server = ShardedServer(tmp_path, A, env=hub).start()
    try:
        answer = text(ask(server, first))
    finally:
        stop(server)
    assert answer == text(ask(single, first))
    # each rank wrote its own shard of the same snapshots, in a folder of its own
    mine, theirs = server.snapshot_files(0), server.snapshot_files(1)
    assert mine and [p.name for p in mine] == [p.name for p in theirs]
    assert mine[0].parent.name == "rank0-of-2" and theirs[0].parent.name == "rank1-of-2"

    # the next turn after a restart reuses the files, as one process reuses its memory
    follow_up = first + [{"role": "assistant", "content": answer},
                         {"role": "user", "content": "Who keeps it?"}]
    server = ShardedServer(tmp_path, A, env=hub).start()
    try:
        got = ask(server, follow_up)
    finally:
        stop(server)
    expected = ask(single, follow_up)
    assert text(got) == text(expected) and got["usage"] == expected["usage"]
    assert cached(got) > 0

    # rank 1's shards damaged while the server is down: no rank uses them, the answer holds
    for path in server.snapshot_files(1):
        data = bytearray(path.read_bytes())
        data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
        path.write_bytes(bytes(data))
    server = ShardedServer(tmp_path, A, env=hub).start()
    try:
        got = ask(server, follow_up)
        assert text(got) == text(expected) and cached(got) == 0
        assert "another rank's shard of it failed its checks" in server.output(0)
    finally:
        stop(server)

    # rank 1's files gone: at startup rank 0 lets go of its own, as no rank can use them
    names = [p.name for p in server.snapshot_files(0)]
    assert names and names == [p.name for p in server.snapshot_files(1)]
    for path in server.snapshot_files(1):
        path.unlink()
    server = ShardedServer(tmp_path, A, env=hub).start()
    try:
        assert server.snapshot_files(0) == []
        got = ask(server, follow_up)
        assert text(got) == text(expected) and cached(got) == 0
    finally:
        stop(server)


def switch(server: ShardedServer, name: str) -> None:
    """Switch the model as the UI's model picker does, and wait until it is loaded."""
    reply = httpx.post(f"{server.url}/models/switch", data={"name": name}, timeout=30)
    assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + 240
    while httpx.get(f"{server.url}/health", timeout=10).json().get("model") != name:
        assert time.monotonic() < deadline, f"{name} never loaded"
        time.sleep(0.5)


@pytest.mark.timeout(900)
def test_a_model_switch_keeps_the_ranks_in_step(hub, single, tmp_path):
    messages = [{"role": "user", "content": "Name three rivers."}]
    server = ShardedServer(tmp_path, A, env=hub).start()
    try:
        before = ask(server, messages)
        assert text(before) == text(ask(single, messages))
        for name in (B, A):
            switch(server, name)
            switch(single, name)
            mine, theirs = ask(server, messages), ask(single, messages)
            assert mine["model"] == theirs["model"] == name
            assert text(mine) == text(theirs)
            assert (text(mine) == text(before)) == (name == A)
        assert httpx.get(f"{server.url}/health").json()["distributed"]["ranks_alive"] == [0, 1]
    finally:
        stop(server)
