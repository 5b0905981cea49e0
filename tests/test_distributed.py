"""A model sharded over two ranks on this host (ring backend over loopback), served through the API.

Each server is real: `mlxchat serve` processes started with the variables `mlx.launch` sets, a
tiny random llama sharded by mlx-lm, compared with a plain single-process server of the same
folder. No bundled model is needed, but the file runs in the real-model tier: three
servers and a few thousand collectives take minutes, over the fast tier's budget.
"""

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.sharded_server import ShardedServer
from tests.tiny_models import LLAMA, build_folder

PROMPTS = ["Tell me about the sea.", "请介绍一下长城。"]


@pytest.fixture(scope="module")
def model() -> Path:
    return build_folder(LLAMA)


@pytest.fixture(scope="module")
def single(model, tmp_path_factory):
    server = ShardedServer(tmp_path_factory.mktemp("single"), model, ranks=1).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sharded(model, tmp_path_factory):
    server = ShardedServer(tmp_path_factory.mktemp("sharded"), model, ranks=2).start()
    yield server
    assert server.stop() == [0, 0], (server.output(0)[-3000:], server.output(1)[-3000:])


def ask(server: ShardedServer, messages: list[dict], max_tokens: int = 24) -> dict:
    body = {"model": server.model.name, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=240)
    assert reply.status_code == 200, reply.text
    return reply.json()


