"""OpenAI-style errors: every rejection is ``{"error": {"message", "type", "param", "code"}}``.

The OpenAI SDKs map the HTTP status to an exception class (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 409 ConflictError, 422 UnprocessableEntityError,
429 RateLimitError, 5xx InternalServerError) and read ``error.message``; so the status must be right
and the body must have this shape, or clients print "None".
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """Raised anywhere in omni-ext's routes; turned into an OpenAI-style JSON error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return APIError(status, message, param=param, code=code).body()


def not_found(kind: str, ident: str) -> APIError:
    return APIError(HTTPStatus.NOT_FOUND, f"No {kind} found with id '{ident}'.", param=f"{kind}_id", code=f"{kind}_not_found")


def from_pydantic(exc: Exception) -> APIError:
    """A pydantic ValidationError as a 400 naming the first offending field."""
    errors = getattr(exc, "errors", lambda: [])()
    if errors:
        first = errors[0]
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return APIError(HTTPStatus.BAD_REQUEST, f"Invalid '{loc}': {first.get('msg')}", param=loc or None, code="invalid_value")
    return APIError(HTTPStatus.BAD_REQUEST, str(exc), code="invalid_value")
