"""OpenAI's `/v1/chat/completions` (JSON or SSE), an adapter over the serving core
(app/api/serving.py): `parse_chat_request` turns a body into a `ChatRequest`, `ChatEncoder` writes
the engine's events as `chat.completion.chunk`s, and `chat_completions` joins them. `file` parts
(PDF and text documents as data URLs) are read as app/api/documents.py says; a prompt longer than
the context is refused at once with `context_length_exceeded` (400), unless the request asks for
`"truncate": "oldest"`."""

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import (Engine, Event, InvalidRequest, ModelDefaults, SamplingParams, SpeculativeOptions,
                    ToolRequest, effort_budget, keep_alive_seconds, tool_request)

from ..context_window import TRUNCATE_MODES, drop_oldest
from ..sse import sse
from ..state import app_state
from .choices import logprobs_body, message_body, system_fingerprint, tool_call_deltas, total_usage
from .documents import read_documents
from .errors import ApiError, check_fields
from .openai_request import (SAMPLING, check_model, choice_count, one_of, parse_messages, sampling_fields,
                             stream_fields, typed, usage_body)
from .response_format import json_schema
from .serving import (engine_param, finished, public_error, read_body, require_model, stream,
                      submit)

# Fields clients send that change nothing here, accepted only with their default meaning.
_NEUTRAL = {"store": False}
_IGNORED = {"user", "metadata"}
_FIELDS = {"model", "messages", "stream", "stream_options", "max_completion_tokens",
           "stop", "response_format"} | set(SAMPLING) | set(_NEUTRAL) | _IGNORED
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
    check_model(body, model_name)
    messages = parse_messages(body.get("messages"))

    sampling = sampling_fields(body)
    max_tokens = typed(body, "max_completion_tokens", int)
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    schema = json_schema(typed(body, "response_format", dict))
    if schema is not None:
        sampling["json_schema"] = schema
    top = typed(body, "top_logprobs", int)
    if typed(body, "logprobs", bool):
        sampling["logprobs"] = top or 0
    elif top is not None:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    try:
        effort = body.get("reasoning_effort")
        if effort is not None and "thinking_budget" not in sampling:
            sampling["thinking_budget"] = effort_budget(effort)
        params = defaults.params(sampling) if defaults is not None else SamplingParams(**sampling)
        keep_alive_seconds(body.get("keep_alive"))
        tools = tool_request(body.get("tools"), body.get("tool_choice"),
                             typed(body, "parallel_tool_calls", bool))
    except InvalidRequest as exc:
        raise ApiError(400, public_error(str(exc)), engine_param(exc),
                       exc.code or "invalid_value") from None
    n = choice_count(body)
    reasoning = one_of(body, "reasoning_format", REASONING_FORMATS, "auto")
    streamed, include_usage = stream_fields(body)
    return ChatRequest(messages=messages, params=params, stream=streamed,
                       include_usage=include_usage, n=n, tools=tools,
                       split_reasoning=reasoning == "auto", keep_alive=body.get("keep_alive"))


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
            if (option := typed(value, name, kind)) is not None:
                options[name] = option
        except ApiError as err:
            raise ApiError(400, err.message.replace(f"'{name}'", f"'speculative.{name}'", 1),
                           f"speculative.{name}", err.code) from None
    try:
        return SpeculativeOptions(**options)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), exc.field, "invalid_value") from None


def _truncated(engine: Engine, mode: Any, chat: ChatRequest,
               messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `messages`, the oldest dropped to fit if it asked (`"truncate": "oldest"`)."""
    if mode is None:
        return messages
    if mode not in TRUNCATE_MODES:
        raise ApiError(400, f"'truncate' must be one of {', '.join(TRUNCATE_MODES)}", "truncate",
                       "invalid_value")
    try:
        return drop_oldest(engine, messages, chat.params.max_tokens, chat.tools)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), engine_param(exc), exc.code) from None


def _data(payload: dict[str, Any]) -> str:
    return sse(json.dumps(payload, ensure_ascii=False))


class ChatEncoder:
    """The stream as OpenAI writes it: a role chunk per choice, content (or `reasoning_content`)
    deltas, tool calls and the finish reason, usage when asked, then `data: [DONE]`; a failure
    mid-stream becomes an error chunk."""

    def __init__(self, meta: dict[str, Any], n: int, include_usage: bool, wants_logprobs: bool):
        self.meta, self.n = meta, n
        self.include_usage, self.wants_logprobs = include_usage, wants_logprobs

    def _chunk(self, i: int, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: list | None = None) -> str:
        choice = {"index": i, "delta": delta, "finish_reason": finish_reason,
                  "logprobs": logprobs_body(logprobs or [], self.wants_logprobs)}
        return _data({**self.meta, "object": "chat.completion.chunk", "choices": [choice]})

    def opening(self) -> Iterable[str]:
        return [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(self.n)]

    def token(self, i: int, event: Event) -> Iterable[str]:
        lps = [event.logprobs] if event.logprobs is not None else []
        key = "reasoning_content" if event.channel == "reasoning" else "content"
        return [self._chunk(i, {key: event.text}, logprobs=lps)] if event.text or lps else []

    def done(self, i: int, event: Event) -> Iterable[str]:
        return [*(self._chunk(i, {"tool_calls": delta}) for delta in tool_call_deltas(event.tool_calls)),
                self._chunk(i, {}, event.finish_reason)]

    def failed(self, i: int, event: Event) -> Iterable[str]:
        return [_data({"error": {"message": public_error(event.error), "type": "server_error",
                                 "param": None, "code": "generation_failed"}})]

    def closing(self, finals: list[Event], complete: bool) -> Iterable[str]:
        usage = []
        if self.include_usage and complete:
            usage = [_data({**self.meta, "object": "chat.completion.chunk", "choices": [],
                            "usage": usage_body(total_usage(finals), finals[0].stats)})]
        return [*usage, sse("[DONE]")]


async def chat_completions(request: Request) -> Response:
    engine = app_state(request).engine
    try:
        body = await read_body(request)
        model = await require_model(request, body,  # a bad request loads nothing
                                    lambda b, name: parse_chat_request(b, name, engine.defaults))
        engine = engine.on(model)  # its defaults, context and requests (issue 49)
        # tool schemas compile, and a long conversation is fitted, off the event loop
        chat = await asyncio.to_thread(parse_chat_request, body, model, engine.defaults)
        speculative = parse_speculative(body.get("speculative"))
        messages = await read_documents(app_state(request), chat.messages)  # `file` parts
        messages = await asyncio.to_thread(_truncated, engine, body.get("truncate"), chat,
                                           messages)
        handles = await submit(engine, messages, chat.params, chat.n, speculative,
                               tools=chat.tools, split_reasoning=chat.split_reasoning,
                               keep_alive=chat.keep_alive)
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model,
                "system_fingerprint": system_fingerprint(model)}
        wants_logprobs = chat.params.logprobs is not None
        if chat.stream:
            return stream(request, handles, ChatEncoder(meta, chat.n, chat.include_usage,
                                                        wants_logprobs))
        choices = await finished(request, handles)
    except ApiError as err:
        return err.response(request.url.path)
    finals = [c.final for c in choices]
    return JSONResponse({
        **meta, "object": "chat.completion",
        "choices": [{"index": i, "message": message_body(c), "finish_reason": c.final.finish_reason,
                     "logprobs": logprobs_body(c.logprobs, wants_logprobs)}
                    for i, c in enumerate(choices)],
        "usage": usage_body(total_usage(finals), finals[0].stats),
    })


routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"])]
