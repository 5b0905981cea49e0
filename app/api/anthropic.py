"""Anthropic's Messages API: `POST /v1/messages` (JSON or SSE) and `/v1/messages/count_tokens`,
for the `anthropic` SDK and Claude Code (`ANTHROPIC_BASE_URL=http://127.0.0.1:8321`).

An adapter over the same engine requests as the OpenAI endpoints (app/api/serving.py): the
request becomes engine messages (tool_use blocks as tool calls, tool_result blocks as tool
messages), `SamplingParams` and a `ToolRequest` (`tool_choice` any/tool decode under the tool's
grammar, as OpenAI's required/named do); the engine's events become Anthropic's content blocks
and stream events. The prefix cache's reuse is reported as `cache_read_input_tokens`.

`thinking: {"type": "enabled", "budget_tokens": N}` is the engine's thinking budget (the model's
closing marker is forced after N tokens of thinking; "disabled": at once).

Tolerant as its clients need: fields and block types that ask for nothing this server must do
(`cache_control`, `metadata`, `thinking: adaptive`, `output_config`, `context_management`, server
tools ...) are accepted and ignored; `max_tokens` is clamped to the context the prompt leaves; any
model name runs on the loaded model unless an alias (`--model-alias`) or a local model's own name
says otherwise. Images: `image` blocks with a base64 source in user turns and inside
`tool_result` (limits in app/api/images.py; a tool result's images follow the tool results as a
user turn, where every vision model's template takes them). Documents: `document` blocks (a base64
PDF, a text source, a content source) in user turns and inside `tool_result`, read as
app/api/documents.py says.

Per-request noise never reaches the prompt (app/api/prompt_noise.py): Claude Code's
`x-anthropic-billing-header:` system block, whose `cch` changes on every request, is dropped, so
every round of a session reuses the one before it from the prefix cache. A prompt longer than the
context is refused at once with the error Claude Code compacts on: 400 `invalid_request_error`,
"prompt is too long: N tokens > M maximum".
"""

import asyncio
import json
import re
import time
import uuid
from typing import Any, Callable, Iterable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import EngineError, Event, InvalidRequest, Usage, count_tokens, tool_request

from ..sse import sse
from ..state import app_state
from . import documents
from .errors import ApiError
from .openai_request import parse_messages
from .prompt_noise import without_noise, without_noise_blocks
from .serving import (Choice, finished, parse_by_cost, public_error, read_body, stream, submit,
                      use_named_model)

PATH = "/v1/messages"
# Block types of earlier turns that carry nothing the model should read again.
_SKIPPED_BLOCKS = {"thinking", "redacted_thinking", "server_tool_use", "web_search_tool_result"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn",
                 "cancelled": "end_turn"}


def _bad(message: str, field: str | None = None) -> ApiError:
    return ApiError(400, message, field, "invalid_value")


def _text(value: Any, where: str) -> str:
    """A string, or a list of text blocks (others ignored)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for block in value:
            if not isinstance(block, dict):
                raise _bad(f"{where} must hold content blocks (objects)", where)
            if block.get("type") in ("image", "document"):
                raise _bad(f"{where} holds an {block['type']} block: only text is read here",
                           where)
        return "".join(b["text"] for b in value if b.get("type") == "text"
                       and isinstance(b.get("text"), str))
    raise _bad(f"{where} must be a string or an array of content blocks", where)


def _system_text(value: Any, where: str) -> str:
    """System text (a string or text blocks) without per-request noise."""
    if isinstance(value, list):
        value = without_noise_blocks(value)
    text = _text(value, where)
    return without_noise(text)


def _turn(i: int, message: Any) -> list[dict[str, Any]]:
    """One Anthropic message as engine (OpenAI-style) messages."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _bad(f"{where} must be an object", where)
    role = message.get("role")
    if role not in ("user", "assistant", "system"):
        raise _bad(f"{where}.role must be \"user\" or \"assistant\"", f"{where}.role")
    content = message.get("content")
    if role == "system":
        return [{"role": role, "content": _system_text(content, f"{where}.content")}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or an array of content blocks",
                   f"{where}.content")
    texts, calls, results = _blocks(where, role, content)
    out = list(results)
    if texts or calls or not results:
        out.append({"role": role, "content": _joined(texts),
                    **({"tool_calls": calls} if calls else {})})
    return out


def _joined(parts: list[Any]) -> Any:
    """Texts (strings) and parts as a message's content: one string when all are text."""
    if all(isinstance(p, str) for p in parts):
        return "".join(parts)
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]


