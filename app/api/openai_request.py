"""The fields OpenAI's two generation endpoints (chat and legacy completions) read alike: typed
fields, the model, the sampling options, `stop`, `n`, `stream` + `stream_options`, the chat
messages, and the `usage` they answer with.

Validation is strict and answers in OpenAI's error format, so clients show a useful message:
wrong types, unknown fields and unsupported options are refused rather than silently ignored.
Ranges of sampling values are checked once, by `SamplingParams`.
"""

import json
import math
from collections.abc import Collection
from typing import Any

from engine import MESSAGE_ROLES, SAMPLING_OPTIONS, ImageInput, Usage

from . import documents
from .choices import MAX_CHOICES
from .errors import ApiError
from .images import check_count, check_pixels, count_images, image_part, images_of, read_url
from .tool_messages import tool_fields

# The roles a message may have (the engine's), and OpenAI's "developer", which is a system message.
ROLES = {**{role: role for role in MESSAGE_ROLES}, "developer": "system"}
# Every sampling option by its own name (max_tokens also as OpenAI's max_completion_tokens).
SAMPLING = {o.name: o.kind for o in SAMPLING_OPTIONS}


def typed(body: dict[str, Any], name: str, kind: type) -> Any:
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


def check_model(body: dict[str, Any], model_name: str | None) -> None:
    """The `model` field names the loaded model `model_name` or is absent."""
    model = typed(body, "model", str)
    if model is not None and model != model_name:
        raise ApiError(404, f"The model '{model}' does not exist or is not loaded "
                            f"(this server runs '{model_name}')", "model", "model_not_found")


def sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The `SamplingParams` fields the body sets by their own names, with `stop` (a string or an
    array of strings) and `logit_bias`."""
    sampling = {k: v for k, kind in SAMPLING.items() if (v := typed(body, k, kind)) is not None}
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError(400, "'stop' must be a string or an array of strings", "stop")
        sampling["stop"] = tuple(stop)
    if bias := typed(body, "logit_bias", dict):
        sampling["logit_bias"] = bias
    return sampling


def one_of(body: dict[str, Any], name: str, options: Collection[str], default: str) -> str:
    """`body[name]`, a string among `options` (`default` when absent); else a 400 naming them."""
    value = typed(body, name, str) or default
    if value not in options:
        raise ApiError(400, f"'{name}' must be one of {', '.join(options)}", name, "invalid_value")
    return value


def choice_count(body: dict[str, Any]) -> int:
    """`n`: how many choices to generate (1 by default, at most MAX_CHOICES)."""
    n = typed(body, "n", int)
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"'n' must be an integer in [1, {MAX_CHOICES}], got {n}", "n",
                       "invalid_value")
    return n or 1


def stream_fields(body: dict[str, Any]) -> tuple[bool, bool]:
    """(`stream`, `stream_options.include_usage`)."""
    stream = typed(body, "stream", bool) or False
    options = typed(body, "stream_options", dict) or {}
    if options and not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' may only hold 'include_usage' (a boolean)",
                       "stream_options")
    return stream, bool(options.get("include_usage"))


def _file(p: dict[str, Any], where: str, param: str) -> dict[str, Any]:
    """A `file` part (`{"file": {"filename", "file_data": <data URL>}}`) as a document part
    (app/api/documents.py); a `file_id` alone is refused (no Files API here)."""
    spec = p.get("file")
    if not isinstance(spec, dict):
        raise ApiError(400, f"{where}.file must be an object with 'file_data'", param,
                       "invalid_document")
    if spec.get("file_data") is None and spec.get("file_id") is not None:
        raise documents.url_refused(f"{where}.file", param)
    return documents.from_data(spec.get("file_data"), spec.get("filename"), f"{where}.file", param)


def _is_decoded(p: dict[str, Any]) -> bool:
    """A part an adapter decoded already (an image, a document); never from JSON."""
    return documents.is_document(p) or (p.get("type") == "image"
                                        and isinstance(p.get("image"), ImageInput))


def _content(i: int, content: Any) -> str | list[dict[str, Any]]:
    """A message's content: a string, or OpenAI's list of parts: text parts alone are joined into
    a string; with `image_url` parts (data URLs, app/api/images.py) or `file` parts (documents,
    app/api/documents.py) it stays a list of text, image and document parts, in order."""
    if isinstance(content, str):
        return content
    where = f"messages[{i}].content"
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise ApiError(400, f"{where} must be a string or a list of text, image_url and file parts",
                       where)
    parts: list[dict[str, Any]] = []
    for j, p in enumerate(content):
        if p.get("type") == "text" and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif p.get("type") == "image_url":
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            parts.append(image_part(read_url(url, f"{where}[{j}].image_url", where)))
        elif p.get("type") == "file":
            parts.append(_file(p, f"{where}[{j}]", where))
        elif _is_decoded(p):
            parts.append(p)
        else:
            raise ApiError(400, f"{where}[{j}] must be a text, image_url or file part (audio is "
                                "not supported)", where)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages as engine messages (roles mapped, text joined, tool fields kept)."""
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty array", "messages")
    check_count(sum(1 for m in value if isinstance(m, dict) and isinstance(m.get("content"), list)
                    for p in m["content"] if isinstance(p, dict) and p.get("type") == "image_url"))
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
    check_count(count_images(out))  # with the images of documents and tool results
    check_pixels(images_of(out))  # each image's header read, none decoded
    documents.check_count(documents.count_documents(out))
    return out


def usage_body(usage: Usage, stats: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI's `usage`, with the `speculative` extension for requests that opted in."""
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
