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
- **Deadlines** (``order="slo"``, the default). Longest-first is the right order for a burst's makespan
  and the wrong one for a stream: a short request that arrives behind queued long ones waits for all
  of them, many times its own length. So every job has a deadline (:meth:`Ticket.deadline`: arrival
  plus ``slo_factor`` x its predicted seconds, or the request's own ``deadline_s``) and, within one
  effective priority, the job with the **tightest relative deadline** (deadline less arrival,
  :func:`budget_s`) starts first: deadline-monotonic order. With the default deadlines that is the
  shortest predicted job first, so a short request waits for the short ones ahead of it and never
  for a queue of long ones; a request that asks for a tighter deadline than its class's goes ahead of
  its class. Nothing else is weighed: on the simulator (:mod:`omni_ext.bench.stream_sim`, a Poisson
  stream of ``omni-ext bench stream``'s mix with preemption) every rule tried that lets a job at risk
  of missing its deadline go first (least slack first, earliest deadline first, longest-first with
  such rescues, the earlier default) met fewer deadlines at 0.9 of capacity (0.77-0.82 against 0.85)
  and left the short jobs' p99 slowdown at 7-60 against 3.8: under load, rescuing one long job
  makes several short ones late. Long jobs are not starved: aging raises them every ``aging_s``, and
  step-level preemption (:mod:`omni_ext.scheduler.preempt`) pauses a long job only for one that
  needs it.

  **A burst keeps its packing.** Jobs that arrived together (a run of arrivals each within
  :data:`BURST_GAP_S` of the one before, more of them than the server has slots: :func:`bursts`)
  start longest first among themselves (Graham's LPT: a closed burst finishes within 4/3 of its
  optimal makespan whatever its arrival order, where shortest-first leaves the long jobs for last:
  1.18 of the bound on the simulator's 81/17-frame bursts against 1.05), and the burst takes its
  place in the order by its tightest member. **When they conflict**: priority and aging first; then,
  within a burst, its makespan (longest first); between a burst and jobs that arrived apart, and
  between those, the deadlines. On one slot a burst's order does not change when it ends, so it is
  ordered by its deadlines too.

**Start times** are list scheduling of the work ahead on the server's ``capacity`` slots (one slot =
one job running at a time: a rank of the TunedExecutor, or the whole server for vLLM-Omni's own
executor): each running job holds its slot for its predicted remaining time, each job ahead in that
order takes the slot that frees first, and a new request starts when the next slot frees after
them. Only jobs that start before it count, so an interactive request (priority -1) sent into a full
queue of batch work (priority 0) is admitted. Where the TunedExecutor pauses jobs (step-level
preemption), a job for which :mod:`omni_ext.scheduler.preempt` would pause a running one starts at
that job's next step boundary instead of its end (:func:`starts`); that interactive request starts a
step after it arrives, not when the first running job ends.

**Admission.** A request predicted to start later than ``max_wait_s`` is refused, and the client is
told when to come back (``Retry-After``): the time at which the work ahead of it, *plus the clients
refused before it* (they come back first), has drained to ``max_wait_s``, plus a small margin.
Remembering those promises is what lets a burst of refused clients come back staggered instead of
all at once, each admitted on its first retry. Under ``order="slo"`` a request is also refused when
admitting it would push an admitted job past ``max_wait_s`` (a newcomer whose deadline is at risk
starts ahead of them). Accepted work is never dropped: admission only ever refuses a request before
a job exists.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from omni_ext.scheduler.config import SchedulerConfig
from omni_ext.scheduler.preempt import Running, Waiting, deadline_pauses, pick


# ---- order ------------------------------------------------------------------------------------
@dataclass
class Ticket:
    """A job as ordering and admission see it.

    ``arrival``: monotonic seconds when it was admitted. ``cost``: its expected work in one
    measure shared by every ticket of the server (predicted seconds when known, else cost units);
    ``predicted_s``: predicted seconds it occupies its slot, None while the server knows no rate.
    ``deadline_s``: the request's own deadline (seconds from ``arrival``), None for the default.
    """

    id: str
    priority: int = 0
    arrival: float = 0.0
    cost: float = 0.0
    predicted_s: float | None = None
    deadline_s: float | None = None

    def deadline(self, slo_factor: float) -> float | None:
        """When it should be done (monotonic seconds): ``arrival + deadline_s`` when the request set
        one, else ``arrival + slo_factor x predicted_s``; None while nothing is predicted."""
        if self.deadline_s is not None:
            return self.arrival + self.deadline_s
        if self.predicted_s is None:
            return None
        return self.arrival + slo_factor * self.predicted_s


def effective_priority(ticket: Ticket, now: float, aging_s: float) -> int:
    """The priority after aging (lower runs earlier)."""
    if aging_s <= 0:
        return ticket.priority
    return ticket.priority - int(max(0.0, now - ticket.arrival) // aging_s)


def sort_key(ticket: Ticket, now: float, config: SchedulerConfig) -> tuple:
    """The order of ``"cost"`` and ``"fifo"`` (``"slo"``'s is :func:`_deadline_order`)."""
    eff = effective_priority(ticket, now, config.aging_s)
    if config.order == "fifo":
        return (eff, ticket.arrival, ticket.id)
    return (eff, -ticket.cost, ticket.arrival, ticket.id)


def in_order(tickets: Iterable[Ticket], now: float, config: SchedulerConfig, *, capacity: int = 1) -> list[Ticket]:
    """``tickets`` in the order they should start; ``capacity`` (slots) tells ``"slo"`` which jobs form
    a burst (more of them than slots)."""
    if config.order == "slo":
        return _deadline_order(list(tickets), now, config, capacity)
    return sorted(tickets, key=lambda t: sort_key(t, now, config))


#: Jobs queued one after another with gaps of at most this many seconds arrived together (one burst,
#: :func:`bursts`). A client's burst reaches the executor a few milliseconds apart (six asynchronous
#: creates sent back to back spanned 36 ms on a 2-core host; ``omni-ext bench mixed``'s six posts,
#: one after another, arrived 2-4 ms apart on 12-04). Between Poisson arrivals at 1.4 per second (``bench stream`` at
#: 0.9) a gap this short comes once in 14, and three such arrivals in a row once in 200.
BURST_GAP_S = 0.1


def bursts(tickets: Sequence[Ticket], capacity: int) -> dict[str, float]:
    """The queued tickets that belong to a burst, by id, with the arrival of the burst's first: a
    run of arrivals each within :data:`BURST_GAP_S` of the one before, more of them than there are
    slots. On one slot the order of a burst does not change when it ends, so nothing is a burst there."""
    if int(capacity) < 2:
        return {}
    out: dict[str, float] = {}
    run: list[Ticket] = []
    for t in [*sorted(tickets, key=lambda t: (t.arrival, t.id)), None]:
        if t is not None and run and t.arrival - run[-1].arrival <= BURST_GAP_S:
            run.append(t)
            continue
        if len(run) > int(capacity):
            out.update((m.id, run[0].arrival) for m in run)
        run = [] if t is None else [t]
    return out


def budget_s(ticket: Ticket, slo_factor: float) -> float:
    """A job's relative deadline: its own ``deadline_s``, else ``slo_factor`` x its cost (its predicted
    seconds once the server knows a rate, else its cost units: every ticket of a server shares that
    measure)."""
    return ticket.deadline_s if ticket.deadline_s is not None else slo_factor * ticket.cost


def _deadline_order(tickets: list[Ticket], now: float, config: SchedulerConfig, capacity: int) -> list[Ticket]:
    """``"slo"``: the tightest relative deadline first within an effective priority, a burst longest
    first within itself and at the place of its tightest member (module docstring)."""
    burst = bursts(tickets, capacity)
    budget = {t.id: budget_s(t, config.slo_factor) for t in tickets}
    tightest: dict[float, float] = {}
    for t in tickets:
        if t.id in burst:
            tightest[burst[t.id]] = min(tightest.get(burst[t.id], budget[t.id]), budget[t.id])

    def key(t: Ticket) -> tuple:
        eff = effective_priority(t, now, config.aging_s)
        if t.id in burst:
            return (eff, tightest[burst[t.id]], burst[t.id], -t.cost, t.arrival, t.id)
        return (eff, budget[t.id], t.arrival, 0.0, t.arrival, t.id)

    return sorted(tickets, key=key)


# ---- start times and admission --------------------------------------------------------------
#: The shortest Retry-After a refused client is given (seconds).
MIN_RETRY_S = 1.0


def slot_free_times(running_remaining: Sequence[float], capacity: int) -> list[float]:
    """A heap of the seconds from now at which each of ``capacity`` slots frees for the queue
    (:func:`_seed_slots`)."""
    slots = [free_s for free_s, _ in _seed_slots([(r, None) for r in running_remaining], capacity)]
    heapq.heapify(slots)
    return slots


def _seed_slots(running: Sequence[tuple[float, Any]], capacity: int) -> list[tuple[float, Any]]:
    """``capacity`` slots as (seconds until it frees, its job's tag), from the running jobs as
    (seconds left, tag): the jobs with the most time left hold a slot each; more running jobs than
    slots (the layout shrank) queue up on the slot that frees first, whose tag becomes None (its job
    is no longer the one that ends it)."""
    capacity = max(1, int(capacity))
    ordered = sorted(((max(0.0, rest), tag) for rest, tag in running), key=lambda r: r[0], reverse=True)
    slots: list[tuple[float, Any]] = ordered[:capacity]
    slots += [(0.0, None)] * (capacity - len(slots))
    for rest, _ in ordered[capacity:]:
        first = min(range(capacity), key=lambda i: (slots[i][0], i))
        slots[first] = (slots[first][0] + rest, None)
    return slots


def start_times(running_remaining: Sequence[float], queued: Sequence[float], capacity: int) -> list[float]:
    """Seconds from now until each of the ``queued`` jobs (service seconds, in start order) starts:
    ``running_remaining`` (one entry per running job) hold their slots first, then each queued job
    takes the slot that frees first, on ``capacity`` slots."""
    slots = slot_free_times(running_remaining, capacity)
    starts = []
    for seconds in queued:
        start = heapq.heappop(slots)
        starts.append(start)
        heapq.heappush(slots, start + max(0.0, seconds))
    return starts


def queue_pressure(now: float, slots_s: Sequence[float], queued: Sequence[tuple[float | None, float | None]],
                   capacity: int, depth: int = 8) -> tuple[float | None, int]:
    """(the deadline the head of the queue is judged by, how many queued jobs would miss theirs).

    ``slots_s``: seconds until each busy slot frees; ``queued``: (predicted seconds, deadline) of the
    queued jobs in start order, the head first; the first ``depth`` are looked at (up to the first
    one not predicted). In the list schedule of the slots
    (:func:`start_times`), a job that misses its deadline waiting
    counts as at risk; job ``i`` behind the head that does asks the head to be done by its
    deadline less the predicted runs of jobs 1..i after it on the same ranks (the head's deadline
    is the earliest of those and its own)."""
    if not queued:
        return None, 0
    best = queued[0][1]
    jobs = list(itertools.takewhile(lambda job: job[0] is not None, queued[:depth]))
    starts = start_times(list(slots_s), [p for p, _ in jobs], capacity)
    behind, at_risk = 0.0, 0
    for i, ((pred, deadline), start) in enumerate(zip(jobs, starts)):
        behind += pred if i else 0.0
        if deadline is None or now + start + pred <= deadline:
            continue
        at_risk += 1
        if i:
            need = deadline - behind
            best = need if best is None else min(best, need)
    return best, at_risk


@dataclass(frozen=True)
class Busy:
    """A slot as a start prediction sees it: ``remaining_s`` until it frees; ``boundary_s``: seconds
    until its job can pause, at its next denoise-step boundary (None: it cannot: the server does not
    preempt, the job is past its loop, or is the warm-up). A slot whose job runs over a paused one
    frees after both, and its boundary is that job's end, where the paused one may let the next job
    through; the fields then are the paused job's. Priority, deadline, arrival (the caller's clock)
    and pauses so far as :class:`Running` has them."""

    remaining_s: float
    boundary_s: float | None = None
    priority: int = 0
    deadline: float | None = None
    arrival: float | None = None
    preemptions: int = 0


def predicted_starts(now: float, busy: Sequence[Busy], queued: Sequence[Waiting], capacity: int, *,
                     max_preemptions: int = 8, deadlines: bool = True) -> list[float]:
    """Seconds from ``now`` until each ``queued`` job (in start order; its own deadline) starts, with
    the pauses this module would make.

    The list schedule of :func:`start_times` (each job takes the slot
    that frees first), except that a job for which :func:`~omni_ext.scheduler.preempt.pick` pauses a running one starts at that
    job's next step boundary, and the paused job's slot frees the head's run later than it would
    have. The paused job resumes when that run ends, and is paused again there for the next job that
    :func:`~omni_ext.scheduler.preempt.pick` lets through (the executor's pass-on: a paused job lets a queue of short jobs through
    one after another, each pause counted). Without this, a short request arriving behind long ones
    was told it would start when the first of them ended, and it started a step later: ``bench
    stream``'s short jobs at 0.9 of capacity were predicted to wait 3.8 s at the median and waited
    0.18 s (2026-12-07, seed 1).

    Not modelled (each makes a start later than predicted, never earlier): a queued job once started
    is not paused, a pair's two slots are two slots, and a pause's own cost (milliseconds) is not
    counted."""
    capacity = max(1, int(capacity))
    # (frees in s, its job if it may pause): a slot with jobs stacked on it (the layout shrank) cannot
    slots: list[tuple[float, Busy | None]] = _seed_slots([(b.remaining_s, b) for b in busy], capacity)
    out: list[float] = []
    for k, job in enumerate(queued):
        first = min(range(capacity), key=lambda i: (slots[i][0], i))
        wait = slots[first][0]
        victim = _predicted_victim(now, slots, queued[k:], capacity, max_preemptions=max_preemptions,
                                   deadlines=deadlines) if wait > 0 else None
        run = max(0.0, job.predicted_s or 0.0)
        if victim is None:
            out.append(wait)
            slots[first] = (wait + run, None)
            continue
        free_s, paused = slots[victim]
        assert paused is not None and paused.boundary_s is not None  # only such a slot is a victim
        out.append(paused.boundary_s)
        # the job runs there, then the paused one resumes: it may pause again for the next, at once
        slots[victim] = (free_s + run, dataclasses.replace(paused, remaining_s=free_s + run,
                                                           boundary_s=paused.boundary_s + run,
                                                           preemptions=paused.preemptions + 1))
    return out


def _predicted_victim(now: float, slots: Sequence[tuple[float, Busy | None]], jobs: Sequence[Waiting], capacity: int,
                      *, max_preemptions: int, deadlines: bool) -> int | None:
    """The slot whose job :func:`~omni_ext.scheduler.preempt.pick` pauses for ``jobs[0]`` (judged with the jobs queued behind it,
    :func:`queue_pressure`), when its step boundary comes before a slot frees anyway."""
    head = jobs[0]
    pressure, at_risk = queue_pressure(now, [s for s, _ in slots], [(j.predicted_s, j.deadline) for j in jobs], capacity)
    judged = Waiting(head.id, None, head.priority, head.predicted_s, head.deadline if pressure is None else pressure,
                     max(1, at_risk), arrival=head.arrival)
    wait = min(s for s, _ in slots)
    fitting = [Running(str(i), head.priority, (i,), remaining_s=s, preemptible=False) if b is None else
               Running(str(i), b.priority, (i,), remaining_s=s, deadline=b.deadline, arrival=b.arrival,
                       preemptions=b.preemptions, preemptible=b.boundary_s is not None and b.boundary_s < wait)
               for i, (s, b) in enumerate(slots)]
    choice = pick(judged, fitting, now=now, max_preemptions=max_preemptions, deadlines=deadlines)
    return None if choice is None else int(choice.victim)


def predict_start(running_remaining: Sequence[float | Busy], ahead: Sequence[float], capacity: int) -> float:
    """Seconds from now until a new job starts behind ``ahead`` (see :func:`start_times`)."""
    return start_times([left_s(r) for r in running_remaining], [*ahead, 0.0], capacity)[-1]


def left_s(running: float | Busy) -> float:
    """Seconds until a running job frees its slot (a :class:`Busy` or the seconds)."""
    return running.remaining_s if isinstance(running, Busy) else running


def starts(now: float, running: Sequence[float | Busy], ordered: Sequence[Ticket], capacity: int,
           config: SchedulerConfig) -> list[float]:
    """Seconds from ``now`` until each of ``ordered`` (in start order) starts: :func:`start_times`,
    with the step-boundary pauses preemption makes when the server pauses jobs (``running`` are
    :class:`Busy` with a boundary, ``config.preempt``:
    :func:`predicted_starts`)."""
    if config.preempt and any(isinstance(r, Busy) and r.boundary_s is not None for r in running):
        return predicted_starts(now, [r if isinstance(r, Busy) else Busy(r) for r in running],
                                [Waiting(t.id, None, t.priority, _seconds(t), t.deadline(config.slo_factor), arrival=t.arrival)
                                 for t in ordered], capacity, max_preemptions=config.max_preemptions, deadlines=deadline_pauses(config.order))
    return start_times([left_s(r) for r in running], [_seconds(t) for t in ordered], capacity)


@dataclass(frozen=True)
class Decision:
    """``wait_s``: predicted seconds until the request starts if admitted now; ``position``: jobs
    queued ahead of it; ``retry_after_s``: when a refused client should come back."""

    admitted: bool
    wait_s: float
    position: int
    retry_after_s: float | None = None
    reason: str = "admitted"  # or "queue_full": the word metrics count refusals by
    deadline: float | None = None  # an admitted request's deadline as admitted (``Ticket.deadline``)


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

    def estimates(self, now: float, running_remaining: Sequence[float | Busy], queued: Sequence[Ticket]) -> dict[str, Estimate]:
        """Queue position and predicted start of every queued ticket, by id (one pass)."""
        ordered = in_order(queued, now, self.config, capacity=self.capacity)
        at = starts(now, running_remaining, ordered, self.capacity, self.config)
        return {t.id: Estimate(i, start) for i, (t, start) in enumerate(zip(ordered, at))}

    def estimate(self, now: float, running_remaining: Sequence[float | Busy], queued: Sequence[Ticket], ticket: Ticket) -> Estimate:
        """Queue position and predicted start of ``ticket`` (queued or about to be)."""
        others = [q for q in queued if q.id != ticket.id]
        return self.estimates(now, running_remaining, [*others, ticket])[ticket.id]

    def decide(self, now: float, running_remaining: Sequence[float | Busy], queued: Sequence[Ticket], new: Ticket) -> Decision:
        """Admit ``new`` or refuse it with the time to come back (and remember that promise)."""
        self._expire(now)
        others = [q for q in queued if q.id != new.id]
        with_new = self.estimates(now, running_remaining, [*others, new])
        est = with_new[new.id]
        # the admitted jobs a newcomer may not push past their promise: those of its priority or better
        peers = [t for t in others if effective_priority(t, now, self.config.aging_s)
                 <= effective_priority(new, now, self.config.aging_s)]
        overtakes = self._breaks_promises(now, running_remaining, others, peers, with_new)
        if est.start_in_s <= self.config.max_wait_s and not overtakes:
            self._redeem(now)
            return Decision(True, est.start_in_s, est.position, deadline=new.deadline(self.config.slo_factor))
        if overtakes:  # it may come back once those peers fit the bound
            ahead = [_seconds(t) for t in peers]
        else:
            ordered = sorted(with_new, key=lambda i: with_new[i].position)
            by_id = {t.id: t for t in others}
            ahead = [_seconds(by_id[i]) for i in ordered[: est.position]]
        ahead += [p.seconds for p in self.promises]
        drained = predict_start(running_remaining, ahead, self.capacity)
        retry = max(MIN_RETRY_S, drained - self.config.max_wait_s + self.config.margin_s)
        self.promises.append(_Promise(now + retry, _seconds(new)))
        return Decision(False, est.start_in_s, est.position, retry_after_s=retry, reason="queue_full")

    def _breaks_promises(self, now: float, running_remaining: Sequence[float | Busy], others: Sequence[Ticket],
                         peers: Sequence[Ticket], with_new: dict[str, Estimate]) -> bool:
        """Whether admitting a request would push one of ``peers`` (admitted, of its priority or better)
        past ``max_wait_s``, or past its current prediction for one already beyond it. Order ``"slo"``
        starts a newcomer whose deadline is at risk ahead of admitted jobs of its priority; every
        newcomer to a full queue is at risk, so without this check admission would refuse nobody and
        break the promises it gave. (Overtaking by priority is intended, and not counted.)"""
        if self.config.order != "slo" or not peers:
            return False
        before = self.estimates(now, running_remaining, others)
        bound = self.config.max_wait_s
        return any(with_new[t.id].start_in_s > max(bound, before[t.id].start_in_s) + 1e-9 for t in peers)

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
