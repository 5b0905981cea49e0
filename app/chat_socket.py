"""The chat WebSocket: the browser sends `{"action": "send" | "edit" | "regenerate" | "stop", ...}`
(htmx `ws-send`); the server answers with HTML fragments that htmx swaps in by id (out-of-band
swaps): the new messages, the growing answer, the final answer with its statistics, the Stop/Send
button.
"""

import asyncio
import json
import logging
import sqlite3
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
from .turns import Conversations, start
from .views import message_views, parts, render

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 0.05  # coalesce tokens into one swap at most this often
SAVE_EVERY_S = 1.0  # how much streamed text a crash can lose at most
RECONNECT_GRACE_S = 5.0  # an answer nobody watches goes on this long for a reload to come back


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
    pages: Conversations = ws.app.state.conversations
    pages.join(conv.id, id(ws), ws.send_text)
    try:
        await ws.send_text(_current_state(ws.app, conv.id))
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            data, problem = _decode(message)
            if problem:
                await _notice(ws, problem)
                continue
            action = data.get("action")
            running = pages.running(conv.id)
            if action == "stop":
                if isinstance(running, _Generation):
                    running.stop()
            elif running is not None:
                await _notice(ws, "Still answering: stop it first or wait for the end.")
            else:
                gen = _Generation()
                pages.claim(conv.id, gen)
                gen.task = asyncio.create_task(_respond(ws.app, conv.id, action, data, gen))
    except WebSocketDisconnect:
        pass
    finally:
        running = pages.running(conv.id)
        if pages.leave(conv.id, id(ws)) == 0 and isinstance(running, _Generation) and running.running:
            # A reload or a dropped connection comes back within moments: answer on for it.
            await asyncio.wait([running.task], timeout=RECONNECT_GRACE_S)
            if running.running and not pages.watched(conv.id):
                running.stop()  # nobody watches any more: stop, and save the partial answer
                await asyncio.wait([running.task])


def _decode(message: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A frame from the page as a JSON object, or the reason it is not one."""
    text = message.get("text")
    if text is None:
        return {}, "Binary messages are not understood here."
    try:
        data = json.loads(text)
    except RecursionError:
        return {}, "That message is nested too deeply."
    except ValueError:
        return {}, "That message is not JSON."
    if not isinstance(data, dict):
        return {}, "That message is not a JSON object."
    return data, None


def _current_state(app: Any, cid: int) -> str:
    """The conversation as the database has it, and whether a turn is running in it: sent to
    each page when its socket (re)connects, so that a page left behind by a restart or a lost
    connection shows no answer as still being written."""
    storage = app.state.storage
    conv = storage.get_conversation(cid)
    views = message_views(storage, storage.active_path(cid))
    running = app.state.conversations.running(cid) is not None
    return (render("_messages.html", conv=conv, views=views, oob=True)
            + render("_composer_actions.html", generating=running, oob=True))


async def _notice(ws: WebSocket, text: str) -> None:
    await ws.send_text(render("_notice.html", text=text))


class _Refused(Exception):
    """A turn that could not start; its message is shown to the user."""


async def _respond(app: Any, cid: int, action: str, data: dict[str, Any],
                   gen: _Generation) -> None:
    """One turn in conversation `cid`; whatever happens, every page of the conversation ends up
    with the turn's outcome, or a notice saying why there is none."""
    pages: Conversations = app.state.conversations
    idle = render("_composer_actions.html", generating=False, oob=True)
    try:
        await _turn(app, cid, action, data, gen)
    except _Refused as exc:
        await pages.send(cid, render("_notice.html", text=str(exc)) + idle)
    except Exception as exc:  # noqa: BLE001 - shown to the user instead of vanishing
        log.exception("a chat turn failed")
        await pages.send(cid, render("_notice.html", text=f"The answer failed: {exc}") + idle)
    finally:
        pages.release(cid, gen)


async def _turn(app: Any, cid: int, action: str, data: dict[str, Any], gen: _Generation) -> None:
    """One turn: record the user's side, create the answer, stream it, finalise it."""
    storage, engine = app.state.storage, app.state.engine
    pages: Conversations = app.state.conversations
    conv = storage.get_conversation(cid)
    if conv is None:
        raise _Refused(_DELETED)
    title = conv.title
    try:
        params = sampling_params(conv.settings, engine.defaults)
        conv, overflow_notice = await asyncio.to_thread(prepare_send, engine, storage, conv, action,
                                                        data, params.max_tokens)
        if overflow_notice:  # too long for the context: nothing is recorded, the user chooses
            await pages.send(cid, overflow_notice
                             + render("_composer_actions.html", generating=False, oob=True))
            return
        turn = start_turn(storage, conv, action, data)
        speculative = speculative_options(conv.settings)
    except (ValueError, EngineError) as exc:
        raise _Refused(str(exc)) from None
    except sqlite3.IntegrityError:  # deleted meanwhile
        raise _Refused(_DELETED) from None
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
        await pages.send(cid, opening)
        messages = await asyncio.to_thread(answer_messages, engine, conv.settings, path[:-1],
                                           params.max_tokens)
        gen.handle = await start(engine, messages, params, speculative)
        if gen.stop_requested:  # Stop pressed before the request existed
            gen.handle.cancel()
        with app.state.runs.track(gen.handle):
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
                    await pages.send(cid, render("_answer_body.html", mid=answer.id,
                                                 html=render_markdown(text)))
                    last_flush = now
    except EngineError as exc:
        error = str(exc)
    finally:
        _finish(storage, answer.id, text, final, error)
    views = message_views(storage, storage.active_path(cid))
    if storage.get_conversation(cid) is None or not views:
        raise _Refused(_DELETED)
    await pages.send(cid, render("_message.html", conv=conv, v=views[-1], oob=True)
                     + render("_composer_actions.html", generating=False, oob=True)
                     + render("_notice.html", text=""))  # "still answering" is over


_DELETED = "This conversation has been deleted."


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
