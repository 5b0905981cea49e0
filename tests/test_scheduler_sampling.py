"""The batched step's sampling and pipelining (engine/scheduling/batch.py `DecodeBatch.step`):
rows of every kind (greedy, seeded sampling, log-probabilities, penalties, logit bias, JSON mode)
decoding in one batch each give exactly what they give alone, also while rows leave (finished or
cancelled between steps, with the next step already enqueued) and join."""

import dataclasses

import pytest

from engine.decoding.generate import build_prompt, generate
from engine.decoding.sampling import SamplingParams
from tiny_models import tiny_llama, tiny_qwen3_5
from watched_model import WatchedModel, tokens_of

pytestmark = pytest.mark.fast

FIRST = list(range(1000, 1040))
PROMPTS = [list(range(3000 + 90 * i, 3025 + 90 * i + 5 * i)) for i in range(8)]
KINDS = [
    SamplingParams(max_tokens=10),
    SamplingParams(max_tokens=10, logprobs=3),
    SamplingParams(max_tokens=10, temperature=0.8, seed=21),
    SamplingParams(max_tokens=10, temperature=1.1, top_k=30, top_p=0.9, seed=22, logprobs=2),
    SamplingParams(max_tokens=10, repetition_penalty=1.4, presence_penalty=0.5),
    SamplingParams(max_tokens=10, logit_bias={42: 6.0}),
    SamplingParams(max_tokens=10, json_schema={"type": "object"}),
    SamplingParams(max_tokens=10, temperature=0.7, seed=23, json_schema={"type": "object"}),
]


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def base(request):
    return tiny_llama() if request.param == "llama" else tiny_qwen3_5()


def run_alone(lm, prompt, params):
    return [e for e in generate(lm, build_prompt(lm, prompt_tokens=prompt), params)
            if e.kind == "token"]


def assert_same_tokens(events, solo):
    assert [e.token for e in events] == [e.token for e in solo]
    for got, want in zip(events, solo):
        if want.logprobs is None:
            assert got.logprobs is None
            continue
        assert got.logprobs.token == want.logprobs.token
        assert got.logprobs.logprob == pytest.approx(want.logprobs.logprob, abs=1e-4)
        assert [t.token for t in got.logprobs.top] == [t.token for t in want.logprobs.top]


def start_busy(base, serve, **options):
    """An engine whose scheduler is inside a first request's prefill, so that the requests
    submitted next arrive together; returns the engine, its model and the release event."""
    model = WatchedModel(base.model)
    engine = serve(dataclasses.replace(base, model=model), prefix_cache=False, **options)
    entered, release = model.hold(len(FIRST) - 1)
    first = engine.submit(prompt_tokens=FIRST, params=SamplingParams(max_tokens=2))
    assert entered.wait(timeout=60)
    return engine, model, first, release


def test_rows_of_every_kind_in_one_batch_each_equal_their_solo_runs(base, serve):
    engine, model, first, release = start_busy(base, serve, max_running=9)
    handles = [engine.submit(prompt_tokens=p, params=k) for p, k in zip(PROMPTS, KINDS)]
    release.set()

    for handle, prompt, params in zip(handles, PROMPTS, KINDS):
        events = [e for e in handle.events(timeout=120) if e.kind == "token"]
        assert handle.state == "finished"
        assert_same_tokens(events, run_alone(base, prompt, params))
    tokens_of(first)
    # all eight decoded in one batch (JSON mode's rows may end early, at their object's end)
    assert (8, 1) in model.shapes


def test_rows_leaving_and_joining_mid_pipeline_leave_the_others_exact(base, serve):
    """Rows end at different steps (their max_tokens), one is cancelled after its third token
    while the next step is already enqueued, and a request arriving meanwhile joins the batch:
    every other request still gives its solo tokens, the cancelled one a prefix of them."""
    engine, model, first, release = start_busy(base, serve, max_running=9)
    lengths = [12, 5, 16, 8, 16, 3]
    kinds = [dataclasses.replace(KINDS[i % 4], max_tokens=n) for i, n in enumerate(lengths)]
    handles = [engine.submit(prompt_tokens=p, params=k) for p, k in zip(PROMPTS, kinds)]
    release.set()
    cancelled = handles[4]
    stream = cancelled.events(timeout=60)
    seen = [next(stream) for _ in range(3)]
    cancelled.cancel()
    late = engine.submit(prompt_tokens=PROMPTS[6], params=KINDS[2])

    for i, (handle, prompt, params) in enumerate(zip(handles, PROMPTS, kinds)):
        solo = run_alone(base, prompt, params)
        if handle is cancelled:
            events = seen + list(stream)
            assert events[-1].finish_reason == "cancelled" and handle.state == "cancelled"
            got = [e.token for e in events if e.kind == "token"]
            assert 3 <= len(got) < len(solo) and got == [e.token for e in solo[:len(got)]]
            continue
        assert_same_tokens([e for e in handle.events(timeout=120) if e.kind == "token"], solo)
    assert_same_tokens([e for e in late.events(timeout=120) if e.kind == "token"],
                       run_alone(base, PROMPTS[6], KINDS[2]))
    tokens_of(first)
    rows = [r for r, n in model.shapes if n == 1 and r > 1]
    assert len(set(rows)) >= 3  # the batch changed size between steps
    status = engine.status()
    assert (status.running, status.queued, status.batch_rows, status.reserved_bytes) == (0, 0, 0, 0)


def test_rows_reaching_max_tokens_together_read_their_last_tokens_without_a_model_call(base, serve):
    """Rows that reach `max_tokens` in the same step end as a lone stream does: their last
    tokens (sampled by the step before) are read and emitted, with no model call whose logits
    nothing would read; tokens and logprobs stay each row's solo ones."""
    engine, model, first, release = start_busy(base, serve, max_running=5)
    kinds = [dataclasses.replace(k, max_tokens=6) for k in KINDS[:4]]
    handles = [engine.submit(prompt_tokens=p, params=k) for p, k in zip(PROMPTS, kinds)]
    release.set()

    for handle, prompt, params in zip(handles, PROMPTS, kinds):
        events = [e for e in handle.events(timeout=120) if e.kind == "token"]
        assert handle.state == "finished" and handle.finish_reason == "length"
        assert_same_tokens(events, run_alone(base, prompt, params))
    tokens_of(first)
    # their first tokens come from the call that fed their prompts' last tokens, tokens 2-6 from
    # the five steps feeding tokens 1-5; the sixth is read without a call
    assert sum(1 for rows, width in model.shapes if rows >= 4 and width == 1) == 6
