"""Running one answer, shared by the API and the chat socket: submit it, wait until the engine
accepts it (a speculative request's draft loads on the engine's side meanwhile), collect it."""

from typing import Sequence

from engine import Engine, Event, RequestHandle, SamplingParams, SpeculativeOptions


async def start(engine: Engine, messages: Sequence[dict[str, str]], params: SamplingParams,
                speculative: SpeculativeOptions | None,
                keep_alive: float | str | None = None) -> RequestHandle:
    """The submitted request, once accepted; raises the EngineError that refused it."""
    handle = engine.submit(messages=messages, params=params, speculative=speculative,
                           keep_alive=keep_alive)
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
