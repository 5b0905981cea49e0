"""The chat WebSocket: the browser sends `{"action": "send" | "edit" | "regenerate" | "stop", ...}`
(htmx `ws-send`); the server answers with HTML fragments that htmx swaps in by id (out-of-band
swaps): the new messages, the growing answer, the final answer with its statistics, the Stop/Send
button.
"""

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from engine import EngineError, Event, RequestHandle

from .chat import sampling_params, speculative_options, start_turn
from .markdown import render_markdown
from .overflow import answer_messages, prepare_send
from .storage import Storage
from .turns import start
from .views import message_views, parts, render

FLUSH_EVERY_S = 0.05  # coalesce tokens into one swap at most this often
SAVE_EVERY_S = 1.0  # how much streamed text a crash can lose at most


@dataclass
class _Generation:
    """The answer a socket is generating: the task streaming it and, once submitted, its handle."""

    task: asyncio.Task | None = None
    handle: RequestHandle | None = None
    stop_requested: bool = False

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def stop(self) -> None:
        self.stop_requested = True
        if self.handle is not None:
            self.handle.cancel()


async def chat_socket(ws: WebSocket) -> None:
    storage, _ = parts(ws)
    conv = storage.get_conversation(int(ws.path_params["cid"]))
    if conv is None:
        await ws.close(code=4404)
        return
    await ws.accept()
    current: _Generation | None = None
    try:
        while True:
            data = await ws.receive_json()
            action = data.get("action") if isinstance(data, dict) else None
            if action == "stop":
                if current:
                    current.stop()
            elif current and current.running:
                await _notice(ws, "Still answering: stop it first or wait for the end.")
            else:
                current = _Generation()
                current.task = asyncio.create_task(_respond(ws, conv.id, action, data, current))
    except (WebSocketDisconnect, ValueError):  # closed, or not JSON
        pass
    finally:
        if current and current.running:
            current.stop()
            await asyncio.wait([current.task])  # let it save the partial answer


async def _notice(ws: WebSocket, text: str) -> None:
    await ws.send_text(render("_notice.html", text=text))


async def _respond(ws: WebSocket, cid: int, action: str, data: dict[str, Any],
                   gen: _Generation) -> None:
    """One turn: record the user's side, create the answer, stream it, finalise it."""
    storage, engine = parts(ws)
    conv = storage.get_conversation(cid)
    title = conv.title
    try:
        params = sampling_params(conv.settings)
        conv, overflow_notice = prepare_send(engine, storage, conv, action, data, params.max_tokens)
        if overflow_notice:  # too long for the context: nothing is recorded, the user chooses
            await ws.send_text(overflow_notice)
            return
        turn = start_turn(storage, conv, action, data)
        speculative = speculative_options(conv.settings)
    except (ValueError, EngineError) as exc:
        await _notice(ws, str(exc))
        return
    answer = storage.add_message(cid, turn.parent_id, "assistant", "", state="streaming",
                                 model=engine.model_name, sampling=params.to_dict())
    storage.update_conversation(cid, model=engine.model_name)  # the model it last talked to
    path = storage.active_path(cid)
    views = message_views(storage, path)
    if turn.rerender:
        opening = render("_messages.html", conv=conv, views=views, oob=True)
    else:
        opening = render("_append.html", conv=conv, views=views[-2:], first=len(views) == 2)
    conv = storage.get_conversation(cid)
    if conv.title != title:  # the first message named the conversation
        opening += render("_title.html", title=conv.title, oob=True)
        opening += render("_conversation_list.html", conversations=storage.list_conversations(),
                           current_id=cid, q="", oob=True)
    opening += render("_composer_actions.html", generating=True, oob=True)

    text, final, error = "", None, None
    try:
        await ws.send_text(opening)
        gen.handle = await start(engine, answer_messages(engine, conv.settings, path[:-1],
                                                         params.max_tokens), params, speculative)
        if gen.stop_requested:  # Stop pressed before the request existed
            gen.handle.cancel()
        with ws.app.state.runs.track(gen.handle):
            last_flush = last_save = time.monotonic()
            async for event in gen.handle.stream():
                if event.kind == "done":
                    final = event
                    break
                text += event.text
                now = time.monotonic()
                if now - last_save >= SAVE_EVERY_S:
                    storage.save_partial(answer.id, text)
                    last_save = now
                if now - last_flush >= FLUSH_EVERY_S:
                    await ws.send_text(render("_answer_body.html", mid=answer.id,
                                               html=render_markdown(text)))
                    last_flush = now
    except EngineError as exc:
        error = str(exc)
    except (WebSocketDisconnect, RuntimeError):
        pass  # the page went away: what we have is saved below
    finally:
        _finish(storage, answer.id, text, final, error)
    views = message_views(storage, storage.active_path(cid))
    try:
        await ws.send_text(render("_message.html", conv=conv, v=views[-1], oob=True)
                           + render("_composer_actions.html", generating=False, oob=True))
    except (WebSocketDisconnect, RuntimeError):
        pass


def _finish(storage: Storage, mid: int, text: str, final: Event | None, error: str | None) -> None:
    if final is None:
        storage.finish_message(mid, text, "failed" if error else "stopped",
                                      finish_reason="failed" if error else "cancelled", error=error)
        return
    reason = final.finish_reason
    state = {"cancelled": "stopped", "failed": "failed"}.get(reason, "done")
    t = final.timings
    storage.finish_message(
        mid, text, state, finish_reason=reason, error=final.error,
        ttft_ms=t.ttft_s * 1000 if t.ttft_s is not None else None, tokens_per_s=t.tokens_per_s,
        prompt_tokens=final.usage.prompt_tokens, completion_tokens=final.usage.completion_tokens,
        cached_tokens=final.usage.cached_tokens, speculative=final.stats.get("speculative"),
    )


routes = [WebSocketRoute("/c/{cid:int}/ws", chat_socket)]
