"""The API's refusals: an HTTP status with an error, written in the shape of the protocol whose
path was asked (app/api/error_shapes.py; OpenAI's by default), and the OpenAI fields an endpoint
accepts only with their neutral values."""

from collections.abc import Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from .error_shapes import api_error, is_api_path


class ApiError(Exception):
    """A refusal: status, message, the offending request field (`param`), a machine-readable
    `code`, the error `type` and extra headers (Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers

    def response(self, path: str = "/v1/") -> JSONResponse:
        """This error in the shape of the protocol `path` belongs to."""
        return api_error(self.status, self.message, self.type, self.code, self.param, self.headers,
                         path=path)


# The codes of the routing errors an API client may meet (an unknown path, a wrong method).
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


async def http_error(request: Request, exc: Exception) -> Response:
    """Routing errors (404, 405, ...): OpenAI's JSON under /v1, Starlette's plain text elsewhere."""
    assert isinstance(exc, HTTPException)
    if not is_api_path(request.url.path):
        return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)
    message = f"{exc.detail}: {request.method} {request.url.path}"
    return api_error(exc.status_code, message, "invalid_request_error",
                     _HTTP_CODES.get(exc.status_code), headers=exc.headers, path=request.url.path)


def _never(value: Any) -> bool:
    return False


# OpenAI request fields (chat and legacy completions) that an endpoint does not read: each is
# accepted, and ignored, when null or when its value asks for nothing this server would do
# differently; any other value is refused with what it asks for.
OPENAI_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "reasoning_effort": (lambda v: isinstance(v, str), "must be a string (a hint, ignored here)"),
    "service_tier": (lambda v: isinstance(v, str), "must be a string (ignored here)"),
    "prediction": (lambda v: isinstance(v, dict), "must be an object (ignored here)"),
    "modalities": (lambda v: v == ["text"], 'asks for output this server does not give: only ["text"]'),
    "audio": (_never, "asks for audio output, which this server does not give (send null)"),
    "web_search_options": (_never, "asks for a web search, which this server does not do (send null)"),
    "functions": (lambda v: v == [], "is not supported: declare functions in 'tools'"),
    "function_call": (lambda v: v in ("none", "auto"), "is not supported: use 'tool_choice'"),
    "best_of": (lambda v: v == 1 and type(v) is int, "is not supported: only 1"),
    "echo": (lambda v: v is False, "is not supported: only false"),
    # fill-in-the-middle is /v1/completions' (app/api/completions.py) and /infill's
    "suffix": (lambda v: v == "", "is not supported here: send a suffix to /v1/completions or "
                                  "/infill"),
}


def check_fields(body: Any, fields: set[str]) -> dict[str, Any]:
    """`body` if it is a JSON object naming only `fields` and `OPENAI_FIELDS` (with values they
    accept); else the ApiError OpenAI gives."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if name in fields:
            continue
        if name not in OPENAI_FIELDS:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", name,
                           "unknown_parameter")
        accepts, refusal = OPENAI_FIELDS[name]
        if value is not None and not accepts(value):
            raise ApiError(400, f"'{name}' {refusal}", name, "unsupported_parameter")
    return body
