"""The API process's side of a server that heals itself (the executor's side: :mod:`omni_ext.executor.tuned`).

The TunedExecutor runs in vLLM-Omni's engine process and keeps a healing record there
(:func:`omni_ext.progress.write_healing`); the API process reads it (:func:`omni_ext.progress.read_healing`:
a directory listing and a ``stat`` per executor) and from it:

- refuses new generations with 503 ``respawning`` and a Retry-After while no executor has a worker group
  that serves (:func:`refusal`, asked by admission first), so that no request is admitted only to fail;
- answers ``/health`` 503 with ``{"status": "respawning", ...}`` then; 200 with ``{"status": "degraded",
  ...}`` while some worker groups are replaced and the others serve (a load balancer keeps sending
  work, which those groups take); the stock answer otherwise (:func:`health_route`, put in place of
  vLLM-Omni's by the ``openai-routes`` patch);
- exits non-zero once an executor has given up (its respawn budget is spent,
  :mod:`omni_ext.scheduler.respawn`), so that a supervisor restarts the server (:func:`watch`: a thread
  that looks once a second; it stops the server as SIGTERM does, and the process then exits with
  :data:`EXIT_CODE`);
- counts worker deaths, respawns and watchdog actions on ``/metrics`` (:mod:`omni_ext.api.metrics`).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from http import HTTPStatus
from typing import Any

from omni_ext.progress import Healing, read_healing

logger = logging.getLogger("omni_ext.api")

#: The server's exit status once an executor gave up (EX_SOFTWARE): not 0, which a supervisor reads
#: as a deliberate stop.
EXIT_CODE = 70
#: How often :func:`watch` reads the executors' records (into :data:`LATEST`).
WATCH_S = 0.25
#: The records as last read (by :func:`watch`'s thread, and by ``/health``): what admission looks at, an
#: attribute read on the request path (:meth:`omni_ext.api.queue.RequestQueue.admit`), at most
#: :data:`WATCH_S` old. A job admitted in that moment is not lost: it waits for the new workers.
LATEST = Healing()


def retry_after_s(state: Healing, now: float | None = None) -> float:
    """Seconds until the workers are predicted to serve again: the last start-up's time, less what
    has passed since the respawn began (at least 1 s)."""
    now = time.time() if now is None else now
    passed = now - state.since if state.since is not None else 0.0
    return max(1.0, state.start_s - passed)


def refusal(state: Healing | None = None) -> Any:
    """An :class:`~omni_ext.api.errors.APIError` 503 ``respawning`` (with Retry-After) while no worker
    group of the server can serve (``state``: the records, read now when not given), else None."""
    state = read_healing() if state is None else state
    if not state.respawning and state.exhausted is None:
        return None
    from omni_ext.api.errors import APIError, retry_headers

    if state.exhausted is not None:
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, f"This server is stopping: {state.exhausted}",
                        code="server_stopping", headers=retry_headers(30.0))
    retry = retry_after_s(state)
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE,
                    f"This server is replacing its workers ({state.reason}); retry after {retry:.0f} s.",
                    code="respawning", headers=retry_headers(retry))


def health_route(stock: Any) -> Any:
    """``GET /health``: 503 ``respawning`` (with the reason and a Retry-After) while no worker group can
    serve, 200 ``degraded`` while some are replaced, else vLLM-Omni's own answer (``stock``, its endpoint)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from omni_ext.api.errors import retry_headers

    async def health(raw_request: Request) -> Any:
        global LATEST
        state = LATEST = read_healing()
        if state.respawning:
            retry = retry_after_s(state)
            return JSONResponse({"status": "respawning", "reason": state.reason, "retry_after_s": round(retry, 1)},
                                status_code=HTTPStatus.SERVICE_UNAVAILABLE, headers=retry_headers(retry))
        if state.exhausted is not None:
            return JSONResponse({"status": "unhealthy", "reason": state.exhausted},
                                status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        if state.groups_respawning:
            return JSONResponse({"status": "degraded", "reason": state.reason,
                                 "groups_respawning": state.groups_respawning, "groups": state.groups})
        return await stock(raw_request)

    health.__annotations__ = {"raw_request": Request, "return": Any}  # FastAPI reads them: no string annotations
    return health


_watching = False


def watch() -> None:
    """Start the thread that stops this server (exit status :data:`EXIT_CODE`) once an executor gave up.
    Called once, when the API server's state is initialised."""
    global _watching
    if _watching:
        return
    _watching = True
    threading.Thread(target=_watch, daemon=True, name="omni-ext-healing-watch").start()


def _watch() -> None:
    global LATEST
    while True:
        time.sleep(WATCH_S)
        try:
            LATEST = read_healing()
            gave_up = LATEST.exhausted
        except Exception:  # never let the watcher die over one bad read
            logger.exception("omni-ext: reading the healing records failed")
            continue
        if gave_up is not None:
            logger.error("omni-ext: the executor gave up (%s); the server stops with exit status %d so that a "
                         "supervisor restarts it", gave_up, EXIT_CODE)
            atexit.register(os._exit, EXIT_CODE)  # registered last, so it runs first at exit, after the shutdown
            os.kill(os.getpid(), signal.SIGTERM)
            return
