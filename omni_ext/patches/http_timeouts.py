"""Patch body for ``http-header-timeout`` (see the registry in ``omni_ext.patches``).

vLLM-Omni starts uvicorn through vLLM's ``serve_http`` with uvicorn's automatic protocol (httptools),
which has no time-out on a request's headers: a client that sends a byte now and then holds its
connection for ever (uvicorn's ``timeout_keep_alive`` is cancelled by every byte). The ASGI app cannot
help, since it is only called once the headers are in. This passes uvicorn's documented ``http`` option
(a protocol class) with the same protocol plus a header time-out (:func:`omni_ext.api.bodies.server_protocol`,
``omni_ext.api.header_timeout_s``); a caller that chose a protocol itself keeps it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from omni_ext.patches import patch_attr

logger = logging.getLogger("omni_ext.patches")


def body_limits(app: Any) -> Any:
    """The server's :class:`~omni_ext.api.bodies.BodyLimits`: from omni-ext's API state, else (its routes
    switched off) from the server's arguments and environment."""
    from omni_ext.api.settings import load_settings
    from omni_ext.api.state import state_of

    try:
        return state_of(app.state).settings.bodies
    except Exception:
        return load_settings(getattr(app.state, "args", None)).bodies


def apply() -> None:
    from vllm_omni.entrypoints.openai import api_server

    from omni_ext.api.bodies import server_protocol

    original = api_server.serve_http

    @functools.wraps(original)
    async def serve_http(app: Any, sock: Any, *args: Any, **uvicorn_kwargs: Any) -> Any:
        if "http" not in uvicorn_kwargs:
            protocol = server_protocol(body_limits(app))
            if protocol is not None:
                uvicorn_kwargs["http"] = protocol
                logger.info("omni-ext: HTTP request headers time out after %g s (%s)",
                            protocol.header_timeout_s, protocol.__name__)
        return await original(app, sock, *args, **uvicorn_kwargs)

    patch_attr(api_server, "serve_http", serve_http)
