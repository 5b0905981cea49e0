"""Prefill that does not stall the running streams (issue 33): while requests decode, a waiting
prompt's chunks ride in the batch's steps (mixed steps, engine/decoding/mixed.py) within the
per-tick token budget (engine/scheduling/prefill_policy.py), or, on a model the mixed step does
not know, prefill in calls of their own within the same budget.

"Alone" is the same request run by itself through `engine.decoding.generate.generate`: no
scheduler, no batch, no prefix cache. Tiny random-weight llama (tests/tiny_models.py), fp32.
"""

import threading

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.decoding.generate import build_prompt, generate
from engine.decoding.mixed import mixed_call, supports
from engine.decoding.sampling import SamplingParams
from engine.model_cache import LOCAL
from engine.scheduling import batch as batch_module
from engine.scheduling import prefill_policy
from tiny_models import tiny_llama, tiny_qwen3_5
from watched_model import tokens_of, watched

pytestmark = pytest.mark.fast

BUDGET = 24  # prompt tokens per tick while others decode, in these tests


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(autouse=True)
def small_budget(monkeypatch):
    monkeypatch.setitem(prefill_policy.DECODING_TOKENS, "cpu", BUDGET)


@pytest.fixture
def rides(monkeypatch):
    """The chunk length of every mixed step, recorded around the real `mixed_call`."""
    seen: list[int] = []
    real = batch_module.mixed_call

    def recording(model, rows, batch_cache, chunk, chunk_cache, logits):
        seen.append(chunk.shape[0])
        return real(model, rows, batch_cache, chunk, chunk_cache, logits)

    monkeypatch.setattr(batch_module, "mixed_call", recording)
    return seen


def alone(lm, params, tokens):
    prompt = build_prompt(lm, prompt_tokens=tokens)
    return [e.token for e in generate(lm, prompt, params) if e.kind == "token"]


def prompt(n, start):
    return [(start + 7 * i) % 40000 + 10 for i in range(n)]


def params(i, max_tokens):
    """Even requests greedy, odd ones seeded sampling."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=max_tokens)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=500 + i)


def first_token(handle):
    """Wait for the first event of `handle` (a token) and return an iterator over the rest."""
    events = handle.events(timeout=60)
    assert next(events).kind == "token"
    return events


def test_a_mixed_call_equals_the_rows_step_and_the_chunk_call_apart(llama):
    """The decode rows' logits and the chunk's last logits of one mixed call, and the caches it
    leaves, equal those of the two calls apart (rows of different lengths, left-padded)."""
    model = llama.model
    assert supports(model) and not supports(tiny_qwen3_5().model)

    def primed(lengths, start):
        caches = []
        for i, n in enumerate(lengths):
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array([prompt(n, start + i)]), cache=cache))
            caches.append(cache)
        return caches

    rows = mx.array([5, 77, 1234])
    chunk = mx.array(prompt(40, 900))
    batch_a, batch_b = LOCAL.merge(primed([7, 12, 3], 1)), LOCAL.merge(primed([7, 12, 3], 1))
    [own_a], [own_b] = primed([20], 50), primed([20], 50)
    apart_rows = model(rows[:, None], cache=batch_a)[:, -1, :]
    apart_chunk = model(chunk[None], cache=own_a)[:, -1, :]
    mixed_rows, mixed_chunk = mixed_call(model, rows, batch_b, chunk, own_b, True)
    assert mx.allclose(mixed_rows, apart_rows, atol=1e-5) and mx.allclose(mixed_chunk, apart_chunk, atol=1e-5)
    nxt = mx.array([[9], [8], [7]])
    assert mx.allclose(model(nxt, cache=batch_a), model(nxt, cache=batch_b), atol=1e-5)
    assert mx.allclose(model(chunk[None, :3], cache=own_a), model(chunk[None, :3], cache=own_b), atol=1e-5)


@pytest.mark.slow  # five streams and their runs alone: seconds by design, the second tier
def test_prompts_riding_in_the_decode_steps_give_every_row_the_tokens_it_gets_alone(llama, serve, rides):
    """Three streams decode (greedy and seeded, leaving at different steps); two long prompts
    arrive and prefill in mixed steps of at most the tick budget while rows leave and the new ones
    join: every request's tokens equal its tokens alone."""
    engine = serve(llama, max_running=6, prefix_cache=False)
    running = [(prompt(16 + 5 * i, 100 * i), params(i, m)) for i, m in enumerate((20, 40, 80))]
    handles = [engine.submit(prompt_tokens=t, params=p) for t, p in running]
    rests = [first_token(h) for h in handles]
    arriving = [(prompt(200, 3000), params(0, 40)), (prompt(130, 5000), params(1, 40))]
    late = [engine.submit(prompt_tokens=t, params=p) for t, p in arriving]
    for (t, p), h, rest in zip(running, handles, rests):
        assert [e.token for e in rest if e.kind == "token"] == alone(llama, p, t)[1:]
    for (t, p), h in zip(arriving, late):
        assert tokens_of(h) == alone(llama, p, t)
    assert rides and max(rides) <= BUDGET and sum(rides) >= 200  # they rode, within the budget


