"""Running a request's `n` choices and writing them in OpenAI's shapes: message or delta content,
`reasoning_content`, `tool_calls`, `logprobs`, and one usage for all choices.

Choice i runs as its own engine request seeded with `seed + i` (a random base when the request
has no seed), so choices differ under sampling and repeat with the same seed; the requests decode
as rows of one batch and later ones reuse the first one's prompt from the prefix cache.
"""

import asyncio
import contextlib
import hashlib
import importlib.metadata
import random
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Sequence

from engine import (EngineError, Event, RequestHandle, SamplingParams, TokenLogprob, ToolCall,
                    Usage)

from ..runs import Runs
from ..submission import start

MAX_CHOICES = 8


def system_fingerprint(model: str) -> str:
    """Names what produced an answer: the model and this engine's version."""
    try:
        version = importlib.metadata.version("mlxchat")
    except importlib.metadata.PackageNotFoundError:
        version = "dev"
    return "fp_" + hashlib.sha256(f"{model}|mlxchat {version}".encode()).hexdigest()[:12]


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    if n == 1:
        return [params]
    base = params.seed if params.seed is not None else random.getrandbits(62)
    return [params.with_(seed=(base + i) % 2**63) for i in range(n)]  # seeds stay in range


async def start_choices(engine: Any, messages: Sequence[dict[str, Any]] | None,
                        params: SamplingParams, n: int, speculative: Any,
                        **options: Any) -> list[RequestHandle]:
    """All `n` requests accepted, or none (those already started are cancelled)."""
    handles: list[RequestHandle] = []
    try:
        for p in choice_params(params, n):
            handles.append(await start(engine, messages, p, speculative, **options))
    except EngineError:
        for h in handles:
            h.cancel()
        raise
    return handles


@contextlib.contextmanager
def tracked(runs: Runs, handles: Sequence[RequestHandle]) -> Iterator[None]:
    """`Runs.track` for every choice."""
    with contextlib.ExitStack() as stack:
        for h in handles:
            stack.enter_context(runs.track(h))
        yield


async def merged(handles: Sequence[RequestHandle]) -> AsyncIterator[tuple[int, Event]]:
    """Every choice's events as they come, tagged with the choice's index."""
    if len(handles) == 1:
        async for event in handles[0].stream():
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        try:
            async for event in handle.stream():
                await queue.put((i, event))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        open_ = len(tasks)
        while open_:
            i, event = await queue.get()
            if event is None:
                open_ -= 1
            else:
                yield i, event
    finally:
        for t in tasks:
            t.cancel()


@dataclass
class Choice:
    """One choice collected whole."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    final: Event | None = None

    def add(self, event: Event) -> None:
        if event.kind == "done":
            self.final = event
            return
        (self.reasoning if event.channel == "reasoning" else self.content).append(event.text)
        if event.logprobs is not None:
            self.logprobs.append(event.logprobs)


async def collect_choices(handles: Sequence[RequestHandle]) -> list[Choice]:
    choices = [Choice() for _ in handles]
    async for i, event in merged(handles):
        choices[i].add(event)
    return choices


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