def _image(at: str, block: dict[str, Any]) -> dict[str, Any]:
    """An `image` block (base64 source) as an OpenAI `image_url` part, which parse_messages decodes
    with the limits of app/api/images.py; a `url` source is refused the same way."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad(f"{at} must have a 'source' object", at)
    if source.get("type") == "url":
        return {"type": "image_url", "image_url": {"url": source.get("url")}}
    if source.get("type") != "base64" or not isinstance(source.get("data"), str):
        raise _bad(f"{at}.source must be {{\"type\": \"base64\", \"media_type\", \"data\"}}", at)
    media = source.get("media_type") if isinstance(source.get("media_type"), str) else ""
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{source['data']}"}}


def _document(at: str, block: dict[str, Any]) -> list[dict[str, Any]]:
    """A `document` block as parts (app/api/documents.py): a base64 source (a PDF; an image's
    media type makes it an image), a text source, a content source (its text one document, its
    images image parts); a URL or file source is refused (nothing is fetched)."""
    source, name = block.get("source"), block.get("title")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media = source.get("media_type") if isinstance(source.get("media_type"), str) else ""
        return [documents.from_base64(source.get("data"), media, name, f"{at}.source.data", at)]
    if kind == "text":
        return [documents.from_text(source.get("data"), name, f"{at}.source.data", at)]
    if kind == "content":
        content = source.get("content")
        if isinstance(content, str):
            return [documents.from_text(content, name, f"{at}.source.content", at)]
        if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
            raise _bad(f"{at}.source.content must be a string or an array of content blocks", at)
        text = "\n\n".join(b["text"] for b in content if b.get("type") == "text"
                            and isinstance(b.get("text"), str))
        images = [_image(f"{at}.source.content[{k}]", b) for k, b in enumerate(content)
                  if b.get("type") == "image"]
        return ([documents.from_text(text, name, f"{at}.source.content", at)] if text else []) \
            + images
    if kind in ("url", "file"):
        raise documents.url_refused(at)
    raise _bad(f"{at}.source must be {{\"type\": \"base64\" | \"text\" | \"content\", ...}}",
               at)


def _blocks(where: str, role: str, content: list[Any]) -> tuple[list[Any], list[dict[str, Any]],
                                                               list[dict[str, Any]]]:
    """(texts with image and document parts, tool calls, tool results) of a message's content
    blocks; the images of tool results come first among the texts (they follow the results)."""
    texts, calls, results, shown = [], [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind is None:
            raise _bad(f"{at} must be a content block with a 'type'", at)
        if kind == "text":
            texts.append(_text([block], at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(at, block))
        elif kind == "tool_result" and role == "user":
            result, images = _tool_result(at, block)
            results.append(result)
            shown += images
        elif kind == "image" and role == "user":
            texts.append(_image(at, block))
        elif kind == "document" and role == "user":
            texts += _document(at, block)
        elif kind in ("image", "document"):
            raise _bad(f"{at} is an {kind} block: only user turns and tool results carry them", at)
        elif kind not in _SKIPPED_BLOCKS and isinstance(block.get("text"), str):
            texts.append(block["text"])  # an unknown block type that carries text
    return shown + texts, calls, results


def _tool_use(at: str, block: dict[str, Any]) -> dict[str, Any]:
    """A `tool_use` block as an OpenAI tool call."""
    if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
        raise _bad(f"{at} must have a 'name' and an 'input' object", at)
    return {"id": str(block.get("id", "")), "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}}


def _tool_result(at: str, block: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A `tool_result` block as a tool message (its text and documents), and its images, which go
    into the user turn after the tool results."""
    if not isinstance(block.get("tool_use_id"), str):
        raise _bad(f"{at}.tool_use_id (a string) is required", at)
    content = block.get("content", "")
    parts: list[Any] = []
    images: list[dict[str, Any]] = []
    if isinstance(content, list):
        for k, item in enumerate(content):
            where = f"{at}.content[{k}]"
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "image":
                images.append(_image(where, item))
            elif kind == "document":
                found = _document(where, item)
                parts += [p for p in found if p.get("type") != "image_url"]
                images += [p for p in found if p.get("type") == "image_url"]
            elif kind == "text" and isinstance(item.get("text"), str):
                parts.append(item["text"])
            elif kind is None:
                raise _bad(f"{where} must be a content block with a 'type'", where)
    else:
        parts.append(_text(content, f"{at}.content"))
    if block.get("is_error"):
        parts.insert(0, "Error: ")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": _joined(parts)}, images


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    text = _system_text(value, "system")
    return [{"role": "system", "content": text}] if text else []


