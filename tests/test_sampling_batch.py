"""Sampling a batch of rows at once (`sample_rows`): each row's token is the one its own sampler
picks from that row alone, whatever the other rows are, and a row whose sampling raises fails
alone."""

import mlx.core as mx
import pytest

from engine.decoding.sampling import SamplingParams, TokenSampler, sample_rows

pytestmark = pytest.mark.fast

VOCAB = 1000
KINDS = [
    SamplingParams(),  # plain greedy: the batch's shared argmax
    SamplingParams(temperature=0.8, seed=7),
    SamplingParams(repetition_penalty=1.5),  # greedy through a processor
    SamplingParams(temperature=1.2, top_p=0.9, top_k=40, min_p=0.05, seed=8),
    SamplingParams(logit_bias={5: 100.0}),
    SamplingParams(),
]


def rows_of(n: int, seed: int) -> mx.array:
    return mx.random.normal((n, VOCAB), key=mx.random.key(seed)) * 4


def history_for(sampler: TokenSampler, i: int) -> mx.array | None:
    return mx.array([i, 3, 3, 9], dtype=mx.uint32) if sampler.processors else None


@pytest.mark.parametrize("order", [list(range(6)), [3, 1, 0, 5, 2, 4], [1, 3], [0, 5]])
def test_each_row_gets_the_token_its_sampler_picks_alone(order):
    params = [KINDS[k] for k in order]
    batched = [TokenSampler(p) for p in params]
    solo = [TokenSampler(p) for p in params]
    histories = [history_for(s, i) for i, s in enumerate(batched)]
    for step in range(4):  # seeded rows advance their own keys step by step
        logits = rows_of(len(params), seed=step)
        tokens, logprobs, failures = sample_rows(batched, histories, logits)
        assert failures == {} and tokens.shape == (len(params),)
        for i, sampler in enumerate(solo):
            token, row_logprobs = sampler(logits[i:i + 1], histories[i])
            assert tokens[i].item() == token.item()
            assert mx.array_equal(logprobs[i:i + 1], row_logprobs).item()
    # the bias of 100 forces its token
    if 4 in order:
        assert tokens[order.index(4)].item() == 5


def test_a_row_whose_sampling_raises_fails_alone():
    samplers = [TokenSampler(p) for p in KINDS[:4]]

    def broken(history, logits):
        raise ValueError("grammar fault")

    samplers[2].processors.append(broken)
    histories = [history_for(s, i) for i, s in enumerate(samplers)]
    logits = rows_of(4, seed=11)
    tokens, _, failures = sample_rows(samplers, histories, logits)
    assert list(failures) == [2] and "grammar fault" in str(failures[2])
    alone = [TokenSampler(p) for p in KINDS[:4]]
    for i in (0, 1, 3):
        assert tokens[i].item() == alone[i](logits[i:i + 1], histories[i])[0].item()


def test_top_p_keeps_exactly_the_tokens_mlx_lm_keeps():
    """Our top-p (the vocabulary sorted by NumPy, engine/decoding/sampling.py `apply_top_p`) gives
    mlx-lm's array bit for bit: flat and peaked rows, rows with banned (-inf) tokens and ties at the
    threshold, one row or several."""
    from mlx_lm.sample_utils import apply_top_p as mlx_lm_top_p

    from engine.decoding.sampling import apply_top_p

    logits = mx.concatenate([rows_of(3, seed=5) * scale for scale in (0.1, 1.0, 8.0)])
    logits[1, :300] = -float("inf")
    logits[4, :] = mx.round(logits[4, :])  # many equal values
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for top_p in (0.05, 0.5, 0.9, 0.999):
        for rows in (logprobs, logprobs[2:3]):
            ours, theirs = apply_top_p(rows, top_p), mlx_lm_top_p(rows, top_p)
            assert mx.array_equal(ours, theirs, equal_nan=True).item(), top_p
            assert 0 < (ours > -float("inf")).sum().item() < rows.size


def test_top_logprobs_are_the_first_of_a_stable_sort_of_the_vocabulary():
    """The alternatives a token reports (engine/decoding/logprobs.py `most_likely`, a partial
    selection) are what a full stable argsort gives: most likely first, equal values by id, with
    ties across the cut, banned tokens and a flat row."""
    import numpy as np

    from engine.decoding.logprobs import most_likely

    rows = rows_of(3, seed=9)
    rows[1] = mx.round(rows[1])  # many ties, across the cut of every `top`
    rows[2, :990] = -float("inf")
    for row in list(rows) + [mx.zeros((VOCAB,))]:
        for top in (1, 2, 5, 20):
            assert most_likely(np.array(row), top).tolist() == mx.argsort(-row)[:top].tolist()
