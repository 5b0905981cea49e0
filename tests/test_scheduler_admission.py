"""Admission that fills the batch: requests that arrive while the scheduler is busy all prefill in
its next tick, together (one right-padded model call for their prompts, one for their last
tokens), and decode together from their first batched step, each giving the tokens it gives
alone; a request cancelled on the way in (queued, in prefill or decoding) ends alone.

To make "arrive while the scheduler is busy" (and "cancelled in prefill") exact, the model (the
real tiny model) can hold a call of a given length until the test releases it.
"""

import dataclasses

import pytest

from engine.decoding.generate import build_prompt, generate
from engine.decoding.sampling import SamplingParams
from tiny_models import tiny_llama, tiny_qwen3_5
from watched_model import WatchedModel, tokens_of

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def base(request):
    return tiny_llama() if request.param == "llama" else tiny_qwen3_5()


def params_for(i: int, max_tokens: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(max_tokens=max_tokens)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=500 + i)


def alone(lm, prompt, params) -> list[int]:
    return [e.token for e in generate(lm, build_prompt(lm, prompt_tokens=prompt), params)
            if e.kind == "token"]


FIRST = list(range(1000, 1040))
PROMPTS = [list(range(2000 + 100 * i, 2030 + 100 * i + 7 * i)) for i in range(7)]  # 30-72 tokens


def start_busy(base, serve, **options):
    """An engine whose scheduler is inside the first request's prefill chunk; returns the event
    that lets it go on."""
    model = WatchedModel(base.model)
    engine = serve(dataclasses.replace(base, model=model), prefix_cache=False, **options)
    entered, release = model.hold(len(FIRST) - 1)  # its last token is fed by the next call
    first = engine.submit(prompt_tokens=FIRST, params=params_for(0, 14))
    assert entered.wait(timeout=60)
    return engine, model, first, release


def test_requests_arriving_together_decode_in_one_full_batch(base, serve):
    engine, model, first, release = start_busy(base, serve, max_running=8)
    params = [params_for(i + 1, 6) for i in range(7)]
    handles = [engine.submit(prompt_tokens=p, params=q) for p, q in zip(PROMPTS, params)]
    release.set()

    assert tokens_of(first) == alone(base, FIRST, params_for(0, 14))
    for handle, prompt, p in zip(handles, PROMPTS, params):
        assert tokens_of(handle) == alone(base, prompt, p)
        assert handle.state == "finished"
    # The seven prompts prefilled in one call (right-padded to the longest, all but its last
    # token) and their last tokens in a second; then every batched step ran all eight rows: they
    # joined at once and stayed until their last token (the first request, longer, ends alone).
    together = [shape for shape in model.shapes if shape[0] > 1]
    assert together[:2] == [(7, max(map(len, PROMPTS)) - 1), (7, 1)]
    assert together[2:] == [(8, 1)] * 6


def test_cancelling_during_batched_admission_touches_no_other_request(base, serve):
    engine, model, first, release = start_busy(base, serve, max_running=6, max_queued=4)
    params = [params_for(i + 1, 8) for i in range(7)]
    handles = [engine.submit(prompt_tokens=p, params=q) for p, q in zip(PROMPTS, params)]
    queued, prefilling, decoding = handles[6], handles[4], handles[1]
    assert queued.state == "queued"
    queued.cancel()  # no slot for it yet: it ends at once
    # The next tick admits five and prefills them in one call; hold it and cancel one of them.
    entered, go_on = model.hold(max(map(len, PROMPTS[:5])) - 1)
    release.set()
    assert entered.wait(timeout=60)
    assert prefilling.state == "prefill"
    prefilling.cancel()
    go_on.set()
    events = decoding.events(timeout=60)
    assert next(events).kind == "token"
    decoding.cancel()

    for i, handle in enumerate(handles):
        if handle in (queued, prefilling, decoding):
            out = list(handle.events(timeout=60)) if handle is not decoding else list(events)
            assert out[-1].finish_reason == "cancelled" and handle.state == "cancelled"
        else:
            assert tokens_of(handle) == alone(base, PROMPTS[i], params[i])
    assert tokens_of(first) == alone(base, FIRST, params_for(0, 14))
    assert [s for s, _ in queued.transitions] == ["queued", "cancelled"]
    assert [s for s, _ in prefilling.transitions] == ["queued", "prefill", "cancelled"]
    assert [s for s, _ in decoding.transitions][-2:] == ["decoding", "cancelled"]
    status = engine.status()
    assert (status.running, status.queued, status.batch_rows, status.reserved_bytes) == (0, 0, 0, 0)


def test_prompts_prefilled_together_reuse_their_prefix_cache(base, serve):
    """The next turns of three conversations, arriving together, prefill together on top of what
    their first turns left in the prefix cache (caches of different lengths, merged left-padded),
    reuse it and give the tokens each gives alone; a turn after them reuses theirs."""
    model = WatchedModel(base.model)
    engine = serve(dataclasses.replace(base, model=model), prefix_cache=True, max_running=4)
    params = SamplingParams(max_tokens=5)
    turn1 = PROMPTS[:3]
    answers = [tokens_of(engine.submit(prompt_tokens=t, params=params)) for t in turn1]
    turn2 = [t + a + list(range(4000 + 50 * i, 4010 + 53 * i)) for i, (t, a) in
             enumerate(zip(turn1, answers))]
    entered, release = model.hold(len(FIRST) - 1)
    first = engine.submit(prompt_tokens=FIRST, params=params_for(0, 4))
    assert entered.wait(timeout=60)
    model.shapes.clear()
    handles = [engine.submit(prompt_tokens=t, params=params) for t in turn2]
    release.set()

    outputs = []
    for handle, t1, t2 in zip(handles, turn1, turn2):
        events = list(handle.events(timeout=120))
        outputs.append([e.token for e in events if e.kind == "token"])
        assert outputs[-1] == alone(base, t2, params)
        assert events[-1].usage.cached_tokens >= len(t1)
    assert tokens_of(first) == alone(base, FIRST, params_for(0, 4))
    assert (3, 1) in model.shapes and any(rows == 3 and n > 1 for rows, n in model.shapes)
    turn3 = turn2[1] + outputs[1] + [7, 8, 9]
    last = list(engine.submit(prompt_tokens=turn3, params=params).events(timeout=120))
    assert last[-1].usage.cached_tokens >= len(turn2[1])
    assert [e.token for e in last if e.kind == "token"] == alone(base, turn3, params)
