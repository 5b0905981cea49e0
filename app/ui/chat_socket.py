"""The chat WebSocket: the browser sends `{"action": "send" | "edit" | "regenerate" | "stop", ...}`
(htmx `ws-send`); the server answers with HTML fragments that htmx swaps in by id (out-of-band
swaps): the new messages, the growing answer, the final answer with its statistics, the Stop/Send
button. A turn runs in app/ui/chat_turn.py; this module holds the connection: frames in, one turn
at a time per conversation, and an answer nobody watches any more stopped.
"""

import asyncio
import json
from typing import Any

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..state import AppState, app_state
from .chat_turn import RunningTurn, respond
from .tool_rounds import question_html
from .views import message_views, parts, render

RECONNECT_GRACE_S = 5.0  # an answer nobody watches goes on this long for a reload to come back


async def chat_socket(ws: WebSocket) -> None:
    state = app_state(ws)
    storage, _ = parts(ws)
    conv = storage.get_conversation(int(ws.path_params["cid"]))
    if conv is None:
        await ws.close(code=4404)
        return
    await ws.accept()
    pages = state.pages
    pages.join(conv.id, id(ws), ws.send_text)
    try:
        await ws.send_text(_current_state(state, conv.id))
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            data, problem = _decode(message)
            if problem:
                await _notice(ws, problem)
            else:
                await _act(ws, conv.id, data)
    except WebSocketDisconnect:
        pass
    finally:
        running = pages.running(conv.id)
        if pages.leave(conv.id, id(ws)) == 0 and isinstance(running, RunningTurn) and running.running:
            # A reload or a dropped connection comes back within moments: answer on for it.
            await asyncio.wait([running.task], timeout=RECONNECT_GRACE_S)
            if running.running and not pages.watched(conv.id):
                running.stop()  # nobody watches any more: stop, and save the partial answer
                await asyncio.wait([running.task])


async def _act(ws: WebSocket, cid: int, data: dict[str, Any]) -> None:
    """Stop the running turn, or start one (one at a time per conversation, whichever page)."""
    state = app_state(ws)
    pages = state.pages
    action = data.get("action")
    running = pages.running(cid)
    if action == "stop":
        if isinstance(running, RunningTurn):
            running.stop()
    elif action == "tool":  # the user's decision on a tool call (app/mcp/approval.py)
        tools = running.tools if isinstance(running, RunningTurn) else None
        problem = tools.approvals.answer(data.get("call_id"), data.get("decision")) if tools \
            else "No tool call is waiting for an answer."
        if problem:
            await _notice(ws, problem)
    elif running is not None:
        await _notice(ws, "Still answering: stop it first or wait for the end.")
    else:
        gen = RunningTurn()
        pages.claim(cid, gen)
        gen.task = asyncio.create_task(respond(state, cid, action, data, gen))


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


def _current_state(state: AppState, cid: int) -> str:
    """The conversation as the database has it, and whether a turn is running in it: sent to
    each page when its socket (re)connects, so that a page left behind by a restart or a lost
    connection shows no answer as still being written."""
    storage = state.storage
    conv = storage.get_conversation(cid)
    views = message_views(storage, storage.active_path(cid))
    running = state.pages.running(cid)
    tools = running.tools if isinstance(running, RunningTurn) else None
    return (render("_messages.html", conv=conv, views=views, oob=True)
            + render("_composer_actions.html", generating=running is not None, oob=True)
            + (question_html(tools.approvals.asking) if tools and tools.approvals.asking else ""))


async def _notice(ws: WebSocket, text: str) -> None:
    await ws.send_text(render("_notice.html", text=text))


routes = [WebSocketRoute("/c/{cid:int}/ws", chat_socket)]
