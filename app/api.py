"""The OpenAI-compatible API: `/v1/models`, `/v1/chat/completions` (JSON or SSE) and `/health`.

Validation is strict and answers in OpenAI's error format, so clients show a useful message:
wrong types, unknown fields and unsupported options are refused rather than silently ignored.
Ranges of sampling values are checked once, by `SamplingParams`.
"""

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import (SAMPLING_OPTIONS, EngineError, InvalidRequest, ModelDefaults, Overloaded,
                    RequestHandle, SamplingParams, SpeculativeOptions, ToolRequest, Usage,
                    device_report, effort_budget, keep_alive_seconds, tool_request)

from .api_choices import (MAX_CHOICES, collect_choices, logprobs_body, merged, message_body,
                          start_choices, system_fingerprint, tool_call_deltas, total_usage,
                          tracked)
from .api_errors import ApiError, check_fields
from .api_models import find_model, local_models, model_object, use_model
from .api_tools import tool_fields
from .context import TRUNCATE_MODES, drop_oldest
from .runs import Runs
from .security import api_error
from .sse import sse

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}

# Fields clients send that change nothing here, accepted only with their default meaning.
_NEUTRAL = {"store": False}
_IGNORED = {"user", "metadata"}
# Every sampling option by its own name (max_tokens also as OpenAI's max_completion_tokens).
_SAMPLING = {o.name: o.kind for o in SAMPLING_OPTIONS}
_FIELDS = {"model", "messages", "stream", "stream_options", "max_completion_tokens",
           "stop", "response_format"} | set(_SAMPLING) | set(_NEUTRAL) | _IGNORED
_FIELDS |= {"n", "logprobs", "top_logprobs", "logit_bias", "tools", "tool_choice",
            "parallel_tool_calls"}
_FIELDS.add("speculative")  # an extension: opt-in speculative decoding, see `parse_speculative`
# An extension (llama.cpp's name): "none" keeps a thinking model's reasoning inline in `content`;
# "auto" (the default) returns it apart as `reasoning_content`.
_FIELDS.add("reasoning_format")
# An extension: "oldest" drops the oldest turns (a leading system message stays) until the prompt
# and max_tokens fit the context; without it a prompt too long is refused (context_length_exceeded).
_FIELDS.add("truncate")
REASONING_FORMATS = ("auto", "none")
_FIELDS.add("keep_alive")  # as Ollama's: how long the model stays loaded after this request
# A thinking budget by effort (engine EFFORT_BUDGETS); `thinking_budget` (tokens) wins if both.
_FIELDS.add("reasoning_effort")
_SPECULATIVE = {"draft": str, "k": int, "adaptive": bool}
# Deeper JSON is refused before anything walks it recursively (schemas, the chat template).
MAX_DEPTH = 64
# Bodies from this size on are parsed and checked off the event loop.
INLINE_BODY_BYTES = 64 * 1024


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1
    tools: ToolRequest | None = None
    split_reasoning: bool = True
    keep_alive: float | str | None = None  # as sent (checked); None: the server's --keep-alive


def _typed(body: dict[str, Any], name: str, kind: type) -> Any:
    """`body[name]` checked against `kind` (float accepts integers; bool is never a number)."""
    value = body.get(name)
    if value is None:
        return None
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is float:
        ok = is_number and math.isfinite(value)
        value = float(value) if ok else value
    elif kind is int:
        ok = is_number and isinstance(value, int)
    else:
        ok = isinstance(value, kind)
    if not ok:
        expected = {float: "a number", int: "an integer", bool: "a boolean", str: "a string",
                    list: "an array", dict: "an object"}[kind]
        raise ApiError(400, f"'{name}' must be {expected}, got {json.dumps(value)}", name,
                       "invalid_type")
    return value


