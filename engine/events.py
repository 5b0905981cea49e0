"""What a generation request streams back: token events and one final `done` event."""

from dataclasses import dataclass, field

@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache


@dataclass(frozen=True)
class Timings:
    queued_s: float = 0.0  # waiting for admission to run
    ttft_s: float | None = None  # submission to first token
    tokens_per_s: float | None = None  # decode speed after the first token
    prefill_tokens_per_s: float | None = None


@dataclass(frozen=True)
class Event:
    """`kind` is "token" (text may be "" while a multi-byte character is incomplete) or "done"."""

    kind: str
    text: str = ""
    token: int | None = None
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    error: str | None = None
    stats: dict = field(default_factory=dict)  # extra per-request figures (e.g. speculative)
