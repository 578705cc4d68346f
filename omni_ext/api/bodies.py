"""Request bodies before any work: a bounded amount of them in memory, and no client slower than a bound.

What omni-ext's intake holds: it reads a body whole into memory (:func:`omni_ext.api.intake.read_limited`,
up to ``max_upload_mb``), parses it (Starlette's multipart parser spools file parts over 1 MiB to a
temporary file, but the raw body is already in memory) and reads every uploaded file back into bytes
for the job. So each request on an upload route costs about its body's size, twice at its peak, until
the intake has turned it into a job; and nothing bounded how many did so at once.

:class:`omni_ext.api.gate.BodyGate` (an ASGI wrapper on omni-ext's ``POST`` routes that take a body: ``/v1/videos``,
``/v1/videos/sync``, ``/v1/images/generations``, ``/v1/images/edits``) bounds that, before the route runs:

1. a body that declares more than ``max_upload_mb`` is refused 413 before a byte of it is read;
2. it reserves its declared length (``max_upload_mb`` when it declares none) from one budget of
   ``max_body_memory_mb`` per server (:class:`MemoryBudget`). A body that does not fit waits, first come
   first served, up to ``body_wait_s``, then is refused 503 ``server_busy`` with ``Retry-After``: waiting
   costs one connection and uvicorn's 64 KiB read buffer, never the body;
3. it reads the body with the slow-client rule (:func:`next_read_wait`): no silence longer than
   ``body_timeout_s``, and no more than ``body_timeout_s`` plus the body's bytes at ``body_min_rate_kib_s``
   in all; past either, 408 ``request_timeout`` and the connection closes;
4. the route reads the body from memory; the reservation is returned when the route returns: at
   admission for ``/v1/videos`` (the job holds its decoded inputs from there, bounded by ``max_queued``),
   after the generation for the synchronous routes, which hold their decoded inputs until then.

Headers: vLLM serves with uvicorn's httptools protocol, which waits for a request's headers for ever
(its keep-alive time-out is cancelled by any byte). :func:`header_timeout_protocol` is that protocol with
a timer from connection (or the end of the previous response) to the end of the headers, ``header_timeout_s``;
the ``http-header-timeout`` patch hands it to uvicorn. Refusals are OpenAI-style JSON
(:mod:`omni_ext.api.errors`); none creates a job or leaves a file behind.

The rules (:func:`reservation`, :func:`next_read_wait`, :class:`MemoryBudget`) are pure and unit-tested.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Callable, Mapping

from omni_ext.api import limits
from omni_ext.api.errors import APIError, retry_headers
from omni_ext.scheduler.config import Option

logger = logging.getLogger("omni_ext.api")

#: The app-state attribute holding the server's :class:`MemoryBudget`.
BUDGET_ATTR = "omni_ext_body_budget"


@dataclass(frozen=True)
class BodyLimits:
    """The body and slow-client bounds of one server (defaults: :mod:`omni_ext.api.limits`)."""

    memory_bytes: int = limits.MAX_BODY_MEMORY_MB * 2**20
    wait_s: float = limits.BODY_WAIT_S
    header_timeout_s: float = limits.HEADER_TIMEOUT_S  # 0: no header time-out
    body_timeout_s: float = limits.BODY_TIMEOUT_S  # 0: no body time-out
    min_rate: float = limits.BODY_MIN_RATE_KIB_S * 1024  # bytes per second; 0: no rate rule


@dataclass(frozen=True)
class BodySetting(Option):
    """An ``omni_ext.api`` setting of these bounds, and how it becomes a :class:`BodyLimits` field."""

    factor: float = 1  # to the field's unit
    attr: str = ""  # the :class:`BodyLimits` field


#: The ``omni_ext.api`` settings of the bounds (rows of :data:`omni_ext.api.settings.SETTINGS`).
SETTINGS: tuple[BodySetting, ...] = (
    BodySetting("max_body_memory_mb", "number", limits.MAX_BODY_MEMORY_MB,
                "MiB of request bodies held in memory at once on omni-ext's upload routes; each body reserves its "
                "declared length (`max_upload_mb` when it declares none) before a byte of it is read. At least "
                "`max_upload_mb`.", "OMNI_EXT_API_MAX_BODY_MEMORY_MB", 2**20, "memory_bytes"),
    BodySetting("body_wait_s", "number", limits.BODY_WAIT_S,
                "Seconds a body waits for room in that memory before a 503 `server_busy` with `Retry-After`.",
                "OMNI_EXT_API_BODY_WAIT_S", 1, "wait_s"),
    BodySetting("header_timeout_s", "number", limits.HEADER_TIMEOUT_S,
                "Seconds from a connection (or the end of the previous response) to the end of a request's "
                "headers; past it, 408 and the connection closes. 0: no limit.",
                "OMNI_EXT_API_HEADER_TIMEOUT_S", 1, "header_timeout_s"),
    BodySetting("body_timeout_s", "number", limits.BODY_TIMEOUT_S,
                "The longest silence inside a body, and the seconds a body may take on top of its bytes at "
                "`body_min_rate_kib_s`; past either, 408 and the connection closes. 0: no limit.",
                "OMNI_EXT_API_BODY_TIMEOUT_S", 1, "body_timeout_s"),
    BodySetting("body_min_rate_kib_s", "number", limits.BODY_MIN_RATE_KIB_S,
                "The slowest sustained upload accepted, in KiB/s. 0: no rate rule.",
                "OMNI_EXT_API_BODY_MIN_RATE_KIB_S", 1024, "min_rate"),
)


def load_body_limits(cfg: Mapping[str, Any], env: Mapping[str, str], max_upload_bytes: int) -> BodyLimits:
    """The bounds from ``--additional-config`` ``omni_ext.api`` (``cfg``) with environment overrides. A budget
    smaller than one upload could never admit a full-size body: that is a configuration error."""
    values: dict[str, Any] = {}
    for s in SETTINGS:
        raw = env.get(s.env) or cfg.get(s.key, s.default)
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"omni_ext.api.{s.key} must be a number, not {raw!r}") from None
        if value < 0:
            raise ValueError(f"omni_ext.api.{s.key} must be 0 or more, not {raw!r}")
        values[s.attr] = int(value * s.factor) if s.attr == "memory_bytes" else value * s.factor
    if values["memory_bytes"] < max_upload_bytes:
        raise ValueError(f"omni_ext.api.max_body_memory_mb ({values['memory_bytes'] / 2**20:g} MiB) is smaller than "
                         f"one upload (max_upload_mb, {max_upload_bytes / 2**20:g} MiB): no full-size body could be read")
    return BodyLimits(**values)


# ---- the rules --------------------------------------------------------------------------------------
def too_large(limit: int) -> APIError:
    return APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"Request body exceeds the limit of {limit / 2**20:g} MiB.",
                    code="request_too_large", headers={"connection": "close"})


def reservation(content_length: str | None, max_upload: int) -> int:
    """The bytes a body reserves before it is read: its declared length, or ``max_upload`` when it declares
    none (chunked); a declared length over ``max_upload`` is a 413, a malformed one a 400."""
    if content_length is None:
        return max_upload
    try:
        declared = int(content_length)
    except ValueError:
        declared = -1
    if declared < 0:
        raise APIError(HTTPStatus.BAD_REQUEST, "Invalid Content-Length header.", code="invalid_header",
                       headers={"connection": "close"})
    if declared > max_upload:
        raise too_large(max_upload)
    return declared


def next_read_wait(lim: BodyLimits, started: float, received: int, now: float) -> float | None:
    """How long the next piece of a body may take (seconds; None: no bound), ``received`` bytes having come
    since ``started``, the last of them just now: at most ``body_timeout_s`` of silence, and the whole body
    within ``body_timeout_s`` plus its bytes at ``min_rate``. 0 or less: the client is too slow."""
    if lim.body_timeout_s <= 0:
        return None
    if lim.min_rate <= 0:
        return lim.body_timeout_s
    return min(lim.body_timeout_s, started + lim.body_timeout_s + received / lim.min_rate - now)


class Lease:
    """Bytes held from a :class:`MemoryBudget`; :meth:`release` returns them (again: nothing more)."""

    def __init__(self, budget: MemoryBudget, size: int) -> None:
        self.budget, self.size = budget, size

    def shrink(self, size: int) -> None:
        """Keep only ``size`` bytes (a chunked body, now read, reserved the upload limit)."""
        if 0 <= size < self.size:
            self.budget.give(self.size - size)
            self.size = size

    def release(self) -> None:
        size, self.size = self.size, 0
        if size:
            self.budget.give(size)


@dataclass
class MemoryBudget:
    """``capacity`` bytes shared by the bodies in flight, granted first come first served: a body that
    does not fit waits behind those that came before it (none is starved by smaller ones after it)."""

    capacity: int
    in_use: int = 0
    peak: int = 0
    waited_total: int = 0  # bodies that had to wait for room
    refused_total: int = 0  # bodies that waited their longest and were refused (503)
    timed_out_total: int = 0  # bodies cut off by the slow-client rule (408), counted by the gate
    _waiters: deque[tuple[int, asyncio.Future[None]]] = field(default_factory=deque)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _grant(self, size: int) -> Lease:
        self.in_use += size
        self.peak = max(self.peak, self.in_use)
        return Lease(self, size)

    def try_take(self, size: int) -> Lease | None:
        """A lease of ``size`` bytes now, if it fits and nobody waits ahead; else None."""
        if not self._waiters and self.in_use + size <= self.capacity:
            return self._grant(size)
        return None

    async def take(self, size: int, wait_s: float) -> Lease | None:
        """A lease of ``size`` bytes, waiting up to ``wait_s`` for room; None if none came."""
        lease = self.try_take(size)
        if lease is not None or size > self.capacity:
            return lease
        self.waited_total += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (size, fut)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout=wait_s)
        except BaseException as exc:  # its wait ran out, or the request itself was cancelled
            if fut.done() and not fut.cancelled():  # granted as the wait ended: give it back
                self.give(size)
            else:
                fut.cancel()
                self._waiters.remove(entry)
                self._wake()  # the one behind may fit now
            if not isinstance(exc, asyncio.TimeoutError):
                raise
            self.refused_total += 1
            return None
        return Lease(self, size)  # in_use was counted when it was granted (_wake)

    def give(self, size: int) -> None:
        self.in_use -= size
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.in_use + self._waiters[0][0] <= self.capacity:
            size, fut = self._waiters.popleft()
            self.in_use += size
            self.peak = max(self.peak, self.in_use)
            fut.set_result(None)

    def info(self) -> dict[str, int]:
        return {"in_use_bytes": self.in_use, "peak_bytes": self.peak, "waiting": self.waiting,
                "waited_total": self.waited_total, "refused_total": self.refused_total,
                "timed_out_total": self.timed_out_total}


# ---- the gate ---------------------------------------------------------------------------------------
def budget_of(app_state: Any, lim: BodyLimits) -> MemoryBudget:
    """The server's one :class:`MemoryBudget` (made on first use, sized by ``lim``)."""
    budget = getattr(app_state, BUDGET_ATTR, None)
    if budget is None:
        budget = MemoryBudget(lim.memory_bytes)
        setattr(app_state, BUDGET_ATTR, budget)
    return budget


