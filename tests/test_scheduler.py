"""The scheduler: bounded admission, one closed lifecycle per request, cancellation and recovery,
batched decoding that changes no token, failure isolation, and model switching.

"Alone" below means the same request run by itself through `engine.decoding.generate.generate`, with no
scheduler, no batch and no prefix cache.
"""

import dataclasses
import gc
import random
import threading
import time

import mlx.core as mx
import pytest

from engine.errors import InvalidRequest
from engine.decoding.generate import build_prompt, generate
from engine.decoding.sampling import SamplingParams
from engine import Overloaded
from engine.scheduling.service import Engine
from tiny_models import tiny_llama, tiny_qwen3_5
from watched_model import watched


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen3_5()


def alone(lm, params, **prompt):
    return [e.token for e in generate(lm, build_prompt(lm, **prompt), params) if e.kind == "token"]


def tokens(handle, timeout=120):
    events = list(handle.events(timeout=timeout))
    assert events[-1].kind == "done"
    return [e.token for e in events if e.kind == "token"]


def params_for(i, max_tokens):
    """Even requests greedy, odd ones seeded sampling."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=max_tokens)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=1000 + i)


def submit_at_once(engine, requests):
    """Submit all requests from their own threads at the same moment: handles or Overloaded."""
    barrier = threading.Barrier(len(requests))
    results = [None] * len(requests)

    def send(i):
        prompt, params = requests[i]
        barrier.wait()
        try:
            results[i] = engine.submit(params=params, **prompt)
        except Overloaded as exc:
            results[i] = exc

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("model", ["bundled", "qwen3_5"])
def test_overflow_is_refused_and_admitted_requests_match_running_alone(model, lm, qwen, serve):
    """16 requests at once with 4 running + 4 queued: exactly 8 are refused at once with a retry
    hint; the other 8 finish complete, in batches of 4, each token-identical to running alone."""
    base = lm if model == "bundled" else qwen
    max_tokens = 8 if model == "bundled" else 24  # long enough for all four to overlap
    requests = [(dict(messages=[{"role": "user", "content": f"Tell me about the number {i}."}]),
                 params_for(i, max_tokens)) for i in range(16)]
    target = watched(base)
    engine = serve(target, max_running=4, max_queued=4, prefix_cache=False)

    target.model.gate.clear()
    results = submit_at_once(engine, requests)
    target.model.gate.set()

    refused = [r for r in results if isinstance(r, Overloaded)]
    admitted = [(i, r) for i, r in enumerate(results) if not isinstance(r, Overloaded)]
    assert len(refused) == 8 and all(r.retry_after > 0 and "busy" in str(r) for r in refused)
    for i, handle in admitted:
        prompt, params = requests[i]
        assert tokens(handle) == alone(base, params, **prompt)
        assert handle.state == "finished" and handle.finish_reason in ("stop", "length")
    assert max(target.model.batch_sizes) == 4


def cancel_after_tokens(handle, n):
    events = handle.events(timeout=60)
    for _ in range(n):
        assert next(events).kind == "token"
    handle.cancel()


def cancel_after_prefill(handle, n):
    """Cancel once `n` prompt tokens have gone through the model (0: before its first chunk)."""
    deadline = time.time() + 60
    # Admission happens on the scheduler thread between steps: wait for it too, not just for n.
    while (handle.state == "queued" or len(handle.generation.fed) < n) and time.time() < deadline:
        time.sleep(0.001)
    assert handle.state == "prefill"
    handle.cancel()


def test_cancel_anywhere_closes_every_request_and_frees_its_memory(llama, serve):
    """Cancel requests while queued, in prefill (long prompts prefill in 512-token chunks) and while
    decoding, in random order and at random depths: each one ends with one final event, memory
    returns to where it was, and the next request matches a fresh engine's."""
    rng = random.Random(5)
    # Slow prefill chunks, so that a request polled into prefill is still there when cancelled.
    engine = serve(watched(llama, prefill_delay=0.05), max_running=2, max_queued=8,
                   prefix_cache=False)
    probe = dict(prompt_tokens=list(range(300, 340)))
    tokens(engine.submit(params=SamplingParams(max_tokens=4), **probe))  # warm up
    gc.collect()
    baseline = mx.get_active_memory()

    cancelled_in = []
    for _ in range(4):
        # Two long prompts fill the running slots and the third waits in the queue. Prefill goes
        # oldest first, so the first decodes while the second is still in prefill.
        decoding, prefilling, queued = handles = [
            engine.submit(prompt_tokens=[rng.randrange(1000, 40000) for _ in range(1600)],
                          params=params_for(k, 400)) for k in range(3)]
        time.sleep(rng.uniform(0, 0.05))
        queued.cancel()  # before either running request ends and frees a slot
        steps = [lambda: cancel_after_tokens(decoding, rng.randrange(1, 6)),
                 lambda: cancel_after_prefill(prefilling, rng.choice([0, 512, 1024]))]
        rng.shuffle(steps)
        for step in steps:
            step()
        for handle in handles:
            events = list(handle.events(timeout=60))
            assert [e.kind for e in events].count("done") == 1 and events[-1].kind == "done"
            assert handle.state == "cancelled" and events[-1].finish_reason == "cancelled"
            assert handle.transitions[-1][0] == "cancelled"
            cancelled_in.append(handle.transitions[-2][0])

    assert set(cancelled_in) == {"queued", "prefill", "decoding"}
    status = engine.status()
    assert (status.running, status.queued, status.batch_rows, status.reserved_bytes) == (0, 0, 0, 0)
    # Each cancelled request held over 1 MiB of cache, so a leak of any one of them shows. What may
    # remain is small and not per request: the test's handles' samplers' 8-byte random keys, and
    # what MLX keeps once per process for a kernel or shape first met here (in CI's long process
    # that came to 8 KB once).
    gc.collect()
    assert mx.get_active_memory() - baseline < 64 * 1024
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=3)
    after = tokens(engine.submit(params=params, **probe))
    assert after == tokens(serve(llama, prefix_cache=False).submit(params=params, **probe))


