"""The serving core every API protocol runs on; an adapter (one module per protocol) only parses
its request and encodes the engine's events.

The contract of an adapter (chat.py, completions.py, anthropic.py, responses.py, ollama.py,
embeddings.py):

1. Read the body with `read_body` (size checked by the middleware; depth and Unicode here; JSON
   errors, nesting deeper than `MAX_DEPTH` and lone surrogates raise `ApiError` 400).
2. Choose the model: `require_model` (strict, OpenAI: a name no local model has is a 404, and the
   request is parsed before anything loads) or `use_named_model` (lenient, for clients that send
   their own vendor's names, with `--model-alias`). Both load the named model into the engine's
   model pool beside the others (app/api/models.py `use_model`: 503 with Retry-After when every
   model holding the memory is busy); while the first model loads they wait for it a bounded
   while (`wait_for_model`), then answer 503 with Retry-After. The adapter then runs on the
   engine bound to that model (`engine.on(model)`: its defaults, context and requests).
3. Parse the request into engine messages (or a raw prompt) + `SamplingParams` + `ToolRequest`;
   refuse bad input by raising `ApiError` (status, message, field, code).
4. `submit` the engine requests (`n` choices; `fit_max_tokens=True` for clients that ask for more
   than the context leaves, as Claude Code does: `Engine.submit` clamps `max_tokens` to the
   context the prompt leaves); the engine's refusals become `ApiError`s (`engine_refusal`:
   invalid input 400, an unknown model 404, `Overloaded` 429 with Retry-After, no model 503).
   Embeddings submit through `Engine.embed` and answer whole.
5. Answer whole (`finished`: every choice collected while a client that leaves cancels them; a
   failed generation raises `ApiError` 500) or streamed (`stream`: the engine's events handed to
   the adapter's `StreamEncoder`, whose lines go out as server-sent events, or NDJSON).
6. Turn every `ApiError` into the protocol's error shape: `ApiError.response(path)` picks the shape
   of the path's protocol from app/api/error_shapes.py, so an adapter declares its shape once there.

The core never writes a protocol's wire format; the encoders never touch the engine's requests.
"""

import asyncio
import contextlib
import fnmatch
import json
import math
import os
import random
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Protocol, Sequence, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from engine import (Engine, EngineError, Event, InvalidRequest, ModelLoadError, NoRoom, Overloaded,
                    RequestHandle, SamplingParams, SpeculativeOptions, TokenLogprob)

from ..model_jobs import ModelSwitch, model_loaded
from ..state import app_state
from ..submission import INLINE_BODY_BYTES, by_cost, costly_body, start
from .errors import ApiError
from .images import check_text_share
from .models import use_model

T = TypeVar("T")
# Deeper JSON is refused before anything walks it recursively (schemas, the chat template).
MAX_DEPTH = 64
# A request that needs the model waits this long for one that is loading (MLXCHAT_LOAD_WAIT
# seconds, as Ollama's OLLAMA_LOAD_TIMEOUT), then gets 503 with Retry-After (a first run downloads
# and converts for a minute or more; clients retry).
LOAD_WAIT_ENV = "MLXCHAT_LOAD_WAIT"
MODEL_WAIT_S = 30.0
RETRY_AFTER_S = 5


# --- the body -----------------------------------------------------------------------------------

