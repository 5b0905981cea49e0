"""Running one answer, shared by the API and the chat socket: submit it, wait until the engine
accepts it (a speculative request's draft loads on the engine's side meanwhile), collect it.
And `Conversations`: which sockets show each conversation and the one turn running in it."""

import asyncio
from typing import Any, Awaitable, Callable, Sequence

from engine import Engine, Event, RequestHandle, SamplingParams, SpeculativeOptions

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


async def collect(handle: RequestHandle) -> tuple[str, Event]:
    """The whole text and the final `done` event."""
    parts = []
    async for event in handle.stream():
        if event.kind == "done":
            return "".join(parts), event
        parts.append(event.text)
    raise RuntimeError("the engine stream ended without a done event")


Send = Callable[[str], Awaitable[None]]


class Conversations:
    """Per conversation: the pages (sockets) that show it, and the turn running in it.

    One turn at a time per conversation, whichever page asked for it: a second page's message
    would otherwise land under the first's still-empty answer. Every page of the conversation
    sees the running turn, and any of them can stop it."""

    def __init__(self) -> None:
        self._pages: dict[int, dict[int, Send]] = {}
        self._turns: dict[int, object] = {}

    def join(self, cid: int, key: int, send: Send) -> None:
        self._pages.setdefault(cid, {})[key] = send

    def leave(self, cid: int, key: int) -> int:
        """Forget a page; returns how many pages still show the conversation."""
        pages = self._pages.get(cid, {})
        pages.pop(key, None)
        if not pages:
            self._pages.pop(cid, None)
        return len(pages)

    def watched(self, cid: int) -> bool:
        """Whether any page shows the conversation."""
        return bool(self._pages.get(cid))

    async def send(self, cid: int, html: str) -> None:
        """`html` to every page of the conversation; a page that has gone is forgotten."""
        for key, send in list(self._pages.get(cid, {}).items()):
            try:
                await send(html)
            except Exception:  # noqa: BLE001 - a closed socket, whatever the server says
                self.leave(cid, key)

    def claim(self, cid: int, turn: object) -> bool:
        """Make `turn` the conversation's running turn, unless one is running already."""
        if cid in self._turns:
            return False
        self._turns[cid] = turn
        return True

    def running(self, cid: int) -> object | None:
        return self._turns.get(cid)

    def release(self, cid: int, turn: object) -> None:
        if self._turns.get(cid) is turn:
            del self._turns[cid]
