"""Sampling parameters, presets, and per-request seeded samplers built on `mlx_lm.sample_utils`.

A request's randomness comes from its own key, never from MLX's global generator, so a seeded
request yields the same tokens whatever else runs. The key sequence is the one `mx.random.seed(seed)`
would produce (`key, sub = split(key)` per draw), so our tokens equal `mlx_lm.generate`'s after
`mx.random.seed(seed)`.
"""

import math
import random
import threading
from dataclasses import asdict, dataclass, field, make_dataclass, replace
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, make_logits_processors
from mlx_lm.sample_utils import apply_top_p as mlx_lm_top_p

from ..errors import InvalidRequest
from ..kernels import native
from . import nucleus
from .stops import check_stops

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class SamplingOption:
    """One numeric sampling option: the single declaration that `SamplingParams`, the API's
    accepted fields, the CLI's flags and the settings form are all derived from.

    The value must lie between `low` and `high` (None: unbounded), each end included unless
    `low_open` / `high_open`; `default` None means "unset" (e.g. a random seed). `unset`: a value
    clients send to mean "unset" (many send seed -1 for a random one); it is taken as None."""

    name: str
    kind: type  # int or float
    default: int | float | None
    low: int | float | None
    high: int | float | None
    label: str  # the settings form's label
    help: str  # the CLI's help text and the form's hint
    low_open: bool = False
    high_open: bool = False
    unset: int | None = None

    def interval(self) -> str:
        """The allowed values as the error messages state them, e.g. "(0, 1]"."""
        low = "-inf" if self.low is None else str(self.low)
        high = "inf" if self.high is None else str(self.high)
        return f"{'(' if self.low_open or self.low is None else '['}{low}, " \
               f"{high}{')' if self.high_open or self.high is None else ']'}"

    def expected(self) -> str:
        """What a value must be, as the error messages say it, e.g. "a positive integer"."""
        if self.kind is int and self.high is None and self.low in (0, 1):
            return "a positive integer" if self.low == 1 else "a non-negative integer"
        return f"{'an integer' if self.kind is int else 'a number'} in {self.interval()}"

    def is_unset(self, value: Any) -> bool:
        return self.unset is not None and type(value) is self.kind and value == self.unset

    def check(self, value: Any) -> None:
        """Raise InvalidRequest (with this option's name as `field`) unless `value` is allowed."""
        if value is None and self.default is None or self.is_unset(value):
            return
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or (self.kind is int and not isinstance(value, int)) or not math.isfinite(value):
            raise InvalidRequest(f"{self.name} must be {self.expected()}, got {value!r}",
                                 field=self.name, code="invalid_type")
        below = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        above = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if below or above:
            wanted = self.expected() if self.kind is int and self.high is None else f"in {self.interval()}"
            raise InvalidRequest(f"{self.name} must be {wanted}, got {value!r}",
                                 field=self.name, code="invalid_value")


# Counts that reach MLX as 32-bit integers (top_k, the penalty window); the model may bound them
# further (top_k by its vocabulary: generate.check_model_ranges).
MAX_INT32 = 2**31 - 1