def busy(lim: BodyLimits) -> APIError:
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE,
                    f"The server holds its limit of {lim.memory_bytes / 2**20:g} MiB of request bodies in memory and no "
                    f"room came within {lim.wait_s:g} s; retry later.", code="server_busy",
                    headers={**retry_headers(max(1.0, lim.wait_s)), "connection": "close"})


def too_slow(lim: BodyLimits, received: int, elapsed: float) -> APIError:
    return APIError(HTTPStatus.REQUEST_TIMEOUT,
                    f"The request body came too slowly ({received} bytes in {elapsed:.0f} s): this server waits at most "
                    f"{lim.body_timeout_s:g} s for more of a body, and {lim.body_timeout_s:g} s plus its size at "
                    f"{lim.min_rate / 1024:g} KiB/s in all.", code="request_timeout", headers={"connection": "close"})


async def read_body(receive: Callable[[], Any], lim: BodyLimits, max_upload: int) -> bytes | None:
    """The whole body from ASGI ``receive``, under the slow-client rule (408) and the upload limit (413);
    None when the client disconnects first."""
    chunks: list[bytes] = []
    size, started = 0, time.monotonic()
    while True:
        wait = next_read_wait(lim, started, size, time.monotonic())
        try:
            if wait is not None and wait <= 0:
                raise TimeoutError
            message = await (receive() if wait is None else asyncio.wait_for(receive(), wait))
        except TimeoutError:
            raise too_slow(lim, size, time.monotonic() - started) from None
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_upload:
            raise too_large(max_upload)
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


