"""The order jobs start in, when each starts, and admission: 429 with Retry-After past ``max_wait_s``.

**Order.** One rule, used wherever jobs queue, so that what a client is told and what runs agree
(the TunedExecutor's ranks, the API process's account, the head's dispatch):

- **Priority** (vLLM's convention): lower runs earlier; default 0 (how it travels:
  :mod:`omni_ext.scheduler.priority`).
- **Aging**: every ``aging_s`` waited improves a job's effective priority by one, so nothing waits
  forever (bounds in :class:`omni_ext.scheduler.config.SchedulerConfig`).
- **Longest predicted first** among jobs of the same effective priority (``order="cost"``). On
  identical groups this is Graham's LPT rule: a closed burst finishes within 4/3 of the optimal
  makespan whatever the arrival order, where first-come-first-served (and shortest-first) leave
  one group idle while the other runs the long job that came last. ``order="fifo"`` keeps arrival
  order instead.

**Start times** are list scheduling of the work ahead on the server's ``capacity`` slots (one slot =
one job running at a time: a rank of the TunedExecutor, or the whole server for vLLM-Omni's own
executor): each running job holds its slot for its predicted remaining time, each job ahead in that
order takes the slot that frees first, and a new request starts when the next slot frees after
them. Only jobs that start before it count, so an interactive request (priority -1) sent into a full
queue of batch work (priority 0) is admitted and starts when the first running job ends.

**Admission.** A request predicted to start later than ``max_wait_s`` is refused, and the client is
told when to come back (``Retry-After``): the time at which the work ahead of it, *plus the clients
refused before it* (they come back first), has drained to ``max_wait_s``, plus a small margin.
Remembering those promises is what lets a burst of refused clients come back staggered instead of
all at once, each admitted on its first retry. Accepted work is never dropped: admission only ever
refuses a request before a job exists.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from omni_ext.scheduler.config import SchedulerConfig


# ---- order ------------------------------------------------------------------------------------
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


# ---- start times and admission --------------------------------------------------------------
#: The shortest Retry-After a refused client is given (seconds).
MIN_RETRY_S = 1.0


def start_times(running_remaining: Sequence[float], queued: Sequence[float], capacity: int) -> list[float]:
    """Seconds from now until each of the ``queued`` jobs (service seconds, in start order) starts:
    ``running_remaining`` (one entry per running job) hold their slots first, then each queued job
    takes the slot that frees first, on ``capacity`` slots."""
    capacity = max(1, int(capacity))
    slots = [0.0] * capacity
    running = sorted((max(0.0, r) for r in running_remaining), reverse=True)
    # Running jobs already hold slots; more running jobs than slots (a layout change) queue up.
    for i, rest in enumerate(running[:capacity]):
        slots[i] = rest
    heapq.heapify(slots)
    for rest in running[capacity:]:
        heapq.heappush(slots, heapq.heappop(slots) + rest)
    starts = []
    for seconds in queued:
        start = heapq.heappop(slots)
        starts.append(start)
        heapq.heappush(slots, start + max(0.0, seconds))
    return starts


def predict_start(running_remaining: Sequence[float], ahead: Sequence[float], capacity: int) -> float:
    """Seconds from now until a new job starts behind ``ahead`` (see :func:`start_times`)."""
    return start_times(running_remaining, [*ahead, 0.0], capacity)[-1]


@dataclass(frozen=True)
class Decision:
    """``wait_s``: predicted seconds until the request starts if admitted now; ``position``: jobs
    queued ahead of it; ``retry_after_s``: when a refused client should come back."""

    admitted: bool
    wait_s: float
    position: int
    retry_after_s: float | None = None
    reason: str = "admitted"  # or "queue_full": the word metrics count refusals by


@dataclass(frozen=True)
class Estimate:
    position: int
    start_in_s: float


@dataclass
class _Promise:
    due: float
    seconds: float


@dataclass
class Admission:
    """Admission decisions for one server (pure; the caller passes the clock and its accounting)."""

    config: SchedulerConfig
    capacity: int = 1
    promises: list[_Promise] = field(default_factory=list)

    def estimates(self, now: float, running_remaining: Sequence[float], queued: Sequence[Ticket]) -> dict[str, Estimate]:
        """Queue position and predicted start of every queued ticket, by id (one pass)."""
        ordered = in_order(queued, now, self.config)
        starts = start_times(running_remaining, [_seconds(t) for t in ordered], self.capacity)
        return {t.id: Estimate(i, start) for i, (t, start) in enumerate(zip(ordered, starts))}

    def estimate(self, now: float, running_remaining: Sequence[float], queued: Sequence[Ticket], ticket: Ticket) -> Estimate:
        """Queue position and predicted start of ``ticket`` (queued or about to be)."""
        others = [q for q in queued if q.id != ticket.id]
        return self.estimates(now, running_remaining, [*others, ticket])[ticket.id]

    def decide(self, now: float, running_remaining: Sequence[float], queued: Sequence[Ticket], new: Ticket) -> Decision:
        """Admit ``new`` or refuse it with the time to come back (and remember that promise)."""
        self._expire(now)
        est = self.estimate(now, running_remaining, queued, new)
        if est.start_in_s <= self.config.max_wait_s:
            self._redeem(now)
            return Decision(True, est.start_in_s, est.position)
        ordered = in_order([*queued, new], now, self.config)
        ahead = [_seconds(t) for t in ordered[: est.position]] + [p.seconds for p in self.promises]
        drained = predict_start(running_remaining, ahead, self.capacity)
        retry = max(MIN_RETRY_S, drained - self.config.max_wait_s + self.config.margin_s)
        self.promises.append(_Promise(now + retry, _seconds(new)))
        return Decision(False, est.start_in_s, est.position, retry_after_s=retry, reason="queue_full")

    def forget_promises(self) -> None:
        """Capacity changed or the server restarted its accounting: earlier promises no longer hold."""
        self.promises.clear()

    def _redeem(self, now: float) -> None:
        """An admitted request that arrives when a promise is due is taken to be that client's retry."""
        due = [p for p in self.promises if p.due <= now + self.config.margin_s]
        if due:
            self.promises.remove(min(due, key=lambda p: p.due))

    def _expire(self, now: float) -> None:
        """Clients that did not come back within a grace period after their time are forgotten."""
        grace = max(5.0, 2 * self.config.margin_s)
        self.promises = [p for p in self.promises if p.due + grace >= now]


def _seconds(ticket: Ticket) -> float:
    return ticket.predicted_s if ticket.predicted_s is not None else 0.0