SAMPLING_OPTIONS: tuple[SamplingOption, ...] = (
    SamplingOption("temperature", float, 0.0, 0, 5, "Temperature", "0 means greedy."),
    SamplingOption("top_p", float, 1.0, 0, 1, "Top p",
                   "Keep the most likely tokens up to this total probability.", low_open=True),
    SamplingOption("top_k", int, 0, 0, MAX_INT32, "Top k",
                   "Keep only the k most likely tokens (0: all)."),
    SamplingOption("min_p", float, 0.0, 0, 1, "Min p",
                   "Drop tokens less likely than this fraction of the most likely one.",
                   high_open=True),
    SamplingOption("repetition_penalty", float, 1.0, 0, 10, "Repetition penalty",
                   "Above 1 discourages repeating earlier tokens.", low_open=True),
    SamplingOption("repetition_context_size", int, 20, 1, MAX_INT32, "Penalty window",
                   "How many of the latest tokens the penalties look at."),
    SamplingOption("frequency_penalty", float, 0.0, -2, 2, "Frequency penalty",
                   "Lowers a token's score by this much for each time it already appeared."),
    SamplingOption("presence_penalty", float, 0.0, -2, 2, "Presence penalty",
                   "Lowers a token's score by this much if it already appeared."),
    SamplingOption("max_tokens", int, 512, 1, None, "Max tokens",
                   "The most tokens to generate."),
    SamplingOption("seed", int, None, 0, 2**63 - 1, "Seed",
                   "Seed for reproducible sampling (-1: random).", unset=-1),
    SamplingOption("thinking_budget", int, None, 0, None, "Thinking budget",
                   "The most tokens a thinking model may think before it answers (empty: no "
                   "limit; 0: answer at once).", unset=-1),
)
OPTIONS_BY_NAME = {o.name: o for o in SAMPLING_OPTIONS}


class _SamplingMethods:
    """Validation and helpers of `SamplingParams` (its fields come from `SAMPLING_OPTIONS`)."""

    stop: tuple[str, ...]
    json_schema: dict | None
    temperature: float
    logprobs: int | None
    logit_bias: dict | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        for option in SAMPLING_OPTIONS:
            if option.is_unset(getattr(self, option.name)):
                object.__setattr__(self, option.name, None)
        self.validate()

    def validate(self) -> None:
        for option in SAMPLING_OPTIONS:
            option.check(getattr(self, option.name))
        check_stops(self.stop)
        check_logprobs(self.logprobs)
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        if self.json_schema is not None:
            from .constrained import check_schema

            check_schema(self.json_schema)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)  # type: ignore[type-var]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)  # type: ignore[call-overload]
        d["stop"] = list(self.stop)
        return d


MAX_TOP_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100


