"""Which queued job should start first: priority, aging, then the longest predicted job.

One rule, used in two places that must agree: the TunedExecutor orders its pending jobs with it,
and the API process orders its own accounting of admitted jobs with it to tell a client its queue
position and predicted start (and to decide admission).

- **Priority** (vLLM's convention): lower runs earlier; default 0.
- **Aging**: every ``aging_s`` waited improves a job's effective priority by one, so nothing waits
  forever (bounds in :class:`omni_ext.scheduler.config.SchedulerConfig`).
- **Longest predicted first** among jobs of the same effective priority (``order="cost"``). On
  identical groups this is Graham's LPT rule: a closed burst finishes within 4/3 of the optimal
  makespan whatever the arrival order, where first-come-first-served (and shortest-first) leave
  one group idle while the other runs the long job that came last. ``order="fifo"`` keeps arrival
  order instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from omni_ext.scheduler.config import SchedulerConfig

#: Where a request's priority travels from the API process to the executor: the key in vLLM-Omni's
#: ``sampling_params.extra_args`` (a request's ``extra_params`` are merged there).
PRIORITY_ARG = "omni_ext_priority"

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


@dataclass
class Ticket:
    """A job as ordering and admission see it.

    ``arrival``: monotonic seconds when it was admitted. ``cost``: its expected work in one
    measure shared by every ticket of the server (predicted seconds when known, else cost units);
    ``predicted_s``: predicted seconds it occupies its slot, None while the server knows no rate.
    """

    id: str
    priority: int = 0
    arrival: float = 0.0
    cost: float = 0.0
    predicted_s: float | None = None


def effective_priority(ticket: Ticket, now: float, aging_s: float) -> int:
    """The priority after aging (lower runs earlier)."""
    if aging_s <= 0:
        return ticket.priority
    return ticket.priority - int(max(0.0, now - ticket.arrival) // aging_s)


def sort_key(ticket: Ticket, now: float, config: SchedulerConfig) -> tuple:
    eff = effective_priority(ticket, now, config.aging_s)
    if config.order == "fifo":
        return (eff, ticket.arrival, ticket.id)
    return (eff, -ticket.cost, ticket.arrival, ticket.id)


def in_order(tickets: Iterable[Ticket], now: float, config: SchedulerConfig) -> list[Ticket]:
    """``tickets`` in the order they should start."""
    return sorted(tickets, key=lambda t: sort_key(t, now, config))
