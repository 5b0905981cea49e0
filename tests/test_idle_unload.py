"""Idle unload: after the keep-alive passes, the model's weights leave memory; the next request
(through the API: never a 503) reloads them and answers exactly as before."""

import time

import mlx.core as mx
import pytest

from engine import Engine
from live_server import openai_client, serving

BUNDLED = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def weight_bytes() -> int:
    """MLX's live allocations in this process (the server runs in it). Not RSS: the quantized
    weights the CPU kernels keep are small arrays that the C allocator need not hand back."""
    return mx.get_active_memory()


def wait_unloaded(engine: Engine, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while engine.status().resident:
        assert time.time() < deadline, "the model was not unloaded after its keep-alive"
        time.sleep(0.1)


@pytest.mark.timeout(600)
def test_unloaded_after_keep_alive_and_the_next_answer_is_the_same(tmp_path):
    engine = Engine(None, keep_alive=3).start()
    with serving(engine, tmp_path / "db.sqlite") as server:
        client = openai_client(server)
        ask = lambda: client.chat.completions.create(model=BUNDLED, messages=QUESTION,
                                                     max_tokens=24, seed=11)
        before = ask().choices[0].message.content
        assert engine.status().resident
        loaded = weight_bytes()
        wait_unloaded(engine)
        # the status says "not resident" as the unload starts (no request is admitted from then);
        # the weights' memory returns when it ends, in the engine's thread
        deadline = time.time() + 10
        while loaded - weight_bytes() <= 50 * 2**20 and time.time() < deadline:
            time.sleep(0.1)
        unloaded = weight_bytes()
        assert loaded - unloaded > 50 * 2**20, (loaded, unloaded)  # the weights' memory returned
        assert engine.model is not None and engine.model.name == BUNDLED  # still the model
        again = ask()  # reloads: an answer, not a 503
        assert again.choices[0].message.content == before
        assert engine.status().resident


def test_a_request_keep_alive_of_zero_unloads_right_after_it(lm):
    engine = Engine(lm.name, load=lambda name, **_: lm, keep_alive=-1).start()
    try:
        handle = engine.submit(QUESTION, engine.params({"max_tokens": 4, "temperature": 0}))
        list(handle.events())
        time.sleep(1)
        assert engine.status().resident  # the server's keep-alive: forever
        handle = engine.submit(QUESTION, engine.params({"max_tokens": 4, "temperature": 0}),
                               keep_alive="0s")
        first = "".join(e.text for e in handle.events())
        wait_unloaded(engine, timeout=10)
        handle = engine.submit(QUESTION, engine.params({"max_tokens": 4, "temperature": 0}))
        assert "".join(e.text for e in handle.events()) == first
        assert engine.status().resident
    finally:
        engine.stop()
