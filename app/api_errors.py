"""The API's refusals: an HTTP status with an error in the OpenAI format."""

from typing import Any

from starlette.responses import JSONResponse

from .security import api_error


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers

    def response(self) -> JSONResponse:
        return api_error(self.status, self.message, self.type, self.code, self.param, self.headers)


def check_fields(body: Any, fields: set[str]) -> dict[str, Any]:
    """`body` if it is a JSON object naming only `fields`; else the ApiError OpenAI gives."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name not in fields:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", name,
                           "unknown_parameter")
    return body
