"""Top-p (nucleus) sampling of one row on the CPU with a fraction of the exponentials, token for
token what mlx-lm's `apply_top_p` followed by `mx.random.categorical` gives.

MLX's CPU `exp` is scalar code here (~13 ns an element: ~0.65 ms for a 49,152-token row) and the
usual path runs it over the whole vocabulary twice per sampled token: once in the top-p filter
(`exp` of the sorted log-probabilities) and once inside `mx.random.categorical` (which, for one
row, draws by inverse CDF: `w = exp(x - max x)`, an exclusive `cumsum` of `w`, one uniform number
`u` from the key, `searchsorted(cdf, u * sum(w), "right") - 1`). With the row on the host (the
top-p filter sorts it with NumPy anyway), both shrink, with the same float operations on every
value that can change the result:

- **The filter.** mlx-lm sums the sorted probabilities from the most likely down (a reverse
  exclusive `cumsum`). Once that sum is `S`, adding a probability below half a unit in the last
  place of `S` leaves it unchanged, so every sorted value below `cut` (whose probability is
  surely below half an ulp of any sum that already holds the largest probability) adds nothing:
  only the values above the cut are exponentiated and summed, all the others' running sums are
  `S`, and the count of dropped tokens, hence the threshold, is the same.
- **The draw.** Tokens the filter drops are -inf, so their `w` is exactly 0, adds nothing to
  `cumsum` or `sum` (MLX's CPU reductions and scans add in index order, one value at a time, on
  Linux), and the draw over the kept tokens alone, in index order, lands on the same token (the
  one case where it would not, `u * sum(w)` at or past the last kept token's cumulative sum,
  gives the last index of the vocabulary in MLX and here).

`usable()` checks the conditions (CPU device, float32, one row, no NaN or +inf, not on macOS,
where MLX's CPU reductions run in SIMD lanes and zeros would regroup the sums); otherwise the
caller runs the usual ops. tests/test_nucleus.py compares tokens with mlx-lm's path.
"""

import math
import sys

import mlx.core as mx
import numpy as np

# mlx's CPU exp is within a few ulp of exp(x); the cut and the lower bound on the sum allow this
# much relative error (tests/test_nucleus.py measures it) and a margin besides.
EXP_ERROR = 1e-3
MARGIN = 0.01


def usable(logprobs: mx.array) -> bool:
    """Whether `draw` applies to `logprobs` (one row of float32 log-probabilities on the CPU)."""
    return (sys.platform != "darwin" and mx.default_device() == mx.cpu
            and logprobs.dtype == mx.float32 and logprobs.ndim == 2 and logprobs.shape[0] == 1)


def cut_below(largest: float) -> float:
    """A log-probability below which a token's probability adds nothing to any running sum that
    holds the probability of the largest log-probability `largest`: that sum is at least
    `exp(largest)` (less exp's error), so half its ulp is at least `2**(floor(log2(that)) - 24)`."""
    low = math.exp(largest) * (1 - EXP_ERROR)
    return (math.floor(math.log2(low)) - 24) * math.log(2) - MARGIN


# the largest value of a row `top_p_threshold` takes: a log-softmax's lies in [-log(vocab), 0]
LARGEST = 80.0


def plain(row: np.ndarray) -> bool:
    """Whether a float32 row holds no NaN and its largest value lies within +-`LARGEST` (what
    `top_p_threshold` and `draw` need; a row of log-probabilities always does)."""
    return bool(abs(row.max()) < LARGEST) and not np.isnan(row).any()


def top_p_threshold(sorted_row: np.ndarray, top_p: float) -> np.float32 | None:
    """mlx-lm's top-p threshold (the smallest kept value) for one `plain` row of log-probabilities
    sorted ascending (float32), or None where mlx-lm's would drop every token (its threshold is
    then read past the end of the row: `top_p` times the mass rounds to 0)."""
    low = int(np.searchsorted(sorted_row, cut_below(float(sorted_row[-1])), side="left"))
    probs = mx.exp(mx.array(sorted_row[low:]))
    mass_above = mx.cumsum(probs, reverse=True, inclusive=False)
    total = mass_above[:1] + probs[:1]  # the sum of the whole row: the values below add nothing
    dropped = low + (mass_above >= top_p * total).sum().item()
    return sorted_row[dropped] if dropped < len(sorted_row) else None


def draw(logprobs: mx.array, top_p: float, temperature: float, key: mx.array) -> mx.array | None:
    """The token (shape (1,), uint32) that `mx.random.categorical(apply_top_p(logprobs, top_p)
    * (1 / temperature), key=key)` gives, or None when this row needs the usual ops (it is not
    `plain`, top-p drops every token, or the tempered logits overflow). `usable(logprobs)` must
    hold."""
    row = np.asarray(logprobs)[0]
    if not plain(row):
        return None
    largest = row.max()
    threshold = top_p_threshold(np.sort(row), top_p)
    if threshold is None:
        return None
    kept = np.flatnonzero(row >= threshold)  # mlx-lm sets the others (row < threshold) to -inf
    scale = 1.0 / temperature
    with np.errstate(over="ignore"):
        if not np.isfinite(largest * np.float32(scale)):  # the tempered maximum is not finite
            return None
    # mx.random.categorical's inverse-CDF draw on the kept values (index order), op for op
    x = mx.array(row[kept]) * scale
    w = mx.exp(x - mx.max(x))
    cdf = mx.cumsum(w, inclusive=False)
    t = mx.random.uniform(shape=(1,), key=key) * mx.sum(w)
    j = mx.searchsorted(cdf, t, side="right") - 1
    past_end = (j == len(kept) - 1) & (cdf[-1:] + w[-1:] <= t)
    return mx.where(past_end, row.size - 1, mx.array(kept, dtype=mx.uint32)[j]).astype(mx.uint32)
