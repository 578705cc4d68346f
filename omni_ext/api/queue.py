"""The API process's account of the jobs it admitted: who waits, who runs, and for how long.

vLLM-Omni's engine does not say how long its queue is, so the API process keeps its own account:
a :class:`~omni_ext.scheduler.admission.Ticket` per admitted generation (async and sync videos,
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
from typing import Any

from omni_ext import healing
from omni_ext.api import metrics
from omni_ext.api.errors import APIError, too_busy
from omni_ext.models.families import JobShape
from omni_ext.progress import PAUSED, StepProgress, read_progress
from omni_ext.scheduler.admission import MIN_RETRY_S, Admission, Decision, predict_start
from omni_ext.scheduler.config import CfgMode, SchedulerConfig
from omni_ext.scheduler.cost import MODES, CostModel
from omni_ext.scheduler.placement import JobMode, predicted_mode
from omni_ext.scheduler.queue import Entry, JobQueue
from omni_ext.scheduler.slo import Attainment

logger = logging.getLogger("omni_ext.api")

@dataclass
class Tracked:
    """What the account keeps of an admitted job beside its queue entry: the priority the client
    asked for (the entry's is 0 under vLLM-Omni's executor, which runs first come first served)
    its latest progress file, and its deadline as admitted (monotonic seconds; None while no rate was
    known), which SLO attainment judges it by (:mod:`omni_ext.scheduler.slo`)."""

    priority: int
    step: StepProgress | None = None
    deadline: float | None = None


@dataclass(frozen=True)
class QueueView:
    """A queued job as a client sees it: ``position`` (0 = next) and predicted seconds until it
    starts (None while the server knows no rate for any shape)."""

    position: int
    wait_s: float | None


@dataclass
class Admitted:
    """What admission hands the route that asked: the job's place in the account and the decision
    (``wait_s``, ``position``). The route reports the job's life through it and nothing else:
    :meth:`started` (vLLM-Omni's ``on_started``), :meth:`finished` (its output arrived: the slot is
    free and its time is learned), :meth:`cancelled` (``DELETE``, a client that went away) and
    :meth:`dropped` (it failed, or was refused after admission; a no-op once finished or cancelled)."""

    queue: RequestQueue
    job_id: str
    decision: Decision
    view: QueueView  # the job's place as admission decided it (what the first answer shows)

    @property
    def wait_s(self) -> float:
        return self.decision.wait_s

    @property
    def position(self) -> int:
        return self.decision.position

    def started(self) -> None:
        self.queue.mark_started(self.job_id)

    def finished(self) -> float | None:
        return self.queue.finish(self.job_id)

    def cancelled(self, reason: str) -> bool:
        return self.queue.cancel(self.job_id, reason)

    def dropped(self) -> None:
        self.queue.drop(self.job_id)


class RequestQueue:
    """The account of one server's admitted jobs (see the module docstring).

    ``tuned``: the TunedExecutor runs the jobs; it orders them by priority, vLLM-Omni's own
    executor runs them first come first served and never pauses one, and the account follows whichever runs.
    ``slots``: jobs that run at once (:meth:`omni_ext.scheduler.layout.ServerLayout.slots`).
    ``live_slots``/``bound_since``: when a dispatch in this process binds jobs to replicas
    (:class:`omni_ext.dispatch.replicas.ReplicaDispatch`, given at start-up), how many jobs its live
    replicas run at once and when a job was bound (it runs from then on); without one, admission
    keeps ``slots``. ``cfg_size``/``cfg_mode``: the CFG group size and the ``cfg_mode`` the
    TunedExecutor applies (:meth:`omni_ext.scheduler.layout.ServerLayout.cfg_mode`): its jobs' times
    are learned and predicted per run mode, as the executor's are, because a CFG job on one rank
    takes longer than on a pair and a burst runs on single ranks (issue 19 item 5: after a paired
    warm-up, a burst admitted at the pair's rate started up to twice later than promised).
    ``clock``/``wall``/``progress`` are injectable for tests.
    """

    def __init__(
        self, config: SchedulerConfig | None = None, slots: int = 1, *, tuned: bool = False, model: str = "",
        max_jobs: int | None = None, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
        progress: Callable[[str], StepProgress | None] = read_progress,
        live_slots: Callable[[], int | None] = lambda: None,
        bound_since: Callable[[str], float | None] = lambda job_id: None,
        cfg_size: int = 1, cfg_mode: CfgMode = CfgMode.ADAPTIVE,
    ) -> None:
        config = config or SchedulerConfig()
        self.config = config if tuned else dataclasses.replace(config, order="fifo", aging_s=0.0, preempt=False)
        self.tuned = tuned
        # the mode a queued job is predicted in, by whether it runs CFG (None: vLLM-Omni's executor, no modes)
        self.modes: dict[bool, str | None] = {
            cfg: predicted_mode(JobMode.for_request(needs_cfg=cfg, group_size=cfg_size), cfg_mode).value if tuned else None
            for cfg in (False, True)}
        # the slots a running CFG pair holds (each rank is a slot unless cfg_mode "pair" counts groups),
        # and how long one that came alone stays tentative: a burst arriving meanwhile splits it
        self.pair_slots = cfg_size if tuned and CfgMode(cfg_mode) != CfgMode.PAIR else 1
        self.tentative_s = config.settle_s if tuned and CfgMode(cfg_mode) == CfgMode.ADAPTIVE else 0.0
        self.model = model
        self.max_jobs = max_jobs
        self.jobs: JobQueue[Tracked] = JobQueue(self.config)
        self.admission = Admission(self.config, max(1, slots))
        self.clock, self.wall, self.progress = clock, wall, progress
        self.live_slots, self.bound_since = live_slots, bound_since
        self.attainment = Attainment()
        metrics.track(self)

    @property
    def slots(self) -> int:
        return self.admission.capacity

    @property
    def cost(self) -> CostModel:
        return self.jobs.cost

    # ---- a job's life ----------------------------------------------------------------------
    def admit(self, job_id: str, priority: int, shape: JobShape, deadline_s: float | None = None, *,
              accepted: bool = False) -> Admitted:
        """Admit a new job (its :class:`Admitted` handle) or raise 429 ``queue_full`` (with Retry-After)
        before it exists; 503 ``respawning`` (with Retry-After) while no worker group can serve.
        ``accepted``: a job a previous process accepted (its client holds a 200), queued again at start-up
        whatever the bounds say."""
        latest = healing.LATEST  # the executors' healing records, read off the request path
        unavailable = None if accepted or not (latest.respawning or latest.exhausted) else healing.refusal(latest)
        if unavailable is not None:
            metrics.REFUSED.labels(unavailable.code).inc()
            raise unavailable
        now = self.clock()
        self._follow_replicas()
        self._update_all()
        if self.max_jobs is not None and len(self.jobs) >= self.max_jobs and not accepted:
            running = [self.jobs.remaining(e, now) or 0.0 for e in self.jobs.running()]
            retry = max(MIN_RETRY_S, min(running, default=MIN_RETRY_S))
            metrics.REFUSED.labels("max_queued").inc()
            raise too_busy(f"Too many jobs on this server ({len(self.jobs)}, limit {self.max_jobs}: "
                           f"omni_ext.api.max_queued); retry after {retry:.1f} s.", retry)
        entry, decision = self.jobs.admit(job_id, Tracked(priority), now=now, priority=priority if self.tuned else 0,
                                          key=shape.key, units=shape.units, admission=self.admission,
                                          mode=self.modes[shape.cfg], n_steps=shape.one_output_steps,
                                          deadline_s=deadline_s)
        if not decision.admitted and accepted:
            self.jobs.add(entry)
        elif not decision.admitted:
            metrics.REFUSED.labels(decision.reason).inc()
            raise self._refusal(decision)
        metrics.ADMITTED.inc()
        metrics.PREDICTED_WAIT.observe(decision.wait_s)
        entry.payload.deadline = decision.deadline
        known = entry.ticket.predicted_s is not None  # priced: a rate is known
        return Admitted(self, job_id, decision, QueueView(decision.position, decision.wait_s if known else None))

    def mark_started(self, job_id: str) -> None:
        """vLLM-Omni's ``on_started``: the engine handed the job on (its start, except under the TunedExecutor)."""
        entry = self.jobs.get(job_id)
        if entry is not None and not self.tuned and not entry.running:
            self.jobs.start(job_id, self.clock())

    def finish(self, job_id: str) -> float | None:
        """The job's output arrived: its slot is free, and its time (start to output) teaches the cost
        model. Returns that time, or None if the job was never seen running (then nothing is learned)."""
        entry = self.jobs.get(job_id)
        if entry is None:
            return None
        self._update(entry)
        now = self.clock()
        seconds = self.jobs.finish(job_id, now)
        if seconds is not None:
            metrics.JOB_SECONDS.labels(self.model).observe(seconds)
            if entry.payload.deadline is not None:
                self.attainment.record(now, entry.payload.deadline)
        return seconds

    def cancel(self, job_id: str, reason: str) -> bool:
        """Forget a job that will not finish (``deleted``, ``client_disconnected``): its capacity is
        free at once. Returns whether it was still accounted."""
        if self.jobs.abort(job_id) is None:
            return False
        metrics.CANCELLED.labels(reason).inc()
        return True

    def drop(self, job_id: str) -> None:
        """Forget a job that failed (or was already finished or cancelled: then nothing happens)."""
        self.jobs.abort(job_id)

    # ---- what clients and metrics see -----------------------------------------------------
    def running(self, job_id: str) -> bool:
        entry = self.jobs.get(job_id)
        if entry is None:
            return False
        self._update(entry)
        return entry.running

    def views(self) -> dict[str, QueueView]:
        """Every queued job's position and predicted start."""
        self._follow_replicas()
        self._update_all()
        known = self.cost.rate() is not None
        return {job_id: QueueView(est.position, est.start_in_s if known else None)
                for job_id, est in self.jobs.estimates(self.clock(), self.slots).items()}

    def view(self, job_id: str) -> QueueView | None:
        """A queued job's :class:`QueueView`; None once it runs (or is unknown)."""
        return self.views().get(job_id)

    def summary(self) -> dict[str, Any]:
        """The queue at a glance (the playground's info route): jobs running and queued, the slots,
        and the predicted seconds until a job admitted now behind every queued one would start
        (None while the server knows no rate for any shape)."""
        self._follow_replicas()
        self._update_all()
        running, queued = self.jobs.snapshot(self.clock())
        wait = None
        if self.cost.rate() is not None:
            wait = round(predict_start(running, [t.predicted_s or 0.0 for t in queued], self.slots), 1)
        return {"running": len(running), "queued": len(queued), "slots": self.slots, "predicted_wait_s": wait}

    def slo_counts(self, window_s: float) -> tuple[int, int]:
        """(met, finished) of the requests with a deadline that finished within ``window_s``."""
        return self.attainment.counts(self.clock(), window_s)

    def depth_by_priority(self) -> dict[int, int]:
        """Queued (not yet started) jobs per requested priority."""
        self._update_all()
        return dict(Counter(e.payload.priority for e in self.jobs.queued()))

    # ---- internals ------------------------------------------------------------------------
    def _refusal(self, decision: Decision) -> APIError:
        retry = decision.retry_after_s if decision.retry_after_s is not None else MIN_RETRY_S
        return too_busy(
            f"This server is busy: the request would wait about {math.ceil(decision.wait_s)} s before it starts "
            f"({decision.position} job(s) ahead), over its bound of {self.config.max_wait_s:g} s "
            f"(omni_ext.scheduler.max_wait_s); retry after {retry:.1f} s.", retry)

    def _update_all(self) -> None:
        for entry in list(self.jobs.entries.values()):
            self._update(entry)

    def _update(self, entry: Entry[Tracked]) -> None:
        """Bring a job up to date with what this process can see of it: its progress file (the
        TunedExecutor's start marker, then the workers' step reports), or, in front of several
        replicas, when the head bound it (a remote replica's progress files are on its own host)."""
        step = self.progress(entry.id)
        if step is not None:
            entry.payload.step = step
            entry.steps = ((step.done, step.total, step.t_last - step.t_start, step.before_loop_s)
                           if step.done > 0 else ())
            entry.step_at = self.clock() - max(0.0, self.wall() - step.t_last) if step.done > 0 else None
            entry.paused = step.mode == PAUSED
            started_wall: float | None = step.started_at
        else:
            started_wall = None if entry.running else self.bound_since(entry.id)
        if started_wall is not None and not entry.running:
            # the mode its ranks run it in (the executor's start marker): its time is learned as that mode's
            mode = step.mode if step is not None and self.tuned else None
            self.jobs.start(entry.id, self.clock() - max(0.0, self.wall() - started_wall),
                            mode=mode if mode in MODES else None)
            self._hold(entry)
        elif (entry.running and self.tuned and step is not None and step.done == 0 and step.mode in MODES
              and step.mode != entry.mode):
            entry.mode = step.mode  # started again in another mode: a tentative pair that a burst split
            self._hold(entry)

    def _hold(self, entry: Entry[Tracked]) -> None:
        """The slots a running job holds: a CFG pair holds each rank of its group, once it is no longer
        tentative (placement rule 5: a CFG job that came alone runs as a pair at once, and a request
        within ``settle_s`` of it splits it, so that request is predicted beside it, not behind it)."""
        pair = entry.mode == JobMode.PAIR.value
        entry.slots = self.pair_slots if pair else 1
        entry.slots_from = entry.ticket.arrival + self.tentative_s if pair else -math.inf

    def _follow_replicas(self) -> None:
        """Admission counts the slots of every live replica: replicas join and leave at run time on a
        multi-machine head (and one can die in one server). Promises made on another capacity are void."""
        live = self.live_slots()
        if live is not None and live > 0 and live != self.admission.capacity:
            change = "joined" if live > self.admission.capacity else "left"
            self.admission.capacity = live
            self.admission.forget_promises()
            logger.info("omni-ext scheduler (API): a replica %s; admission now counts %d slot(s)", change, live)