def load_body(raw: bytes) -> Any:
    """The request body as JSON, checked for what would break later: nesting deeper than
    MAX_DEPTH, and strings that are not valid Unicode (lone surrogates such as "\\ud800", which
    JSON allows but UTF-8 cannot encode). Raises ApiError."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
    _check_json(body)
    return body


def _check_json(body: Any) -> None:
    pending: list[tuple[Any, str, int]] = [(body, "", 0)]
    while pending:
        value, where, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep",
                           where.split(".")[0].split("[")[0] or None)
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, where)
                pending.append((item, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(value, list):
            pending.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, where)


def _check_text(text: str, where: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"{where or 'the request body'} holds a string that is not valid "
                                "Unicode (a lone surrogate)", where or None,
                           "invalid_value") from None


async def read_body(request: Request) -> Any:
    """The request's JSON body, checked (depth, Unicode; on an image route, a body larger than
    the text limit must owe it to its images: app/api/images.py); bodies from
    INLINE_BODY_BYTES on (app/submission.py) are parsed in a thread."""
    raw = await request.body()
    if len(raw) < INLINE_BODY_BYTES:
        return load_body(raw)
    return await asyncio.to_thread(_load_sized, raw, request.url.path)


async def parse_by_cost(request: Request, parse: Callable[..., T], body: Any, *args: Any) -> T:
    """`parse(body, *args)` (an adapter's parsing: images' headers, tool schemas), off the event
    loop when the body makes it costly (app/submission.py `costly_body`)."""
    return await by_cost(costly_body(body, len(await request.body())), parse, body, *args)


def _load_sized(raw: bytes, path: str) -> Any:
    body = load_body(raw)
    check_text_share(body, len(raw), path)
    return body


# --- the model ----------------------------------------------------------------------------------

def model_loading(switch: ModelSwitch | None = None) -> ApiError:
    """The 503 while no model is loaded: with Retry-After while one loads (its stage said), or
    the reason the last load failed."""
    if switch is not None and not switch.loading and switch.error:
        return ApiError(503, switch.error, "model", "model_load_failed", type_="server_error")
    stage = f" ({switch.progress.describe()})" if switch and switch.progress else ""
    return ApiError(503, f"a model is loading{stage}; try again shortly", type_="server_error",
                    code="model_loading", headers={"Retry-After": str(RETRY_AFTER_S)})


async def wait_for_model(request: Request) -> None:
    """Return once a model is loaded: a request that comes while one loads (the server's first,
    or a switch) waits for it up to MODEL_WAIT_S (MLXCHAT_LOAD_WAIT); raises `model_loading`'s
    ApiError after that."""
    state = app_state(request)
    if not await model_loaded(state.switch, state.engine, load_wait_s()):
        raise model_loading(state.switch)


def load_wait_s() -> float:
    """MLXCHAT_LOAD_WAIT seconds (a number >= 0), else MODEL_WAIT_S."""
    try:
        return max(0.0, float(os.environ.get(LOAD_WAIT_ENV) or MODEL_WAIT_S))
    except ValueError:
        return MODEL_WAIT_S


async def require_model(request: Request, body: Any, check: Any = None) -> str:
    """The name of the model that serves `body` under OpenAI's strict rules: its `model` field
    names a local model (loaded first, beside the others) or is absent (the default one).
    `check(body, name)` parses the request against the named model before anything loads, so a
    bad request loads nothing. Raises ApiError: 503 while no model is loaded or none can be now,
    404 for a name no local model has."""
    engine = app_state(request).engine
    await wait_for_model(request)
    wanted = body.get("model") if isinstance(body, dict) else None
    if isinstance(wanted, str) and wanted != engine.model_name:
        if check is not None:  # off the event loop: parsing may compile tool schemas
            await asyncio.to_thread(check, body, wanted)
        await use_model(request, wanted)
        return wanted
    return engine.model_name


def parse_aliases(pairs: Sequence[str]) -> dict[str, str]:
    """`NAME=MODEL` pairs (`--model-alias`) as a table; NAME may hold `*` wildcards
    (`claude-*=qwen3-8b`). Raises ValueError naming a malformed pair."""
    table = {}
    for pair in pairs:
        name, sep, model = pair.partition("=")
        if not sep or not name.strip() or not model.strip():
            raise ValueError(f"--model-alias takes NAME=MODEL, got {pair!r}")
        table[name.strip()] = model.strip()
    return table


def aliased(aliases: dict[str, str], name: str) -> str:
    """The model `name` stands for in the alias table (exact names first, then patterns)."""
    if name in aliases:
        return aliases[name]
    return next((m for pattern, m in aliases.items() if fnmatch.fnmatchcase(name, pattern)), name)


async def use_named_model(request: Request, name: Any) -> str:
    """Load the model a lenient client names and return the name that serves it: an alias
    (`--model-alias`), or a local model's own name, loads that model; any other name (Claude Code's
    `claude-*`, Codex's `gpt-*`) runs on the default model. Raises ApiError (503) while none is
    loaded, or the named one cannot be now."""
    state = app_state(request)
    engine = state.engine
    if isinstance(name, str):
        target = aliased(state.aliases, name)
        if target != engine.model_name and target in {m.name for m in engine.list_models()}:
            await use_model(request, target)
            return target
    await wait_for_model(request)
    return engine.model_name


# --- the choices ---------------------------------------------------------------------------------
# Choice i of `n` runs as its own engine request seeded with `seed + i` (a random base when the
# request has no seed), so choices differ under sampling and repeat with the same seed; the
# requests decode as rows of one batch and later ones reuse the first one's prompt from the prefix
# cache.

def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    if n == 1:
        return [params]
    base = params.seed if params.seed is not None else random.getrandbits(62)
    return [params.with_(seed=(base + i) % 2**63) for i in range(n)]  # seeds stay in range


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


# --- the engine requests ------------------------------------------------------------------------

def public_error(message: str | None) -> str:
    """An engine failure as a client may see it: its first line only (a grammar engine's error
    goes on with its internal state)."""
    line = (message or "").strip().split("\n", 1)[0]
    return line[:300] or "generation failed"


def engine_param(exc: EngineError) -> str | None:
    """The request parameter an engine error is about (JSON mode's schema is `response_format`)."""
    return {"json_schema": "response_format", "logprobs": "top_logprobs"}.get(exc.field or "",
                                                                              exc.field)


async def submit(engine: Engine, messages: list[dict[str, Any]] | None, params: SamplingParams,
                 n: int = 1, speculative: SpeculativeOptions | None = None,
                 **options: Any) -> list[RequestHandle]:
    """The accepted engine requests of `n` choices, all or none (`options`: `tools`,
    `split_reasoning`, `keep_alive`, or a raw `text`/`prompt_tokens` instead of `messages`); the
    engine's refusals become ApiErrors (400 invalid, 429 overloaded, 503 no model)."""
    handles: list[RequestHandle] = []
    try:
        for p in choice_params(params, n):
            handles.append(await start(engine, messages, p, speculative, **options))
    except EngineError as exc:
        for h in handles:  # those already started
            h.cancel()
        raise engine_refusal(exc) from None
    return handles


def engine_refusal(exc: EngineError) -> ApiError:
    """An engine's refusal as the client's error: invalid input 400 (an unknown model 404),
    `Overloaded` 429 with Retry-After, a model that failed to load or none loaded 503 (with
    Retry-After when no model can be loaded now: `NoRoom`)."""
    if isinstance(exc, InvalidRequest):
        status = 404 if exc.code == "model_not_found" else 400
        return ApiError(status, public_error(str(exc)), engine_param(exc), exc.code)
    if isinstance(exc, NoRoom):
        return ApiError(503, str(exc), "model", exc.code, type_="server_error",
                        headers={"Retry-After": str(math.ceil(exc.retry_after))})
    if isinstance(exc, Overloaded):
        return ApiError(429, str(exc), type_="rate_limit_exceeded", code="rate_limit_exceeded",
                        headers={"Retry-After": str(math.ceil(exc.retry_after))})
    if isinstance(exc, ModelLoadError):
        return ApiError(503, str(exc), "model", exc.code or "model_load_failed",
                        type_="server_error")
    return ApiError(503, str(exc), type_="server_error", code="model_unavailable")


async def cancel_on_disconnect(request: Request, handles: Sequence[RequestHandle]) -> None:
    """The body has been read, so the next ASGI message can only be the client leaving."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for handle in handles:
        handle.cancel()


@contextlib.asynccontextmanager
async def watched(request: Request, handles: Sequence[RequestHandle]) -> AsyncIterator[None]:
    """While the block runs: the requests count in `/health`, and a client that leaves cancels
    them (as does leaving the block early)."""
    with contextlib.ExitStack() as stack:
        for handle in handles:
            stack.enter_context(app_state(request).runs.track(handle))
        watcher = asyncio.create_task(cancel_on_disconnect(request, handles))
        try:
            yield
        finally:
            watcher.cancel()


async def finished(request: Request, handles: Sequence[RequestHandle]) -> list[Choice]:
    """Every choice once finished (a client that leaves cancels them); raises ApiError (500,
    `generation_failed`) when one failed."""
    async with watched(request, handles):
        choices = await collect_choices(handles)
    failed = next((c.final for c in choices if c.final is None or c.final.finish_reason == "failed"),
                  False)
    if failed is not False:
        raise ApiError(500, public_error(failed.error if failed else None), type_="server_error",
                       code="generation_failed")
    return choices


# --- streaming ----------------------------------------------------------------------------------

class StreamEncoder(Protocol):
    """A protocol's streamed wire format: each method returns the lines (server-sent events framed
    by `app.sse.sse`, or NDJSON lines) for one step of the engine's events."""

    def opening(self) -> Iterable[str]:
        """Before any event (a role chunk, `message_start`...)."""
        ...

    def token(self, choice: int, event: Event) -> Iterable[str]:
        """A token event of choice `choice` (text, reasoning, logprobs)."""
        ...

    def done(self, choice: int, event: Event) -> Iterable[str]:
        """Choice `choice` finished (its finish reason, tool calls, usage)."""
        ...

    def failed(self, choice: int, event: Event) -> Iterable[str]:
        """Choice `choice` failed mid-stream (the protocol's error event)."""
        ...

    def closing(self, finals: list[Event], complete: bool) -> Iterable[str]:
        """After every choice ended; `complete` when none failed (usage, `[DONE]`)."""
        ...


async def stream_events(request: Request, handles: Sequence[RequestHandle],
                        encoder: StreamEncoder) -> AsyncIterator[str]:
    """The stream skeleton: the engine's events of every choice, as they come, handed to
    `encoder`; the requests are watched (a client that leaves cancels them)."""
    finals: list[Event] = []
    failures = 0
    async with watched(request, handles):
        for line in encoder.opening():
            yield line
        async for i, event in merged(handles):
            if event.kind == "token":
                lines = encoder.token(i, event)
            elif event.finish_reason == "failed":
                failures += 1
                lines = encoder.failed(i, event)
            else:
                finals.append(event)
                lines = encoder.done(i, event)
            for line in lines:
                yield line
        for line in encoder.closing(finals, complete=not failures and len(finals) == len(handles)):
            yield line


def stream(request: Request, handles: Sequence[RequestHandle], encoder: StreamEncoder,
           media_type: str = "text/event-stream") -> StreamingResponse:
    """The streamed answer: `encoder`'s lines as `media_type` (server-sent events unless the
    protocol says otherwise: Ollama's `application/x-ndjson`), unbuffered."""
    return StreamingResponse(stream_events(request, handles, encoder), media_type=media_type,
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
