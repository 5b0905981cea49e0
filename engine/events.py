"""What a generation request streams back (token events and one final `done` event), and the
names of its states and finish reasons."""

from dataclasses import dataclass, field
from typing import Any, Literal

EventKind = Literal["token", "done"]
# "stop": an end-of-sequence token or a stop string; "length": max_tokens or the context is full;
# "tool_calls": the answer ended with calls to the request's tools (`Event.tool_calls`).
FinishReason = Literal["stop", "length", "tool_calls", "cancelled", "failed"]
# Where a token's text belongs when a request asks for it apart (engine/decoding/channels.py):
# the answer, the model's reasoning (between think markers), or a tool call being written.
Channel = Literal["content", "reasoning", "tool"]
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
class TopLogprob:
    token: str
    logprob: float
    bytes: tuple[int, ...]


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (log-softmax of its logits, before any
    sampling transform: penalties, bias, grammar, temperature, top-p/k) and the most likely
    alternatives, most likely first."""

    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class ToolCall:
    """A call the answer makes: `arguments` is JSON text (as OpenAI sends it)."""

    id: str
    name: str
    arguments: str


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
    channel: Channel = "content"
    logprobs: TokenLogprob | None = None  # a token's, when the request asks for them
    tool_calls: tuple[ToolCall, ...] = ()  # on `done` with finish_reason "tool_calls"
