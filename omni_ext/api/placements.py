"""``GET /v1/omni_ext/placements``: where each request ran, from the placement journal.

The TunedExecutors (one per replica) and the head's replica dispatcher journal their decisions
(:func:`omni_ext.progress.record_placement`): ``queued`` (it could not start at once; its
priority), ``start`` (the ranks and mode a request got, its wait,
its prediction), ``done`` (its ranks, seconds, error) and ``bind`` (the stage replica). This route
serves the merged journal read-only, so an operator or a test reads placement from state the
server exposes rather than from its log lines. Behind ``--api-key`` like every ``/v1`` route, and a key sees
only its own requests (:mod:`omni_ext.api.tenants`).
"""

from __future__ import annotations

import math

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from omni_ext.api.errors import bad_request
from omni_ext.api.intake import bounded_int
from omni_ext.api.limits import MAX_PLACEMENTS_PAGE
from omni_ext.api.media import off_loop
from omni_ext.api.state import get_state
from omni_ext.progress import read_placements

PATH = "/v1/omni_ext/placements"
DEFAULT_LIMIT = 100


def parse_after(value: str | None) -> float | None:
    """``after``: a unix time in seconds (events strictly later are listed), e.g. the last event's ``time``."""
    if value is None:
        return None
    try:
        after = float(value)
    except ValueError:
        raise bad_request(f"'after' must be a unix time in seconds, got {value!r}.", "after") from None
    if not math.isfinite(after) or after < 0:
        raise bad_request(f"'after' must be a finite unix time >= 0, got {value!r}.", "after")
    return after


async def placements(request: Request, after: str | None = None, limit: str | None = None) -> JSONResponse:
    """Events in time order: the first ``limit`` after ``after``, or the newest ``limit`` without it; on a
    server with keys, only the caller's own requests' (an admin key's: all)."""
    since = parse_after(after)
    lim = DEFAULT_LIMIT if limit is None else bounded_int(limit, "limit", 1, MAX_PLACEMENTS_PAGE)
    state = get_state(request)
    tenant = state.tenant(request)
    keep = None if tenant.admin else (lambda e: state.sees_request(tenant, str(e.get("request_id", ""))))
    events, has_more = await off_loop(read_placements, since, lim, None, keep)
    return JSONResponse({"object": "list", "data": [{"object": "omni_ext.placement", **e} for e in events],
                         "has_more": has_more})


def install(router: APIRouter) -> None:
    router.add_api_route(PATH, placements, methods=["GET"], name="omni_ext_placements")
