"""One queue of jobs: who waits, who runs and for how long, learned from the jobs that finished.

Three mechanisms hold a queue, each its own :class:`JobQueue`: the API process's account of what it
admitted (:mod:`omni_ext.api.queue`), the head's dispatch in front of several replicas
(:mod:`omni_ext.dispatch.replicas`) and the TunedExecutor inside a replica
(:mod:`omni_ext.executor.tuned`). The state machine is the same for all three, so it is written
once, here: a job is submitted (queued; or admitted, when an
:class:`~omni_ext.scheduler.admission.Admission` may refuse it first), started (running,
somewhere), then finished (its time teaches the cost model) or aborted (it teaches nothing).
Pricing (a job's predicted seconds from the :class:`~omni_ext.scheduler.cost.CostModel`, the one
measure tickets are ordered by), the order (:mod:`omni_ext.scheduler.admission`), the remaining
time of running jobs (:func:`~omni_ext.scheduler.cost.remaining_s`) and predicted starts
(:func:`~omni_ext.scheduler.admission.starts`) are read from it.

Pure: no clock of its own (every call takes ``now``, in the one clock the owner uses for arrivals
and starts), no threads, no I/O; the owner serialises its calls (a lock, or one event loop).
What each mechanism adds (pipes and ranks, replica bindings, HTTP admission) stays with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from omni_ext.scheduler.admission import Admission, Decision, Estimate, Ticket, in_order, starts
from omni_ext.scheduler.config import SchedulerConfig
from omni_ext.scheduler.cost import CostModel, mode_key, remaining_s
from omni_ext.scheduler.admission import Busy

#: vLLM-Omni's start-up warm-up request ids start with this
#: (``vllm_omni.diffusion.request.DUMMY_DIFFUSION_REQUEST_ID`` in 0.30).
WARM_UP_PREFIX = "dummy_req_id"
#: The warm-up's priority: it is the only job at start-up, and it stays ahead of anything queued meanwhile.
WARM_UP_PRIORITY = -(10**6)

P = TypeVar("P")


def is_warm_up(request_id: str) -> bool:
    """vLLM-Omni's start-up request: it is resized on a CPU host and pays first-call costs, so it
    runs ahead of everything, has no cost-based time limit and teaches the cost model nothing."""
    return request_id.startswith(WARM_UP_PREFIX)


@dataclass
class Entry(Generic[P]):
    """One job of a :class:`JobQueue`. ``ticket``: priority, arrival and the current prediction
    (what ordering and admission read); ``key``/``units``: its shape class and cost units;
    ``payload``: what the owning mechanism keeps for it. Once started: ``started`` (the owner's
    clock), ``where`` (ranks, a replica), ``predicted_s`` (the prediction when it started, before
    ``speed``), ``speed`` (how much slower than the cost model ``where`` runs), ``steps`` (measured
    denoise progress: done, total, seconds those took, seconds from the job's start to its loop's;
    ``step_at``: when the latest of them ended),
    ``mode``: the run mode its time is predicted in while queued and learned in once it ran
    (:func:`~omni_ext.scheduler.cost.mode_key`; None: its class is ``key`` alone)."""

    ticket: Ticket
    key: str
    units: float
    payload: P
    learns: bool = True
    started: float | None = None
    where: Any = None
    predicted_s: float | None = None
    speed: float = 1.0
    steps: tuple[int, int, float, float] | tuple[()] = field(default=())
    step_at: float | None = None  # when its latest step ended (the owner's clock; None: not reported)
    paused: bool = False  # paused by step-level preemption, another job on its ranks
    mode: str | None = None
    n_steps: int = 0  # its denoise steps, 0: unknown (the cost model's fixed + per-step prediction)
    slots: int = 1  # slots it holds while it runs (a CFG pair: both ranks of its group) ...
    slots_from: float = -math.inf  # ... from then on, one before (a tentative pair: placement rule 5)

    @property
    def id(self) -> str:
        return self.ticket.id

    @property
    def running(self) -> bool:
        return self.started is not None


#: How a queue predicts a job's seconds from its cost model (default: its shape class and units).
Predictor = Callable[[Entry, CostModel], "float | None"]


def _by_shape(entry: Entry, model: CostModel) -> float | None:
    return model.predict_s(entry.key, entry.units, entry.mode, entry.n_steps)


class JobQueue(Generic[P]):
    """The jobs of one mechanism, queued and running (see the module docstring).

    ``predict``: a queue whose jobs run in several modes (the TunedExecutor: a CFG job on a pair
    or on one rank) predicts with its own rule; the default reads the job's shape class."""

    def __init__(self, config: SchedulerConfig, *, predict: Predictor = _by_shape) -> None:
        self.config = config
        self.cost = CostModel(config.seconds_per_unit)
        self.entries: dict[str, Entry[P]] = {}
        self._predict = predict

    # ---- a job's life ----------------------------------------------------------------------
    def entry(self, job_id: str, payload: P, *, priority: int, arrival: float, key: str, units: float,
              learns: bool = True, deadline_s: float | None = None, mode: str | None = None,
              n_steps: int = 0) -> Entry[P]:
        """A new job priced against this queue, not yet in it (admission decides on it first);
        ``deadline_s``: the request's own deadline (seconds from ``arrival``), None for the default;
        ``mode``: the run mode it is predicted in (:attr:`Entry.mode`); ``n_steps``: its denoise steps."""
        entry = Entry(Ticket(job_id, priority, arrival, deadline_s=deadline_s), key, units, payload, learns=learns,
                      mode=mode, n_steps=n_steps)
        self.price(entry)
        return entry

    def admit(self, job_id: str, payload: P, *, now: float, priority: int, key: str, units: float,
              admission: Admission, deadline_s: float | None = None, mode: str | None = None,
              n_steps: int = 0) -> tuple[Entry[P], Decision]:
        """A new job arriving ``now``: priced, decided on by ``admission`` against this queue as it is
        (:meth:`snapshot`), and queued if admitted. Returns the entry (a refused one is not queued)
        and the decision."""
        entry = self.entry(job_id, payload, priority=priority, arrival=now, key=key, units=units, deadline_s=deadline_s,
                           mode=mode, n_steps=n_steps)
        running, queued = self.snapshot(now)
        decision = admission.decide(now, running, queued, entry.ticket)
        if decision.admitted:
            self.add(entry)
        return entry, decision

    def add(self, entry: Entry[P], *, front: bool = False) -> Entry[P]:
        """Queue ``entry``; ``front``: ahead of the others in arrival order (a job that goes back)."""
        entry.started = None
        self.entries = {entry.id: entry, **self.entries} if front else {**self.entries, entry.id: entry}
        return entry

    def submit(self, job_id: str, payload: P, *, priority: int, arrival: float, key: str, units: float,
               learns: bool = True, deadline_s: float | None = None, n_steps: int = 0) -> Entry[P]:
        """Queue a new job (priced at once)."""
        return self.add(self.entry(job_id, payload, priority=priority, arrival=arrival, key=key, units=units,
                                   learns=learns, deadline_s=deadline_s, n_steps=n_steps))

    def start(self, job_id: str, now: float, where: Any = None, *, speed: float = 1.0,
              key: str | None = None, mode: str | None = None) -> Entry[P]:
        """The job runs from ``now`` on ``where``; ``key``: the class its time is predicted by there,
        else its shape class; ``mode``: the mode it runs in, when its class is its key and mode."""
        entry = self.entries[job_id]
        entry.started, entry.where, entry.speed = now, where, speed
        if key is not None:
            entry.key = key
        if mode is not None:
            entry.mode = mode
        entry.predicted_s = self.cost.predict_s(entry.key, entry.units, entry.mode, entry.n_steps)
        return entry

    def finish(self, job_id: str, now: float, seconds: float | None = None) -> float | None:
        """The job is done: it leaves the queue, and its time (``seconds``, else start to ``now``)
        teaches the cost model unless it may not (:meth:`forget`, a warm-up), with the time of its
        denoise loop when its step reports covered all of it (:attr:`Entry.steps`: fixed and per-step
        costs). Returns that time, or None for a job that never started (nothing is learned then)."""
        entry = self.entries.pop(job_id, None)
        if entry is None or entry.started is None:
            return None
        took = max(0.0, now - entry.started) if seconds is None else seconds
        if entry.learns:
            done, total, loop_s = entry.steps[:3] if entry.steps else (0, 0, None)
            whole = total > 0 and done >= total
            self.cost.observe(entry.key, entry.units, took, entry.mode, steps=total if whole else 0,
                              loop_s=loop_s if whole else None)
        return took

    def abort(self, job_id: str) -> Entry[P] | None:
        """The job leaves the queue without teaching anything (cancelled, failed, lost)."""
        return self.entries.pop(job_id, None)

    def forget(self, job_id: str) -> None:
        """A running job that will not finish normally (aborted, its replica lost): it holds its
        place until it is released, and its time teaches nothing."""
        entry = self.entries.get(job_id)
        if entry is not None:
            entry.learns = False

    # ---- what is read from it -----------------------------------------------------------------
    def get(self, job_id: str) -> Entry[P] | None:
        return self.entries.get(job_id)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def queued(self) -> list[Entry[P]]:
        return [e for e in self.entries.values() if e.started is None]

    def running(self) -> list[Entry[P]]:
        return [e for e in self.entries.values() if e.started is not None]

    def price(self, entry: Entry[P]) -> Ticket:
        """``entry``'s ticket with its prediction from what the cost model knows now, and its ordering
        cost in the measure every ticket shares at that moment (seconds once a rate is known, else units)."""
        ticket = entry.ticket
        ticket.predicted_s = self._predict(entry, self.cost)
        ticket.cost = ticket.predicted_s if ticket.predicted_s is not None else entry.units
        return ticket

    def ordered(self, now: float, capacity: int = 1) -> list[Entry[P]]:
        """The queued jobs in the order they should start on ``capacity`` slots, each priced afresh
        (the slots tell ``order: "slo"`` which jobs form a burst)."""
        by_id = {e.id: e for e in self.queued()}
        tickets = [self.price(e) for e in by_id.values()]
        return [by_id[t.id] for t in in_order(tickets, now, self.config, capacity=capacity)]

    def remaining(self, entry: Entry[P], now: float) -> float | None:
        """Predicted seconds left of a running job, times its place's ``speed``: its measured steps
        when known, else its prediction (from what the cost model knows now) less the time it ran;
        None while no rate is known."""
        predicted = self.cost.predict_s(entry.key, entry.units, entry.mode, entry.n_steps)
        left = remaining_s(predicted, now - (entry.started if entry.started is not None else now), *entry.steps)
        return None if left is None else left * entry.speed

    def snapshot(self, now: float) -> tuple[list[Busy], list[Ticket]]:
        """(each slot a running job holds, the queued tickets priced afresh): what
        :class:`~omni_ext.scheduler.admission.Admission` decides on."""
        return self._held(now), [self.price(e) for e in self.queued()]

    def _held(self, now: float) -> list[Busy]:
        """Each slot a running job holds (a pair's for each of its ranks): its predicted seconds left,
        and when it can pause (:meth:`boundary`). A paused job waits under the job running on its
        ranks (taken to be the one that ends first of those not yet over a paused one): their slot
        frees after both, and when that one ends the paused one may let the next job through (the
        executor's pass-on), so the slot's boundary is that end."""
        running = self.running()
        slots = [self._busy(e, now) for e in running if not e.paused
                 for _ in range(max(1, e.slots) if now >= e.slots_from else 1)]
        free = sorted(range(len(slots)), key=lambda i: slots[i].remaining_s)
        for under in sorted((self._busy(e, now) for e in running if e.paused), key=lambda b: -b.remaining_s):
            if not free:
                slots.append(dataclasses.replace(under, boundary_s=None))
                continue
            i = free.pop(0)
            over = slots[i].remaining_s
            slots[i] = dataclasses.replace(under, remaining_s=over + under.remaining_s,
                                           boundary_s=over if self.config.preempt else None)
        return slots

    def _busy(self, entry: Entry[P], now: float) -> Busy:
        ticket = entry.ticket
        return Busy(self.remaining(entry, now) or 0.0, self.boundary(entry, now), ticket.priority,
                    ticket.deadline(self.config.slo_factor), ticket.arrival)

    def boundary(self, entry: Entry[P], now: float) -> float | None:
        """Predicted seconds until a running job reaches its next denoise-step boundary, where the
        TunedExecutor can pause it (:mod:`omni_ext.scheduler.preempt`); None when it will not pause
        there: this server does not preempt (``config.preempt``), it is the warm-up, its loop is done,
        it is overdue by more than a step (paused under another job), or no step time is known.
        Measured steps give the step time and when the last one ended; before the first, the
        boundary is taken to be one step away (the text encoding before the loop is not known apart)."""
        if not self.config.preempt or is_warm_up(entry.id) or entry.started is None:
            return None
        if entry.steps:
            done, total, loop_s, before_loop_s = entry.steps
            if done >= total or done <= 0:
                return None
            per_step = loop_s / done
            # since its latest step: a pause moves the reported loop's start on, not the job's start here
            ended = entry.step_at if entry.step_at is not None else entry.started + before_loop_s + loop_s
            into = max(0.0, now - ended)
            return per_step - into if into <= per_step else None
        if entry.n_steps <= 0:
            return None
        cls = mode_key(entry.key, entry.mode) if entry.mode else entry.key
        per_step = self.cost.per_step.get(cls)
        if per_step is None:
            predicted = self.cost.predict_s(entry.key, entry.units, entry.mode, entry.n_steps)
            per_step = None if predicted is None else predicted / entry.n_steps
        return None if per_step is None else per_step * entry.speed

    def estimates(self, now: float, capacity: int) -> dict[str, Estimate]:
        """Queue position and predicted seconds until it starts of every queued job, on ``capacity`` slots."""
        ordered = self.ordered(now, capacity)
        at = starts(now, self._held(now), [e.ticket for e in ordered], capacity, self.config)
        return {e.id: Estimate(i, s) for i, (e, s) in enumerate(zip(ordered, at))}
