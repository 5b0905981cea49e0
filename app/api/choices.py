"""OpenAI's shapes of an answer's choices: message or delta content, `reasoning_content`,
`tool_calls`, `logprobs`, one usage for all choices, and the fingerprint of what answered. The
choices themselves run and are collected in the serving core (app/api/serving.py)."""

import hashlib
import importlib.metadata
from typing import Any, Sequence

from engine import Event, TokenLogprob, ToolCall, Usage

from .serving import Choice

MAX_CHOICES = 8


def system_fingerprint(model: str) -> str:
    """Names what produced an answer: the model and this engine's version."""
    try:
        version = importlib.metadata.version("mlxchat")
    except importlib.metadata.PackageNotFoundError:
        version = "dev"
    return "fp_" + hashlib.sha256(f"{model}|mlxchat {version}".encode()).hexdigest()[:12]


def logprob_entry(lp: TokenLogprob) -> dict[str, Any]:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.bytes),
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)}
                             for t in lp.top]}


def logprobs_body(entries: Sequence[TokenLogprob], wanted: bool) -> dict[str, Any] | None:
    return {"content": [logprob_entry(e) for e in entries], "refusal": None} if wanted else None


def tool_calls_body(calls: Sequence[ToolCall], streamed: bool = False) -> list[dict[str, Any]]:
    out = []
    for i, c in enumerate(calls):
        body = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        out.append({"index": i, **body} if streamed else body)
    return out


def tool_call_deltas(calls: Sequence[ToolCall]) -> list[list[dict[str, Any]]]:
    """Each call as OpenAI streams one: its id, type and name with empty arguments, then the
    arguments (clients concatenate argument deltas by index)."""
    deltas = []
    for i, c in enumerate(calls):
        deltas.append([{"index": i, "id": c.id, "type": "function",
                        "function": {"name": c.name, "arguments": ""}}])
        deltas.append([{"index": i, "function": {"arguments": c.arguments}}])
    return deltas


def message_body(choice: Choice) -> dict[str, Any]:
    final = choice.final
    message: dict[str, Any] = {"role": "assistant", "content": "".join(choice.content)}
    if choice.reasoning:
        message["reasoning_content"] = "".join(choice.reasoning)
    if final is not None and final.tool_calls:
        message["tool_calls"] = tool_calls_body(final.tool_calls)
        message["content"] = message["content"] or None
    return message


def total_usage(finals: Sequence[Event]) -> Usage:
    """The prompt counted once (the choices share it), completions summed."""
    return Usage(prompt_tokens=finals[0].usage.prompt_tokens,
                 completion_tokens=sum(f.usage.completion_tokens for f in finals),
                 cached_tokens=finals[0].usage.cached_tokens)
