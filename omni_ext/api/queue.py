"""The API process's account of the jobs it admitted: who waits, who runs, and for how long.

vLLM-Omni's engine does not say how long its queue is, so the API process keeps its own account:
a :class:`~omni_ext.scheduler.order.Ticket` per admitted generation (async and sync videos,
images while they run) with its predicted service time from a
:class:`~omni_ext.scheduler.cost.CostModel` learned from the jobs it saw finish. From that account,
:class:`~omni_ext.scheduler.admission.Admission` (pure, shared rules) decides whether a new request
would start within ``max_wait_s`` (else 429 with Retry-After), and a queued job's GET tells its
queue position and predicted start.

Running or queued: a job runs once its first progress file exists (the TunedExecutor writes a
start marker when a rank really starts it; vLLM-Omni's workers write one after each denoise step),
or, under vLLM-Omni's own executor, once the engine hands it on (``on_started``), which there is
when it runs. Under the TunedExecutor ``on_started`` comes when the executor queues the job, so it
is ignored.

All calls happen on the API server's event loop, without awaiting in between, so that a decision
and the registration it allows cannot interleave with another request's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from omni_ext.api import metrics
from omni_ext.api.errors import APIError, too_busy
from omni_ext.models import families
from omni_ext.progress import StepProgress, read_progress
from omni_ext.scheduler.admission import MIN_RETRY_S, Admission, Decision, predict_start
from omni_ext.scheduler.config import SchedulerConfig
from omni_ext.scheduler.cost import CostModel, remaining_s, request_shape
from omni_ext.scheduler.order import PRIORITY_ARG, Ticket

logger = logging.getLogger("omni_ext.api")

@dataclass(frozen=True)
class JobShape:
    """What a request costs: its shape class (:func:`~omni_ext.scheduler.cost.shape_key`) and its
    work in the cost units of :func:`omni_ext.models.families.cost_units`."""

    key: str
    units: float


def job_shape(
    pipeline: str | None, *, width: int | None, height: int | None, frames: int | None = None, steps: int | None = None,
    n: int = 1, negative_prompt: str | None = None, guidance_scale: float | None = None,
    guidance_scale_2: float | None = None, true_cfg_scale: float | None = None,
) -> JobShape:
    """The shape of a request as its pipeline will run it: unset sizes take the family's native
    ones, and CFG is decided by the pipeline's own rule (:func:`omni_ext.models.families.needs_cfg`).
    ``n`` outputs cost ``n`` times one."""
    sp = SimpleNamespace(
        num_inference_steps=steps, width=width, height=height, num_frames=frames,
        guidance_scale=guidance_scale, guidance_scale_provided=guidance_scale is not None,
        guidance_scale_2=guidance_scale_2, guidance_scale_2_provided=guidance_scale_2 is not None,
        true_cfg_scale=true_cfg_scale,
    )
    cfg = families.needs_cfg(pipeline, {"negative_prompt": negative_prompt}, sp)
    key, _steps = request_shape(pipeline, sp, cfg)
    return JobShape(key, families.cost_units(pipeline, sp, cfg) * max(1, n))


def with_priority(extra: dict[str, Any] | None, priority: int) -> dict[str, Any] | None:
    """``extra`` (a request's ``extra_params``) carrying ``priority`` to the executor; the key is
    left out at the default 0, so that vLLM-Omni's "Applied extra_params" log line stays the user's."""
    out = {k: v for k, v in (extra or {}).items() if k != PRIORITY_ARG}
    if priority:
        out[PRIORITY_ARG] = priority
    return out if out or extra is not None else None


@dataclass
class Tracked:
    """One admitted job: its ticket (order and prediction), its shape, and when it started."""

    ticket: Ticket
    shape: JobShape
    priority: int
    started_wall: float | None = None  # unix seconds it started on the workers; None while queued
    step: StepProgress | None = None  # its latest progress file

    @property
    def running(self) -> bool:
        return self.started_wall is not None


@dataclass(frozen=True)
class QueueView:
    """A queued job as a client sees it: ``position`` (0 = next) and predicted seconds until it
    starts (None while the server knows no rate for any shape)."""

    position: int
    wait_s: float | None

    def fields(self, now_wall: float) -> dict[str, Any]:
        """``queue_position``, ``predicted_wait_s`` and ``predicted_start_at`` (unix seconds) for a video object."""
        known = self.wait_s is not None
        return {"queue_position": self.position,
                "predicted_wait_s": round(self.wait_s, 1) if known else None,
                "predicted_start_at": int(round(now_wall + self.wait_s)) if known else None}


class RequestQueue:
    """The account of one server's admitted jobs (see the module docstring).

    ``tuned``: the TunedExecutor runs the jobs; it orders them by priority, vLLM-Omni's own
    executor runs them first come first served, and the account follows whichever runs.
    ``slots``: jobs that run at once (:meth:`omni_ext.api.layout.ServerLayout.slots`).
    ``live_slots``/``bound_since``: when a dispatch in this process binds jobs to replicas
    (:class:`omni_ext.dispatch.replicas.ReplicaDispatch`, given at start-up), how many jobs its live
    replicas run at once and when a job was bound (it runs from then on); without one, admission
    keeps ``slots``. ``clock``/``wall``/``progress`` are injectable for tests.
    """

    def __init__(
        self, config: SchedulerConfig | None = None, slots: int = 1, *, tuned: bool = False, model: str = "",
        max_jobs: int | None = None, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
        progress: Callable[[str], StepProgress | None] = read_progress,
        live_slots: Callable[[], int | None] = lambda: None,
        bound_since: Callable[[str], float | None] = lambda job_id: None,
    ) -> None:
        config = config or SchedulerConfig()
        self.config = config if tuned else dataclasses.replace(config, order="fifo", aging_s=0.0)
        self.tuned = tuned
        self.model = model
        self.max_jobs = max_jobs
        self.cost = CostModel(config.seconds_per_unit)
        self.admission = Admission(self.config, max(1, slots))
        self.jobs: dict[str, Tracked] = {}
        self.clock, self.wall, self.progress = clock, wall, progress
        self.live_slots, self.bound_since = live_slots, bound_since
        metrics.track(self)

    @property
    def slots(self) -> int:
        return self.admission.capacity

    # ---- a job's life ----------------------------------------------------------------------
    def admit(self, job_id: str, priority: int, shape: JobShape) -> Decision:
        """Admit a new job or raise 429 ``queue_full`` (with Retry-After) before it exists."""
        ticket = self._price(Ticket(job_id, priority if self.tuned else 0, self.clock()), shape)
        self._follow_replicas()
        running, queued = self._snapshot()
        if self.max_jobs is not None and len(self.jobs) >= self.max_jobs:
            retry = max(MIN_RETRY_S, min(running, default=MIN_RETRY_S))
            metrics.REFUSED.labels("max_queued").inc()
            raise too_busy(f"Too many jobs on this server ({len(self.jobs)}, limit {self.max_jobs}: "
                           f"omni_ext.api.max_queued); retry after {retry:.1f} s.", retry)
        decision = self.admission.decide(self.clock(), running, queued, ticket)
        if not decision.admitted:
            metrics.REFUSED.labels(decision.reason).inc()
            raise self._refusal(decision)
        self.jobs[job_id] = Tracked(ticket, shape, priority)
        metrics.ADMITTED.inc()
        metrics.PREDICTED_WAIT.observe(decision.wait_s)
        return decision

    def mark_started(self, job_id: str) -> None:
        """vLLM-Omni's ``on_started``: the engine handed the job on (its start, except under the TunedExecutor)."""
        tracked = self.jobs.get(job_id)
        if tracked is not None and not self.tuned and tracked.started_wall is None:
            tracked.started_wall = self.wall()

    def finish(self, job_id: str) -> float | None:
        """The job's output arrived: its slot is free, and its time (start to output) teaches the cost
        model. Returns that time, or None if the job was never seen running (then nothing is learned)."""
        tracked = self.jobs.pop(job_id, None)
        if tracked is None:
            return None
        self._update(tracked)
        if tracked.started_wall is None:
            return None
        seconds = max(0.0, self.wall() - tracked.started_wall)
        self.cost.observe(tracked.shape.key, tracked.shape.units, seconds)
        metrics.JOB_SECONDS.labels(self.model).observe(seconds)
        return seconds

    def cancel(self, job_id: str, reason: str) -> bool:
        """Forget a job that will not finish (``deleted``, ``client_disconnected``): its capacity is
        free at once. Returns whether it was still accounted."""
        if self.jobs.pop(job_id, None) is None:
            return False
        metrics.CANCELLED.labels(reason).inc()
        return True

    def drop(self, job_id: str) -> None:
        """Forget a job that failed (or was already finished or cancelled: then nothing happens)."""
        self.jobs.pop(job_id, None)

    # ---- what clients and metrics see -----------------------------------------------------
    def running(self, job_id: str) -> bool:
        tracked = self.jobs.get(job_id)
        if tracked is None:
            return False
        self._update(tracked)
        return tracked.running

    def views(self) -> dict[str, QueueView]:
        """Every queued job's position and predicted start."""
        self._follow_replicas()
        running, queued = self._snapshot()
        known = self.cost.rate() is not None
        return {job_id: QueueView(est.position, est.start_in_s if known else None)
                for job_id, est in self.admission.estimates(self.clock(), running, queued).items()}

    def view(self, job_id: str) -> QueueView | None:
        """A queued job's :class:`QueueView`; None once it runs (or is unknown)."""
        return self.views().get(job_id)

    def summary(self) -> dict[str, Any]:
        """The queue at a glance (the playground's info route): jobs running and queued, the slots,
        and the predicted seconds until a job admitted now behind every queued one would start
        (None while the server knows no rate for any shape)."""
        self._follow_replicas()
        running, queued = self._snapshot()
        wait = None
        if self.cost.rate() is not None:
            wait = round(predict_start(running, [t.predicted_s or 0.0 for t in queued], self.slots), 1)
        return {"running": len(running), "queued": len(queued), "slots": self.slots, "predicted_wait_s": wait}

    def depth_by_priority(self) -> dict[int, int]:
        """Queued (not yet started) jobs per requested priority."""
        for tracked in self.jobs.values():
            self._update(tracked)
        return dict(Counter(tracked.priority for tracked in self.jobs.values() if not tracked.running))

    # ---- internals ------------------------------------------------------------------------
    def _refusal(self, decision: Decision) -> APIError:
        retry = decision.retry_after_s if decision.retry_after_s is not None else MIN_RETRY_S
        return too_busy(
            f"This server is busy: the request would wait about {math.ceil(decision.wait_s)} s before it starts "
            f"({decision.position} job(s) ahead), over its bound of {self.config.max_wait_s:g} s "
            f"(omni_ext.scheduler.max_wait_s); retry after {retry:.1f} s.", retry)

    def _price(self, ticket: Ticket, shape: JobShape) -> Ticket:
        """``ticket`` with its predicted seconds from what the cost model knows now, and its ordering
        cost in the measure every ticket shares at that moment (seconds once a rate is known, else units)."""
        return ticket.price(self.cost.predict_s(shape.key, shape.units), shape.units)

    def _update(self, tracked: Tracked) -> None:
        step = self.progress(tracked.ticket.id)
        if step is not None:
            tracked.step = step
            if tracked.started_wall is None:
                tracked.started_wall = step.t_start
        if tracked.started_wall is None:
            # In front of several replicas the head binds a job when it starts on one; a remote
            # replica's progress files are on its own host, so the binding is what is known here.
            tracked.started_wall = self.bound_since(tracked.ticket.id)

    def _follow_replicas(self) -> None:
        """Admission counts the slots of every live replica: replicas join and leave at run time on a
        multi-machine head (and one can die in one server). Promises made on another capacity are void."""
        live = self.live_slots()
        if live is not None and live > 0 and live != self.admission.capacity:
            change = "joined" if live > self.admission.capacity else "left"
            self.admission.capacity = live
            self.admission.forget_promises()
            logger.info("omni-ext scheduler (API): a replica %s; admission now counts %d slot(s)", change, live)

    def _snapshot(self) -> tuple[list[float], list[Ticket]]:
        """(predicted seconds left of each running job, the queued tickets), with every prediction
        brought up to date with what the cost model has learned meanwhile."""
        now = self.wall()
        running: list[float] = []
        queued: list[Ticket] = []
        for tracked in self.jobs.values():
            self._update(tracked)
            ticket = self._price(tracked.ticket, tracked.shape)
            if tracked.started_wall is None:
                queued.append(ticket)
                continue
            step = tracked.step
            measured = (step.done, step.total, step.t_last - step.t_start) if step is not None else ()
            running.append(remaining_s(ticket.predicted_s, now - tracked.started_wall, *measured) or 0.0)
        return running, queued
