"""Synchronous generations (``/v1/videos/sync``, ``/v1/images/generations``): a client that goes away
frees its capacity at once.

The route waits on the generation and, concurrently, on the client's connection. If the client
disconnects first, the engine request is aborted (as ``DELETE`` does for an async job), its ticket
leaves the queue, ``omni_ext:requests_cancelled_total{reason="client_disconnected"}`` counts it,
and the route answers 499 (nobody reads it). Without this, vLLM-Omni keeps generating for a client
that is gone, and every request queued behind waits for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

from omni_ext.api.state import abort
from omni_ext.progress import clear_progress

if TYPE_CHECKING:
    from fastapi import Request

    from omni_ext.api.queue import Admitted

logger = logging.getLogger("omni_ext.api")
T = TypeVar("T")

#: nginx's "client closed request": what is logged for a request whose client left.
CLIENT_CLOSED = 499


class ClientGone(Exception):
    """The client disconnected before its synchronous generation finished (answered 499)."""


async def client_gone(request: Request) -> None:
    """Returns once the client disconnects. The body must have been read already: this consumes the
    request's remaining ASGI messages, as vLLM's ``listen_for_disconnect`` does (Starlette's
    ``is_disconnected`` polls instead and only sees what arrived by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled and :class:`ClientGone` raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(client_gone(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when the route itself is cancelled
        watcher.cancel()
        if not task.done():
            task.cancel()  # vLLM-Omni's generate aborts its engine request when cancelled
    if task in done:
        return task.result()
    raise ClientGone


async def run_admitted(request: Request, admitted: Admitted, what: str, work: Awaitable[T]) -> T:
    """Run an admitted synchronous generation until its output arrives, then report it finished
    through its handle (its slot is free, the cost model learns its time); or, if the client leaves
    first, abort it and report it cancelled (its slot is free at once). ``what`` names it in the log
    ("video", "image")."""
    request_id = admitted.job_id
    try:
        result = await unless_gone(request, work)
        admitted.finished()
        return result
    except ClientGone:
        admitted.cancelled("client_disconnected")
        await abort(request, request_id)
        logger.info("omni-ext %s %s: client disconnected; generation aborted and its slot freed", what, request_id)
        raise
    finally:
        admitted.dropped()  # a failed generation (a finished or cancelled one is already gone)
        clear_progress(request_id)
