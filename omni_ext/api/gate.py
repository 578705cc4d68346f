"""The ASGI wrapper that holds omni-ext's routes that take a body to :mod:`omni_ext.api.bodies`' bounds."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any, Callable, Mapping

from omni_ext.api.bodies import Lease, budget_of, busy, read_body, reservation
from omni_ext.api.errors import APIError
from omni_ext.api.intake import replay

logger = logging.getLogger("omni_ext.api")


def _header(scope: Mapping[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class BodyGate:
    """ASGI wrapper of one route that takes a body: the steps in :mod:`omni_ext.api.bodies`, then the route
    with the body already in memory (``content-length`` set to its size). ``settings_of``: the app's state
    -> its :class:`~omni_ext.api.settings.ApiSettings` (an :class:`APIError` before start-up)."""

    def __init__(self, app: Any, settings_of: Callable[[Any], Any]) -> None:
        self.app, self.settings_of = app, settings_of

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        lease: Lease | None = None
        try:
            settings = self.settings_of(scope["app"].state)  # 503 before start-up
            lim, max_upload = settings.bodies, settings.max_upload_bytes
            budget = budget_of(scope["app"].state, lim)
            size = reservation(_header(scope, b"content-length"), max_upload)
            lease = await budget.take(size, lim.wait_s)
            if lease is None:
                logger.warning("omni-ext: %s %s refused: %d bytes of bodies in memory, %d waiting",
                               scope["method"], scope["path"], budget.in_use, budget.waiting)
                raise busy(lim)
            try:
                body = await read_body(receive, lim, max_upload)
            except APIError as err:
                if err.status == HTTPStatus.REQUEST_TIMEOUT:
                    budget.timed_out_total += 1
                    logger.warning("omni-ext: %s %s from %s: %s", scope["method"], scope["path"], scope.get("client"),
                                   err.message)
                raise
        except APIError as err:
            if lease is not None:
                lease.release()
            await err.response()(scope, receive, send)
            return
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        try:
            if body is None:  # the client left before its body did
                return
            lease.shrink(len(body))
            headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
            replayed = replay(body, receive)
            del body  # the route's copy is the only one from here
            await self.app(scope, replayed, send)
        finally:
            lease.release()