def _content(i: int, content: Any) -> str:
    """A message's text: a string, or OpenAI's list of `{"type": "text", "text": ...}` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts "
                        "(images, audio and tool calls are not supported)", f"messages[{i}].content")


def parse_messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                                f"{json.dumps(role)}", f"messages[{i}].role")
        content = m.get("content")
        if content is None and (m.get("tool_calls") or role == "tool"):
            content = ""
        out.append({"role": ROLES[role], "content": _content(i, content),
                    **tool_fields(i, role, m)})
    return out


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


def parse_chat_request(body: Any, model_name: str | None,
                       defaults: ModelDefaults | None = None) -> ChatRequest:
    """Validate a `/v1/chat/completions` body; raises ApiError with the offending parameter.
    Sampling fields the body omits take the model's `defaults` (as the chat UI's do)."""
    check_fields(body, _FIELDS)
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and (type(value) is not type(neutral) or value != neutral):
            raise ApiError(400, f"'{name}' is not supported (only {json.dumps(neutral)})", name,
                           "unsupported_parameter")
    model = _typed(body, "model", str)
    if model is not None and model != model_name:  # absent: the loaded model
        raise ApiError(404, f"The model '{model}' does not exist or is not loaded "
                            f"(this server runs '{model_name}')", "model", "model_not_found")
    messages = parse_messages(body.get("messages"))

    sampling = {k: v for k, kind in _SAMPLING.items() if (v := _typed(body, k, kind)) is not None}
    max_tokens = _typed(body, "max_completion_tokens", int)
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError(400, "'stop' must be a string or an array of strings", "stop")
        sampling["stop"] = tuple(stop)
    schema = _json_schema(_typed(body, "response_format", dict))
    if schema is not None:
        sampling["json_schema"] = schema
    sampling.update(_choice_options(body))
    try:
        effort = body.get("reasoning_effort")
        if effort is not None and "thinking_budget" not in sampling:
            sampling["thinking_budget"] = effort_budget(effort)
        params = defaults.params(sampling) if defaults is not None else SamplingParams(**sampling)
        keep_alive_seconds(body.get("keep_alive"))
        tools = tool_request(body.get("tools"), body.get("tool_choice"),
                             _typed(body, "parallel_tool_calls", bool))
    except InvalidRequest as exc:
        raise ApiError(400, public_error(str(exc)), _param(exc), exc.code or "invalid_value") from None
    n = _typed(body, "n", int)
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"'n' must be an integer in [1, {MAX_CHOICES}], got {n}", "n",
                       "invalid_value")
    reasoning = _typed(body, "reasoning_format", str) or "auto"
    if reasoning not in REASONING_FORMATS:
        raise ApiError(400, f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}",
                       "reasoning_format", "invalid_value")

    stream = _typed(body, "stream", bool) or False
    options = _typed(body, "stream_options", dict) or {}
    if options and not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' may only hold 'include_usage' (a boolean)",
                       "stream_options")
    return ChatRequest(messages=messages, params=params, stream=stream,
                       include_usage=bool(options.get("include_usage")), n=n or 1, tools=tools,
                       split_reasoning=reasoning == "auto",
                       keep_alive=body.get("keep_alive"))


def _choice_options(body: dict[str, Any]) -> dict[str, Any]:
    """`logprobs` + `top_logprobs` and `logit_bias` as `SamplingParams` fields."""
    out: dict[str, Any] = {}
    top = _typed(body, "top_logprobs", int)
    if _typed(body, "logprobs", bool):
        out["logprobs"] = top or 0
    elif top is not None:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    bias = _typed(body, "logit_bias", dict)
    if bias:
        out["logit_bias"] = bias
    return out


def _json_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON Schema that `response_format` asks the answer to match (None: plain text):
    `{"type": "json_object"}` is any object; `{"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}, "strict": ...}}` is that schema (checked by `SamplingParams`)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind in ("text", "json_object") and len(response_format) == 1:
        return {"type": "object"} if kind == "json_object" else None
    if kind != "json_schema" or set(response_format) != {"type", "json_schema"}:
        raise ApiError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": "
                            "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                            "{\"name\": ..., \"schema\": {...}}}", "response_format")
    spec = response_format["json_schema"]
    if (not isinstance(spec, dict) or set(spec) - {"name", "description", "schema", "strict"}
            or not isinstance(spec.get("schema"), dict)
            or not isinstance(spec.get("name", ""), str)
            or not isinstance(spec.get("strict", False), (bool, type(None)))):
        raise ApiError(400, "'response_format.json_schema' must be an object with 'schema' (a JSON "
                            "Schema object) and optionally 'name', 'description' and 'strict'",
                       "response_format")
    loop = _ref_loop(spec["schema"])
    if loop is not None:
        raise ApiError(400, f"'response_format.json_schema.schema' refers to itself through "
                            f"{json.dumps(loop)}: no JSON value can match it", "response_format",
                       "invalid_value")
    return spec["schema"]


# Keywords whose subschemas apply to the same JSON value as their parent: a `$ref` cycle through
# them alone never reaches a value (properties/items descend into one, so recursion there is fine).
_IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else")


def _ref_loop(schema: dict[str, Any]) -> str | None:
    """A local `$ref` that comes back to itself on the same JSON value (`{"$ref": "#"}`, `a`
    defined as `{"$ref": "#/definitions/a"}` or as `{"allOf": [{"$ref": "#/definitions/a"}]}`):
    the grammar engine cannot compile it and would only fail while generating."""
    def resolve(ref: str) -> Any:
        if not ref.startswith("#"):
            return None
        node: Any = schema
        for part in filter(None, ref[1:].split("/")):
            key = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                return None
        return node

    def same_value(node: dict[str, Any]) -> list[tuple[Any, str | None]]:
        """The subschemas `node` applies to its own value, each with the `$ref` leading there."""
        found: list[tuple[Any, str | None]] = []
        if isinstance(node.get("$ref"), str):
            found.append((resolve(node["$ref"]), node["$ref"]))
        for key in _IN_PLACE:
            value = node.get(key)
            found.extend((sub, None) for sub in (value if isinstance(value, list) else [value]))
        return [(sub, ref) for sub, ref in found if isinstance(sub, dict)]

    done: set[int] = set()
    pending: list[Any] = [schema]
    while pending:  # every subschema, each the start of a walk along same-value edges
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        pending.extend(node.values())
        if id(node) in done:
            continue
        path, on_path = [(node, iter(same_value(node)))], {id(node)}
        while path:  # depth first; a node met again on the current path closes a loop
            top, edges = path[-1]
            step = next(edges, None)
            if step is None:
                path.pop()
                on_path.discard(id(top))
                done.add(id(top))
                continue
            sub, ref = step
            if id(sub) in on_path:
                return ref or "$ref"  # only a `$ref` can lead back up
            if id(sub) not in done:
                path.append((sub, iter(same_value(sub))))
                on_path.add(id(sub))
    return None


def parse_speculative(value: Any) -> SpeculativeOptions | None:
    """`"speculative": {"draft": "self-q4" | "truncated:N" | "mtp" | a model, "k": 1-16,
    "adaptive": true}` opts a request in to speculative decoding (absent or null: plain)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, "'speculative' must be an object such as {\"draft\": \"self-q4\", "
                            "\"k\": 4}", "speculative", "invalid_type")
    for name in value:
        if name not in _SPECULATIVE:
            raise ApiError(400, f"Unrecognized argument supplied in 'speculative': {name} (allowed: "
                                f"{', '.join(_SPECULATIVE)})", f"speculative.{name}", "unknown_parameter")
    if "draft" not in value:
        raise ApiError(400, "'speculative.draft' is required", "speculative.draft",
                       "missing_required_parameter")
    options = {}
    for name, kind in _SPECULATIVE.items():
        try:
            if (typed := _typed(value, name, kind)) is not None:
                options[name] = typed
        except ApiError as err:
            raise ApiError(400, err.message.replace(f"'{name}'", f"'speculative.{name}'", 1),
                           f"speculative.{name}", err.code) from None
    try:
        return SpeculativeOptions(**options)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), exc.field, "invalid_value") from None


