"""The API's refusals: an HTTP status with an error in the OpenAI format."""

from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from .security import api_error, is_api_path


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers

    def response(self) -> JSONResponse:
        return api_error(self.status, self.message, self.type, self.code, self.param, self.headers)


# The codes of the routing errors an API client may meet (an unknown path, a wrong method).
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


async def http_error(request: Request, exc: Exception) -> Response:
    """Routing errors (404, 405, ...): OpenAI's JSON under /v1, Starlette's plain text elsewhere."""
    assert isinstance(exc, HTTPException)
    if not is_api_path(request.url.path):
        return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)
    message = f"{exc.detail}: {request.method} {request.url.path}"
    return api_error(exc.status_code, message, "invalid_request_error",
                     _HTTP_CODES.get(exc.status_code), headers=exc.headers)


def check_fields(body: Any, fields: set[str]) -> dict[str, Any]:
    """`body` if it is a JSON object naming only `fields`; else the ApiError OpenAI gives."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name not in fields:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", name,
                           "unknown_parameter")
    return body
