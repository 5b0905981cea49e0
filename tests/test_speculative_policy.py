"""Speculation that pays or steps aside: a request times its speculative rounds against plain
decoding and switches speculation off when it loses, saying so in its final event's stats; the
tokens stay those of plain decoding either way. "Forced to lose" / "forced to win": the real tiny
models with a fixed delay added to every call of the draft (losing) or of the target (winning,
by a wide margin: a round of drafting and verifying is slow on this CPU).
"""


import pytest

from engine.decoding.generate import build_prompt, generate
from engine.decoding.sampling import SamplingParams
from engine.decoding.speculative import SpecConfig, model_speculator
from tiny_models import tiny_llama
from watched_model import watched

pytestmark = pytest.mark.fast

PROMPT = list(range(3000, 3040))


def slow(lm, delay=0.1):
    return watched(lm, delay=delay)


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


def run(lm, params, speculator=None):
    events = list(generate(lm, build_prompt(lm, prompt_tokens=PROMPT), params, speculator=speculator))
    return [e.token for e in events if e.kind == "token"], events[-1]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40),
                                    SamplingParams(max_tokens=40, temperature=0.8, seed=4)])
def test_speculation_that_loses_switches_itself_off_and_says_so(target, params):
    draft = slow(tiny_llama(seed=1))  # an unrelated draft: nothing it drafts is accepted, slowly
    plain, _ = run(target, params)
    tokens, done = run(target, params, model_speculator(target, draft, SpecConfig()))
    stats = done.stats["speculative"]
    assert stats["switched_off"] is True
    assert stats["speculative_tokens_per_s"] < stats["plain_tokens_per_s"]
    assert stats["target_steps"] <= SpecConfig().trial_rounds + 1  # then plain to the end
    assert done.finish_reason == "length" and len(tokens) == 40
    if params.greedy:  # sampled tokens follow the same distribution, not the same draws
        assert tokens == plain


def test_a_losing_draft_steps_aside_within_a_few_tokens(target):
    """Plain decoding is timed first (the opening tokens), so a draft that loses is switched off
    right after its trial rounds, each of which emits one token: then plain to the end."""
    config = SpecConfig()
    draft = slow(tiny_llama(seed=1))
    params = SamplingParams(max_tokens=60)
    plain, _ = run(target, params)
    tokens, done = run(target, params, model_speculator(target, draft, config))
    stats = done.stats["speculative"]
    assert stats["switched_off"] is True and stats["accepted"] == 0
    # the opening plain tokens, the one emitted before the first round, one per round
    assert stats["switched_off_at_token"] <= config.trial_tokens + 1 + config.trial_rounds
    assert stats["target_steps"] <= config.trial_rounds
    assert tokens == plain


def test_speculation_that_wins_stays_on_after_timing_plain_decoding(target):
    params = SamplingParams(max_tokens=40)
    slow_target = slow(target, delay=0.1)
    plain, _ = run(target, params)  # the same weights: the delay changes the time, not the tokens
    # its own weights without the delay: every draft accepted, one slow target call per round
    tokens, done = run(slow_target, params, model_speculator(slow_target, target.model, SpecConfig()))
    stats = done.stats["speculative"]
    assert stats["switched_off"] is False and stats["plain_tokens_per_s"] is not None
    assert stats["speculative_tokens_per_s"] > stats["plain_tokens_per_s"]
    assert stats["acceptance_rate"] == 1.0 and tokens == plain