# ---- headers: a time-out in uvicorn's protocol --------------------------------------------------------
#: The header time-out this process's server runs with (None: uvicorn's own protocol, no time-out) and the
#: connections it closed (read by ``/v1/omni_ext/info``).
HEADER_TIMEOUT: dict[str, Any] = {"seconds": None, "timed_out_total": 0}


def _timeout_response(message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "request_timeout"}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def header_timeout_protocol(base: type, timeout_s: float) -> type:
    """uvicorn's httptools protocol ``base`` with a header time-out: from the connection (or the end of the
    previous response) to the end of a request's headers at most ``timeout_s``, else a 408 and the
    connection closes. Idle keep-alive connections are still closed by uvicorn's ``timeout_keep_alive``
    first; this bounds the client that keeps sending a byte now and then and never finishes its headers."""

    class HeaderTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        header_timeout_s = timeout_s
        _header_timer: asyncio.TimerHandle | None = None

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._disarm_header_timer()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            pending = bool(self.pipeline)  # a pipelined request whose headers are in already
            super().on_response_complete()
            if not pending and not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            HEADER_TIMEOUT["timed_out_total"] += 1
            logger.warning("omni-ext: closed a connection from %s: no complete request headers within %g s",
                           self.client, self.header_timeout_s)
            self.transport.write(_timeout_response(
                f"The request headers did not arrive within {self.header_timeout_s:g} s."))
            self.transport.close()

    HeaderTimeoutProtocol.__qualname__ = HeaderTimeoutProtocol.__name__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol


