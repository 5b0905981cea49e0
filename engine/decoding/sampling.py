"""Sampling parameters, presets, and per-request seeded samplers built on `mlx_lm.sample_utils`.

A request's randomness comes from its own key, never from MLX's global generator, so a seeded
request yields the same tokens whatever else runs. The key sequence is the one `mx.random.seed(seed)`
would produce (`key, sub = split(key)` per draw), so our tokens equal `mlx_lm.generate`'s after
`mx.random.seed(seed)`.
"""

import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from ..errors import InvalidRequest
from .stops import check_stops

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 512
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    # JSON mode: the output must be JSON matching this JSON Schema ({"type": "object"}: any object).
    json_schema: dict | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise InvalidRequest(message)

        check(isinstance(self.max_tokens, int) and self.max_tokens > 0,
              f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        check(0 <= self.temperature <= 5, f"temperature must be in [0, 5], got {self.temperature!r}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(isinstance(self.top_k, int) and self.top_k >= 0,
              f"top_k must be a non-negative integer, got {self.top_k!r}")
        check(0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p!r}")
        check(0 < self.repetition_penalty <= 10,
              f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        check_stops(self.stop)
        check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
              f"seed must be a non-negative integer, got {self.seed!r}")
        if self.json_schema is not None:
            from .constrained import check_schema

            check_schema(self.json_schema)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d


# Recommended non-thinking settings per model family (from the model cards).
_RECOMMENDED = {
    "qwen3": dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0),
    "qwen3_5": dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0),
    "qwen3_next": dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0),
    "qwen2": dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    "llama": dict(temperature=0.2, top_p=0.9),  # SmolLM2's model card suggests low temperature
}
PRESETS = ("greedy", "recommended")


def preset(name: str, family: str | None = None, **overrides: Any) -> SamplingParams:
    """`greedy` or `recommended` (per model family, e.g. the `model_type` of its config)."""
    if name == "greedy":
        base: dict[str, Any] = {}
    elif name == "recommended":
        base = dict(_RECOMMENDED.get(family or "", dict(temperature=0.7, top_p=0.9)))
    else:
        raise InvalidRequest(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    base.update(overrides)
    return SamplingParams(**base)


def filter_logprobs(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """Apply top-p, min-p and top-k in mlx-lm's order (`make_sampler`): excluded tokens get -inf."""
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p, 1)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs


class TokenSampler:
    """Turns one row of logits into a token for one request, with its own random key."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.processors: list[LogitsProcessor] = (
            make_logits_processors(repetition_penalty=params.repetition_penalty)
            if params.repetition_penalty != 1.0 else []
        )
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.key = mx.random.key(seed)

    def __call__(self, logits: mx.array, history: mx.array | None) -> tuple[mx.array, mx.array]:
        """`logits` has shape (1, vocab); `history` holds the tokens so far (prompt + output)."""
        if self.processors and history is not None:
            for processor in self.processors:
                logits = processor(history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        p = self.params
        if p.greedy:
            return mx.argmax(logprobs, axis=-1), logprobs
        self.key, sub = mx.random.split(self.key)
        filtered = filter_logprobs(logprobs, p)
        return mx.random.categorical(filtered * (1.0 / p.temperature), key=sub), logprobs

    def mlx_lm_sampler(self) -> Callable[[mx.array], mx.array]:
        """The equivalent `mlx_lm.sample_utils.make_sampler` sampler (for reference comparisons)."""
        from mlx_lm.sample_utils import make_sampler

        p = self.params
        return make_sampler(temp=p.temperature, top_p=p.top_p if p.top_p < 1 else 0.0,
                            min_p=p.min_p, top_k=p.top_k)