def _tools(body: dict[str, Any]) -> Any:
    """`tools` and `tool_choice` as the engine's ToolRequest (None: no tools)."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad("'tools' must be an array", "tools")
    functions = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise _bad(f"tools[{i}] must be an object", f"tools[{i}]")
        if tool.get("type") not in (None, "custom"):
            continue  # a server tool (web search, code execution ...): not offered here
        functions.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description") or "",
            "parameters": tool.get("input_schema") or {"type": "object"}}})
    choice = body.get("tool_choice")
    if choice is not None and not (isinstance(choice, dict)
                                   and choice.get("type") in ("auto", "any", "tool", "none")):
        raise _bad('\'tool_choice\' must be {"type": "auto" | "any" | "tool" | "none"}',
                   "tool_choice")
    kind = (choice or {}).get("type", "auto")
    if not functions or kind == "none":
        return None
    openai_choice: Any = {"auto": "auto", "any": "required"}.get(kind)
    if kind == "tool":
        openai_choice = {"type": "function", "function": {"name": choice.get("name")}}
    parallel = not (choice or {}).get("disable_parallel_tool_use", False)
    try:
        return tool_request(functions, openai_choice, parallel)
    except InvalidRequest as exc:
        raise _bad(str(exc), exc.field) from None


def _thinking(value: Any) -> int | None:
    """`thinking`: enabled with `budget_tokens` sets the thinking budget, disabled answers at
    once; adaptive (Claude Code) and absent leave the model's own way."""
    if not isinstance(value, dict):
        return None
    if value.get("type") == "disabled":
        return 0
    budget = value.get("budget_tokens")
    if value.get("type") == "enabled" and budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise _bad("'thinking.budget_tokens' must be a non-negative integer", "thinking")
        return budget
    return None


def _number(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}",
                       name, "invalid_type")
    return value