@dataclasses.dataclass(frozen=True)
class FaultyParams(SamplingParams):
    """Sampling parameters whose sampler breaks at its `fault_at`-th token, as a faulty custom
    sampler would: the first draw happens at the end of prefill, the others while decoding."""

    fault_at: int = 1
    draws: list = dataclasses.field(default_factory=list, compare=False)

    @property
    def greedy(self):  # read once per draw by the request's own TokenSampler
        self.draws.append(1)
        if len(self.draws) == self.fault_at:
            raise ValueError("injected fault")
        return super().greedy


@pytest.mark.parametrize("where", ["decode", "prefill"])
def test_a_fault_in_one_request_fails_only_that_one(where, llama, serve):
    target = watched(llama)
    engine = serve(target, max_running=4, prefix_cache=False)
    target.model.gate.clear()  # all four are submitted before the first model call
    requests = [(dict(prompt_tokens=list(range(100 + 50 * i, 130 + 50 * i))),
                 params_for(i, 12)) for i in range(4)]
    # In decode it fails at its sixth draw, by when all four requests decode in one batch.
    faulty = FaultyParams(max_tokens=12, fault_at=6 if where == "decode" else 1)
    handles = [engine.submit(params=faulty if i == 1 else p, **prompt)
               for i, (prompt, p) in enumerate(requests)]
    target.model.gate.set()

    for i, handle in enumerate(handles):
        events = list(handle.events(timeout=60))
        if i == 1:
            assert handle.state == "failed" and events[-1].finish_reason == "failed"
            assert "injected fault" in events[-1].error and "injected fault" in handle.error
            assert [e.kind for e in events] == (["token"] * 4 if where == "decode" else []) + ["done"]
            assert handle.transitions[-2][0] == ("decoding" if where == "decode" else "prefill")
        else:
            prompt, params = requests[i]
            assert handle.state == "finished"
            assert [e.token for e in events if e.kind == "token"] == alone(llama, params, **prompt)
    # Decode steps: one-token calls after a one-token call (a prompt's last token follows its
    # prefill call, which may hold all four prompts). The faulty request never decodes with others.
    shapes = target.model.shapes
    steps = [rows for (_, before), (rows, length) in zip(shapes, shapes[1:]) if before == length == 1]
    assert max(steps) == (4 if where == "decode" else 3)
    prompt, params = requests[1]
    assert tokens(engine.submit(params=params, **prompt)) == alone(llama, params, **prompt)


def test_states_and_timestamps_follow_the_lifecycle(llama, serve):
    target = watched(llama)
    engine = serve(target, max_running=1, max_queued=2)
    target.model.gate.clear()  # the first request cannot end before the third is cancelled
    first = engine.submit(prompt_tokens=list(range(100, 140)), params=SamplingParams(max_tokens=8))
    second = engine.submit(prompt_tokens=list(range(200, 240)), params=SamplingParams(max_tokens=5))
    third = engine.submit(prompt_tokens=list(range(300, 340)), params=SamplingParams(max_tokens=5))
    assert second.state == third.state == "queued"
    third.cancel()
    target.model.gate.set()
    out = {h.id: list(h.events(timeout=60)) for h in (first, second, third)}

    assert [s for s, _ in third.transitions] == ["queued", "cancelled"]
    assert "started" not in third.times and out[third.id][-1].finish_reason == "cancelled"
    for handle in (first, second):
        assert [s for s, _ in handle.transitions] == ["queued", "prefill", "decoding", "finished"]
        stamps = [t for _, t in handle.transitions]
        assert stamps == sorted(stamps)
        t = handle.times
        assert t["queued"] <= t["started"] <= t["first_token"] <= t["last_token"] <= t["ended"]
        n = sum(e.kind == "token" for e in out[handle.id])
        assert handle.state == "finished" and handle.finish_reason == "length"
        assert handle.usage.completion_tokens == n == handle.generation.params.max_tokens
        assert handle.usage.prompt_tokens == 40 and handle.error is None
    assert first.times["ended"] <= second.times["started"]  # one running at a time


