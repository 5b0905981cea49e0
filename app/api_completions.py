"""The legacy `/v1/completions` endpoint for raw-prompt clients: the prompt is sent to the model as
it is (no chat template), streamed or not, with the chat endpoint's sampling fields, `n` and
`logit_bias`; `logprobs` is the legacy integer (how many alternatives per token)."""

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import InvalidRequest, RequestHandle, SamplingParams, TokenLogprob

from .api import (_SAMPLING, ApiError, cancel_on_disconnect, _param, _typed, finished_choices,
                  sse_response, submit_choices, usage_body)
from .api_errors import check_fields
from .api_models import use_model
from .api_choices import MAX_CHOICES, merged, system_fingerprint, total_usage, tracked
from .security import api_error
from .sse import sse

_FIELDS = {"model", "prompt", "stream", "stream_options", "stop", "n", "logprobs", "logit_bias",
           "user", "presence_penalty", "frequency_penalty"} | set(_SAMPLING)
LEGACY_MAX_TOKENS = 16  # OpenAI's default for this endpoint


def _legacy_logprobs(entries: list[TokenLogprob], wanted: bool) -> dict[str, Any] | None:
    if not wanted:
        return None
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets}


def _is_tokens(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt(prompt: Any) -> str | list[int]:
    """The one prompt of a request, as text or token ids; OpenAI's forms are a string, token ids,
    or an array of either (one prompt per completion: here, one per request)."""
    if isinstance(prompt, list) and prompt and not _is_tokens(prompt) and \
            all(isinstance(p, str) or _is_tokens(p) for p in prompt):
        if len(prompt) > 1:
            raise ApiError(400, f"'prompt' holds {len(prompt)} prompts; send one prompt per "
                                "request", "prompt", "invalid_value")
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt or _is_tokens(prompt):
        return prompt
    raise ApiError(400, "'prompt' must be a non-empty string or an array of token ids",
                   "prompt", "invalid_value")


def parse(body: Any, model_name: str) -> tuple[str | list[int], SamplingParams, int, bool, bool]:
    """(prompt as text or token ids, params, n, stream, include_usage) of a `/v1/completions` body."""
    check_fields(body, _FIELDS)
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0)):
        if body.get(name) not in (None, neutral):
            raise ApiError(400, f"'{name}' is not supported", name, "unsupported_parameter")
    model = _typed(body, "model", str)
    if model is not None and model != model_name:
        raise ApiError(404, f"The model '{model}' does not exist or is not loaded "
                            f"(this server runs '{model_name}')", "model", "model_not_found")
    prompt = _prompt(body.get("prompt"))
    sampling = {k: v for k, kind in _SAMPLING.items() if (v := _typed(body, k, kind)) is not None}
    sampling.setdefault("max_tokens", LEGACY_MAX_TOKENS)
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError(400, "'stop' must be a string or an array of strings", "stop")
        sampling["stop"] = tuple(stop)
    logprobs = _typed(body, "logprobs", int)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    if bias := _typed(body, "logit_bias", dict):
        sampling["logit_bias"] = bias
    try:
        params = SamplingParams(**sampling)
    except InvalidRequest as exc:
        param = "logprobs" if exc.field == "top_logprobs" else _param(exc)
        raise ApiError(400, str(exc).replace("top_logprobs", "logprobs"), param,
                       exc.code or "invalid_value") from None
    n = _typed(body, "n", int) or 1
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"'n' must be an integer in [1, {MAX_CHOICES}]", "n", "invalid_value")
    stream = _typed(body, "stream", bool) or False
    options = _typed(body, "stream_options", dict) or {}
    if options and (not stream or set(options) - {"include_usage"}):
        raise ApiError(400, "'stream_options' may only hold 'include_usage', with 'stream': true",
                       "stream_options")
    return prompt, params, n, stream, bool(options.get("include_usage"))


async def completions(request: Request) -> Response:
    engine = request.app.state.engine
    try:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
        if engine.model_name is None:
            return api_error(503, "a model is loading; try again shortly", "server_error",
                             "model_loading", headers={"Retry-After": "5"})
        wanted = body.get("model") if isinstance(body, dict) else None
        if isinstance(wanted, str) and wanted != engine.model_name:
            parse(body, wanted)  # a bad request loads nothing
            await use_model(request, wanted)
        prompt, params, n, stream, include_usage = parse(body, engine.model_name)
        handles = await submit_choices(engine, None, params, n, None, **(
            {"text": prompt} if isinstance(prompt, str) else {"prompt_tokens": prompt}))
    except ApiError as err:
        return err.response()
    meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": engine.model_name,
            "system_fingerprint": system_fingerprint(engine.model_name)}
    runs, wanted = request.app.state.runs, params.logprobs is not None
    if stream:
        return sse_response(_stream(request, runs, handles, meta, include_usage, wanted))
    choices = await finished_choices(request, runs, handles)
    if isinstance(choices, Response):
        return choices
    finals = [c.final for c in choices]
    return JSONResponse({**meta, "choices": [
        {"index": i, "text": "".join(c.content), "finish_reason": c.final.finish_reason,
         "logprobs": _legacy_logprobs(c.logprobs, wanted)} for i, c in enumerate(choices)],
        "usage": usage_body(total_usage(finals))})


async def _stream(request: Request, runs: Any, handles: list[RequestHandle], meta: dict[str, Any],
                  include_usage: bool, wanted: bool) -> AsyncIterator[str]:
    def chunk(i: int, text: str, finish_reason: str | None = None,
              entries: list[TokenLogprob] | None = None) -> str:
        choice = {"index": i, "text": text, "finish_reason": finish_reason,
                  "logprobs": _legacy_logprobs(entries or [], wanted)}
        return sse(json.dumps({**meta, "choices": [choice]}, ensure_ascii=False))

    finals = []
    with tracked(runs, handles):
        watcher = asyncio.create_task(cancel_on_disconnect(request, handles))
        try:
            async for i, event in merged(handles):
                if event.kind == "token":
                    if event.text or event.logprobs is not None:
                        yield chunk(i, event.text, entries=[event.logprobs] if event.logprobs else [])
                elif event.finish_reason == "failed":
                    yield sse(json.dumps({"error": {"message": event.error or "generation failed",
                                                    "type": "server_error", "param": None,
                                                    "code": "generation_failed"}}))
                else:
                    finals.append(event)
                    yield chunk(i, "", event.finish_reason)
            if include_usage and len(finals) == len(handles):
                yield sse(json.dumps({**meta, "choices": [],
                                      "usage": usage_body(total_usage(finals))}))
            yield sse("[DONE]")
        finally:
            watcher.cancel()


routes = [Route("/v1/completions", completions, methods=["POST"])]
