"""OpenAI's Responses API: `POST /v1/responses` (JSON or SSE), `GET` and `DELETE
/v1/responses/{id}`, for the `openai` SDK's `responses` and Codex CLI.

An adapter over the same engine requests as chat completions (app/api/serving.py): `input` (a
string or items: messages, function_call, function_call_output; reasoning items are skipped) and
`instructions` become engine messages, function `tools` a `ToolRequest` (`required` and a named
function decode under the grammar), `text.format` a JSON schema; the engine's events become
output items (reasoning, message, function_call) and OpenAI's stream events. `store` (the
default) keeps the response and its conversation in SQLite so that `previous_response_id`
continues it; `store: false` keeps nothing. Fields that ask for nothing this server must do
(`include`, `prompt_cache_key`, `truncation`, `user`, `service_tier` ...) and hosted tool types
(web search, ...) are ignored; `input_image` parts (data URLs) in user messages and function call
outputs are images (app/api/images.py; stored with the conversation as sent, once each:
app/storage/responses.py); `input_file` parts (a PDF or text as `file_data`) are documents
(app/api/documents.py). The fields a response echoes (`metadata`, `text`, `reasoning`,
`tool_choice`, hosted `tools` ...) are checked and bounded as OpenAI bounds them, since they are
stored; stored responses expire (`--responses-ttl`) and the store has a cap. Without
`max_output_tokens` the answer may use the context the prompt leaves. Model names that are no
local model run on the loaded one (`--model-alias` applies).
Per-request noise (a billing line in `instructions`, app/api/prompt_noise.py) never reaches the
prompt; a prompt longer than the context is refused at once with `context_length_exceeded` (400),
which Codex compacts on.
"""

import json
import time
import uuid
from typing import Any, Iterable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import Event, InvalidRequest, effort_budget, tool_request

from .error_shapes import api_error
from ..sse import sse
from ..state import app_state
from ..storage import StoredResponses
from ..submission import by_cost, costly_body
from . import documents
from .errors import ApiError
from .images import storable
from .openai_request import parse_messages
from .prompt_noise import without_noise
from .tool_messages import add_tool_result
from .response_format import json_schema
from .serving import (Choice, finished, public_error, read_body, stream, submit,
                      use_named_model)

_SKIPPED_ITEMS = {"reasoning", "item_reference", "web_search_call"}


