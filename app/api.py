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

from engine import (SAMPLING_OPTIONS, EngineError, InvalidRequest, Overloaded,
                    RequestHandle, SamplingParams, SpeculativeOptions, Usage, device_report)

from .runs import Runs
from .security import api_error
from .sse import sse
from .turns import collect, start

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# Fields clients send that change nothing here, accepted only with their default meaning.
_NEUTRAL = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": False,
            "parallel_tool_calls": None, "store": False}
_IGNORED = {"user", "metadata"}
# Every sampling option by its own name (max_tokens also as OpenAI's max_completion_tokens).
_SAMPLING = {o.name: o.kind for o in SAMPLING_OPTIONS}
_FIELDS = {"model", "messages", "stream", "stream_options", "max_completion_tokens",
           "stop", "response_format"} | set(_SAMPLING) | set(_NEUTRAL) | _IGNORED
_FIELDS.add("speculative")  # an extension: opt-in speculative decoding, see `parse_speculative`
_SPECULATIVE = {"draft": str, "k": int, "adaptive": bool}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def response(self) -> JSONResponse:
        return api_error(self.status, self.message, self.type, self.code, self.param)


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]
    params: SamplingParams
    stream: bool
    include_usage: bool


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


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                                f"{json.dumps(role)}", f"messages[{i}].role")
        out.append({"role": ROLES[role], "content": _content(i, m.get("content"))})
    return out


def parse_chat_request(body: Any, model_name: str | None) -> ChatRequest:
    """Validate a `/v1/chat/completions` body; raises ApiError with the offending parameter."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name not in _FIELDS:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", name,
                           "unknown_parameter")
    for name, neutral in _NEUTRAL.items():
        if body.get(name) not in (None, neutral):
            raise ApiError(400, f"'{name}' is not supported (only {json.dumps(neutral)})", name,
                           "unsupported_parameter")
    model = _typed(body, "model", str)
    if model is None:
        raise ApiError(400, "'model' is required", "model", "missing_required_parameter")
    if model != model_name:
        raise ApiError(404, f"The model '{model}' does not exist or is not loaded "
                            f"(this server runs '{model_name}')", "model", "model_not_found")
    messages = _messages(body.get("messages"))

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
    try:
        params = SamplingParams(**sampling)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), _param(exc), "invalid_value") from None

    stream = _typed(body, "stream", bool) or False
    options = _typed(body, "stream_options", dict) or {}
    if options and not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' may only hold 'include_usage' (a boolean)",
                       "stream_options")
    return ChatRequest(messages=messages, params=params, stream=stream,
                       include_usage=bool(options.get("include_usage")))


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
    return spec["schema"]


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
    return "response_format" if exc.field == "json_schema" else exc.field


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


async def _cancel_on_disconnect(request: Request, handle: RequestHandle) -> None:
    """The body has been read, so the next ASGI message can only be the client leaving."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    handle.cancel()


# --- endpoints ----------------------------------------------------------------------------------

async def health(request: Request) -> JSONResponse:
    engine = request.app.state.engine
    status = "failed" if engine.halted else "ok" if engine.model_name else "loading"
    cluster = getattr(request.app.state, "cluster", None)  # a sharded model (engine/distributed/)
    return JSONResponse({"status": status, "model": engine.model_name,
                         "generating": len(request.app.state.runs), "device": device_report(),
                         **({"error": engine.halted} if engine.halted else {}),
                         **({"distributed": cluster.health()} if cluster else {})})


async def list_models(request: Request) -> JSONResponse:
    """Only the loaded model: it is the one a request can name."""
    name = request.app.state.engine.model_name
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "mlxchat"}] if name else []
    return JSONResponse({"object": "list", "data": data})


async def chat_completions(request: Request) -> Response:
    engine = request.app.state.engine
    try:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
        if engine.model_name is None:
            return api_error(503, "a model is loading; try again shortly", "server_error",
                             "model_loading", headers={"Retry-After": "5"})
        chat = parse_chat_request(body, engine.model_name)
        speculative = parse_speculative(body.get("speculative"))
        try:
            handle = await start(engine, chat.messages, chat.params, speculative)
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), _param(exc)) from None
        except Overloaded as exc:
            return api_error(429, str(exc), "rate_limit_exceeded", "rate_limit_exceeded",
                             headers={"Retry-After": str(math.ceil(exc.retry_after))})
        except EngineError as exc:  # no model loaded
            raise ApiError(503, str(exc), type_="server_error", code="model_unavailable") from None
    except ApiError as err:
        return err.response()

    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    meta = {"id": completion_id, "created": int(time.time()), "model": engine.model_name}
    runs = request.app.state.runs
    if chat.stream:
        return StreamingResponse(_sse(request, runs, handle, meta, chat.include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    with runs.track(handle):
        watcher = asyncio.create_task(_cancel_on_disconnect(request, handle))
        try:
            text, final = await collect(handle)
        finally:
            watcher.cancel()
    if final.finish_reason == "failed":
        return api_error(500, final.error or "generation failed", "server_error", "generation_failed")
    return JSONResponse({
        **meta, "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": final.finish_reason, "logprobs": None}],
        "usage": usage_body(final.usage, final.stats),
    })


def _data(payload: dict[str, Any]) -> str:
    return sse(json.dumps(payload, ensure_ascii=False))


async def _sse(request: Request, runs: Runs, handle: RequestHandle, meta: dict[str, Any],
               include_usage: bool) -> AsyncIterator[str]:
    """`data: {chunk}` lines, then `data: [DONE]`; a failure mid-stream becomes an error chunk."""
    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return _data({**meta, "object": "chat.completion.chunk", "choices": [choice]})

    with runs.track(handle):
        watcher = asyncio.create_task(_cancel_on_disconnect(request, handle))
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for event in handle.stream():
                if event.kind == "token":
                    if event.text:
                        yield chunk({"content": event.text})
                elif event.finish_reason == "failed":
                    yield _data({"error": {"message": event.error or "generation failed",
                                           "type": "server_error", "param": None,
                                           "code": "generation_failed"}})
                else:
                    yield chunk({}, event.finish_reason)
                    if include_usage:
                        yield _data({**meta, "object": "chat.completion.chunk", "choices": [],
                                     "usage": usage_body(event.usage, event.stats)})
            yield sse("[DONE]")
        finally:
            watcher.cancel()


routes = [
    Route("/health", health),
    Route("/v1/models", list_models),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