def check_logprobs(value: Any) -> None:
    """None: no log-probabilities; n: each token's and its n most likely alternatives'."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got "
                             f"{value!r}", field="top_logprobs", code="invalid_value")


def check_logit_bias(bias: Any) -> dict[int, float]:
    """Token id -> a value in [-100, 100] added to its logit (-100 bans it, 100 forces it)."""
    if not isinstance(bias, dict):
        raise InvalidRequest("logit_bias must map token ids to numbers", field="logit_bias",
                             code="invalid_type")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if token < 0 or not number or not math.isfinite(value) or abs(value) > LOGIT_BIAS_LIMIT:
            raise InvalidRequest(f"logit_bias must map token ids to numbers in [-100, 100], got "
                                 f"{key!r}: {value!r}", field="logit_bias", code="invalid_value")
        out[token] = float(value)
    return out


# How to pick tokens: one field per sampling option, then the stop strings, JSON mode's schema
# ({"type": "object"}: any object), how many top log-probabilities to report per token (None:
# none) and a logit bias per token id. temperature 0 means greedy (argmax).
SamplingParams = make_dataclass(
    "SamplingParams",
    [(o.name, o.kind if o.default is not None else (o.kind | None), field(default=o.default))
     for o in SAMPLING_OPTIONS]
    + [("stop", tuple[str, ...], field(default=())), ("json_schema", dict | None, field(default=None)),
       ("logprobs", int | None, field(default=None)), ("logit_bias", dict | None, field(default=None))],
    bases=(_SamplingMethods,), frozen=True)
SamplingParams.__module__ = __name__


def apply_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """mlx-lm's `apply_top_p` (keep the most likely tokens up to `top_p` of the mass; the others
    get -inf), the same array, with each row's threshold found on the host on the CPU device
    (engine/decoding/nucleus.py `top_p_threshold`: the vocabulary sorted by NumPy, ~0.12 ms a row
    where MLX's CPU sort took ~4.3 ms, and only the probabilities that can change the sum
    exponentiated). The price is a host sync (`logprobs` is evaluated here) in a step that would
    otherwise be queued whole: on a GPU, for other dtypes or for rows that are not
    `nucleus.plain`, mlx-lm's own runs."""
    if mx.default_device() != mx.cpu or logprobs.dtype != mx.float32:
        return mlx_lm_top_p(logprobs, top_p)
    rows = np.asarray(logprobs).reshape(-1, logprobs.shape[-1])
    thresholds = [nucleus.top_p_threshold(np.sort(row), top_p) if nucleus.plain(row) else None
                  for row in rows]
    if any(t is None for t in thresholds):
        return mlx_lm_top_p(logprobs, top_p)
    threshold = mx.array(np.array(thresholds, dtype=np.float32)).reshape(*logprobs.shape[:-1], 1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


def only_top_p(params: SamplingParams, vocab: int) -> bool:
    """Whether top-p is the only filter `filter_logprobs` applies for `params`."""
    return 0 < params.top_p < 1.0 and params.min_p == 0.0 and not 0 < params.top_k < vocab


def filter_logprobs(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """Apply top-p, min-p and top-k in mlx-lm's order (`make_sampler`): excluded tokens get -inf."""
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p, 1)
    if 0 < params.top_k < logprobs.shape[-1]:  # k of the whole vocabulary keeps every token
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs


class TokenSampler:
    """Turns one row of logits into a token for one request, with its own random key."""

    def __init__(self, params: SamplingParams):
        self.params = params
        window = params.repetition_context_size
        self.processors: list[LogitsProcessor] = make_logits_processors(
            logit_bias=params.logit_bias or None,
            repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
            repetition_context_size=window,
            presence_penalty=params.presence_penalty, presence_context_size=window,
            frequency_penalty=params.frequency_penalty, frequency_context_size=window)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.key = mx.random.key(seed)

    def __call__(self, logits: mx.array, history: mx.array | None) -> tuple[mx.array, mx.array]:
        """`logits` has shape (1, vocab); `history` holds the tokens so far (prompt + output).
        Returns the token and the model's own log-softmax (before any processor or transform)."""
        model_logprobs = log_softmax(logits)
        return self.pick(logits, model_logprobs, history), model_logprobs

    def plain_greedy(self, history: mx.array | None) -> bool:
        """Greedy and no processor changes the logits: the token is the argmax of the model's
        log-softmax, which a batch takes for all such rows in one op (`sample_rows`)."""
        return self.params.greedy and not (self.processors and history is not None)

    def pick(self, logits: mx.array, model_logprobs: mx.array, history: mx.array | None) -> mx.array:
        """The token (shape (1,)) for one row of `logits` and its log-softmax `model_logprobs`."""
        processed = bool(self.processors) and history is not None
        if processed:
            for processor in self.processors:
                logits = processor(history, logits)
            logprobs = log_softmax(logits)
        else:
            logprobs = model_logprobs
        p = self.params
        if p.greedy:
            return mx.argmax(logprobs, axis=-1)
        self.key, sub = mx.random.split(self.key)
        if only_top_p(p, logprobs.shape[-1]) and nucleus.usable(logprobs):
            token = nucleus.draw(logprobs, p.top_p, p.temperature, sub)
            if token is not None:
                return token
        filtered = filter_logprobs(logprobs, p)
        return mx.random.categorical(filtered * (1.0 / p.temperature), key=sub)


_thread_streams = threading.local()


def side_stream() -> mx.Stream | None:
    """A second CPU stream of this thread (made on first use: MLX's streams belong to the thread
    that made them), or None off the CPU. MLX runs each CPU stream's operations on a thread of its
    own, so work split over this stream and the default one runs on two cores."""
    if mx.default_device() != mx.cpu:
        return None
    stream = getattr(_thread_streams, "cpu", None)
    if stream is None:
        stream = _thread_streams.cpu = mx.new_stream(mx.cpu)
    return stream


def log_softmax(logits: mx.array) -> mx.array:
    """`logits - logsumexp(logits, axis=-1, keepdims=True)`, the same values bit for bit either
    way: on the CPU with fp32 logits and the kernels loaded, the kernels' `log_softmax`
    (engine/kernels/csrc/softmax.cpp: MLX's exp on SIMD lanes and its sums in MLX's order, ~0.07 ms
    for a 49,152-token row and ~0.21 ms for 4 rows where MLX's scalar exp takes ~0.6 and ~2.4 ms);
    MLX's ops otherwise."""
    kernels = _softmax_kernels(logits)
    if kernels is not None:
        return kernels.log_softmax(logits)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _softmax_kernels(logits: mx.array) -> Any:
    """The kernels' module where `log_softmax` can take `logits` (fp32, on the CPU), else None."""
    if logits.dtype == mx.float32 and logits.size and mx.default_device() == mx.cpu:
        return native.kernels()
    return None


def log_softmax_rows(logits: mx.array) -> mx.array:
    """`log_softmax` of (rows, vocab) `logits`. The kernels overlap a batch's rows on one core
    (4 rows ~0.21 ms: a second stream only added its cost, bench/sampling_cost.py). Without them,
    on the CPU with two rows or more, the first half of the rows is computed on `side_stream()`,
    the rest on the default stream: MLX's CPU `exp` is scalar code and runs on one thread per
    stream, so a 4-row batch's log-softmax takes about half the time on two free cores. Each
    row's values are the same either way (a row's reduction never reads another)."""
    side = side_stream() if len(logits) > 1 else None
    if side is None or _softmax_kernels(logits) is not None:
        return log_softmax(logits)
    half = len(logits) // 2
    with mx.stream(side):
        first = log_softmax(logits[:half])
    return mx.concatenate([first, log_softmax(logits[half:])])


def sample_rows(samplers: Sequence[TokenSampler], histories: Sequence[mx.array | None],
                logits: mx.array) -> tuple[mx.array, mx.array, dict[int, Exception]]:
    """Row i of `logits` (rows, vocab) sampled by `samplers[i]` with `histories[i]`, each token
    the one that sampler would pick alone. Returns the tokens (rows,), the model's log-softmax
    (rows, vocab) and the rows whose sampling raised (e.g. a grammar's processor), by index: their
    token is a placeholder, the other rows are unaffected.

    The log-softmax is computed for all rows at once (`log_softmax_rows`), and the
    argmax of every plain greedy row is one op; only
    rows with logits processors or a temperature run ops of their own (each draws from its own
    key: MLX's categorical sampling takes one key per call, so seeded rows cannot share one)."""
    model_logprobs = log_softmax_rows(logits)
    picks: dict[int, mx.array] = {}
    failures: dict[int, Exception] = {}
    for i, sampler in enumerate(samplers):
        try:
            if sampler.plain_greedy(histories[i]):
                continue  # the shared argmax below, without slicing the row's logits
            picks[i] = sampler.pick(logits[i:i + 1], model_logprobs[i:i + 1], histories[i])
        except Exception as exc:  # isolated to this row
            failures[i] = exc
    if not picks:
        return mx.argmax(model_logprobs, axis=-1), model_logprobs, failures
    picked = mx.concatenate(list(picks.values()))
    if len(picks) == len(samplers):
        return picked, model_logprobs, failures
    # each row reads the batch's argmax or its own pick: one gather over both
    where = {row: len(samplers) + j for j, row in enumerate(picks)}
    source = mx.array([where.get(i, i) for i in range(len(samplers))], dtype=mx.uint32)
    greedy = mx.argmax(model_logprobs, axis=-1)
    return mx.concatenate([greedy, picked])[source], model_logprobs, failures