def _new(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def _text(content: Any, where: str, images: bool = False) -> str | list[dict[str, Any]]:
    """A content's text; with `images` (a user message's content, a function call's output),
    `input_image` parts (an `image_url` data URL) and `input_file` parts (a document as
    `file_data`, app/api/documents.py) make it a list of text, OpenAI `image_url` parts (which
    parse_messages decodes; limits: app/api/images.py) and document parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or an array of content parts", where)
    parts: list[Any] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "input_image" and images and part.get("image_url") is not None:
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "input_file" and images:
            parts.append(_file(part, f"{where}[{j}]", where))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise _bad(f"{where}[{j}] is {kind}: this server reads text here, and images and "
                       "files in user messages and function call outputs", where)
        elif kind is None:
            raise _bad(f"{where}[{j}] must be a content part with a 'type'", where)
    if all(isinstance(p, str) for p in parts):
        return "".join(parts)
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]


def _file(part: dict[str, Any], where: str, param: str) -> dict[str, Any]:
    """An `input_file` part as a document part; a file id or URL is refused (nothing fetched)."""
    if part.get("file_data") is None and (part.get("file_id") or part.get("file_url")):
        raise documents.url_refused(where, param)
    return documents.from_data(part.get("file_data"), part.get("filename"), f"{where}.file_data",
                               param)


def input_messages(value: Any, instructions: Any) -> list[dict[str, Any]]:
    """`instructions` and `input` as engine (OpenAI chat) messages, per-request noise dropped from
    the instructions (app/api/prompt_noise.py)."""
    out: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("'instructions' must be a string", "instructions")
        instructions = without_noise(instructions)
        if instructions.strip():
            out.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        return out + [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("'input' must be a string or a non-empty array of items", "input")
    for i, item in enumerate(value):
        _add_item(out, f"input[{i}]", item)
    return out


def _add_item(out: list[dict[str, Any]], where: str, item: Any) -> None:
    """Input item `item` appended to `out` as engine messages (a function call joins the
    assistant turn before it; a function call output's images follow the outputs as a user
    turn)."""
    if not isinstance(item, dict):
        raise _bad(f"{where} must be an object", where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        out.append(_message(where, item))
    elif kind == "function_call":
        if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
            raise _bad(f"{where} needs 'name' and 'call_id'", where)
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
        if out and out[-1]["role"] == "assistant":  # the same turn as the text before it
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise _bad(f"{where}.call_id is required", where)
        output = _text(item.get("output", ""), f"{where}.output", images=True)
        add_tool_result(out, item["call_id"], output)
    elif kind not in _SKIPPED_ITEMS:
        raise _bad(f"{where}.type {json.dumps(kind)} is not supported here", where)


def _message(where: str, item: dict[str, Any]) -> dict[str, Any]:
    """A message item as an engine message (per-request noise dropped from system text)."""
    role = {"developer": "system"}.get(item.get("role"), item.get("role"))
    if role not in ("user", "assistant", "system"):
        raise _bad(f"{where}.role must be user, assistant, system or developer", where)
    content = _text(item.get("content", ""), f"{where}.content", images=role == "user")
    if role == "system" and isinstance(content, str):
        content = without_noise(content)
    return {"role": role, "content": content}


def _functions(tools: Any) -> list[dict[str, Any]]:
    """Function tools in chat's shape; those inside a `namespace` tool too; hosted tools left out."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("'tools' must be an array", "tools")
    out, seen = [], set()
    for tool in tools:
        if not isinstance(tool, dict):
            raise _bad("'tools' entries must be objects", "tools")
        if tool.get("type") == "namespace":
            out += [f for f in _functions(tool.get("tools") or []) if f["function"]["name"] not in seen]
            seen |= {f["function"]["name"] for f in out}
        elif tool.get("type") == "function" and tool.get("name") not in seen:
            seen.add(tool.get("name"))
            out.append({"type": "function", "function": {
                "name": tool.get("name"), "description": tool.get("description") or "",
                "parameters": tool.get("parameters") or {"type": "object"}}})
    return out


def _tool_request(body: dict[str, Any]) -> Any:
    functions = _functions(body.get("tools"))
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}} \
            if choice.get("type") == "function" else "auto"
    if not functions or choice == "none":
        return None
    try:
        return tool_request(functions, choice, body.get("parallel_tool_calls"))
    except InvalidRequest as exc:
        raise _bad(str(exc), exc.field) from None