def test_cancelling_the_riding_prompt_and_a_decoding_row_mid_interleave(llama, serve, rides):
    """A long prompt riding in the decode steps is cancelled after some chunks, and a decoding
    row too: both end `cancelled` with one final event, the other rows keep their tokens alone,
    and the engine serves on with nothing reserved."""
    engine = serve(llama, max_running=6, prefix_cache=False)
    running = [(prompt(20, 100 * i), params(i, 90)) for i in range(3)]
    handles = [engine.submit(prompt_tokens=t, params=p) for t, p in running]
    rests = [first_token(h) for h in handles]
    long = engine.submit(prompt_tokens=prompt(2000, 7000), params=SamplingParams(max_tokens=8))
    seen = threading.Event()
    while not seen.wait(0.001):
        if len(rides) >= 3:
            seen.set()
    long.cancel()
    handles[1].cancel()
    done = list(long.events(timeout=60))
    assert [e.kind for e in done].count("done") == 1 and done[-1].finish_reason == "cancelled"
    assert long.state == "cancelled" and len(long.generation.fed) < 2000
    cut = list(rests[1])
    assert cut[-1].finish_reason == "cancelled"
    for i in (0, 2):
        got = [e.token for e in rests[i] if e.kind == "token"]
        assert got == alone(llama, running[i][1], running[i][0])[1:]
    probe = (prompt(40, 123), SamplingParams(max_tokens=6))
    assert tokens_of(engine.submit(prompt_tokens=probe[0], params=probe[1])) == alone(llama, probe[1], probe[0])
    assert engine.status().reserved_bytes == 0 and engine.status().running == 0


@pytest.mark.slow  # streams decoding to 80 tokens and their runs alone: seconds by design, the second tier
def test_without_mixed_steps_the_tick_budget_still_bounds_each_prefill_call(llama, serve, rides):
    """On a model the mixed step does not run (here a wrapped one), a prompt arriving while others
    decode prefills in calls of its own of at most the budget, and the tokens stay those alone."""
    target = watched(llama)
    engine = serve(target, max_running=4, prefix_cache=False)
    assert not engine.slot.batch.mixed
    running = [(prompt(16, 100 * i), params(i, 80)) for i in range(2)]
    handles = [engine.submit(prompt_tokens=t, params=p) for t, p in running]
    rests = [first_token(h) for h in handles]
    calls_before = len(target.model.shapes)
    new = (prompt(150, 9000), params(0, 10))
    late = engine.submit(prompt_tokens=new[0], params=new[1])
    assert tokens_of(late) == alone(llama, new[1], new[0])
    for (t, p), rest in zip(running, rests):
        assert [e.token for e in rest if e.kind == "token"] == alone(llama, p, t)[1:]
    prefill_calls = [n for rows, n in target.model.shapes[calls_before:] if n > 1]
    assert prefill_calls and max(prefill_calls) <= BUDGET and not rides


@pytest.mark.parametrize("i", [0, 1])
def test_a_full_attention_models_tokens_do_not_depend_on_where_its_prompt_is_cut(llama, i):
    """What a per-tick prefill budget below one chunk would need on the CPU: a llama's request
    gives the same tokens (greedy and seeded) whether its prompt is prefilled in one call or cut
    into calls of 8 or 5 tokens. (The Qwen3.5 hybrid does not: its linear attention's chunked
    prefill and its per-token path round differently, bench/results/HISTORY-gpu.md "The same row
    on the CPU".)"""
    from engine.decoding.generate import Generation

    tokens, sampling = prompt(37, 900), params(i, 12)

    def run(chunk):
        gen = Generation(llama, build_prompt(llama, prompt_tokens=tokens), sampling, prefill_chunk=chunk)
        out = []
        while not gen.done:
            out += [e.token for e in gen.step() if e.kind == "token"]
        return out

    whole = run(512)
    assert len(whole) == 12 and run(8) == whole and run(5) == whole
