"""Issue 54 H1: one legal embedding request stopped every chat stream for minutes and hanging up did
not cancel it (`{"input": [[5]*2048]}` held a running stream's next token 93 s, 8,192 tokens
1,086 s; a 2-token chat waited 361 s after its client left), and `/health` said ok throughout.

Now an input longer than one chunk goes through in segments, one per tick, each sized to what the
model embeds in a fraction of a second while chats decode (at most a chat prompt's prefill chunk),
with a model cache (the same vector as one call); a request holds a bounded number of tokens, a
client that leaves cancels it, and `/health` says when the scheduler is stuck.
The real engine on a tiny random llama (and a real server for the HTTP cases)."""

import threading
import time

import httpx
import numpy as np
import pytest

from engine import Engine, InvalidRequest, SamplingParams
from engine.decoding import pooling
from engine.decoding.generate import default_prefill_chunk
from engine.scheduling import embedding_queue
from engine.scheduling.embedding_queue import MAX_REQUEST_TOKENS
from live_server import tiny_serving
from tiny_models import tiny_llama, tiny_qwen3_embedding_folder

pytestmark = pytest.mark.fast

CONTEXT = 4096


@pytest.fixture(scope="module")
def lm():
    return tiny_llama(max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def engine(lm):
    e = Engine(lm.name, load=lambda name, **_: lm).start()
    yield e
    e.stop()


@pytest.fixture
def calls(monkeypatch):
    """The tokens of each embedding model call, in order, and when it ran."""
    seen = []
    real_batch, real_segment = embedding_queue.embed_batch, embedding_queue.pool_segment

    def batch(model, rows, *a):
        seen.append(("batch", max(map(len, rows)) * len(rows), time.monotonic()))
        return real_batch(model, rows, *a)

    def segment(model, tokens, *a):
        seen.append(("segment", len(tokens), time.monotonic()))
        return real_segment(model, tokens, *a)

    monkeypatch.setattr(embedding_queue, "embed_batch", batch)
    monkeypatch.setattr(embedding_queue, "pool_segment", segment)
    return seen


def test_a_long_input_runs_in_prefill_sized_segments_between_a_streams_tokens(engine, lm, calls,
                                                                             monkeypatch):
    chunk = default_prefill_chunk(lm)
    ticks: list[float] = []
    tick = engine.scheduler._serve_tick
    monkeypatch.setattr(engine.scheduler, "_serve_tick",
                        lambda running: ticks.append(time.monotonic()) or tick(running))
    stream = engine.submit(prompt_tokens=[7] * 8, params=SamplingParams(max_tokens=400))
    events = stream.events(timeout=120)
    next(e for e in events if e.kind == "token")  # decoding
    vectors = engine.embed([[5] * (chunk + 300)]).result(120).vectors
    stream.cancel()
    list(events)
    assert {kind for kind, _, _ in calls} == {"segment"}  # one per tick, never the whole input
    assert max(n for _, n, _ in calls) <= chunk and sum(n for _, n, _ in calls) == chunk + 300
    starts = [t for _, _, t in calls]
    between = [sum(a < t < b for t in ticks) for a, b in zip(starts, starts[1:])]
    assert all(n >= 1 for n in between), between  # the stream's decode steps between segments
    whole = pooling.embed_batch(lm.model, [[5] * (chunk + 300)], engine.embeddings.target(None).recipe)
    assert np.abs(vectors - np.array(whole)).max() < 1e-4  # the same vector as one call


def test_segments_give_the_dedicated_models_last_token_vector(engine, monkeypatch, calls):
    monkeypatch.setattr(embedding_queue, "CHUNK_TOKENS", 128)
    folder = str(tiny_qwen3_embedding_folder())
    ids = [[(i * 7) % 900 + 3 for i in range(500)]]  # its context is 512
    segmented = engine.embed(ids, model=folder).result(120).vectors
    target = engine.embeddings.target(folder)
    whole = pooling.embed_batch(engine.pool.find(folder).lm.model, ids, target.recipe)
    assert np.abs(segmented - np.array(whole)).max() < 1e-4
    assert [n for _, n, _ in calls] == [128, 128, 128, 116]


def test_a_request_holds_a_bounded_number_of_tokens(engine, lm, monkeypatch):
    monkeypatch.setattr(embedding_queue, "MAX_REQUEST_TOKENS", 3000)
    with pytest.raises(InvalidRequest) as err:
        engine.embed([[5] * 2000, [6] * 1001])
    assert (err.value.field, err.value.code) == ("input", "too_many_tokens")
    started = time.monotonic()
    with pytest.raises(InvalidRequest) as err:  # refused from its characters, not tokenised
        engine.embed(["word " * 4_000_000])
    assert err.value.code == "too_many_tokens" and MAX_REQUEST_TOKENS > 3000


@pytest.mark.slow  # a server of its own, a client that waits to give up
def test_a_client_that_leaves_cancels_its_embedding_and_health_shows_a_stall(lm, tmp_path,
                                                                            calls, monkeypatch):
    from app.api import health

    with tiny_serving(tmp_path, lm) as server:
        engine = server.app.state.engine
        long = {"model": server.model, "input": [[5] * 3000] * 6}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after the first segments
            httpx.post(f"{server.url}/v1/embeddings", json=long, timeout=1.5)
        deadline = time.monotonic() + 60
        while engine.embeddings.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.embeddings.pending() == 0
        assert sum(n for _, n, _ in calls) < 6 * 3000  # it stopped before its last input
        # /health: ok, then "stalled" while the scheduler is held in one task
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
        monkeypatch.setattr(health, "STALLED_S", 0.2)
        gate = threading.Event()
        engine.scheduler.soon(lambda: gate.wait(30))
        try:
            time.sleep(0.5)
            shown = httpx.get(f"{server.url}/health").json()
            assert shown["status"] == "stalled" and shown["scheduler_busy_s"] >= 0.2, shown
        finally:
            gate.set()
        time.sleep(0.2)
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