def _format(body: dict[str, Any]) -> Any:
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_object":
        return {"type": "object"}
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return json_schema({"type": "json_schema", "json_schema": spec})
    raise _bad("'text.format.type' must be text, json_object or json_schema", "text.format")


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ApiError(400, f"'{name}' must be a number", name, "invalid_type")
            out[name] = value
    limit = body.get("max_output_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise _bad("'max_output_tokens' must be a positive integer", "max_output_tokens")
    out["max_tokens"] = limit or 1 << 30
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if effort is not None:
        try:
            out["thinking_budget"] = effort_budget(effort, "reasoning.effort")
        except InvalidRequest as exc:
            raise _bad(str(exc), "reasoning.effort") from None
    if (schema := _format(body)) is not None:
        out["json_schema"] = schema
    return out


def _items(choice_reasoning: str, text: str, final: Event | None) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if choice_reasoning:
        items.append({"type": "reasoning", "id": _new("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": choice_reasoning}]})
    if text or not (final and final.tool_calls):
        items.append({"type": "message", "id": _new("msg"), "status": "completed",
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": text, "annotations": []}]})
    for call in (final.tool_calls if final else ()):
        items.append({"type": "function_call", "id": _new("fc"), "call_id": call.id or _new("call"),
                      "name": call.name, "arguments": call.arguments, "status": "completed"})
    return items


def _usage(final: Event | None) -> dict[str, Any]:
    u = final.usage if final else None
    prompt, out, cached = (u.prompt_tokens, u.completion_tokens, u.cached_tokens) if u else (0, 0, 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + out}


# --- the echoed fields: checked and bounded, since a stored response keeps them -------------------

METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512  # OpenAI's limits
ECHO_BYTES = 16 * 1024  # one hosted tool's or a tool_choice's JSON
VERBOSITY = ("low", "medium", "high")
SUMMARIES = ("auto", "concise", "detailed")


def check_echoed(body: dict[str, Any]) -> None:
    """The fields a response echoes (and a stored one keeps) are what OpenAI allows, bounded;
    raises a 400 naming the field."""
    _check_metadata(body.get("metadata"))
    text = body.get("text")
    if text is not None and (not isinstance(text, dict) or set(text) - {"format", "verbosity"}
                             or text.get("verbosity") not in (None, *VERBOSITY)):
        raise _bad("'text' must be an object with 'format' and optionally 'verbosity' (low, medium, "
                   "high)", "text")
    _check_reasoning(body.get("reasoning"))
    if not isinstance(body.get("parallel_tool_calls", True), (bool, type(None))):
        raise ApiError(400, "'parallel_tool_calls' must be a boolean", "parallel_tool_calls",
                       "invalid_type")
    choice = body.get("tool_choice")
    if choice is not None and not (isinstance(choice, str) or isinstance(choice, dict)
                                   and _small(choice)):
        raise _bad("'tool_choice' must be a string or a small object", "tool_choice")
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        if isinstance(tool, dict) and tool.get("type") not in ("function", "namespace") \
                and not _small(tool):
            raise _bad(f"tools[{i}] (a hosted tool, not used here) is larger than {ECHO_BYTES} "
                       "bytes", f"tools[{i}]")


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > METADATA_PAIRS:
        raise _bad(f"'metadata' must be an object of at most {METADATA_PAIRS} pairs", "metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY or not isinstance(value, str) or len(value) > METADATA_VALUE:
            raise _bad(f"'metadata' keys are at most {METADATA_KEY} characters and its values "
                       f"strings of at most {METADATA_VALUE}", f"metadata.{key[:METADATA_KEY]}")


def _check_reasoning(reasoning: Any) -> None:
    if reasoning is None:
        return
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise _bad("'reasoning' must be an object with 'effort' and optionally 'summary'",
                   "reasoning")
    if not isinstance(reasoning.get("effort"), (str, type(None))):
        raise _bad("'reasoning.effort' must be a string", "reasoning.effort")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) not in (None, *SUMMARIES):
            raise _bad(f"'reasoning.{key}' must be one of {', '.join(SUMMARIES)}",
                       f"reasoning.{key}")


def _small(value: Any) -> bool:
    return len(json.dumps(value)) <= ECHO_BYTES


class _Request:
    """A parsed Responses request."""

    def __init__(self, body: Any, stored: StoredResponses):
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        check_echoed(body)
        self.body = body
        self.stream = body.get("stream", False)
        if not isinstance(self.stream, bool):
            raise ApiError(400, "'stream' must be a boolean", "stream", "invalid_type")
        self.store = body.get("store", True) is not False
        previous: list[dict[str, Any]] = []
        self.previous_id = body.get("previous_response_id")
        if self.previous_id is not None:
            found = stored.get(self.previous_id) if isinstance(self.previous_id, str) \
                else None
            if found is None:
                raise ApiError(400, f"Previous response with id '{self.previous_id}' not found.",
                               "previous_response_id", "previous_response_not_found")
            previous = found[1]
        self.messages = parse_messages(previous + input_messages(body.get("input"),
                                                                 body.get("instructions")))
        self.tools = _tool_request(body)
        self.sampling = _sampling(body)

    def envelope(self, rid: str, model: str, status: str) -> dict[str, Any]:
        b = self.body
        return {"id": rid, "object": "response", "created_at": int(time.time()),
                "status": status, "error": None, "incomplete_details": None,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "model": model, "output": [], "parallel_tool_calls": b.get("parallel_tool_calls", True),
                "previous_response_id": self.previous_id,
                "reasoning": {"effort": (b.get("reasoning") or {}).get("effort"), "summary": None},
                "store": self.store, "temperature": b.get("temperature"),
                "text": b.get("text") or {"format": {"type": "text"}},
                "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
                "top_p": b.get("top_p"), "truncation": "disabled", "usage": None,
                "metadata": b.get("metadata") or {}}

    def finish(self, envelope: dict[str, Any], items: list[dict[str, Any]], final: Event,
               stored: StoredResponses) -> dict[str, Any]:
        """The completed response; stored with its conversation unless `store` is false."""
        incomplete = final.finish_reason == "length"
        done = {**envelope, "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": items, "usage": _usage(final)}
        if self.store:
            text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
            calls = [{"id": i["call_id"], "type": "function",
                      "function": {"name": i["name"], "arguments": i["arguments"]}}
                     for i in items if i["type"] == "function_call"]
            answer = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
            stored.save(done["id"], done, *storable(self.messages + [answer]))
        return done


async def create(request: Request) -> Response:
    engine, stored = app_state(request).engine, app_state(request).responses
    try:
        body = await read_body(request)
        # images' headers, tool schemas and a stored conversation: off the event loop by cost
        parsed = await by_cost(costly_body(body, len(await request.body()))
                               or isinstance(body, dict) and "previous_response_id" in body,
                               _Request, body, stored)
        model = await use_named_model(request, parsed.body.get("model"))
        engine = engine.on(model)  # its defaults, context and requests (issue 49)
        try:
            params = engine.defaults.params(parsed.sampling)
        except InvalidRequest as exc:
            raise ApiError(400, public_error(str(exc)), exc.field, exc.code) from None
        parsed.messages = await documents.read_documents(app_state(request), parsed.messages)
        handles = await submit(engine, parsed.messages, params, tools=parsed.tools,
                               split_reasoning=True, fit_max_tokens=True)
        envelope = parsed.envelope(_new("resp"), model, "in_progress")
        if parsed.stream:
            return stream(request, handles, ResponseEncoder(parsed, envelope, stored))
        choice: Choice = (await finished(request, handles))[0]
    except ApiError as exc:
        return exc.response(request.url.path)
    final = choice.final
    items = _items("".join(choice.reasoning), "".join(choice.content), final)
    return JSONResponse(parsed.finish(envelope, items, final, stored))


class ResponseEncoder:
    """OpenAI's Responses stream events, each with its `event:` line and sequence number: created,
    in_progress, output items (reasoning, message, function calls) with their deltas, then always
    `response.completed` (the response's own status says "incomplete" when the limit cut it: the
    SDK's stream helper and Codex wait for that event alone), or `response.failed`."""

    def __init__(self, parsed: _Request, envelope: dict[str, Any], stored: StoredResponses) -> None:
        self.parsed, self.envelope, self.stored = parsed, envelope, stored
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None  # the item being streamed: reasoning or message
        self.texts: list[str] = []

    def _event(self, kind: str, **payload: Any) -> str:
        self.seq += 1
        return sse(json.dumps({"type": kind, "sequence_number": self.seq, **payload},
                              ensure_ascii=False), event=kind)

    def _close(self) -> list[str]:
        current = self.current
        if current is None:
            return []
        index, text = len(self.items) - 1, "".join(self.texts)
        if current["type"] == "reasoning":
            current["content"] = [{"type": "reasoning_text", "text": text}]
            out = [self._event("response.reasoning_text.done", item_id=current["id"],
                               output_index=index, content_index=0, text=text)]
        else:
            part = {"type": "output_text", "text": text, "annotations": []}
            current["content"], current["status"] = [part], "completed"
            out = [self._event("response.output_text.done", item_id=current["id"],
                               output_index=index, content_index=0, text=text),
                   self._event("response.content_part.done", item_id=current["id"],
                               output_index=index, content_index=0, part=part)]
        out.append(self._event("response.output_item.done", output_index=index, item=current))
        self.current = None
        self.texts.clear()
        return out

    def _open(self, kind: str) -> list[str]:
        out = self._close()
        if kind == "reasoning":
            current = {"type": "reasoning", "id": _new("rs"), "summary": [], "content": []}
        else:
            current = {"type": "message", "id": _new("msg"), "status": "in_progress",
                       "role": "assistant", "content": []}
        self.current = current
        self.items.append(current)
        index = len(self.items) - 1
        out.append(self._event("response.output_item.added", output_index=index, item=current))
        if kind == "message":
            out.append(self._event("response.content_part.added", item_id=current["id"],
                                   output_index=index, content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def _function_call(self, call: Any) -> list[str]:
        item = {"type": "function_call", "id": _new("fc"), "call_id": call.id or _new("call"),
                "name": call.name, "arguments": "", "status": "in_progress"}
        self.items.append(item)
        index = len(self.items) - 1
        out = [self._event("response.output_item.added", output_index=index, item=item),
               self._event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=index, delta=call.arguments),
               self._event("response.function_call_arguments.done", item_id=item["id"],
                           output_index=index, arguments=call.arguments)]
        item.update(arguments=call.arguments, status="completed")
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def opening(self) -> Iterable[str]:
        return [self._event("response.created", response=self.envelope),
                self._event("response.in_progress", response=self.envelope)]

    def token(self, i: int, event: Event) -> Iterable[str]:
        if not event.text:
            return []
        kind = "reasoning" if event.channel == "reasoning" else "message"
        out = self._open(kind) if self.current is None or self.current["type"] != kind else []
        self.texts.append(event.text)
        name = "response.reasoning_text.delta" if kind == "reasoning" else \
            "response.output_text.delta"
        out.append(self._event(name, item_id=self.current["id"], output_index=len(self.items) - 1,
                               content_index=0, delta=event.text))
        return out

    def failed(self, i: int, event: Event) -> Iterable[str]:
        failed = {**self.envelope, "status": "failed", "output": self.items,
                  "error": {"code": "server_error", "message": public_error(event.error)}}
        return [*self._close(), self._event("response.failed", response=failed)]

    def done(self, i: int, event: Event) -> Iterable[str]:
        out = self._open("message") if not self.items and not event.tool_calls else []
        out += self._close()
        for call in event.tool_calls:
            out += self._function_call(call)
        done = self.parsed.finish(self.envelope, self.items, event, self.stored)
        out.append(self._event("response.completed", response=done))
        return out

    def closing(self, finals: list[Event], complete: bool) -> Iterable[str]:
        return []


async def retrieve(request: Request) -> Response:
    found = app_state(request).responses.get(request.path_params["rid"])
    if found is None:
        return api_error(404, f"Response with id '{request.path_params['rid']}' not found.",
                         "invalid_request_error", "not_found")
    return JSONResponse(found[0])


async def delete(request: Request) -> Response:
    rid = request.path_params["rid"]
    if not app_state(request).responses.delete(rid):
        return api_error(404, f"Response with id '{rid}' not found.", "invalid_request_error",
                         "not_found")
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


routes = [
    Route("/v1/responses", create, methods=["POST"]),
    Route("/v1/responses/{rid}", retrieve, methods=["GET"]),
    Route("/v1/responses/{rid}", delete, methods=["DELETE"]),
]