def text(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"]


# First in the module, before any test asks for the module's servers: these two tests start
# servers of their own, and two sharded servers at once crowd a 2-core machine.
@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_a_dead_rank_fails_the_answer_and_new_requests_get_503(model, tmp_path, how):
    server = ShardedServer(tmp_path, model, ranks=2).start()
    try:
        body = {"model": model.name, "messages": [{"role": "user", "content": "Go on."}],
                "max_tokens": 2000, "temperature": 0, "stream": True}
        lines = []
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                          timeout=60) as reply:
            for line in reply.iter_lines():
                lines.append(line)
                if len(lines) == 10:
                    server.signal(1, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
                    killed = time.monotonic()
        ended = time.monotonic() - killed
        assert ended < 30, ended  # the watchdog's silence limit plus a busy machine's slack
        errors = [line for line in lines if '"error"' in line]
        gone = "rank 1 is gone" if how == "killed" else "rank 1 stopped responding"
        # a killed peer: the ring backend may fail the collective in flight before the watchdog
        # hears the heartbeat connection close (which of the two comes first is a race)
        said = (gone, "connection to a peer was lost") if how == "killed" else (gone,)
        assert len(errors) == 1 and any(s in errors[0] for s in said), lines[-3:]
        health = httpx.get(f"{server.url}/health").json()
        assert health["status"] == "failed"
        assert health["distributed"]["ranks_alive"] == [0]
        assert list(health["distributed"]["ranks_gone"]) == ["1"]
        retry = httpx.post(f"{server.url}/v1/chat/completions", timeout=10, json={
            "model": model.name, "messages": [{"role": "user", "content": "Hi"}]})
        assert retry.status_code == 503 and gone in retry.text
    finally:
        if how == "stalled":
            server.signal(1, signal.SIGKILL)  # a stopped process cannot exit by itself
        codes = server.stop()
    assert codes[0] is not None  # rank 0 exits although its scheduler thread is blocked


def test_health_reports_the_group(sharded, single):
    health = httpx.get(f"{sharded.url}/health").json()
    assert health["status"] == "ok"
    assert health["distributed"] == {"world_size": 2, "ranks_alive": [0, 1], "backend": "ring",
                                     "ranks_gone": {}}
    assert "distributed" not in httpx.get(f"{single.url}/health").json()
    page = httpx.get(f"{sharded.url}/", follow_redirects=True)
    assert page.status_code == 200 and "sharded over 2 processes" in page.text
    assert "sharded over" not in httpx.get(f"{single.url}/", follow_redirects=True).text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_answers_equal_one_process(sharded, single, prompt):
    messages = [{"role": "user", "content": prompt}]
    mine, theirs = ask(sharded, messages), ask(single, messages)
    assert text(mine) == text(theirs) and mine["usage"]["completion_tokens"] == 24
    assert mine["usage"] == theirs["usage"]
    # the next turn, on the first answer: the prefix cache reuses the same tokens on both
    messages += [{"role": "assistant", "content": text(mine)},
                 {"role": "user", "content": "And then?"}]
    mine, theirs = ask(sharded, messages), ask(single, messages)
    assert text(mine) == text(theirs) and mine["usage"] == theirs["usage"]
    assert mine["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # an edit of that last turn branches off the same cached prefix
    messages[-1] = {"role": "user", "content": "And after that?"}
    mine, theirs = ask(sharded, messages), ask(single, messages)
    assert text(mine) == text(theirs) and mine["usage"] == theirs["usage"]
    assert mine["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_follower_sleeps_until_rank_0_rings(sharded):
    """Between requests the follower waits for rank 0's next plan on its doorbell (asleep), not
    inside the collective, where the ring backend's polling kept a core busy for as long as the
    server was idle; its next plan still runs at once."""
    messages = [{"role": "user", "content": PROMPTS[0]}]
    first = text(ask(sharded, messages, max_tokens=8))
    time.sleep(0.5)
    follower = sharded.procs[1].pid
    before, t0 = cpu_seconds(follower), time.monotonic()
    time.sleep(3)
    used, wall = cpu_seconds(follower) - before, time.monotonic() - t0
    assert used < 0.25 * wall, f"the idle follower used {used:.2f} s of CPU in {wall:.1f} s"
    assert text(ask(sharded, messages, max_tokens=8)) == first


def test_concurrent_streams_and_a_cancellation_keep_ranks_in_step(sharded, single):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    expected = text(ask(single, messages, max_tokens=40))
    results: dict[str, str] = {}

    def stream(name: str, stop_after: int | None) -> None:
        body = {"model": sharded.model.name, "messages": messages, "max_tokens": 40,
                "temperature": 0, "stream": True}
        pieces = []
        with httpx.stream("POST", f"{sharded.url}/v1/chat/completions", json=body,
                          timeout=240) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(line)
                    if stop_after is not None and len(pieces) >= stop_after:
                        break  # the client leaves: the server cancels the request
        results[name] = "".join(
            httpx.Response(200, content=p[6:]).json()["choices"][0]["delta"].get("content") or ""
            for p in pieces)

    threads = [threading.Thread(target=stream, args=("whole", None)),
               threading.Thread(target=stream, args=("cancelled", 5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert results["whole"] == expected
    assert expected.startswith(results["cancelled"])
    assert text(ask(sharded, messages, max_tokens=40)) == expected  # still in step afterwards


@pytest.mark.timeout(400)
def test_thousands_of_collectives_without_a_hang(sharded, single):
    # 300 tokens: three plan collectives and two per layer for each, about 3,300 in all
    messages = [{"role": "user", "content": "Count."}]
    mine = ask(sharded, messages, max_tokens=300)
    assert mine["usage"]["completion_tokens"] == 300
    assert text(mine) == text(ask(single, messages, 300))


def test_speculative_decoding_is_refused_and_ranks_stay_in_step(sharded, single):
    messages = [{"role": "user", "content": PROMPTS[1]}]
    reply = httpx.post(f"{sharded.url}/v1/chat/completions", timeout=60, json={
        "model": sharded.model.name, "messages": messages, "max_tokens": 8, "temperature": 0,
        "speculative": {"draft": "self-q4", "k": 2}})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "speculative" and "sharded" in error["message"]
    assert "do not mirror the draft model's cache" in error["message"]  # why, not only what
    assert text(ask(sharded, messages)) == text(ask(single, messages))
