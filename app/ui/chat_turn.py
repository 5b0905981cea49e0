"""One chat turn, run as rounds: `record` the user's side and the empty answer (or refuse with
a notice), `stream` one round of the answer from the engine (saving it as it grows), `finalise`
the answer with its statistics. When the conversation has MCP tools switched on, tool rounds
(app/mcp/rounds.py: approve, call, answer again) run between stream and finalise.

Whatever happens, every page of the conversation ends up with the turn's outcome, or a notice
saying why there is none (`respond`)."""

import asyncio
import dataclasses
import logging
import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from engine import EngineError, Event, RequestHandle, SamplingParams, SpeculativeOptions, ToolRequest

from ..mcp import rounds as mcp_rounds
from ..model_jobs import model_loaded
from ..state import AppState
from ..storage import Conversation, Message, Storage
from ..submission import start
from .context_notice import prepare_send
from .markdown import render_markdown
from .prompt import document_prompt, prompt_with_documents
from .settings import sampling_params, speculative_options
from .tool_rounds import RoundsPages
from .user_turn import record_user_turn
from .views import message_views, render

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 0.05  # coalesce tokens into one swap at most this often
SAVE_EVERY_S = 1.0  # how much streamed text a crash can lose at most
DELETED = "This conversation has been deleted."
WAITING = "The model is still loading: your message goes out as soon as it is ready."


@dataclass
class RunningTurn:
    """The turn running in a conversation: the task streaming its answer and, once submitted, the
    engine request's handle."""

    task: asyncio.Task | None = None
    handle: RequestHandle | None = None
    stop_requested: bool = False
    tools: mcp_rounds.TurnTools | None = None  # the turn's MCP tools, when it has some

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def stop(self) -> None:
        self.stop_requested = True
        if self.handle is not None:
            self.handle.cancel()
        if self.tools is not None:
            self.tools.stop()


class Refused(Exception):
    """A turn that could not start; its message is shown to the user."""


@dataclass
class Recorded:
    """A turn once recorded: the conversation, the empty answer, how it is sampled, and the
    HTML that opens it on every page."""

    conv: Conversation
    answer: Message
    params: SamplingParams
    speculative: SpeculativeOptions | None
    opening: str
    tools: ToolRequest | None = None  # this round's MCP tools


@dataclass
class Streamed:
    """What one round of streaming gave: the text, and the final event or the error."""

    text: str = ""
    final: Event | None = None
    error: str | None = None


def _idle() -> str:
    return render("_composer_actions.html", generating=False, oob=True)


async def respond(state: AppState, cid: int, action: str, data: dict[str, Any],
                  gen: RunningTurn) -> None:
    """One turn in conversation `cid`, its outcome (or the reason there is none) sent to every
    page of the conversation."""
    pages = state.pages
    try:
        if not await _model_ready(state, cid, gen):
            await pages.send(cid, _idle() + render("_notice.html", text=""))
            return
        state = await on_its_model(state, cid)
        turn = await record(state, cid, action, data)
        if isinstance(turn, str):  # too long for the context: nothing is recorded, the user chooses
            await pages.send(cid, turn + _idle())
            return
        await pages.send(cid, turn.opening)
        gen.tools = await mcp_rounds.turn_tools(state.mcp, state.storage, cid,
                                                RoundsPages(pages, state.storage, cid))
        if gen.tools is not None:  # tools run with plain decoding (the engine refuses both)
            turn.tools = gen.tools.request_after(state.storage.active_path(cid)[:-1])
            turn.speculative = None
        streamed = await stream(state, turn, gen)
        turn, streamed = await tool_rounds(state, turn, streamed, gen)
        await finalise(state, turn, streamed)
    except Refused as exc:
        await pages.send(cid, render("_notice.html", text=str(exc)) + _idle())
    except Exception as exc:  # noqa: BLE001 - shown to the user instead of vanishing
        log.exception("a chat turn failed")
        await pages.send(cid, render("_notice.html", text=f"The answer failed: {exc}") + _idle())
    finally:
        pages.release(cid, gen)


async def on_its_model(state: AppState, cid: int) -> AppState:
    """`state` with its engine bound to the conversation's model (the default one when it has
    none that is here), loaded into the engine's model pool if it is not in memory: two
    conversations on two models answer at the same time. Raises Refused when it cannot load."""
    engine = state.engine
    conv = state.storage.get_conversation(cid)
    name = conv.model if conv is not None else None
    if not name or name not in {m.name for m in engine.list_models()}:
        name = engine.model_name
    if name is None:
        return state
    try:
        bound = await asyncio.to_thread(engine.use, name)
    except EngineError as exc:
        raise Refused(f"Could not load {name}: {exc}") from None
    return dataclasses.replace(state, engine=bound)


async def _model_ready(state: AppState, cid: int, gen: RunningTurn) -> bool:
    """Wait for the model when one is loading (the server's first run, a switch), saying so on
    the conversation's pages, Stop ready; False when Stop was pressed meanwhile. Raises Refused
    when no model could load."""
    if state.engine.model is not None:
        return True
    await state.pages.send(cid, render("_notice.html", text=WAITING)
                           + render("_composer_actions.html", generating=True, oob=True))
    while not await model_loaded(state.switch, state.engine, 0.5):
        if gen.stop_requested:
            return False
        if not state.switch.loading:
            raise Refused(state.switch.error or "No model is loaded: choose one in Settings.")
    await state.pages.send(cid, render("_notice.html", text=""))
    return not gen.stop_requested


