"""How each protocol's paths answer an error: one declaration (`SHAPES`), read by the endpoints
and by the middleware's refusals (401, 403, 413, a bad Host), so a client always gets an error
its SDK can read.

- OpenAI (`/v1/...`): `{"error": {"message", "type", "param", "code"}}`
- Anthropic (`/v1/messages...`): `{"type": "error", "error": {"type", "message"}}`
- Ollama (`/api/...`): `{"error": "message"}`
- llama.cpp's `/infill`, `/rerank`, `/reranking` and `/metrics`: OpenAI's
Paths outside these (the UI) get plain text from the middleware.
"""

from typing import Any, Callable

from starlette.responses import JSONResponse

Shape = Callable[[int, str, str, "str | None", "str | None"], dict[str, Any]]


def openai_error(status: int, message: str, type_: str, code: str | None,
                 param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                   409: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str, type_: str, code: str | None,
                    param: str | None) -> dict[str, Any]:
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def ollama_error(status: int, message: str, type_: str, code: str | None,
                 param: str | None) -> dict[str, Any]:
    return {"error": message}


# (path prefix, shape), the most specific first; the first that matches a path decides.
SHAPES: tuple[tuple[str, Shape], ...] = (
    ("/v1/messages", anthropic_error),
    ("/v1/", openai_error),
    ("/api/", ollama_error),
    # llama.cpp's own paths (its errors hold an `error` object too) and Prometheus' scrape
    ("/infill", openai_error),
    ("/rerank", openai_error),
    ("/metrics", openai_error),
)


def shape_of(path: str) -> Shape | None:
    """The error shape of the protocol `path` belongs to; None for the UI's paths."""
    if path == "/v1":
        return openai_error
    return next((shape for prefix, shape in SHAPES if path.startswith(prefix)), None)


def is_api_path(path: str) -> bool:
    """Whether `path` belongs to one of the programmatic APIs (JSON errors, no login redirect)."""
    return shape_of(path) is not None


def api_error(status: int, message: str, type_: str = "invalid_request_error",
              code: str | None = None, param: str | None = None,
              headers: dict[str, str] | None = None, *, path: str = "/v1/") -> JSONResponse:
    """An error in the shape of the protocol `path` belongs to (OpenAI's by default)."""
    shape = shape_of(path) or openai_error
    return JSONResponse(shape(status, message, type_, code, param), status_code=status,
                        headers=headers)
