"""Ollama's API under `/api`, for tools that speak only Ollama (`OLLAMA_HOST=http://127.0.0.1:8321`
or `mlxchat serve --port 11434`): version, tags, show, ps, chat, generate, pull, delete.

An adapter over the same engine requests as the OpenAI and Anthropic endpoints
(app/api/serving.py): prefix reuse, cancel on disconnect, admission, constrained decoding
(`format`), the API key. Streams are newline-delimited JSON (`stream` defaults to true, as in
Ollama); errors are `{"error": "..."}`.

Names: Ollama clients write `name:tag`. A name matches a local model by dropping a `:latest` tag
(and an `hf.co/` prefix), case aside; `/api/tags` lists each model as `<id>:latest`. Other names
run on the loaded model, as on `/v1/messages` (aliases from `--model-alias` apply first).
`/api/embed` and `/api/embeddings` run through the engine's embedding queue (app/api/embeddings.py).
`prompt_eval_count` counts only the prompt tokens actually computed, so the prefix cache's reuse
shows; durations are nanoseconds. Several models stay loaded at once (the engine's model pool):
`/api/ps` lists those in memory with the bytes of their weights and when each unloads if still
idle; a chat with no messages (or a generate with an empty prompt) loads the model, and with
`keep_alive: 0` unloads it instead, as in Ollama. A `suffix` on generate fills in the middle (the model's FIM
tokens, engine `Infill`; 400 for a model without them, as Ollama's "does not support insert").
Accepted and ignored: `options.num_ctx` (the model's own
context is used), `template`, and `raw` on chat.
"""

import asyncio
import functools
import hashlib
import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import (DownloadError, Engine, EngineError, Event, Infill, InvalidRequest, ModelInfo,
                    device_report, effort_budget, keep_alive_seconds, parse_pull_spec, pull_model,
                    remove_model, tool_request)

from ..state import app_state
from .embeddings import embed as embed_vectors
from .errors import ApiError
from .models import context_length, described, iso_time, local_models, model_config
from .openai_request import parse_messages
from .serving import (Choice, aliased, finished, parse_by_cost, public_error, read_body, stream,
                      submit, use_named_model, wait_for_model)

# The Ollama version we answer as: clients check it (codex --oss needs >= 0.13.4).
VERSION = "0.13.5"
# Ollama's option names and ours (SamplingParams); the others Ollama has are accepted, ignored.
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "num_predict": "max_tokens", "seed": "seed", "repeat_penalty": "repetition_penalty",
           "repeat_last_n": "repetition_context_size", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty"}
DONE_REASONS = {"length": "length", "stop": "stop", "tool_calls": "stop", "cancelled": "stop"}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _from(exc: ApiError) -> JSONResponse:
    return _error(exc.status, exc.message, exc.headers)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def ollama_name(model_id: str) -> str:
    return model_id if ":" in model_id.split("/")[-1] else f"{model_id}:latest"


def local_id(request: Request, name: Any) -> str | None:
    """The local model an Ollama-style name stands for (None: no local model has it)."""
    if not isinstance(name, str):
        return None
    wanted = name.removeprefix("hf.co/").removesuffix(":latest").lower()
    for m in local_models(app_state(request).engine):
        if m.name.lower() in (wanted, name.lower()):
            return m.name
    return None


def _digest(m: ModelInfo) -> str:
    return hashlib.sha256(f"{m.name}|{m.path}|{m.size_bytes}".encode()).hexdigest()


def _details(engine: Engine, m: ModelInfo) -> dict[str, Any]:
    loaded = described(engine, m.name)
    return {"parent_model": "", "format": "gguf" if m.source == "gguf" else "safetensors",
            "family": loaded.family if loaded else "", "families": [loaded.family] if loaded else [],
            "parameter_size": "", "quantization_level": ""}


