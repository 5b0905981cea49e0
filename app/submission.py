"""Submitting one answer's engine request, shared by the API and the chat socket: submit it and
wait until the engine accepts it (a speculative request's draft loads on the engine's side
meanwhile); and the rule for what leaves the event loop.

By cost, not by size alone: work runs off the event loop when it may take more than a moment,
whatever the message size says. Submitting tokenises the prompt (long text, many messages, a
fill-in-the-middle prompt with its files), decodes images the model will see, and compiles tool
and JSON schemas to grammars; parsing a request body reads JSON, image headers and tool schemas.
`costly_submit` and `costly_body` say which; `by_cost` runs a function inline or in a thread
accordingly. Cheap requests stay inline, so a burst of small ones does not queue on the threads.
"""

import asyncio
from typing import Any, Callable, Sequence, TypeVar

from engine import Engine, Infill, RequestHandle, SamplingParams, SpeculativeOptions

# Prompts are tokenised (engine.submit) off the event loop from this many characters or messages on.
INLINE_PROMPT_CHARS = 20_000
INLINE_PROMPT_MESSAGES = 64
# Bodies from this size on are parsed and checked off the event loop (app/api/serving.py).
INLINE_BODY_BYTES = 64 * 1024
# Keys whose value asks for work whatever the body's size: tool schemas to compile, a JSON
# schema, images to read (OpenAI `image_url`, Ollama `images`, Anthropic's `source`).
COSTLY_KEYS = frozenset({"tools", "functions", "response_format", "format", "schema", "image_url",
                         "images", "source"})

T = TypeVar("T")


async def by_cost(costly: bool, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)`, in a thread when `costly`, else here (it is quick)."""
    return await asyncio.to_thread(work, *args) if costly else work(*args)


def costly_body(body: Any, size: int) -> bool:
    """Whether parsing a request body of `size` bytes may take more than a moment: a large body,
    or one with tools, a schema or images in it (walking a small body is cheap)."""
    if size >= INLINE_BODY_BYTES:
        return True
    pending = [body]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            if any(value.get(key) for key in COSTLY_KEYS):
                return True
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return False


def _has_image(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image"
                                             for p in content)


def _text(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return 0


def costly_submit(messages: Sequence[dict[str, Any]] | None, params: SamplingParams,
                  options: dict[str, Any]) -> bool:
    """Whether submitting takes more than a moment: a long prompt (messages, raw `text`, or a
    fill-in-the-middle prompt with its files), images (decoded on first use, then the model's
    processor), tools or a JSON schema to compile."""
    infill: Infill | None = options.get("infill")
    size = sum(_text(m.get("content")) for m in messages or ()) + len(options.get("text") or "")
    if infill is not None:
        size += len(infill.prefix) + len(infill.suffix) + \
            sum(len(name) + len(text) for name, text in infill.files)
    return (size >= INLINE_PROMPT_CHARS or len(messages or ()) >= INLINE_PROMPT_MESSAGES
            or bool(options.get("tools")) or params.json_schema is not None
            or any(_has_image(m.get("content")) for m in messages or ()))


async def start(engine: Engine, messages: Sequence[dict[str, Any]] | None, params: SamplingParams,
                speculative: SpeculativeOptions | None, **options: Any) -> RequestHandle:
    """The submitted request, once accepted; raises the EngineError that refused it. `options`
    go to `Engine.submit` as they are (`tools`, `split_reasoning`, `text` or `infill` instead of
    messages). Submitting runs off the event loop when it is costly (`costly_submit`)."""
    handle = await by_cost(costly_submit(messages, params, options),
                           lambda: engine.submit(messages=messages, params=params,
                                                 speculative=speculative, **options))
    await handle.accepted()
    return handle
