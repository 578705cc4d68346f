"""Which queued request goes to which vLLM-Omni replica, and when (pure; no vLLM import).

vLLM-Omni 0.30 binds a request to a replica the moment it arrives: ``StagePool`` round robin in one
server, the multi-machine head's ``random`` / ``least-queue-length`` (a count refreshed every 5 s)
across hosts. None of them sees what a request costs, and once bound, a request waits in that
replica's own first-come-first-served queue even when another replica frees first (vLLM-Omni's
RFC #5135 measured 18-34 % of the makespan lost this way on mixed Wan traffic).

omni-ext keeps the queue on the head instead and binds late:

1. **Bind when it can start.** A request is bound only to a replica with a free slot (a slot is one
   job running at once: one for vLLM-Omni's executor, one per rank or CFG group for the
   TunedExecutor, :meth:`omni_ext.scheduler.layout.ServerLayout.slots`), so no replica ever holds a
   backlog and the head's order decides what runs next everywhere.
2. **Order** is the scheduler's own (:mod:`omni_ext.scheduler.admission`: priority, aging, longest
   predicted first), so a burst stays near its makespan bound across replicas as inside one.
3. **Earliest predicted finish.** Among the replicas with a free slot, the one where the job is
   predicted to end first: its predicted seconds times the replica's measured speed (a slower host
   learns a factor > 1), ties to the replica with the least predicted work left, then the fewest
   jobs, then the lowest id.
4. **Deadlines.** The same deadline as inside a replica (:meth:`Ticket.deadline`: ``slo_factor`` x
   its predicted seconds after its arrival at the head, or the request's own ``deadline_s``): a
   replica where the request would end past it is not chosen when another replica meets it. When
   every free replica would miss it and a busy one (a faster host) frees in time for the request
   to meet it there, the request waits for that replica (its next slot is reserved for it, so
   later requests in the order do not take it) and the free replicas take the requests behind it.
   When no replica meets it, rule 3 binds it at once (it is late whatever happens). Under
   ``order`` "cost" or "fifo" a replica's scheduler has no deadlines, and neither has this rule.
5. **Settle.** When every replica is idle, nothing is bound until the oldest queued request has
   waited ``settle_s``: a burst's requests reach the head a few milliseconds apart and are ordered
   whole instead of first-come (as the TunedExecutor does inside a replica).

The mechanism (the head's queue on vLLM-Omni's ``StagePool``: submission, release, membership) is
:mod:`omni_ext.dispatch.replicas`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from omni_ext.scheduler.config import SchedulerConfig
from omni_ext.scheduler.admission import Ticket, in_order, slot_free_times


#: Weight of the newest measurement in a replica's speed factor.
SPEED_WEIGHT = 0.3
#: A replica's speed factor stays within these bounds (one odd job cannot park a replica).
SPEED_BOUNDS = (0.25, 4.0)


@dataclass
class ReplicaLoad:
    """One replica as dispatch sees it: ``capacity`` slots, the predicted seconds left of each job
    bound to it (``running``), and ``speed`` (measured seconds / predicted seconds; 1.0 until known)."""

    id: int
    capacity: int = 1
    running: list[float] = field(default_factory=list)
    speed: float = 1.0

    @property
    def free(self) -> int:
        return max(0, self.capacity - len(self.running))

    @property
    def work_s(self) -> float:
        return sum(self.running)


def finish_s(replica: ReplicaLoad, job_s: float) -> float:
    """Predicted seconds from now until ``job_s`` of work ends on ``replica`` if started there now."""
    return max(0.0, job_s) * replica.speed


def frees_in_s(replica: ReplicaLoad) -> float:
    """Seconds from now until a slot of ``replica`` is free (0.0 when one is)."""
    return slot_free_times(replica.running, replica.capacity)[0]


@dataclass(frozen=True)
class Choice:
    """Where a request goes: ``replica``, now (``wait_s`` 0) or when its next slot frees (``wait_s``
    > 0: the request waits for it on the head, rule 4)."""

    replica: ReplicaLoad
    wait_s: float = 0.0


def choose(replicas: Sequence[ReplicaLoad], job_s: float, slack_s: float | None = None) -> Choice | None:
    """Where a job of ``job_s`` predicted seconds goes: the free replica where it ends first (rule 3),
    unless that misses its deadline ``slack_s`` seconds from now and a busy replica would still meet
    it (rule 4: it waits for the one of those where it ends first). None when no replica has a free
    slot and none is worth waiting for."""
    free = [r for r in replicas if r.free > 0]
    best = min(free, key=lambda r: _rank(r, job_s)) if free else None
    if best is not None and (slack_s is None or finish_s(best, job_s) <= slack_s):
        return Choice(best)
    if slack_s is not None:
        meets = [(frees_in_s(r) + finish_s(r, job_s), r.id, r) for r in replicas
                 if r.free == 0 and frees_in_s(r) + finish_s(r, job_s) <= slack_s]
        if meets:
            _end, _id, r = min(meets)
            return Choice(r, frees_in_s(r))
    return Choice(best) if best is not None else None


def _rank(replica: ReplicaLoad, job_s: float) -> tuple:
    """Rule 3's order: earliest finish, then the least predicted work left, the fewest jobs, the lowest id."""
    return (round(finish_s(replica, job_s), 6), round(replica.work_s, 6), len(replica.running), replica.id)


def settling(pending: Sequence[Ticket], replicas: Sequence[ReplicaLoad], now: float, settle_s: float) -> float:
    """Seconds left of the settle hold (rule 5), 0.0 when there is none."""
    if not pending or settle_s <= 0 or any(r.running for r in replicas):
        return 0.0
    oldest = min(t.arrival for t in pending)
    return max(0.0, settle_s - (now - oldest))


def plan(pending: Sequence[Ticket], replicas: Sequence[ReplicaLoad], now: float,
         config: SchedulerConfig) -> list[tuple[str, int]]:
    """``(ticket id, replica id)`` for every queued request that should be bound now, in order.

    ``replicas`` are the live ones; their ``running`` lists are updated as jobs are placed (and as a
    waiting request reserves a busy replica's next slot), so the caller's view stays consistent if
    it applies the whole plan.
    """
    if settling(pending, replicas, now, config.settle_s) > 0:
        return []
    out: list[tuple[str, int]] = []
    capacity = sum(replica.capacity for replica in replicas)
    for ticket in in_order(pending, now, config, capacity=capacity):
        job_s = ticket.predicted_s if ticket.predicted_s is not None else ticket.cost
        # Deadlines in seconds, as a replica's own scheduler has them (only under order "slo").
        due = ticket.deadline(config.slo_factor) if ticket.predicted_s is not None and config.order == "slo" else None
        choice = choose(replicas, job_s, None if due is None else due - now)
        if choice is None:
            break
        replica = choice.replica
        if choice.wait_s > 0:  # it waits for this replica: the slot that frees first is its own
            slots = sorted(replica.running)
            slots[0] += finish_s(replica, job_s)
            replica.running[:] = slots
            continue
        replica.running.append(finish_s(replica, job_s))
        out.append((ticket.id, replica.id))
    return out


def updated_speed(speed: float, predicted_s: float | None, measured_s: float) -> float:
    """A replica's speed factor after a job predicted at ``predicted_s`` took ``measured_s`` there."""
    if predicted_s is None or predicted_s <= 0 or measured_s <= 0:
        return speed
    lo, hi = SPEED_BOUNDS
    ratio = min(hi, max(lo, measured_s / predicted_s))
    return (1 - SPEED_WEIGHT) * speed + SPEED_WEIGHT * ratio