def _entry(engine: Engine, m: ModelInfo) -> dict[str, Any]:
    path = Path(m.path) if m.path else None
    modified = datetime.fromtimestamp(path.stat().st_mtime if path and path.exists()
                                      else time.time(), timezone.utc)
    return {"name": ollama_name(m.name), "model": ollama_name(m.name),
            "modified_at": modified.isoformat().replace("+00:00", "Z"),
            "size": m.size_bytes or 0, "digest": _digest(m), "details": _details(engine, m)}


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


async def tags(request: Request) -> Response:
    engine = app_state(request).engine
    return JSONResponse({"models": [_entry(engine, m) for m in local_models(engine)]})


# What /api/ps says of a model that stays loaded until told otherwise (Ollama's own far date).
FOREVER = "2318-01-01T00:00:00Z"


@functools.cache
def _on_gpu() -> bool:
    """Whether the models run on a GPU (their weights then count as `size_vram`)."""
    return device_report().get("device") not in (None, "cpu")


async def ps(request: Request) -> Response:
    """The models in memory, most recently used first: `size` is the bytes of their weights
    (reserved in the memory budget; on a GPU as `size_vram` too), `expires_at` when each unloads
    if still idle."""
    engine = app_state(request).engine
    local = {m.name: m for m in local_models(engine)}
    on_gpu = _on_gpu()
    out = []
    for r in engine.loaded_models():
        m = local.get(r.name) or ModelInfo(r.name, "folder", None, r.weight_bytes)
        out.append({**_entry(engine, m), "size": r.weight_bytes,
                    "size_vram": r.weight_bytes if on_gpu else 0,
                    "expires_at": iso_time(r.expires_at) or FOREVER,
                    "context_length": r.context_length})
    return JSONResponse({"models": out})


async def _named(request: Request) -> tuple[str, str] | Response:
    """(the name a show/delete body gives, the local model it names); else the error answer."""
    try:
        body = await read_body(request)
    except ApiError as exc:
        return _from(exc)
    name = body.get("model", body.get("name")) if isinstance(body, dict) else None
    found = local_id(request, name)
    if found is None:
        return _error(404, f"model '{name}' not found")
    return name, found


async def show(request: Request) -> Response:
    engine = app_state(request).engine
    named = await _named(request)
    if isinstance(named, Response):
        return named
    name, found = named
    m = next(m for m in local_models(engine) if m.name == found)
    known = described(engine, found)
    config = model_config(m)
    family = known.family if known else config.get("model_type", "")
    context = context_length(m, engine)  # as /v1/models reports it
    info = {"general.architecture": family, "general.basename": m.name}
    if context:
        info[f"{family}.context_length"] = context
    return JSONResponse({"modelfile": "", "parameters": "", "template": "",
                         "details": _details(engine, m), "model_info": info,
                         "capabilities": list(known.capabilities if known
                                              else ("completion",)),
                         "modified_at": _entry(engine, m)["modified_at"]})


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The `SamplingParams` fields of a chat/generate body: `options`, `format`, `think`."""
    out = _options(body.get("options") or {})
    fmt = body.get("format")
    if fmt == "json":
        out["json_schema"] = {"type": "object"}
    elif isinstance(fmt, dict):
        out["json_schema"] = fmt
    elif fmt not in (None, ""):
        raise ApiError(400, "'format' must be \"json\" or a JSON schema object")
    out.setdefault("max_tokens", 1 << 30)
    budget = _thinking_budget(body.get("think"))
    if budget is not None:
        out["thinking_budget"] = budget
    return out


def _options(options: Any) -> dict[str, Any]:
    """Ollama's `options` by our names (OPTIONS), with `stop`."""
    if not isinstance(options, dict):
        raise ApiError(400, "'options' must be an object")
    out: dict[str, Any] = {}
    for name, ours in OPTIONS.items():
        value = options.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(400, f"option '{name}' must be a number")
        out[ours] = value
    if out.get("max_tokens", 1) < 1:  # -1 (no limit) and -2 (fill the context): the context left
        out["max_tokens"] = 1 << 30
    stop = options.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError(400, "option 'stop' must be a string or an array of strings")
        if stop:
            out["stop"] = tuple(stop)
    return out


