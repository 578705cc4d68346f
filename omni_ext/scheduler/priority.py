"""How a request's priority, its own deadline (and the time it already waited) travel from the API
process to the queues that order it: keys in vLLM-Omni's ``sampling_params.extra_args``, and their
readers.

What the priority and the deadline mean for the order jobs start in is
:mod:`omni_ext.scheduler.admission`'s.
"""

from __future__ import annotations

import logging
import math
from typing import Any

#: Where a request's priority travels from the API process to the executor: the key in vLLM-Omni's
#: ``sampling_params.extra_args`` (a request's ``extra_params`` are merged there).
PRIORITY_ARG = "omni_ext_priority"

#: A request's own deadline, seconds from its arrival (the ``deadline_s`` field); absent: the
#: scheduler's default, ``slo_factor`` x its predicted seconds.
DEADLINE_ARG = "omni_ext_deadline_s"

#: Seconds a request already waited in the head's queue before it was bound to a replica (set by the
#: dispatch in front of several replicas): the replica's executor counts its wait from the arrival at
#: the head, so aging holds across both queues and a burst the head already let settle is not held again.
WAITED_ARG = "omni_ext_waited_s"

logger = logging.getLogger("omni_ext.scheduler")


def request_waited_s(sp: Any) -> float:
    """``sampling_params.extra_args["omni_ext_waited_s"]``: seconds waited before this queue (0 if unset)."""
    raw = (getattr(sp, "extra_args", None) or {}).get(WAITED_ARG)
    try:
        value = float(raw) if raw is not None and not isinstance(raw, bool) else 0.0
    except (TypeError, ValueError):
        return 0.0
    return value if 0.0 <= value < 1e7 else 0.0


def request_priority(request_id: str, sp: Any) -> int:
    """A request's priority (lower runs earlier): ``sampling_params.extra_args["omni_ext_priority"]``;
    0 when absent or not an integer (logged). Read where a request is queued: the TunedExecutor
    inside a replica, and the dispatcher in front of several replicas."""
    raw = (getattr(sp, "extra_args", None) or {}).get(PRIORITY_ARG)
    if raw is None:
        return 0
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    try:
        return int(str(raw).strip())
    except ValueError:
        logger.warning("omni-ext: request %s has priority %r, not an integer; it runs with priority 0", request_id, raw)
        return 0


def request_deadline_s(request_id: str, sp: Any) -> float | None:
    """``sampling_params.extra_args["omni_ext_deadline_s"]``: the request's own deadline in seconds from
    its arrival; None when absent or not a positive number (logged: the default deadline applies)."""
    raw = (getattr(sp, "extra_args", None) or {}).get(DEADLINE_ARG)
    if raw is None:
        return None
    try:
        value = float(raw) if not isinstance(raw, bool) else math.nan
    except (TypeError, ValueError):
        value = math.nan
    if math.isfinite(value) and value > 0:
        return value
    logger.warning("omni-ext: request %s has deadline_s %r, not a positive number; the default deadline applies",
                   request_id, raw)
    return None