def _param(exc: EngineError) -> str | None:
    """The request parameter an engine error is about (JSON mode's schema is `response_format`)."""
    return {"json_schema": "response_format", "logprobs": "top_logprobs"}.get(exc.field or "",
                                                                              exc.field)


def usage_body(usage: Usage, stats: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    speculative = (stats or {}).get("speculative")
    if speculative is not None:  # an extension, only for requests that opted in
        body["speculative"] = {k: speculative[k] for k in (
            "drafted", "accepted", "acceptance_rate", "tokens_per_target_step", "switched_off")}
    return body


async def cancel_on_disconnect(request: Request, handles: list[RequestHandle]) -> None:
    """The body has been read, so the next ASGI message can only be the client leaving."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for handle in handles:
        handle.cancel()


# --- endpoints ----------------------------------------------------------------------------------

async def health(request: Request) -> JSONResponse:
    engine = request.app.state.engine
    status = "failed" if engine.halted else "ok" if engine.model_name else "loading"
    cluster = getattr(request.app.state, "cluster", None)  # a sharded model (engine/distributed/)
    return JSONResponse({"status": status, "model": engine.model_name,
                         "generating": len(request.app.state.runs), "device": device_report(),
                         **({"error": engine.halted} if engine.halted else {}),
                         **({"distributed": cluster.health()} if cluster else {})},
                        status_code=503 if engine.halted else 200)


async def list_models(request: Request) -> JSONResponse:
    """Every local model, the loaded one first: a request naming any of them loads it."""
    data = [model_object(m) for m in local_models(request.app.state.engine)]
    return JSONResponse({"object": "list", "data": data})


async def retrieve_model(request: Request) -> JSONResponse:
    """One local model, as OpenAI's `models.retrieve` asks for it."""
    try:
        model = find_model(request.app.state.engine, request.path_params["model"])
    except ApiError as exc:
        return exc.response()
    return JSONResponse(model_object(model))


def public_error(message: str | None) -> str:
    """An engine failure as a client may see it: its first line only (a grammar engine's error
    goes on with its internal state)."""
    line = (message or "").strip().split("\n", 1)[0]
    return line[:300] or "generation failed"


async def chat_completions(request: Request) -> Response:
    engine = request.app.state.engine
    try:
        raw = await request.body()
        body = load_body(raw) if len(raw) < INLINE_BODY_BYTES else \
            await asyncio.to_thread(load_body, raw)
        if engine.model_name is None:
            return api_error(503, "a model is loading; try again shortly", "server_error",
                             "model_loading", headers={"Retry-After": "5"})
        wanted = body.get("model") if isinstance(body, dict) else None
        if isinstance(wanted, str) and wanted != engine.model_name:
            parse_chat_request(body, wanted, engine.defaults)  # a bad request loads nothing
            await use_model(request, wanted)
        chat = parse_chat_request(body, engine.model_name, engine.defaults)
        speculative = parse_speculative(body.get("speculative"))
        messages = _truncated(engine, body.get("truncate"), chat)
        handles = await submit_choices(engine, messages, chat.params, chat.n, speculative,
                                       tools=chat.tools, split_reasoning=chat.split_reasoning,
                                       keep_alive=chat.keep_alive)
    except ApiError as err:
        return err.response()

    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    meta = {"id": completion_id, "created": int(time.time()), "model": engine.model_name,
            "system_fingerprint": system_fingerprint(engine.model_name)}
    runs = request.app.state.runs
    wants_logprobs = chat.params.logprobs is not None
    if chat.stream:
        return sse_response(_sse(request, runs, handles, meta, chat.include_usage, wants_logprobs))
    choices = await finished_choices(request, runs, handles)
    if isinstance(choices, Response):
        return choices
    finals = [c.final for c in choices]
    return JSONResponse({
        **meta, "object": "chat.completion",
        "choices": [{"index": i, "message": message_body(c), "finish_reason": c.final.finish_reason,
                     "logprobs": logprobs_body(c.logprobs, wants_logprobs)}
                    for i, c in enumerate(choices)],
        "usage": usage_body(total_usage(finals), finals[0].stats),
    })


def _truncated(engine: Any, mode: Any, chat: ChatRequest) -> list[dict[str, Any]]:
    """The request's messages, the oldest dropped to fit if it asked (`"truncate": "oldest"`)."""
    if mode is None:
        return chat.messages
    if mode not in TRUNCATE_MODES:
        raise ApiError(400, f"'truncate' must be one of {', '.join(TRUNCATE_MODES)}", "truncate",
                       "invalid_value")
    try:
        return drop_oldest(engine, chat.messages, chat.params.max_tokens, chat.tools)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), _param(exc), exc.code) from None


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def finished_choices(request: Request, runs: Runs,
                           handles: list[RequestHandle]) -> list[Any] | Response:
    """Every choice once finished (a client that leaves cancels them), or the 500 response when
    one failed."""
    with tracked(runs, handles):
        watcher = asyncio.create_task(cancel_on_disconnect(request, handles))
        try:
            choices = await collect_choices(handles)
        finally:
            watcher.cancel()
    failed = next((c.final for c in choices if c.final.finish_reason == "failed"), None)
    if failed is not None:
        return api_error(500, public_error(failed.error), "server_error", "generation_failed")
    return choices


