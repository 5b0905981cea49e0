"""Top-p sampling with fewer exponentials (engine/decoding/nucleus.py): every token is the one
mlx-lm's `apply_top_p` + `mx.random.categorical` draws with the same key, alone and in a batch."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_top_p as mlx_lm_top_p

from engine.decoding import nucleus
from engine.decoding.sampling import SamplingParams, TokenSampler, apply_top_p, sample_rows

pytestmark = pytest.mark.fast

VOCAB = 49152  # the bundled model's: the cut leaves out most of it, as in real rows


def log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def rows() -> list[mx.array]:
    """Rows of log-probabilities: peaked, flat, with banned (-inf) tokens, with many equal values,
    one token holding nearly all the mass, and a heavy tail like a small model's."""
    normal = mx.random.normal((6, VOCAB), key=mx.random.key(3))
    out = [log_softmax(normal[i:i + 1] * scale) for i, scale in enumerate((0.3, 2.0, 5.0, 12.0))]
    banned = normal[4:5] * 4
    banned[0, :40000] = -float("inf")
    out.append(log_softmax(banned))
    out.append(log_softmax(mx.round(normal[5:6] * 3)))  # ties across the threshold
    peaked = mx.zeros((1, VOCAB))
    peaked[0, 17] = 30.0
    out.append(log_softmax(peaked))
    tail = -mx.abs(normal[:1]) * 9.0  # most of the vocabulary far below the cut
    tail[0, 100:110] = 0.0
    out.append(log_softmax(tail))
    return out


def mlx_lm_draw(logprobs: mx.array, top_p: float, temperature: float, key: mx.array) -> int:
    return mx.random.categorical(mlx_lm_top_p(logprobs, top_p) * (1.0 / temperature),
                                 key=key).item()


def test_each_draw_is_mlx_lms():
    for r, row in enumerate(rows()):
        for top_p, temperature in ((0.9, 0.7), (0.5, 1.3), (0.999, 0.05)):
            reference = mlx_lm_top_p(row, top_p) * (1.0 / temperature)
            for k in range(6):
                key = mx.random.key(100 * r + k)
                ours = nucleus.draw(row, top_p, temperature, key)
                assert ours.dtype == mx.uint32 and ours.shape == (1,)
                assert ours.item() == mx.random.categorical(reference, key=key).item(), (r, top_p, k)


def test_the_filter_is_mlx_lms_array():
    for row in rows():
        for top_p in (0.05, 0.9, 0.999):
            assert mx.array_equal(apply_top_p(row, top_p), mlx_lm_top_p(row, top_p),
                                  equal_nan=True).item()
    both = mx.concatenate(rows()[:3])  # several rows at once (speculative decoding's verify)
    assert mx.array_equal(apply_top_p(both, 0.9), mlx_lm_top_p(both, 0.9)).item()


def test_rows_it_cannot_draw_fall_back():
    row = rows()[1]
    nan = mx.where(mx.arange(VOCAB) == 5, float("nan"), row)
    inf = mx.where(mx.arange(VOCAB) == 5, float("inf"), row)
    far = row - 200.0  # not a log-softmax: its largest value is far below 0
    for bad in (nan, inf, far):
        assert nucleus.draw(bad, 0.9, 0.7, mx.random.key(0)) is None
        assert mx.array_equal(apply_top_p(bad, 0.9), mlx_lm_top_p(bad, 0.9), equal_nan=True).item()
    assert nucleus.draw(row, 1e-46, 0.7, mx.random.key(0)) is None  # top_p * mass rounds to 0
    assert nucleus.draw(row, 0.9, 1e-38, mx.random.key(0)) is None  # tempered max overflows
    assert not nucleus.usable(mx.concatenate([row, row]))
    assert not nucleus.usable(row.astype(mx.bfloat16))


def test_mlx_exp_is_within_the_error_the_cut_allows():
    """The cut assumes MLX's exp within `EXP_ERROR` (relative) of the true one down to the
    smallest normal results; measure it on a dense sweep."""
    x = np.concatenate([np.linspace(-87.0, 0.0, 400_003, dtype=np.float32),
                        np.float32(-17.3) + np.arange(-2000, 2000, dtype=np.float32) * 1e-6])
    ours = np.array(mx.exp(mx.array(x))).astype(np.float64)
    error = np.abs(ours / np.exp(x.astype(np.float64)) - 1)
    assert error.max() < nucleus.EXP_ERROR / 100


def test_a_sampled_batch_gives_each_row_its_alone_and_mlx_lm_tokens():
    """Four seeded rows with the app's default sampling (temperature 0.7, top_p 0.9), batched
    over four steps: each token is the one the row gets alone and the one mlx-lm draws with the
    request's key sequence (`key, sub = split(key)` per draw)."""
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=s) for s in (1, 2, 3, 1)]
    batched = [TokenSampler(p) for p in params]
    alone = [TokenSampler(p) for p in params]
    keys = [mx.random.key(p.seed) for p in params]
    source = rows()
    for step in range(4):
        logits = mx.concatenate([source[(step + i) % len(source)] * 1.5 for i in range(4)])
        tokens, _, failures = sample_rows(batched, [None] * 4, logits)
        assert failures == {}
        for i in range(4):
            keys[i], sub = mx.random.split(keys[i])
            expected = mlx_lm_draw(log_softmax(logits[i:i + 1]), 0.9, 0.7, sub)
            assert tokens[i].item() == alone[i](logits[i:i + 1], None)[0].item() == expected


def test_the_batch_log_softmax_is_each_rows_on_two_streams_from_any_thread():
    """`log_softmax_rows` splits the rows over a second CPU stream of the calling thread (MLX's
    streams are per thread: a scheduler thread makes its own); every row's values are the ones
    that row gets alone."""
    import threading

    from engine.decoding.sampling import log_softmax_rows, side_stream

    logits = mx.concatenate(rows()[:5]) * 3
    mx.eval(logits)  # made before the threads, as the model's logits are made on the sampling thread
    results: dict[int, mx.array] = {}

    def run(n: int) -> None:
        assert side_stream() is not None and side_stream() != mx.default_stream(mx.cpu)
        results[n] = log_softmax_rows(logits[:n])
        mx.eval(results[n])

    for n in (1, 2, 3, 5):
        thread = threading.Thread(target=run, args=(n,))
        thread.start()
        thread.join()
        for i in range(n):
            assert mx.array_equal(results[n][i:i + 1], log_softmax(logits[i:i + 1])).item(), (n, i)
