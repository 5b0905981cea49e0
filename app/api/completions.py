"""The legacy `/v1/completions` endpoint for raw-prompt clients: the prompt is sent to the model as
it is (no chat template), streamed or not, with the chat endpoint's sampling fields, `n` and
`logit_bias`; `logprobs` is the legacy integer (how many alternatives per token). A non-empty
`suffix` makes it a fill-in-the-middle request (the prompt before the gap, the suffix after it:
engine `Infill`), which a model without FIM tokens refuses (400, param `suffix`)."""

import json
import time
import uuid
from typing import Any, Iterable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import Event, Infill, InvalidRequest, SamplingParams, TokenLogprob

from ..sse import sse
from ..state import app_state
from .choices import system_fingerprint, total_usage
from .errors import ApiError, check_fields
from .openai_request import (SAMPLING, check_model, choice_count, sampling_fields, stream_fields,
                             typed, usage_body)
from .serving import engine_param, finished, public_error, read_body, require_model, stream, submit

_FIELDS = {"model", "prompt", "suffix", "stream", "stream_options", "stop", "n", "logprobs",
           "logit_bias", "user", "presence_penalty", "frequency_penalty"} | set(SAMPLING)
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


def _with_suffix(prompt: str | list[int], suffix: Any) -> str | list[int] | Infill:
    """The prompt, or with a non-empty `suffix` the fill-in-the-middle request around it."""
    if suffix is None or suffix == "":
        return prompt
    if not isinstance(suffix, str):
        raise ApiError(400, "'suffix' must be a string", "suffix", "invalid_type")
    if not isinstance(prompt, str):
        raise ApiError(400, "'suffix' takes a text prompt, not token ids", "suffix",
                       "invalid_value")
    return Infill(prefix=prompt, suffix=suffix)


def parse(body: Any, model_name: str) -> tuple[str | list[int] | Infill, SamplingParams, int, bool,
                                               bool]:
    """(prompt as text, token ids or a fill-in-the-middle request, params, n, stream,
    include_usage) of a `/v1/completions` body."""
    check_fields(body, _FIELDS)
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0)):
        if body.get(name) not in (None, neutral):
            raise ApiError(400, f"'{name}' is not supported", name, "unsupported_parameter")
    check_model(body, model_name)
    prompt = _with_suffix(_prompt(body.get("prompt")), body.get("suffix"))
    sampling = sampling_fields(body)
    sampling.setdefault("max_tokens", LEGACY_MAX_TOKENS)
    logprobs = typed(body, "logprobs", int)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    try:
        params = SamplingParams(**sampling)
    except InvalidRequest as exc:
        param = "logprobs" if exc.field == "top_logprobs" else engine_param(exc)
        raise ApiError(400, str(exc).replace("top_logprobs", "logprobs"), param,
                       exc.code or "invalid_value") from None
    n = choice_count(body)
    return (prompt, params, n, *stream_fields(body))


class CompletionEncoder:
    """The stream as OpenAI writes a legacy completion: a `text` chunk per token, the finish
    reason, usage when asked, then `data: [DONE]`; a failure mid-stream becomes an error chunk."""

    def __init__(self, meta: dict[str, Any], include_usage: bool, wants_logprobs: bool):
        self.meta, self.include_usage, self.wants_logprobs = meta, include_usage, wants_logprobs

    def _chunk(self, i: int, text: str, finish_reason: str | None = None,
               entries: list[TokenLogprob] | None = None) -> str:
        choice = {"index": i, "text": text, "finish_reason": finish_reason,
                  "logprobs": _legacy_logprobs(entries or [], self.wants_logprobs)}
        return sse(json.dumps({**self.meta, "choices": [choice]}, ensure_ascii=False))

    def opening(self) -> Iterable[str]:
        return []

    def token(self, i: int, event: Event) -> Iterable[str]:
        if not event.text and event.logprobs is None:
            return []
        return [self._chunk(i, event.text, entries=[event.logprobs] if event.logprobs else [])]

    def done(self, i: int, event: Event) -> Iterable[str]:
        return [self._chunk(i, "", event.finish_reason)]

    def failed(self, i: int, event: Event) -> Iterable[str]:
        return [sse(json.dumps({"error": {"message": public_error(event.error),
                                          "type": "server_error", "param": None,
                                          "code": "generation_failed"}}))]

    def closing(self, finals: list[Event], complete: bool) -> Iterable[str]:
        usage = []
        if self.include_usage and complete:
            usage = [sse(json.dumps({**self.meta, "choices": [],
                                     "usage": usage_body(total_usage(finals))}))]
        return [*usage, sse("[DONE]")]


def _prompt_option(prompt: str | list[int] | Infill) -> dict[str, Any]:
    """The engine request's prompt argument: raw text, token ids or a fill-in-the-middle."""
    if isinstance(prompt, Infill):
        return {"infill": prompt}
    return {"text": prompt} if isinstance(prompt, str) else {"prompt_tokens": prompt}


async def completions(request: Request) -> Response:
    engine = app_state(request).engine
    try:
        body = await read_body(request)
        model = await require_model(request, body, parse)  # a bad request loads nothing
        engine = engine.on(model)  # its defaults, context and requests (issue 49)
        prompt, params, n, streamed, include_usage = parse(body, model)
        handles = await submit(engine, None, params, n, **_prompt_option(prompt))
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": model,
                "system_fingerprint": system_fingerprint(model)}
        wanted = params.logprobs is not None
        if streamed:
            return stream(request, handles, CompletionEncoder(meta, include_usage, wanted))
        choices = await finished(request, handles)
    except ApiError as err:
        return err.response(request.url.path)
    finals = [c.final for c in choices]
    return JSONResponse({**meta, "choices": [
        {"index": i, "text": "".join(c.content), "finish_reason": c.final.finish_reason,
         "logprobs": _legacy_logprobs(c.logprobs, wanted)} for i, c in enumerate(choices)],
        "usage": usage_body(total_usage(finals))})


routes = [Route("/v1/completions", completions, methods=["POST"])]
