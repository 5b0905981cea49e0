"""What a generation request streams back (token events and one final `done` event), and the
names of its states and finish reasons."""

from dataclasses import dataclass, field
from typing import Any, Literal

EventKind = Literal["token", "done"]
# "stop": an end-of-sequence token or a stop string; "length": max_tokens or the context is full.
FinishReason = Literal["stop", "length", "cancelled", "failed"]
# A request's lifecycle: `loading_draft` only while a speculative request's draft loads (on the
# engine's thread, after `submit` has returned), then queued -> prefill -> decoding -> a final state.
RequestState = Literal["loading_draft", "queued", "prefill", "decoding", "finished", "cancelled",
                       "failed"]
FINAL_STATES: tuple[RequestState, ...] = ("finished", "cancelled", "failed")


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
    """`kind` "token" (text may be "" while a multi-byte character is incomplete) or "done"."""

    kind: EventKind
    text: str = ""
    token: int | None = None
    finish_reason: FinishReason | None = None
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)  # extra per-request figures (speculative)