def test_batched_requests_reuse_and_fill_the_prefix_cache(llama, serve):
    """Requests that share a conversation prefix reuse it while batched, and what a batched request
    generated is saved when it leaves the batch, so its follow-up turn reuses the whole answer."""
    engine = serve(llama, max_running=4)
    system = {"role": "system", "content": "You are a helpful assistant. " * 20}
    tokens(engine.submit([system, {"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4)))
    chats = [[system, {"role": "user", "content": f"Question {i}?"}] for i in range(3)]
    params = SamplingParams(max_tokens=10)
    handles = [engine.submit(chat, params) for chat in chats]
    answers = [tokens(h) for h in handles]
    for chat, handle, answer in zip(chats, handles, answers):
        assert answer == alone(llama, params, messages=chat)
        assert handle.usage.cached_tokens > 100

    # A request that ends inside a batched step (here on a stop string) is saved as it leaves the
    # batch: a continuation of its tokens reuses all that went through the model.
    stopping = SamplingParams(max_tokens=10, stop=(llama.tokenizer.decode(answers[0][5:6]),))
    handles = [engine.submit(chat, stopping) for chat in chats]
    stopped = tokens(handles[0])
    assert handles[0].finish_reason == "stop" and len(stopped) < 9
    assert stopped == alone(llama, stopping, messages=chats[0])
    held = list(handles[0].generation.fed)
    follow = engine.submit(prompt_tokens=held + [500, 501, 502], params=params)
    assert tokens(follow) == alone(llama, params, prompt_tokens=held + [500, 501, 502])
    assert follow.usage.cached_tokens == len(held)


def test_requests_over_the_memory_budget_are_refused_before_any_work(llama, serve):
    probe = serve(llama)
    per_request = probe.request_bytes(40, 8)
    weights = probe.status().weight_bytes  # the budget holds the model's weights too
    engine = serve(llama, max_running=4, memory_budget=weights + int(per_request * 2.5))
    long = dict(prompt_tokens=list(range(100, 140)), params=SamplingParams(max_tokens=2000))
    with pytest.raises(InvalidRequest, match="memory budget"):
        engine.submit(**long)
    ok = [engine.submit(prompt_tokens=list(range(100, 140)), params=SamplingParams(max_tokens=8))
          for _ in range(2)]
    with pytest.raises(Overloaded, match="memory budget"):
        engine.submit(prompt_tokens=list(range(100, 140)), params=SamplingParams(max_tokens=8))
    assert all(len(tokens(h)) == 8 for h in ok)
    assert len(tokens(engine.submit(prompt_tokens=list(range(100, 140)),
                                    params=SamplingParams(max_tokens=8)))) == 8


def test_switching_models_keeps_the_running_requests_or_cancels_them(llama, qwen):
    """The default model changes while the other model's requests run on (both stay loaded),
    or after every running request is cancelled, if asked."""
    models = {"llama": llama, "qwen": qwen}
    engine = Engine("llama", load=lambda name, **_: models[name]).start()
    try:
        prompt = dict(prompt_tokens=list(range(100, 140)))
        running = engine.submit(params=SamplingParams(max_tokens=40), **prompt)
        stages = []
        engine.switch_model("qwen", progress=lambda p: stages.append(p.stage))
        assert engine.model_name == qwen.name and stages == ["ready"]
        params = SamplingParams(max_tokens=8)
        assert tokens(engine.submit(params=params, **prompt)) == alone(qwen, params, **prompt)
        assert len(tokens(running)) == 40 and running.state == "finished"
        assert set(engine.status().loaded) == {llama.name, qwen.name}

        running = engine.submit(params=SamplingParams(max_tokens=4000), **prompt)
        while running.state != "decoding":
            time.sleep(0.001)
        engine.switch_model("llama", cancel_running=True)
        assert len(tokens(running)) < 4000  # its events end with the cancellation
        assert running.state == "cancelled" and running.finish_reason == "cancelled"
        assert tokens(engine.submit(params=params, **prompt)) == alone(llama, params, **prompt)
    finally:
        engine.stop()


def test_run_on_scheduler_runs_on_its_thread_once_the_requests_end(llama, serve):
    """The hooks bench measures the scheduler thread with (bench.concurrency_step,
    bench.tick_profile): a task waits for the admitted requests, then runs on that thread."""
    engine = serve(llama)
    running = engine.submit(params=SamplingParams(max_tokens=40), prompt_tokens=list(range(100, 140)))
    seen = []
    engine.run_on_scheduler(lambda: seen.append((threading.get_native_id(), running.state)))
    assert seen == [(engine.scheduler.thread_id, "finished")]
    assert engine.scheduler.thread_id != threading.get_native_id()
