"""OpenAI-style errors: every rejection is ``{"error": {"message", "type", "param", "code"}}``.

The OpenAI SDKs map the HTTP status to an exception class (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 409 ConflictError, 422 UnprocessableEntityError,
429 RateLimitError, 5xx InternalServerError) and read ``error.message``; so the status must be right
and the body must have this shape, or clients print "None".
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import sqlite3
from collections.abc import Iterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse

logger = logging.getLogger("omni_ext.api")

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
    507: "server_error",
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
        from fastapi.responses import JSONResponse

        headers = dict(self.headers or {})
        verdict = should_retry(self.status, self.code, "retry-after" in headers)
        if verdict is not None:
            headers.setdefault(SHOULD_RETRY, verdict)
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


#: The header the ``openai`` SDKs obey before their own rule (which retries 408, 409, 429 and every 5xx
#: twice): "false" stops a retry that would only repeat the failure, "true" asks for one.
SHOULD_RETRY = "x-should-retry"
#: 5xx codes whose cause the same request meets again: a retry would run (and fail) the whole work again.
DETERMINISTIC_5XX = frozenset({"generation_failed", "storage_full"})


def should_retry(status: int, code: str | None, has_retry_after: bool) -> str | None:
    """``x-should-retry`` for an error: "false" for a client's own mistake (4xx other than 408, 409 and 429)
    and for a failure the same request would repeat (:data:`DETERMINISTIC_5XX`); "true" where a
    Retry-After says when it will work (429 queue_full, 503 respawning or draining) and for a lost replica;
    None (the SDK's own rule) otherwise."""
    if 400 <= status < 500 and status not in (408, 409, 429):
        return "false"
    if code in DETERMINISTIC_5XX:
        return "false"
    if has_retry_after or code == "replica_lost":
        return "true"
    return None


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    """A 400 about one request field (``param``)."""
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def retry_headers(seconds: float) -> dict[str, str]:
    """``Retry-After`` (whole seconds, rounded up, as HTTP defines it) and ``retry-after-ms`` (the
    exact wait; the ``openai`` SDKs read it first and sleep that long before their next try)."""
    ms = round(max(0.0, seconds) * 1000)
    return {"retry-after": str(math.ceil(ms / 1000)), "retry-after-ms": str(ms)}


def too_busy(message: str, retry_after_s: float) -> APIError:
    """429 ``queue_full``: the server will not take this request now; come back after ``retry_after_s``."""
    return APIError(HTTPStatus.TOO_MANY_REQUESTS, message, code="queue_full", headers=retry_headers(retry_after_s))


def not_found(kind: str, ident: str) -> APIError:
    return APIError(HTTPStatus.NOT_FOUND, f"No {kind} found with id '{ident}'.", param=f"{kind}_id", code=f"{kind}_not_found")


def from_pydantic(exc: Exception) -> APIError:
    """A pydantic ValidationError as a 400 naming the first offending field."""
    errors = getattr(exc, "errors", lambda: [])()
    if errors:
        first = errors[0]
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return bad_request(f"Invalid '{loc}': {first.get('msg')}", loc or None)
    return bad_request(str(exc), None)


def client_error(exc: BaseException) -> APIError | None:
    """``exc`` as the 4xx it stands for (ours, vLLM-Omni's ``OmniClientError``, a 4xx HTTPException), else None."""
    from fastapi import HTTPException
    from vllm_omni.errors import OmniClientError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, OmniClientError):
        return APIError(exc.status_code, exc.message, code="invalid_value")
    if isinstance(exc, HTTPException) and 400 <= exc.status_code < 500:
        return APIError(exc.status_code, str(exc.detail), code="invalid_value")
    return None


#: What vLLM-Omni (and omni-ext's dispatcher) say when the replica running a request is gone: a
#: headless replica that stopped heartbeating, a dead local replica process, no live replica left.
REPLICA_LOST_MARKERS = ("stage replica disappeared", "has no live replica", "EngineCore encountered an issue",
                        "StageDiffusionProc died", "diffusion subprocess is dead", "no connected replica")


def replica_lost(exc: BaseException) -> bool:
    """Whether ``exc`` means the replica that ran (or was to run) the request is gone."""
    text = f"{exc} {getattr(exc, 'args', '')}"
    return any(marker in text for marker in REPLICA_LOST_MARKERS)


def generation_error(exc: BaseException, what: str, request_id: str) -> APIError:
    """Why a generation failed, for the client: its own mistake (4xx), 503 ``replica_lost`` when the
    replica running it died (the request may be sent again; the server keeps serving on the others),
    or a logged 500 ``generation_failed``."""
    client = client_error(exc)
    if client is not None:
        return client
    if replica_lost(exc):
        logger.error("omni-ext: %s %s lost with its replica: %s", what.lower(), request_id, exc)
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, f"{what} failed: the replica running it is gone ({exc}); "
                        "send the request again.", code="replica_lost")
    logger.error("omni-ext: %s %s failed", what.lower(), request_id, exc_info=exc)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"{what} failed: {exc}", code="generation_failed")


# ---- storage ------------------------------------------------------------------------------------
#: errno values meaning "no room left": the data directory's file system (or the user's quota) is full.
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class StorageError(APIError):
    """A write (or read) under the API's data directory (``OMNI_EXT_API_DATA_DIR``: job database and
    media) failed: 507 ``storage_full`` when the file system has no room left, else 500
    ``storage_error`` (unwritable, not a directory, I/O error). A job that meets one fails with that
    code instead of a traceback; the server keeps serving."""


def storage_failure(exc: BaseException, what: str) -> StorageError:
    """``exc`` (an ``OSError`` or ``sqlite3.Error`` raised while ``what``) as a :class:`StorageError`."""
    full = (isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS) or (
        isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL)
    if full:
        return StorageError(HTTPStatus.INSUFFICIENT_STORAGE, f"The server's storage is full ({what}: {exc}); "
                            "free space in its data directory and retry.", code="storage_full")
    return StorageError(HTTPStatus.INTERNAL_SERVER_ERROR, f"The server could not use its storage ({what}: {exc}).",
                        code="storage_error")


@contextlib.contextmanager
def storage(what: str) -> Iterator[None]:
    """Run a data-directory operation; an ``OSError``/``sqlite3.Error`` in it becomes a logged
    :class:`StorageError` (``what`` says which operation, for the log and the client)."""
    try:
        yield
    except (OSError, sqlite3.Error) as exc:
        err = storage_failure(exc, what)
        logger.warning("omni-ext: %s failed: %s (%s)", what, exc, err.code)
        raise err from exc
