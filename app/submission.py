"""Submitting one answer's engine request, shared by the API and the chat socket: submit it (a long
prompt tokenised off the event loop) and wait until the engine accepts it (a speculative
request's draft loads on the engine's side meanwhile)."""

import asyncio
from typing import Any, Sequence

from engine import Engine, RequestHandle, SamplingParams, SpeculativeOptions

# Prompts are tokenised (engine.submit) off the event loop from this many characters or messages on.
INLINE_PROMPT_CHARS = 20_000
INLINE_PROMPT_MESSAGES = 64


async def start(engine: Engine, messages: Sequence[dict[str, Any]] | None, params: SamplingParams,
                speculative: SpeculativeOptions | None, **options: Any) -> RequestHandle:
    """The submitted request, once accepted; raises the EngineError that refused it. `options`
    go to `Engine.submit` as they are (`tools`, `split_reasoning`, `text` instead of messages).
    Long prompts are tokenised off the event loop."""
    size = sum(len(m.get("content") or "") for m in messages or ()) + len(options.get("text") or "")
    if size < INLINE_PROMPT_CHARS and len(messages or ()) < INLINE_PROMPT_MESSAGES:
        handle = engine.submit(messages=messages, params=params, speculative=speculative, **options)
    else:
        handle = await asyncio.to_thread(engine.submit, messages=messages, params=params,
                                         speculative=speculative, **options)
    await handle.accepted()
    return handle
