"""llama.cpp's `/infill` for editor completion (llama.vim, llama.vscode, Tabby-style plug-ins):
the code before the cursor (`input_prefix`, then `prompt`), the code after it (`input_suffix`)
and other files as context (`input_extra`: `[{"filename", "text"}]`), laid out with the model's
FIM tokens as one engine request (engine `Infill`), so the prefix cache keeps the file between
keystrokes. A model without FIM tokens answers 400 naming `input_suffix` and the reason.

The answer is llama.cpp's `/completion` shape: `content`, `stop`, `stop_type`, `tokens_predicted`,
`tokens_evaluated`, `tokens_cached`, `timings`; streamed, one `data:` line per piece of text and a
last one with `stop: true`. Its sampling fields by llama.cpp's names (`n_predict`, `temperature`,
`top_k`, `top_p`, `min_p`, `seed`, `stop`, `repeat_penalty`, `repeat_last_n`,
`presence_penalty`, `frequency_penalty`); the model's defaults fill the others. Fields llama.cpp
takes that change nothing here (`cache_prompt`, `id_slot`, `samplers`, `n_indent`,
`t_max_*_ms`, `response_fields`, ...) are ignored, as llama.cpp ignores unknown fields.
"""

import json
from typing import Any, Iterable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import Event, Infill, InvalidRequest

from ..sse import sse
from ..state import app_state
from .errors import ApiError
from .openai_request import typed
from .serving import finished, public_error, read_body, stream, submit, use_named_model

# llama.cpp's sampling field names and ours (SamplingParams)
SAMPLING = {"n_predict": ("max_tokens", int), "temperature": ("temperature", float),
            "top_k": ("top_k", int), "top_p": ("top_p", float), "min_p": ("min_p", float),
            "seed": ("seed", int), "repeat_penalty": ("repetition_penalty", float),
            "repeat_last_n": ("repetition_context_size", int),
            "presence_penalty": ("presence_penalty", float),
            "frequency_penalty": ("frequency_penalty", float)}
UNLIMITED = 1 << 30  # n_predict -1 (llama.cpp's default): as long as the context allows
# llama.cpp's stop types by our finish reasons
STOP_TYPES = {"stop": "eos", "length": "limit", "cancelled": "none", "tool_calls": "eos"}


def _text(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string", name, "invalid_type")
    return value


def _extra(value: Any) -> tuple[tuple[str, str], ...]:
    """`input_extra` as (file name, text) pairs; llama.cpp's rules: an array of objects, each with
    a string `text` and, if given, a string `filename`."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ApiError(400, "'input_extra' must be an array of {\"filename\", \"text\"} objects",
                       "input_extra", "invalid_type")
    files = []
    for i, chunk in enumerate(value):
        where = f"input_extra[{i}]"
        if not isinstance(chunk, dict):
            raise ApiError(400, f"'{where}' must be an object", "input_extra", "invalid_type")
        name, text = chunk.get("filename", "tmp"), chunk.get("text")
        if not isinstance(name, str):
            raise ApiError(400, f"'{where}.filename' must be a string", "input_extra",
                           "invalid_type")
        if not isinstance(text, str):
            raise ApiError(400, f"'{where}.text' must be a string", "input_extra", "invalid_type")
        files.append((name, text))
    return tuple(files)


def parse(body: Any) -> tuple[Infill, dict[str, Any], bool]:
    """(the fill-in-the-middle, the sampling values it sets, stream) of an `/infill` body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    infill = Infill(prefix=_text(body, "input_prefix") + _text(body, "prompt"),
                    suffix=_text(body, "input_suffix"), files=_extra(body.get("input_extra")))
    sampling = {}
    for name, (ours, kind) in SAMPLING.items():
        value = typed(body, name, kind)
        if value is not None:
            sampling[ours] = value
    if sampling.get("max_tokens", 1) < 0:  # -1: no limit but the context
        sampling["max_tokens"] = UNLIMITED
    stop = body.get("stop")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError(400, "'stop' must be an array of strings", "stop", "invalid_type")
        if stop:
            sampling["stop"] = tuple(stop)
    sampling.setdefault("max_tokens", UNLIMITED)
    return infill, sampling, bool(typed(body, "stream", bool))


def _timings(final: Event) -> dict[str, Any]:
    """llama.cpp's `timings` from the engine's usage and timings."""
    usage, t = final.usage, final.timings
    evaluated = max(usage.prompt_tokens - usage.cached_tokens, 0)
    prompt_ms = (t.ttft_s or 0.0) * 1e3
    predicted_ms = usage.completion_tokens / t.tokens_per_s * 1e3 if t.tokens_per_s else 0.0
    return {"cache_n": usage.cached_tokens, "prompt_n": evaluated, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / evaluated if evaluated else 0.0,
            "prompt_per_second": evaluated / prompt_ms * 1e3 if prompt_ms else 0.0,
            "predicted_n": usage.completion_tokens, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / usage.completion_tokens
            if usage.completion_tokens else 0.0,
            "predicted_per_second": t.tokens_per_s or 0.0}


def _final(model: str, content: str, final: Event) -> dict[str, Any]:
    usage = final.usage
    return {"index": 0, "content": content, "tokens": [], "id_slot": 0, "stop": True,
            "model": model, "tokens_predicted": usage.completion_tokens,
            "tokens_evaluated": usage.prompt_tokens, "tokens_cached": usage.cached_tokens,
            "has_new_line": "\n" in content, "truncated": False,
            "stop_type": STOP_TYPES.get(final.finish_reason or "stop", "eos"),
            "stopping_word": "", "timings": _timings(final)}


class InfillEncoder:
    """llama.cpp's stream: `data: {"content": piece, "stop": false}` per token, then the final
    object with `stop: true` (no `[DONE]`); a failure is an error line."""

    def __init__(self, model: str):
        self.model = model

    def opening(self) -> Iterable[str]:
        return []

    def token(self, i: int, event: Event) -> Iterable[str]:
        if not event.text:
            return []
        return [sse(json.dumps({"index": 0, "content": event.text, "tokens": [event.token],
                                "stop": False, "id_slot": 0}, ensure_ascii=False))]

    def done(self, i: int, event: Event) -> Iterable[str]:
        return [sse(json.dumps(_final(self.model, "", event), ensure_ascii=False))]

    def failed(self, i: int, event: Event) -> Iterable[str]:
        return [sse(json.dumps({"error": {"code": 500, "message": public_error(event.error),
                                          "type": "server_error"}}))]

    def closing(self, finals: list[Event], complete: bool) -> Iterable[str]:
        return []


async def infill(request: Request) -> Response:
    engine = app_state(request).engine
    try:
        body = await read_body(request)
        parsed, sampling, streamed = parse(body)
        model = await use_named_model(request, body.get("model"))
        engine = engine.on(model)  # its defaults, context and requests (issue 49)
        try:
            params = engine.params(sampling)
        except InvalidRequest as exc:
            raise ApiError(400, public_error(str(exc)), exc.field, exc.code) from None
        handles = await submit(engine, None, params, infill=parsed, fit_max_tokens=True)
        if streamed:
            return stream(request, handles, InfillEncoder(model))
        choice = (await finished(request, handles))[0]
    except ApiError as err:
        if err.param == "suffix":  # the engine's name for what /infill calls input_suffix
            err.param = "input_suffix"
        return err.response(request.url.path)
    return JSONResponse(_final(model, "".join(choice.content), choice.final))


routes = [Route("/infill", infill, methods=["POST"])]