async def submit_choices(engine: Any, messages: list[dict[str, Any]] | None,
                         params: SamplingParams, n: int, speculative: SpeculativeOptions | None,
                         **options: Any) -> list[RequestHandle]:
    """The accepted engine requests of `n` choices; engine refusals become ApiErrors."""
    try:
        return await start_choices(engine, messages, params, n, speculative, **options)
    except InvalidRequest as exc:
        raise ApiError(400, public_error(str(exc)), _param(exc), exc.code) from None
    except Overloaded as exc:
        raise ApiError(429, str(exc), type_="rate_limit_exceeded", code="rate_limit_exceeded",
                       headers={"Retry-After": str(math.ceil(exc.retry_after))}) from None
    except EngineError as exc:  # no model loaded
        raise ApiError(503, str(exc), type_="server_error", code="model_unavailable") from None


def _data(payload: dict[str, Any]) -> str:
    return sse(json.dumps(payload, ensure_ascii=False))


async def _sse(request: Request, runs: Runs, handles: list[RequestHandle], meta: dict[str, Any],
               include_usage: bool, wants_logprobs: bool) -> AsyncIterator[str]:
    """`data: {chunk}` lines, then `data: [DONE]`; a failure mid-stream becomes an error chunk."""
    def chunk(i: int, delta: dict[str, Any], finish_reason: str | None = None,
              logprobs: list | None = None) -> str:
        choice = {"index": i, "delta": delta, "finish_reason": finish_reason,
                  "logprobs": logprobs_body(logprobs or [], wants_logprobs)}
        return _data({**meta, "object": "chat.completion.chunk", "choices": [choice]})

    finals = []
    with tracked(runs, handles):
        watcher = asyncio.create_task(cancel_on_disconnect(request, handles))
        try:
            for i in range(len(handles)):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for i, event in merged(handles):
                if event.kind == "token":
                    lps = [event.logprobs] if event.logprobs is not None else []
                    key = "reasoning_content" if event.channel == "reasoning" else "content"
                    if event.text or lps:
                        yield chunk(i, {key: event.text}, logprobs=lps)
                elif event.finish_reason == "failed":
                    yield _data({"error": {"message": public_error(event.error),
                                           "type": "server_error", "param": None,
                                           "code": "generation_failed"}})
                else:
                    for delta in tool_call_deltas(event.tool_calls):
                        yield chunk(i, {"tool_calls": delta})
                    yield chunk(i, {}, event.finish_reason)
                    finals.append(event)
            if include_usage and len(finals) == len(handles):
                yield _data({**meta, "object": "chat.completion.chunk", "choices": [],
                             "usage": usage_body(total_usage(finals), finals[0].stats)})
            yield sse("[DONE]")
        finally:
            watcher.cancel()


routes = [
    Route("/health", health),
    Route("/v1/models", list_models),
    Route("/v1/models/{model:path}", retrieve_model),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
