"""Step-level preemption: which running job pauses, when, so that a waiting one starts now.

The TunedExecutor can pause a running job at a denoise-step boundary and resume it later on the same
ranks with byte-identical output (the mechanism: :mod:`omni_ext.executor.role`,
:mod:`omni_ext.executor.worker`, :mod:`omni_ext.executor.suspend`). This module decides when it is
worth it; pure (no clock, no threads), called by the executor under its lock whenever the job that
should start next (the head of :meth:`~omni_ext.scheduler.queue.JobQueue.ordered`) cannot start on
the free ranks.

Two reasons, tried in this order (the ``reason`` label of ``omni_ext:preemptions_total``):

1. ``priority``: the head's requested priority is better (lower) than a running job's: that job
   pauses and the head starts within one step of it. Of several such jobs, the one of the worst
   priority, then the one with the most time left. Requested priority, not aged: aging orders the
   queue, it never pauses a running job of the same class.
2. ``deadline`` (under the order ``"slo"`` only, :func:`deadline_pauses`): the head would miss its
   deadline waiting for the first running job it fits after, with a margin for prediction errors
   (``now + wait + predicted > deadline - DEADLINE_MARGIN x predicted``),
   and a running job of the same or worse priority has the
   slack to wait for it (it still meets its own deadline after the head's predicted run) and holds
   its ranks for at least :data:`MIN_GAIN` times the head's predicted time: the one with the most
   slack pauses. The last condition is what a pause buys: a short job out from behind a long one.
   Between jobs of similar length (a burst of one shape) a pause would only swap who waits, at the
   cost of a pause, so it is not made. A head that misses its deadline even if it started now (it
   waited too long already, or its deadline is tight) is still let out: the victim keeps its own
   deadline, so no deadline is lost, and the head is late by its run instead of by a long job's
   (the tail of the short requests' slowdown is what a stream's users see).

3. **A burst keeps its packing.** Between two jobs of one burst (arrived within
   :data:`BURST_WINDOW_S` of each other) a deadline pause is made only on the ranks the head would
   take by waiting: those of the running job that frees first. It then changes which of the two runs
   first there, not where either runs, so the order's packing of the burst (longest first: its
   makespan) stands; a pause of another job would run the head's work on ranks that the order had
   given to the rest of the burst, and the burst ends later (on the simulator, 81/17-frame bursts:
   1.15-1.17 of the makespan bound with such pauses, 1.04 without). Jobs that arrived apart (a
   stream) pause as rule 2 says. **When they conflict**, for a burst's jobs the packing decides; for a
   stream's, the deadlines.

The jobs queued behind the head count too (:func:`queue_pressure`): when one of them would miss its
deadline waiting, the head is judged by the deadline it must meet for that job to meet its own, run
after it on the freed ranks. A pause is thus made for a queue of short jobs behind a long one, not
only for the first of them.

When the head and at least one job queued behind it would miss their deadlines waiting
(:func:`queue_pressure`), a victim without the slack to meet its own deadline may pause too (the
one least late after it): two or more deadlines are saved for at most one. So may a victim that
misses its deadline even without the pause (it loses nothing a deadline counts). Otherwise the
victim keeps its own.

A victim must free ranks on which the head can start (placement's rules,
:func:`~omni_ext.scheduler.placement.next_placements`, on the free ranks plus the victim's).

**Nothing starves.** A job is paused at most ``max_preemptions`` times (option, default 8); the job
that runs while another is paused on its ranks cannot be paused itself (the executor marks it not
``preemptible``), so a paused job waits for one job at a time. When its ranks free up it resumes
before anything else starts there, unless this function would pause it again for the next job (the
executor asks with the paused job as the one candidate): then it stays paused, one pause more,
rather than resuming for a step. Its total delay is thus at most ``max_preemptions`` runs of other
jobs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from omni_ext.scheduler.config import CfgMode
from omni_ext.scheduler.placement import JobNeeds, Layout, next_placements

#: The reasons a job is preempted (``omni_ext:preemptions_total{reason}``).
REASONS: tuple[str, ...] = ("priority", "deadline")

#: A deadline preemption pauses only a job with at least this many times the waiting job's predicted
#: seconds left (rule 2 in the module docstring).
MIN_GAIN = 2.0

#: A deadline pause is made for a waiting job that would finish later than its deadline less this share
#: of its own predicted seconds (rule 2). Predictions err both ways: a job beside another runs 10-20 %
#: slower than alone on a shared host, and the cost model's seconds are a typical run, not the
#: slowest. A pause timed to end a job exactly on its deadline misses it about half the time; one
#: run of margin absorbs a job up to 1.5x slower than predicted at ``slo_factor`` 3, and costs the
#: victim nothing it cannot afford (it must keep its own deadline). On the simulator with preemption
#: (a Poisson stream at 0.7 of two slots, runs 5-25 % slower than predicted): SLO 3x attainment
#: 0.89 without a margin, 0.95 with one run (:func:`omni_ext.bench.stream_sim.preemptive_run`).
DEADLINE_MARGIN = 1.0

#: Jobs that arrived within this many seconds of each other are one burst (rule 3).
BURST_WINDOW_S = 0.3


@dataclass(frozen=True)
class Running:
    """A running job as preemption sees it. ``units``: the placement units it holds; ``remaining_s``:
    predicted seconds left (None: unknown); ``deadline``: its deadline in the caller's clock (None:
    none); ``preemptions``: times it was paused so far; ``preemptible``: whether the mechanism may
    pause it now (not a warm-up, not already pausing, no job paused under it, pausing supported)."""

    id: str
    priority: int
    units: tuple[int, ...]
    remaining_s: float | None = None
    deadline: float | None = None
    preemptions: int = 0
    preemptible: bool = True
    arrival: float | None = None  # when it was queued (caller's clock; None: unknown)


@dataclass(frozen=True)
class Waiting:
    """The queued job that should start next: its placement needs, requested priority, predicted
    seconds and deadline (caller's clock; None: none)."""

    id: str
    needs: JobNeeds | None = None  # None: a start prediction's job, which any one busy slot fits
    priority: int = 0
    predicted_s: float | None = None
    deadline: float | None = None
    at_risk: int = 1  # queued jobs (it and those behind it) that would miss their deadline waiting
    arrival: float | None = None  # when it was queued (caller's clock; None: unknown)


@dataclass(frozen=True)
class Preemption:
    """Pause ``victim`` so that ``for_job`` starts; ``reason`` is one of :data:`REASONS`; ``detail``
    says why in words (the executor's log line)."""

    victim: str
    for_job: str
    reason: str
    detail: str


def deadline_pauses(order: str) -> bool:
    """Whether a job pauses for another's deadline (rule 2) under the scheduler's ``order``: only
    ``"slo"``, the order that weighs deadlines. ``"cost"`` is chosen for a burst's makespan (its
    longest first, which a pause for a short job queued behind would unpack: ``omni-ext bench
    mixed`` measured 1.17 of its bound with deadline pauses, 1.04 without) and ``"fifo"`` for
    arrival order; under both a job pauses only for a better priority."""
    return order == "slo"


def _one_burst(head: Waiting, victim: Running) -> bool:
    return (head.arrival is not None and victim.arrival is not None
            and abs(head.arrival - victim.arrival) <= BURST_WINDOW_S)


def _fits(head: Waiting, free: Iterable[int], layout: Layout, cfg_mode: CfgMode, now: float) -> bool:
    return bool(next_placements([head], set(free), layout, cfg_mode=cfg_mode, now=now, settle_s=0.0))


def choose(head: Waiting, running: Sequence[Running], free_units: Iterable[int], layout: Layout, *,
           now: float, cfg_mode: CfgMode = CfgMode.PAIR, max_preemptions: int = 8,
           deadlines: bool = True) -> Preemption | None:
    """The preemption to make now for ``head`` (see the module docstring), or None. ``deadlines``:
    whether rule 2 applies (the scheduler's order is ``"slo"``, see :func:`deadline_pauses`)."""
    free = set(free_units)
    if _fits(head, free, layout, cfg_mode, now):
        return None  # it starts without anyone pausing
    fitting = [r for r in running if _fits(head, free | set(r.units), layout, cfg_mode, now)]
    return pick(head, fitting, now=now, max_preemptions=max_preemptions, deadlines=deadlines)


def pick(head: Waiting, fitting: Sequence[Running], *, now: float, max_preemptions: int = 8,
         deadlines: bool = True) -> Preemption | None:
    """:func:`choose` once placement has said which running jobs free ranks the head can start on
    (``fitting``, and nothing is free for it now): the rules of the module docstring."""
    allowed = [r for r in fitting if r.preemptible and r.preemptions < max_preemptions]

    def left(r: Running) -> float:
        return math.inf if r.remaining_s is None else r.remaining_s

    worse = [r for r in allowed if r.priority > head.priority]
    if worse:
        victim = max(worse, key=lambda r: (r.priority, left(r), r.id))
        return Preemption(victim.id, head.id, "priority",
                          f"priority {head.priority} waits behind priority {victim.priority}")
    if not deadlines or head.deadline is None or head.predicted_s is None:
        return None
    wait = min((left(r) for r in fitting), default=math.inf)
    if now + wait + head.predicted_s <= head.deadline - DEADLINE_MARGIN * head.predicted_s:
        return None  # it meets its deadline by waiting, with the margin
    slack = {r.id: r.deadline - (now + r.remaining_s + head.predicted_s) for r in allowed
             if r.priority >= head.priority and r.deadline is not None and r.remaining_s is not None
             and r.remaining_s >= MIN_GAIN * head.predicted_s}
    # a victim late even if it runs on undisturbed loses no deadline by the pause
    doomed = {r.id for r in allowed if r.deadline is not None and r.remaining_s is not None
              and now + r.remaining_s > r.deadline}
    kept = {k: v for k, v in slack.items() if v >= 0 or k in doomed}
    if not kept and head.at_risk >= 2:
        kept = slack  # two or more deadlines saved for at most one: the victim least late after it pauses
    slack = kept
    if not slack:
        return None
    victim_id = max(slack, key=lambda k: (slack[k], k))
    first = min(fitting, key=lambda r: (left(r), r.id))  # whose ranks the head would take by waiting
    victim = next(r for r in allowed if r.id == victim_id)
    if victim_id != first.id and _one_burst(head, victim):
        if first.id not in slack:
            return None  # rule 3: within a burst, only the ranks it would take anyway
        victim_id = first.id
    late_now = now + head.predicted_s - head.deadline
    miss = now + wait + head.predicted_s - head.deadline
    return Preemption(victim_id, head.id, "deadline",
                      (f"it would miss its deadline by {miss:.1f} s waiting" if miss > 0 else
                       f"waiting it would end {-miss:.2f} s before its deadline, inside the margin of "
                       f"{DEADLINE_MARGIN * head.predicted_s:.2f} s")
                      + (f" ({late_now:.1f} s even if it starts now)" if late_now > 0 else "")
                      + _victim_words(slack[victim_id], victim_id in doomed, head.at_risk))


def _victim_words(slack_s: float, doomed: bool, at_risk: int) -> str:
    if slack_s >= 0:
        return f"; the paused job keeps {slack_s:.1f} s of slack"
    if doomed:
        return f"; the paused job, late already, ends {-slack_s:.1f} s after its deadline"
    return f"; the paused job ends {-slack_s:.1f} s after its deadline ({at_risk} queued deadlines saved)"