def _sampling(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """The `SamplingParams` fields a Messages request sets."""
    sampling: dict[str, Any] = {"max_tokens": max_tokens}
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
        if (value := _number(body, name, kind)) is not None:
            sampling[name] = value
    budget = _thinking(body.get("thinking"))
    if budget is not None:
        sampling["thinking_budget"] = budget
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _bad("'stop_sequences' must be an array of strings", "stop_sequences")
        if stops:
            sampling["stop"] = tuple(stops)
    return sampling


def parse(body: Any) -> tuple[list[dict[str, Any]], dict[str, Any], Any, bool]:
    """(engine messages, sampling fields, ToolRequest, stream) of a Messages request."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    max_tokens = _number(body, "max_tokens", int)
    if max_tokens is None or max_tokens < 1:
        raise _bad("'max_tokens' is required: a positive integer", "max_tokens")
    if not isinstance(body.get("model"), str):
        raise _bad("'model' is required: a string", "model")
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise _bad("'messages' must be a non-empty array", "messages")
    messages = _system(body.get("system")) + [m for i, t in enumerate(turns) for m in _turn(i, t)]
    messages = parse_messages(messages)
    sampling = _sampling(body, max_tokens)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", "stream", "invalid_type")
    return messages, sampling, _tools(body), stream


def _usage(usage: Usage) -> dict[str, int]:
    """Anthropic's usage: input tokens computed, and those read from the prefix cache apart."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


def _stop(final: Event) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if final.tool_calls:
        return "tool_use", None
    sequence = final.stats.get("stop_sequence")
    if sequence is not None:
        return "stop_sequence", sequence
    return _STOP_REASONS.get(final.finish_reason or "stop", "end_turn"), None


def _tool_block(call: Any) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:
        arguments = {}
    return {"type": "tool_use", "id": call.id or f"toolu_{uuid.uuid4().hex[:24]}",
            "name": call.name, "input": arguments if isinstance(arguments, dict) else {}}


def _content(choice: Choice) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if choice.reasoning:
        blocks.append({"type": "thinking", "thinking": "".join(choice.reasoning), "signature": ""})
    text = "".join(choice.content)
    if text or not (choice.final and choice.final.tool_calls):
        blocks.append({"type": "text", "text": text})
    blocks += [_tool_block(c) for c in (choice.final.tool_calls if choice.final else ())]
    return blocks


# The engine's refusal of a prompt longer than the context: "the prompt has N tokens; this
# model's context is M tokens".
_TOO_LONG = re.compile(r"(\d+) tokens;\D+(\d+) tokens")


def too_long(exc: ApiError) -> ApiError:
    """A prompt over the context as Anthropic words it, which Claude Code compacts on: 400
    `invalid_request_error`, "prompt is too long: N tokens > M maximum"; other errors as they are."""
    found = _TOO_LONG.search(exc.message) if exc.code == "context_length_exceeded" else None
    if found is None:
        return exc
    return ApiError(400, f"prompt is too long: {found[1]} tokens > {found[2]} maximum", exc.param,
                    exc.code)


async def messages_endpoint(request: Request) -> Response:
    engine = app_state(request).engine
    try:
        body = await read_body(request)
        messages, sampling, tools, streamed = await parse_by_cost(request, parse, body)
        model = await use_named_model(request, body.get("model"))
        engine = engine.on(model)  # its defaults, context and requests (issue 49)
        try:
            params = engine.defaults.params(sampling)
        except InvalidRequest as exc:
            raise ApiError(400, public_error(str(exc)), exc.field, exc.code) from None
        messages = await documents.read_documents(app_state(request), messages)
        try:
            handles = await submit(engine, messages, params, tools=tools, split_reasoning=True,
                                   fit_max_tokens=True)
        except ApiError as exc:
            raise too_long(exc) from None
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        if streamed:
            return stream(request, handles, MessageEncoder(message_id, model, lambda: handles[0].usage))
        choice = (await finished(request, handles))[0]
    except ApiError as exc:
        return exc.response(request.url.path)
    final = choice.final
    stop_reason, stop_sequence = _stop(final)
    return JSONResponse({"id": message_id, "type": "message", "role": "assistant", "model": model,
                         "content": _content(choice), "stop_reason": stop_reason,
                         "stop_sequence": stop_sequence, "usage": _usage(final.usage)})


def _event(kind: str, payload: dict[str, Any]) -> str:
    return sse(json.dumps({"type": kind, **payload}, ensure_ascii=False), event=kind)


class MessageEncoder:
    """Anthropic's event sequence: message_start, ping, content blocks with their deltas (a block
    opens when its kind of text starts and closes when another kind begins: thinking, then text,
    then tool calls), message_delta (stop_reason, usage), message_stop; a failure becomes an
    `error` event. A ping every 10 s of tokens keeps proxies from timing out."""

    def __init__(self, message_id: str, model: str, usage: Callable[[], Usage]) -> None:
        self.message_id, self.model, self.usage = message_id, model, usage
        self.started = False
        self.index = -1
        self.open: str | None = None
        self.last_ping = time.monotonic()

    def _switch(self, kind: str, start: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = kind
        out.append(_event("content_block_start", {"index": self.index, "content_block": start}))
        return out

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def opening(self) -> Iterable[str]:
        return []  # message_start waits for the first event: see `_start`

    def _start(self) -> list[str]:
        """message_start and a ping, once, with the first engine event: the prefix cache's reuse
        is known by then, so its usage counts input tokens as every later usage does."""
        if self.started:
            return []
        self.started = True
        usage = {**_usage(self.usage()), "output_tokens": 0}
        return [_event("message_start", {"message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}}),
            _event("ping", {})]

    def token(self, i: int, event: Event) -> Iterable[str]:
        out = self._start()
        if not event.text:
            return out
        kind = "thinking" if event.channel == "reasoning" else "text"
        if self.open != kind:
            out += self._switch(kind, {"type": kind, kind: ""})
        delta = {"type": f"{kind}_delta", kind: event.text}
        out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        if time.monotonic() - self.last_ping > 10:
            self.last_ping = time.monotonic()
            out.append(_event("ping", {}))
        return out

    def failed(self, i: int, event: Event) -> Iterable[str]:
        return [*self._start(), *self._close(), _event("error", {"error": {"type": "api_error",
                                                           "message": public_error(event.error)}})]

    def done(self, i: int, event: Event) -> Iterable[str]:
        out = self._start()
        if self.index < 0 and not event.tool_calls:  # an empty answer is one empty block
            out += self._switch("text", {"type": "text", "text": ""})
        for call in event.tool_calls:
            block = _tool_block(call)
            out += self._switch("tool_use", {**block, "input": {}})
            out.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}}))
        out += self._close()
        stop_reason, stop_sequence = _stop(event)
        out.append(_event("message_delta", {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": _usage(event.usage)}))
        out.append(_event("message_stop", {}))
        return out

    def closing(self, finals: list[Event], complete: bool) -> Iterable[str]:
        return []


async def count_tokens_endpoint(request: Request) -> Response:
    """`{"input_tokens": N}`: the prompt as a request with this body would be counted."""
    engine = app_state(request).engine
    try:
        body = await read_body(request)
        if isinstance(body, dict):
            body = {"max_tokens": 1, **body}
        messages, _, tools, _ = await parse_by_cost(request, parse, body)
        engine = engine.on(await use_named_model(request, body.get("model")))  # issue 49
        messages = await documents.read_documents(app_state(request), messages)
        try:
            n = await asyncio.to_thread(count_tokens, engine, messages=messages, tools=tools)
        except EngineError as exc:
            raise ApiError(400 if isinstance(exc, InvalidRequest) else 503, str(exc)) from None
    except ApiError as exc:
        return exc.response(request.url.path)
    return JSONResponse({"input_tokens": n})


routes = [
    Route(PATH, messages_endpoint, methods=["POST"]),
    Route(f"{PATH}/count_tokens", count_tokens_endpoint, methods=["POST"]),
]