async def record(state: AppState, cid: int, action: str, data: dict[str, Any]) -> Recorded | str:
    """The user's side and the empty answer, recorded; or the context notice to show instead
    (nothing recorded). Raises Refused."""
    storage, engine = state.storage, state.engine
    conv = storage.get_conversation(cid)
    if conv is None:
        raise Refused(DELETED)
    title = conv.title
    try:
        params = sampling_params(conv.settings, engine.defaults)
        conv, overflow_notice = await asyncio.to_thread(prepare_send, engine, storage, conv, action,
                                                        data, params.max_tokens, document_prompt(state))
        if overflow_notice:
            return overflow_notice
        turn = record_user_turn(storage, conv, action, data)
        speculative = speculative_options(conv.settings)
    except (ValueError, EngineError) as exc:
        raise Refused(str(exc)) from None
    except sqlite3.IntegrityError:  # deleted meanwhile
        raise Refused(DELETED) from None
    answer = storage.add_message(cid, turn.parent_id, "assistant", "", state="streaming",
                                 model=engine.model_name, sampling=params.to_dict())
    storage.update_conversation(cid, model=engine.model_name)  # the model it last talked to
    views = message_views(storage, storage.active_path(cid))
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
    return Recorded(conv, answer, params, speculative, opening)


async def stream(state: AppState, turn: Recorded, gen: RunningTurn) -> Streamed:
    """One round: the answer generated, each piece sent to the conversation's pages as it grows
    and saved every SAVE_EVERY_S; saved as it ended whatever happens (`finish`)."""
    storage, engine = state.storage, state.engine
    pages = state.pages
    cid, mid = turn.conv.id, turn.answer.id
    out = Streamed()
    try:
        path = storage.active_path(cid)
        messages = await asyncio.to_thread(prompt_with_documents, state, turn.conv.settings,
                                           path[:-1], turn.params.max_tokens)
        gen.handle = await start(engine, messages, turn.params, turn.speculative, tools=turn.tools)
        if gen.stop_requested:  # Stop pressed before the request existed
            gen.handle.cancel()
        with state.runs.track(gen.handle):
            last_flush = last_save = time.monotonic()
            async for event in gen.handle.stream():
                if event.kind == "done":
                    out.final = event
                    break
                if event.channel != "content":  # a tool call being written: shown once done
                    continue
                out.text += event.text
                now = time.monotonic()
                if now - last_save >= SAVE_EVERY_S:
                    storage.save_partial(mid, out.text)
                    last_save = now
                if now - last_flush >= FLUSH_EVERY_S:
                    await pages.send(cid, render("_answer_body.html", mid=mid,
                                                 html=render_markdown(out.text)))
                    last_flush = now
    except EngineError as exc:
        out.error = str(exc)
    finally:
        finish(storage, mid, out)
    return out


async def tool_rounds(state: AppState, turn: Recorded, streamed: Streamed,
                      gen: RunningTurn) -> tuple[Recorded, Streamed]:
    """While the model calls tools: the calls approved, run and stored, and the next answer
    streamed (app/mcp/rounds.py); the last round's turn and answer."""
    storage, cid = state.storage, turn.conv.id
    while (gen.tools is not None and streamed.final is not None and streamed.final.tool_calls
           and not gen.stop_requested):
        parent = await mcp_rounds.run_calls(
            gen.tools, storage, turn.conv, turn.answer.id, streamed.final.tool_calls,
            RoundsPages(state.pages, storage, cid), lambda: gen.stop_requested)
        if gen.stop_requested:
            break
        answer = storage.add_message(cid, parent, "assistant", "", state="streaming",
                                     model=turn.answer.model, sampling=turn.answer.sampling)
        turn = dataclasses.replace(turn, answer=answer, tools=gen.tools.request_after(
            storage.active_path(cid)[:-1]))
        await state.pages.send(cid, render(
            "_messages.html", conv=turn.conv, oob=True,
            views=message_views(storage, storage.active_path(cid))))
        streamed = await stream(state, turn, gen)
    return turn, streamed


async def finalise(state: AppState, turn: Recorded, streamed: Streamed) -> None:
    """The finished answer, with its statistics, on every page; the composer idle again."""
    storage, cid = state.storage, turn.conv.id
    views = message_views(storage, storage.active_path(cid))
    if storage.get_conversation(cid) is None or not views:
        raise Refused(DELETED)
    await state.pages.send(
        cid, render("_message.html", conv=turn.conv, v=views[-1], oob=True) + _idle()
        + render("_notice.html", text=""))  # "still answering" is over


def finish(storage: Storage, mid: int, streamed: Streamed) -> None:
    """Save the answer as it ended: done, stopped or failed, with its statistics."""
    final, text, error = streamed.final, streamed.text, streamed.error
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