def _thinking_budget(think: Any) -> int | None:
    """`think`: false answers at once, an effort sets a budget, true or absent the model's way."""
    if think is False:
        return 0
    if isinstance(think, str):
        try:
            return effort_budget(think, "think")
        except InvalidRequest as exc:
            raise ApiError(400, str(exc)) from None
    if think not in (None, True):
        raise ApiError(400, "'think' must be true, false, \"low\", \"medium\" or \"high\"")
    return None


def _with_images(where: str, images: Any, text: str) -> str | list[dict[str, Any]]:
    """Content with Ollama's `images` (base64 strings), placed before the text as Ollama places
    them, as OpenAI `image_url` parts that parse_messages decodes (limits: app/api/images.py)."""
    if not images:
        return text
    if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
        raise ApiError(400, f"{where}.images must be an array of base64 strings", f"{where}.images")
    return [{"type": "image_url", "image_url": {"url": f"data:;base64,{x}"}} for x in images] + \
        [{"type": "text", "text": text}]


def _chat_messages(value: Any) -> list[dict[str, Any]]:
    """Ollama's messages as engine messages: tool calls get ids, and a tool message answers the
    oldest open call of its `tool_name`."""
    if not isinstance(value, list):
        raise ApiError(400, "'messages' must be an array")
    out, open_calls = [], []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object")
        message = {"role": m.get("role"),
                   "content": _with_images(f"messages[{i}]", m.get("images"), m.get("content") or "")}
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise ApiError(400, f"messages[{i}].tool_calls must be an array")
            message["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ApiError(400, f"messages[{i}].tool_calls[{j}] needs a function name")
                args = fn.get("arguments", {})
                call_id = f"call_{i}_{j}"
                open_calls.append((call_id, fn["name"]))
                message["tool_calls"].append({"id": call_id, "type": "function", "function": {
                    "name": fn["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args)}})
        if m.get("role") == "tool":
            name = m.get("tool_name") or m.get("name")
            match = next((c for c in open_calls if c[1] == name), open_calls[0] if open_calls
                         else (f"call_{i}", name))
            if match in open_calls:
                open_calls.remove(match)
            message["tool_call_id"] = match[0]
        out.append(message)
    return out


def _tools(body: dict[str, Any]) -> Any:
    tools = body.get("tools")
    if not tools:
        return None
    try:
        return tool_request(tools, "auto")
    except InvalidRequest as exc:
        raise ApiError(400, str(exc)) from None


async def _run(request: Request, messages: list[dict[str, Any]] | None, body: dict[str, Any],
               tools: Any, text: str | None = None,
               infill: Infill | None = None) -> tuple[list, dict[str, Any], float]:
    """Submit; returns (handles, what the answers need to know, when it started)."""
    started = time.perf_counter()
    model = await use_named_model(request, body.get("model"))
    engine = app_state(request).engine.on(model)
    loaded_at = time.perf_counter()
    sampling = _sampling(body)
    try:
        params = engine.defaults.params(sampling)
    except InvalidRequest as exc:
        raise ApiError(400, public_error(str(exc))) from None
    options = {"text": text} if text is not None else {"infill": infill} if infill else {}
    handles = await submit(engine, messages, params, tools=tools, split_reasoning=True,
                           keep_alive=body.get("keep_alive"), fit_max_tokens=True, **options)
    return handles, {"model": ollama_name(model), "load_ns": int((loaded_at - started) * 1e9)}, \
        started


def _timings(final: Event, meta: dict[str, Any], started: float) -> dict[str, Any]:
    usage, timings = final.usage, final.timings
    evaluated = max(usage.prompt_tokens - usage.cached_tokens, 0)
    prompt_ns = int((timings.ttft_s or 0) * 1e9)
    eval_ns = int(usage.completion_tokens / timings.tokens_per_s * 1e9) \
        if timings.tokens_per_s else 0
    return {"done_reason": DONE_REASONS.get(final.finish_reason or "stop", "stop"),
            "total_duration": int((time.perf_counter() - started) * 1e9),
            "load_duration": meta["load_ns"], "prompt_eval_count": evaluated,
            "prompt_eval_duration": prompt_ns, "eval_count": usage.completion_tokens,
            "eval_duration": eval_ns}


def _calls(final: Event) -> list[dict[str, Any]]:
    out = []
    for call in final.tool_calls:
        try:
            args = json.loads(call.arguments or "{}")
        except json.JSONDecodeError:
            args = {}
        out.append({"function": {"name": call.name, "arguments": args}})
    return out


def _ndjson(lines: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def encode() -> AsyncIterator[str]:
        async for line in lines:
            yield json.dumps(line, ensure_ascii=False) + "\n"
    return StreamingResponse(encode(), media_type="application/x-ndjson")


def _piece(chat: bool, text: str, thinking: str = "", calls: list | None = None) -> dict[str, Any]:
    """Answer text as Ollama writes it: chat answers carry `message`, generate answers `response`."""
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"message": message}
    return {"response": text, **({"thinking": thinking} if thinking else {})}


class OllamaEncoder:
    """Ollama's stream: one NDJSON object per token (`done: false`), then the final one with the
    timings (`done: true`); a failure is an `{"error": ...}` line."""

    def __init__(self, meta: dict[str, Any], started: float, chat: bool) -> None:
        self.meta, self.started, self.chat = meta, started, chat

    def _line(self, body: dict[str, Any]) -> str:
        return json.dumps(body, ensure_ascii=False) + "\n"

    def opening(self) -> Iterable[str]:
        return []

    def token(self, i: int, event: Event) -> Iterable[str]:
        if not event.text:
            return []
        thinking = event.channel == "reasoning"
        return [self._line({"model": self.meta["model"], "created_at": _now(),
                            **_piece(self.chat, "" if thinking else event.text,
                                     event.text if thinking else ""), "done": False})]

    def done(self, i: int, event: Event) -> Iterable[str]:
        return [self._line({"model": self.meta["model"], "created_at": _now(),
                            **_piece(self.chat, "", "", _calls(event)), "done": True,
                            **_timings(event, self.meta, self.started)})]

    def failed(self, i: int, event: Event) -> Iterable[str]:
        return [self._line({"error": public_error(event.error)})]

    def closing(self, finals: list[Event], complete: bool) -> Iterable[str]:
        return []


async def _answer(request: Request, handles: list, meta: dict[str, Any], started: float,
                  streamed: bool, chat: bool) -> Response:
    """The answer as NDJSON chunks or one object."""
    if streamed:
        return stream(request, handles, OllamaEncoder(meta, started, chat),
                      media_type="application/x-ndjson")
    try:
        choice: Choice = (await finished(request, handles))[0]
    except ApiError as exc:
        return _from(exc)
    final = choice.final
    return JSONResponse({"model": meta["model"], "created_at": _now(),
                         **_piece(chat, "".join(choice.content), "".join(choice.reasoning),
                                  _calls(final)),
                         "done": True, **_timings(final, meta, started)})


def _stream_flag(body: dict[str, Any]) -> bool:
    value = body.get("stream", True)
    if not isinstance(value, bool):
        raise ApiError(400, "'stream' must be a boolean")
    return value


async def chat(request: Request) -> Response:
    try:
        body = await read_body(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        streamed = _stream_flag(body)
        messages = _chat_messages(body.get("messages", []))
        if not messages:  # Ollama's way to load (or with keep_alive 0 unload) a model
            return await _load_or_unload(request, body, {"message": {"role": "assistant",
                                                                     "content": ""}})
        messages, tools = await parse_by_cost(
            request, lambda b: (parse_messages(messages), _tools(b)), body)
        handles, meta, started = await _run(request, messages, body, tools)
    except ApiError as exc:
        return _from(exc)
    return await _answer(request, handles, meta, started, streamed, chat=True)


async def generate(request: Request) -> Response:
    try:
        body = await read_body(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        streamed = _stream_flag(body)
        prompt, system = body.get("prompt", ""), body.get("system")
        if not isinstance(prompt, str) or (system is not None and not isinstance(system, str)):
            raise ApiError(400, "'prompt' and 'system' must be strings")
        if not prompt:  # Ollama's way to load (or with keep_alive 0 unload) a model
            return await _load_or_unload(request, body, {"response": ""})
        suffix = body.get("suffix")
        if suffix not in (None, ""):  # fill in the middle (a model without FIM tokens: 400)
            if not isinstance(suffix, str):
                raise ApiError(400, "'suffix' must be a string")
            handles, meta, started = await _run(request, None, body, None,
                                                infill=Infill(prefix=prompt, suffix=suffix))
        elif body.get("raw"):
            handles, meta, started = await _run(request, None, body, None, text=prompt)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": _with_images("the request", body.get("images"), prompt)}]
            messages = await parse_by_cost(request, lambda b: parse_messages(messages), body)
            handles, meta, started = await _run(request, messages, body, None)
    except ApiError as exc:
        return _from(exc)
    return await _answer(request, handles, meta, started, streamed, chat=False)


async def _load_or_unload(request: Request, body: dict[str, Any],
                          empty: dict[str, Any]) -> Response:
    """A request with nothing to answer: `keep_alive` 0 unloads the model it names (at once, or
    once its running requests end), anything else loads it and sets how long it stays."""
    if _unloads(body.get("keep_alive")):
        engine = app_state(request).engine
        name = local_id(request, aliased(app_state(request).aliases, body.get("model") or "")) \
            if isinstance(body.get("model"), str) else None
        name = name or engine.model_name
        if name is not None:
            engine.unload_model(name)
        return JSONResponse({"model": ollama_name(name or ""), "created_at": _now(), **empty,
                             "done": True, "done_reason": "unload"})
    model = await use_named_model(request, body.get("model"))
    keep = body.get("keep_alive")
    if keep is not None:  # how long it stays loaded from now, as a request's would
        try:
            app_state(request).engine.on(model).touch(keep)
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), "keep_alive") from None
    return JSONResponse({"model": ollama_name(model), "created_at": _now(), **empty,
                         "done": True, "done_reason": "load"})


def _unloads(keep_alive: Any) -> bool:
    """Whether a `keep_alive` asks to unload now (0, "0", "0s", "0m"...)."""
    try:
        return keep_alive is not None and keep_alive_seconds(keep_alive) == 0
    except InvalidRequest:
        return False


def _hub_spec(name: str) -> str:
    """An Ollama pull name as our hub spec: `hf.co/owner/repo[:FILE.gguf]`, tag `latest` dropped."""
    return name.removeprefix("hf.co/").removeprefix("huggingface.co/").removesuffix(":latest")


async def _pull_request(request: Request) -> tuple[str, bool]:
    """(the model to pull, whether to stream the progress) of a pull body; raises ApiError."""
    body = await read_body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not name:
        raise ApiError(400, "'model' (the model to pull) is required")
    return name, _stream_flag(body)


async def pull(request: Request) -> Response:
    """Download a model from the Hugging Face hub (`owner/repo` or `owner/repo:FILE.gguf`, also
    written `hf.co/owner/repo:...`) with progress lines as Ollama streams them."""
    try:
        name, streamed = await _pull_request(request)
    except ApiError as exc:
        return _from(exc)
    try:
        parse_pull_spec(_hub_spec(name))
    except DownloadError as exc:  # not a name the hub has: the client's mistake
        return _error(400, str(exc).split("\n", 1)[0])
    if local_id(request, name) is not None:  # already here
        done = {"status": "success"}
        return _ndjson(_one(done)) if streamed else JSONResponse(done)
    updates: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def progress(p: Any) -> None:
        loop.call_soon_threadsafe(updates.put_nowait, {
            "status": f"pulling {p.file}", "digest": p.file, "total": p.total_bytes,
            "completed": p.done_bytes})

    async def fetch() -> str | None:
        try:
            await asyncio.to_thread(pull_model, _hub_spec(name), progress)
            return None
        except (DownloadError, EngineError) as exc:
            return str(exc).split("\n", 1)[0]

    if not streamed:
        failure = await fetch()
        return _error(502, failure) if failure else JSONResponse({"status": "success"})

    return _ndjson(_pull_progress(fetch, updates))


async def _pull_progress(fetch: Callable[[], Awaitable[str | None]],
                         updates: asyncio.Queue) -> AsyncIterator[dict[str, Any]]:
    """Ollama's pull progress lines while `fetch` runs, then success or its error."""
    yield {"status": "pulling manifest"}
    task = asyncio.create_task(fetch())
    while not task.done() or not updates.empty():
        try:
            yield await asyncio.wait_for(updates.get(), 0.2)
        except TimeoutError:
            continue
    failure = task.result()
    if failure:
        yield {"error": failure}
    else:
        yield {"status": "verifying sha256 digest"}
        yield {"status": "success"}


async def _one(line: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    yield line


async def delete(request: Request) -> Response:
    named = await _named(request)
    if isinstance(named, Response):
        return named
    name, found = named
    engine = app_state(request).engine
    if found == engine.model_name or found in {m.name for m in engine.loaded_models()}:
        return _error(409, f"model '{name}' is loaded; unload it first (keep_alive 0) or load "
                           f"another model")
    try:
        await asyncio.to_thread(remove_model, found)
    except (DownloadError, EngineError) as exc:
        return _error(400, str(exc))
    return JSONResponse({})


def _embedding_model(request: Request, name: Any) -> str | None:
    """The model an embed request names: an alias, a local model, or a folder; any other name
    embeds with the loaded chat model (None), as chat names do."""
    if not isinstance(name, str):
        return None
    target = aliased(app_state(request).aliases, name)
    return local_id(request, target) or (target if Path(target).expanduser().exists() else None)


async def embed(request: Request) -> Response:
    """`/api/embed` (`input`: a string or strings -> `embeddings`) and the older `/api/embeddings`
    (`prompt` -> `embedding`), through the engine's embedding queue."""
    legacy = request.url.path.endswith("/embeddings")
    started = time.perf_counter()
    try:
        body = await read_body(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        inputs = body.get("prompt") if legacy else body.get("input")
        if inputs is None:
            raise ApiError(400, f"'{'prompt' if legacy else 'input'}' is required")
        dimensions = body.get("dimensions")
        await wait_for_model(request)  # a model that is loading: wait for it a while
        result = await embed_vectors(
            app_state(request).engine, inputs, model=_embedding_model(request, body.get("model")),
            dimensions=dimensions if isinstance(dimensions, int) else None,
            truncate=body.get("truncate", True) is not False, keep_alive=body.get("keep_alive"),
            request=request)
    except ApiError as exc:
        return _from(exc)
    vectors = [v.tolist() for v in result.vectors]
    if legacy:
        return JSONResponse({"embedding": vectors[0]})
    return JSONResponse({"model": ollama_name(result.model), "embeddings": vectors,
                         "total_duration": int((time.perf_counter() - started) * 1e9),
                         "load_duration": 0, "prompt_eval_count": result.prompt_tokens})


routes = [
    Route("/api/version", version),
    Route("/api/tags", tags),
    Route("/api/ps", ps),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/pull", pull, methods=["POST"]),
    Route("/api/delete", delete, methods=["DELETE"]),
    Route("/api/embed", embed, methods=["POST"]),
    Route("/api/embeddings", embed, methods=["POST"]),
]