def info(app_state: Any, lim: BodyLimits, max_upload_bytes: int) -> dict[str, Any]:
    """The bounds and their counters, as ``/v1/omni_ext/info`` lists them under ``bodies``."""
    budget = getattr(app_state, BUDGET_ATTR, None) or MemoryBudget(lim.memory_bytes)
    return {"max_upload_bytes": max_upload_bytes, "max_body_memory_bytes": lim.memory_bytes, "body_wait_s": lim.wait_s,
            "header_timeout_s": HEADER_TIMEOUT["seconds"],
            "body_timeout_s": lim.body_timeout_s, "body_min_rate_bytes_s": lim.min_rate, **budget.info(),
            "header_timed_out_total": HEADER_TIMEOUT["timed_out_total"]}


def server_protocol(lim: BodyLimits) -> type | None:
    """The HTTP protocol class for uvicorn's ``http`` option: its automatic choice with the header time-out
    of ``lim``; None (uvicorn's own choice, no time-out) when the time-out is 0 or the choice is not the
    httptools protocol (the h11 one has another structure; it then runs without a header time-out)."""
    if lim.header_timeout_s <= 0:
        return None
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: uvicorn serves with h11
        HttpToolsProtocol = None  # noqa: N806
    if HttpToolsProtocol is None or not issubclass(AutoHTTPProtocol, HttpToolsProtocol):
        logger.warning("omni-ext: uvicorn serves with %s, not httptools: no header time-out", AutoHTTPProtocol.__name__)
        return None
    HEADER_TIMEOUT["seconds"] = lim.header_timeout_s
    return header_timeout_protocol(AutoHTTPProtocol, lim.header_timeout_s)
