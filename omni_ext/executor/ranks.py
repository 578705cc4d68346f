"""The TunedExecutor's queue over its worker ranks: jobs wait, start on ranks, answer, are cancelled.

The executor (:mod:`omni_ext.executor.tuned`) owns the processes, pipes, reader and monitor
threads; this object owns what happens to a job between ``execute_batch`` and its answer, and
touches the workers only through the two things it is given: ``send(rank, message)`` (the rank's
pipe) and ``cancel_slots`` (the shared-memory slot through which a running rank stops at its next
step, :mod:`omni_ext.executor.role`). Tests drive it with a list for each.

Placement works on units (:class:`~omni_ext.scheduler.placement.Units`: the sequence-parallel
processes of one CFG half; one process each without sequence parallel); everything else here is
per worker process: a unit is free when all of its processes are, a job started on units is sent
to each of their processes and is done once all of them answered, and a cancel is written into each
of their slots.

Under one lock, each change to the queue or to the free ranks (a submit, an answer, a cancel, the
settle timer) asks placement what starts now (:func:`omni_ext.scheduler.placement.next_placements`,
in the order of the :class:`~omni_ext.scheduler.queue.JobQueue`), marks it started for the API
process (:func:`omni_ext.progress.mark_started`) and sends it to its ranks. A rank is free again as
soon as it answers, and a request is answered as soon as the rank holding its output answers (for
Qwen-Image CFG rank 1 skips the VAE decode and is free early). Times are learned per shape class
and per mode the ranks ran a job in (:meth:`RankQueue.cost_key`).

Preemption (step-level). When the job that should start next cannot start on the free ranks,
:func:`omni_ext.scheduler.preempt.choose` may name a running job to pause for it. The pause is asked
through the shared board (its token in the job's PAUSE cells, :mod:`omni_ext.executor.role`); each of
its ranks answers :class:`~protocol.Paused` at the agreed step and is free. The job that asked starts
on them first; nothing else starts on a paused job's ranks, and as soon as they are all free again the
paused job resumes there (:class:`~protocol.ResumeJob`), before anything queued. A paused job that is
cancelled unwinds instead of resuming (``ResumeJob(drop=True)``), which frees its memory.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, MutableSequence
from dataclasses import dataclass, field
from typing import Any

from vllm_omni.diffusion.data import DiffusionOutput

from omni_ext import environment, progress
from omni_ext.executor import protocol
from omni_ext.executor.role import PAUSE, board_size, pause_token
from omni_ext.scheduler import admission, batching, cost, placement, preempt
from omni_ext.scheduler.config import CfgMode, SchedulerConfig
from omni_ext.models.families import request_cost
from omni_ext.scheduler.cost import CostModel
from omni_ext.scheduler.priority import request_deadline_s, request_priority, request_waited_s
from omni_ext.scheduler.placement import JobMode, JobNeeds, Layout
from omni_ext.scheduler.queue import WARM_UP_PRIORITY, Entry, JobQueue, is_warm_up

#: While the next job waits with a deadline and no pause is made for it, the queue looks again this
#: often: whether it would miss its deadline by waiting changes as running jobs turn out slower than
#: predicted (two jobs side by side on a CPU host), with no event to say so.
RECHECK_S = 0.2
#: What a rank is busy with while its worker is being replaced (:meth:`RankQueue.fail_on`).
RESPAWNING = "respawning"

logger = logging.getLogger("omni_ext.executor")


@dataclass
class Job:
    """One request on its way through the ranks (the payload of its queue entry)."""

    job_id: str
    request_id: str
    req: Any
    needs: JobNeeds  # mode, units and arrival: what placement reads
    shape: str = ""  # its shape class (families.shape_key)
    steps: int = 0  # denoise steps, for the start marker
    seq: int = 0  # written into the ranks' cancel slots to stop the job while it runs
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    ranks: tuple[int, ...] = ()  # its worker processes, once started (every process of its units)
    mode: JobMode | None = None  # how its ranks run it, once started
    answered: set[int] = field(default_factory=set)
    started: float | None = None  # monotonic
    deadline: float | None = None  # monotonic time limit (cost-based), once started
    longest_s: float = 0.0
    dropped: bool = False
    first_out: Any = None
    pauses: int = 0  # times it was preempted (step-level preemption; what max_preemptions bounds)
    stops: int = 0  # times its ranks paused it at a step (a job kept paused for the next one pauses once)
    pausing_for: str | None = None  # the job it pauses for, from the request until it resumes
    pause_reason: str = ""
    paused: set[int] = field(default_factory=set)  # its ranks that answered Paused
    paused_at: float | None = None  # monotonic, while every rank of it is paused
    paused_step: int = 0
    members: tuple[str, ...] = ()  # a batched job's request ids, in batch order (request batching)
    cancelled: set[str] = field(default_factory=set)  # members cancelled while the batch runs on for the others
    parts: list[Part] = field(default_factory=list)  # a batched job's per-request futures
    stop_asked: float | None = None  # monotonic, when the watchdog asked it to stop at its next step
    tentative_until: float | None = None  # a pair started alone: split if a burst follows before then (rule 5)
    splitting: bool = False  # its pair stops at the next step, to start again on one rank (:meth:`RankQueue.split`)
    split_out: Any = None  # what its ranks answered while splitting (a complete output: it finished first)

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The engine requests this job answers: its batch's members, else its one request."""
        return self.members or (self.request_id,)

    @property
    def batched(self) -> bool:
        return bool(self.members)

    @property
    def is_paused(self) -> bool:
        return self.paused_at is not None

    @property
    def all_ranks(self) -> bool:
        """The warm-up of a tuned model: runs once on every rank and answers when all are done."""
        return self.needs.mode is JobMode.ALL_RANKS

    @property
    def warm_up(self) -> bool:
        return is_warm_up(self.request_id)


class RankQueue:
    """Jobs over the ranks of ``layout`` (see the module docstring).

    ``model_arch``: the served pipeline class (CFG rule and cost units); ``tuned_model``: whether
    omni-ext's pipeline runs it (a request may then use part of a CFG group, else it takes a whole
    group and its warm-up is an ordinary request); ``cfg_mode``: the scheduler's, as it applies to
    this model; ``small_warmup``: the warm-up runs at a small size (a CPU host); ``units``: the
    worker processes of each of ``layout``'s ranks (sequence parallel); ``preempt_refusal``: why
    this executor's jobs cannot be paused (None: they can, when the scheduler's ``preempt`` is on);
    ``batch_key``: requests of one wave with equal keys may run as one batch (request batching, None:
    never); ``engine_settles``: vLLM-Omni's scheduler gathers a burst before handing it over, so no job
    settles again here (placement rule 5).
    """

    def __init__(
        self, layout: Layout, sched: SchedulerConfig, *, model_arch: str | None, tuned_model: bool, cfg_mode: CfgMode,
        send: Callable[[int, protocol.Message], None], cancel_slots: MutableSequence[int], small_warmup: bool = False,
        units: placement.Units = placement.ONE_PROCESS_UNITS, preempt_refusal: str | None = None,
        batch_key: Callable[[Any], Hashable] | None = None, engine_settles: bool = False,
    ) -> None:
        self.layout, self.sched, self.cfg_mode, self.units = layout, sched, cfg_mode, units
        self.cfg_size = len(layout.groups[0]) if layout.groups else 1
        self.model_arch, self.tuned_model, self.small_warmup = model_arch, tuned_model, small_warmup
        self.send, self.cancel_slots = send, cancel_slots
        self.lock = threading.Condition(threading.RLock())
        self.jobs: JobQueue[Job] = JobQueue(sched, predict=self._predict)
        self.outputs: dict[str, Job] = {}  # async output id -> job, until the engine collects it
        self.busy: dict[int, str | None] = {p: None for p in units.expand(layout.ranks)}  # process -> job or RPC id
        self.hold = 0  # > 0 while a control-plane RPC waits for every rank to be idle: nothing starts
        self.stopped = False  # the executor failed or shut down: nothing starts
        self._ids = itertools.count(1)
        self.preempts = sched.preempt and preempt_refusal is None
        if sched.preempt and preempt_refusal is not None:
            logger.info("omni-ext: step-level preemption is off: %s", preempt_refusal)
        self.preemptions: dict[str, int] = {r: 0 for r in preempt.REASONS}
        self.batch_key = batch_key  # requests of a wave with equal keys may run as one batch (None: never)
        # vLLM-Omni's request scheduler gathers a burst itself before it hands a wave over
        # (--request-batch-max-wait-ms): placement's settle (rule 5) would only wait a second time.
        self.settled_s = sched.settle_s if engine_settles else 0.0
        self._recheck_at: float | None = None  # when a pending deadline re-check dispatches (one timer at a time)
        self._last_arrival = -math.inf  # the latest request's arrival (placement rule 5's gap)

    @property
    def costs(self) -> CostModel:
        return self.jobs.cost

    def next_id(self) -> int:
        return next(self._ids)

    def _gap_s(self, arrival: float) -> float:
        """Seconds since the request before this one arrived (placement rule 5: only a request that came
        within the settle time of another waits for the rest of a burst); remembers this one."""
        with self.lock:
            gap = arrival - self._last_arrival
            self._last_arrival = max(self._last_arrival, arrival)
        return gap

    # ---- a job's life ----------------------------------------------------------------------
    def submit(self, request_id: str, req: Any) -> Job:
        """Queue a request scheduled by the engine, and start what can start."""
        sp = getattr(req, "sampling_params", None)
        prompt = getattr(req, "prompt", None)
        # Only omni-ext's tuned pipeline runs a CFG-free request on part of a group.
        rc = request_cost(self.model_arch, prompt, sp, None if self.tuned_model else True)
        warm_up = is_warm_up(request_id)  # tuned models: it runs CFG-free on every rank
        mode = JobMode.for_request(needs_cfg=rc.cfg, group_size=self.cfg_size, warm_up=warm_up and self.tuned_model)
        seq = self.next_id()
        arrival = time.monotonic() - request_waited_s(sp)  # a job bound by the head waited there first
        needs = JobNeeds(mode, rc.units, arrival=arrival - self.settled_s, gap_s=self._gap_s(arrival))
        job = Job(f"omx-{seq}", request_id, req, needs, shape=rc.key, steps=rc.steps, seq=seq)
        if job.all_ranks and self.small_warmup:
            job.req = _small_warmup(req)
        self._enqueue(job, {job.job_id: job}, arrival=arrival, learns=not warm_up,
                      priority=WARM_UP_PRIORITY if warm_up else request_priority(request_id, sp),
                      deadline_s=None if warm_up else request_deadline_s(request_id, sp))
        return job

    def _enqueue(self, job: Job, outputs: dict[str, Job | Part], *, arrival: float, priority: int,
                 deadline_s: float | None, learns: bool = True) -> None:
        """Queue a new job (one request's, or a batch's) whose answers the engine collects under
        ``outputs``' ids, and start what can start."""
        with self.lock:
            if self.stopped:
                raise RuntimeError("omni-ext TunedExecutor is not running")
            self.outputs.update(outputs)
            self.jobs.submit(job.job_id, job, priority=priority, arrival=arrival, key=job.shape, units=job.needs.units,
                             learns=learns, deadline_s=deadline_s, n_steps=0 if job.batched or _outputs(job.req) > 1 else job.steps)
            self.dispatch()
            if self.jobs.get(job.job_id) is not None and not self.entry(job).running:
                if self.sched.settle_s > 0:
                    self._dispatch_after(self.sched.settle_s)  # a settle hold (placement rule 5) ends then
                priority = self.entry(job).ticket.priority
                logger.info("omni-ext: queued %s (priority %d, %d waiting)",
                            f"batch {list(job.members)}" if job.batched else f"request {job.request_id}", priority,
                            len(self.jobs.queued()))
                for rid in job.request_ids:
                    progress.record_placement("queued", rid, priority=priority,
                                              **({"batch": list(job.members)} if job.batched else {}))

    def submit_wave(self, items: list[tuple[str, Any]]) -> list[str]:
        """Queue a wave the engine scheduled together (``--max-num-seqs``): ``(request_id, req)`` in
        order; returns each request's async output id. Requests with equal batch keys are cut into
        chunks by :func:`omni_ext.scheduler.batching.plan`, each chunk of more than one a batched job."""
        if len(items) > 1:
            self._gap_s(time.monotonic())  # its requests came together: even the first is part of a burst (rule 5)
        if self.batch_key is None or len(items) < 2:
            return [self.submit(rid, req).job_id for rid, req in items]
        ids: dict[int, str] = {}
        waves: dict[Hashable, list[int]] = {}
        for i, (rid, req) in enumerate(items):
            if is_warm_up(rid):
                ids[i] = self.submit(rid, req).job_id
                continue
            try:
                key = self.batch_key(req)
            except Exception as exc:  # a request the key cannot read runs alone
                logger.warning("omni-ext: request %s runs unbatched: %s", rid, exc)
                ids[i] = self.submit(rid, req).job_id
                continue
            waves.setdefault(key, []).append(i)
        with self.lock:
            for idx in waves.values():
                sizes = self._batch_plan([items[i] for i in idx])
                at = 0
                for size in sizes:
                    chunk = idx[at:at + size]
                    at += size
                    if size == 1:
                        ids[chunk[0]] = self.submit(*items[chunk[0]]).job_id
                    else:
                        for i, out_id in zip(chunk, self._submit_batch([items[i] for i in chunk])):
                            ids[i] = out_id
        return [ids[i] for i in range(len(items))]

    def _batch_plan(self, items: list[tuple[str, Any]]) -> list[int]:
        """The chunk sizes of one compatible wave (under the lock): predicted times of each batch size
        from the cost model, the slots the wave's mode runs on and when each is predicted free."""
        _, req = items[0]
        rc = request_cost(self.model_arch, getattr(req, "prompt", None), getattr(req, "sampling_params", None),
                          None if self.tuned_model else True)
        mode = JobMode.for_request(needs_cfg=rc.cfg, group_size=self.cfg_size)
        rank_mode = placement.predicted_mode(mode, self.cfg_mode).rank_mode.value

        def batch_s(k: int) -> float | None:
            return self.costs.predict_s(cost.mode_key(cost.batch_key(rc.key, k), rank_mode), k * rc.units)

        now = time.monotonic()
        one_unit = rank_mode == JobMode.SINGLE.value and self.cfg_size > 1
        slots = [(r,) for r in self.layout.ranks] if one_unit else list(self.layout.groups)
        free_at = []
        for slot in slots:
            procs = set(self.units.expand(slot))
            left = [self.jobs.remaining(self.entry(j), now) or 0.0 for j in self.running() if procs & set(j.ranks)]
            free_at.append(max(left, default=0.0))
        for entry in self.jobs.queued():  # queued work, each on the slot free first
            free_at.sort()
            free_at[0] += self._predict(entry, self.costs) or 0.0
        sizes = batching.plan(len(items), batch_s, free_at)
        logger.info("omni-ext: a wave of %d compatible requests (%s) runs as %s on %d %s(s) free in %s s",
                    len(items), rc.key, "+".join(map(str, sizes)), len(slots), "rank" if one_unit else "group",
                    [round(t, 2) for t in sorted(free_at)])
        return sizes

    def _submit_batch(self, items: list[tuple[str, Any]]) -> list[str]:
        """Queue one batched job of these compatible requests (under the lock); each request's async
        output id (its :class:`Part`)."""
        members = tuple(rid for rid, _ in items)
        reqs = [req for _, req in items]
        sps = [getattr(req, "sampling_params", None) for req in reqs]
        rc = request_cost(self.model_arch, getattr(reqs[0], "prompt", None), sps[0], None if self.tuned_model else True)
        mode = JobMode.for_request(needs_cfg=rc.cfg, group_size=self.cfg_size)
        seq = self.next_id()
        now = time.monotonic()
        arrival = min(now - request_waited_s(sp) for sp in sps)
        units = rc.units * len(items)
        job = Job(f"omx-{seq}", f"{members[0]}+{len(members) - 1}", reqs,
                  JobNeeds(mode, units, arrival=arrival - self.settled_s, gap_s=self._gap_s(arrival)),
                  shape=cost.batch_key(rc.key, len(items)), steps=rc.steps, seq=seq, members=members)
        priority = min(request_priority(rid, sp) for rid, sp in zip(members, sps))
        deadlines = [d for rid, sp in zip(members, sps) if (d := request_deadline_s(rid, sp)) is not None]
        parts = job.parts = [Part(job, i) for i in range(len(members))]
        _split_batch(job, parts)
        outputs = {f"{job.job_id}/{part.index}": part for part in parts}
        logger.info("omni-ext: batch of %d requests %s as one job (priority %d)", len(members), list(members), priority)
        self._enqueue(job, outputs, arrival=arrival, priority=priority, deadline_s=min(deadlines) if deadlines else None)
        return list(outputs)

    def entry(self, job: Job) -> Entry[Job]:
        return self.jobs.entries[job.job_id]

    def take_output(self, async_output_id: str) -> Job | Part | None:
        with self.lock:
            return self.outputs.pop(async_output_id, None)

    def drop_output(self, async_output_id: str) -> None:
        """The engine will not collect this output: the job (or its batch's member) is cancelled."""
        with self.lock:
            out = self.outputs.pop(async_output_id, None)
            if isinstance(out, Part):
                self._cancel_members(out.job, {out.request_id})
            elif out is not None:
                self._cancel(out)
            self.dispatch()

    def abort(self, request_ids) -> None:
        """Stop these requests, queued or running."""
        ids = set(request_ids)
        with self.lock:
            for entry in list(self.jobs.entries.values()):
                job = entry.payload
                if job.batched:
                    self._cancel_members(job, ids & set(job.members))
                elif job.request_id in ids:
                    self._cancel(job)
            self.dispatch()

    def _cancel_members(self, job: Job, ids: set[str]) -> None:
        """Cancel members of a batched job (under the lock): each is answered aborted at once; the
        batch runs on for the others (as vLLM-Omni's runner does with a partly cancelled wave) and
        stops, like any job, once every member is cancelled."""
        ids -= job.cancelled
        if not ids:
            return
        job.cancelled |= ids
        for part in job.parts:  # answered now; the batch's own answer skips them
            if part.request_id in ids and not part.future.done():
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    part.future.set_result(DiffusionOutput(aborted=True, abort_message=f"Request {part.request_id} aborted."))
        if job.cancelled >= set(job.members):
            self._cancel(job)
            return
        logger.info("omni-ext: cancelled request(s) %s of batch %s; it runs on for %s", sorted(ids), job.job_id,
                    [m for m in job.members if m not in job.cancelled])

    def _cancel(self, job: Job) -> None:
        """Cancel a job (under the lock). A queued one leaves the queue, and with it the ordering,
        at once (the caller dispatches next: jobs it held back may start now)."""
        entry = self.jobs.get(job.job_id)
        if job.dropped or entry is None:
            return
        job.dropped = True
        if not entry.running:
            self.jobs.abort(job.job_id)
            resolve(job, DiffusionOutput(aborted=True, abort_message=f"Request {job.request_id} aborted."))
            logger.info("omni-ext: cancelled queued request %s", job.request_id)
        elif not job.all_ranks:
            # Running: its rank(s) stop at the next denoise step and are free for the next job. A
            # paused one unwinds where it waits (once its rank is done with the job running there).
            self.jobs.forget(job.job_id)
            for r in job.ranks:
                self.cancel_slots[r] = job.seq
            for r in sorted(job.paused):
                self._post(r, protocol.ResumeJob(job.job_id, drop=True))
            logger.info("omni-ext: cancelling running request %s on rank(s) %s%s", job.request_id, list(job.ranks),
                        " (paused: it unwinds where it waits, without resuming)" if job.paused else "")
            if job.is_paused:
                job.paused_at = None
                progress.mark_paused([job.request_id], False)
                self._report()

    def answer(self, rank: int, done: protocol.JobDone) -> None:
        """A rank's answer as it came through its pipe, in that rank's reader thread: the output is
        copied out of the shared memory the worker put it in (:mod:`omni_ext.executor.protocol`) and
        the segments unlinked here, not under the lock, and for every answer, also one that
        :meth:`on_done` will discard (a cancelled job, a shut-down executor), so that nothing is
        left in ``/dev/shm``."""
        try:
            protocol.output_from_shared_memory(done.out)
        except Exception as exc:
            logger.exception("omni-ext: the output of %s from worker %d could not be read", done.job_id, rank)
            out = DiffusionOutput(error=f"omni-ext: the output from worker {rank} could not be read: {exc}")
            done = protocol.JobDone(done.job_id, rank, out, True, done.seconds)
        self.on_done(rank, done)

    def on_done(self, rank: int, done: protocol.JobDone) -> None:
        """A rank answered (its output already copied to the host): the rank is free, the request is
        answered once the rank holding its output answers, and the job is done once all its ranks are."""
        job_id, out, owner = done.job_id, done.out, done.owner
        with self.lock:
            if self.busy.get(rank) == job_id:
                self.busy[rank] = None
            entry = self.jobs.get(job_id)
            if entry is None or not entry.running:
                self.dispatch()
                self.lock.notify_all()
                return
            job = entry.payload
            job.answered.add(rank)
            if job.splitting and not job.dropped:
                self._split_answer(job, rank, done)
                self.dispatch()
                self.lock.notify_all()
                return
            job.longest_s = max(job.longest_s, done.seconds)
            for r in sorted(job.paused - job.answered) if not job.dropped else ():
                # it ended here (an error) while others wait paused: they can never meet this rank in
                # a collective again; unwind them (a cancelled job's paused ranks were told already)
                job.paused.discard(r)
                self._post(r, protocol.ResumeJob(job.job_id, drop=True))
            is_error = isinstance(out, DiffusionOutput) and bool(getattr(out, "error", None))
            if job.all_ranks:
                if rank == job.ranks[0] or is_error:
                    job.first_out = out  # the warm-up answers once every rank is done
            elif ((owner and out is not None) or is_error) and not job.dropped:
                if owner and not (is_error or job.batched or job.stops) and isinstance(out, DiffusionOutput):
                    out.stage_durations = {**(out.stage_durations or {}), **hops(
                        entry.ticket.arrival, job.started, done.began, done.ended, time.monotonic())}
                resolve(job, out)  # answer now, even if the partner rank is still finishing
            if len(job.answered) == len(job.ranks):
                self._finished(job, out, is_error)
            self.dispatch()
            self.lock.notify_all()

    def on_paused(self, rank: int, msg: protocol.Paused) -> None:
        """A rank paused its job at a step boundary (it waits in the worker): the rank is free. Once
        every rank of the job paused, the job that asked for it starts there (:meth:`dispatch`)."""
        with self.lock:
            if self.busy.get(rank) == msg.job_id:
                self.busy[rank] = None
            entry = self.jobs.get(msg.job_id)
            job = entry.payload if entry is not None else None
            if job is None or not entry.running:
                self.lock.notify_all()
                return
            job.paused.add(rank)
            if job.dropped:  # cancelled on its way to the pause: unwind at once
                self._post(rank, protocol.ResumeJob(job.job_id, drop=True))
            elif len(job.paused) == len(job.ranks):
                now = time.monotonic()
                job.paused_at, job.paused_step, job.pauses, job.stops = now, msg.step, job.pauses + 1, job.stops + 1
                self.preemptions[job.pause_reason] = self.preemptions.get(job.pause_reason, 0) + 1
                logger.info("omni-ext: paused request %s before step %d on rank(s) %s; its memory stays there "
                            "(pause %d of at most %d)", job.request_id, msg.step, list(job.ranks), job.pauses,
                            self.sched.max_preemptions)
                progress.mark_paused([job.request_id], True)
                progress.record_placement("paused", job.request_id, ranks=list(job.ranks), step=msg.step,
                                          reason=job.pause_reason, for_request=self._request_of(job.pausing_for))
                self._report()
            self.dispatch()
            self.lock.notify_all()

    def _finished(self, job: Job, out: Any, is_error: bool) -> None:
        if is_error:
            self.jobs.forget(job.job_id)  # learn from complete runs only
        elif not (job.warm_up or job.all_ranks):
            self._read_steps(self.entry(job))  # its whole loop: the class learns fixed and per-step costs
        self.jobs.finish(job.job_id, time.monotonic(), seconds=job.longest_s)
        logger.info("omni-ext: done request %s on rank(s) %s in %.2f s%s",
                    job.request_id, list(job.ranks), job.longest_s, " (error)" if is_error else "")
        for rid in job.request_ids:
            progress.record_placement("done", rid, ranks=list(job.ranks), seconds=job.longest_s, error=is_error,
                                      **({"batch": list(job.members)} if job.batched else {}))
        if job.all_ranks:
            resolve(job, job.first_out if job.first_out is not None else out)
        elif job.dropped:
            resolve(job, DiffusionOutput(aborted=True, abort_message=f"Request {job.request_id} aborted."))
        elif not job.future.done():
            resolve(job, DiffusionOutput(error=f"omni-ext: no rank returned an output for {job.request_id}"))

    def drain(self) -> list[Job]:
        """Every job queued or running, taken out (the executor failed or shuts down: nothing starts again)."""
        with self.lock:
            self.stopped = True
            jobs = [e.payload for e in self.jobs.entries.values()]
            self.jobs.entries.clear()
            self.lock.notify_all()
        return jobs

    # ---- what is read -------------------------------------------------------------------------
    def running(self) -> list[Job]:
        return [e.payload for e in self.jobs.running()]

    def queued(self) -> list[Job]:
        return [e.payload for e in self.jobs.queued()]

    def idle(self) -> bool:
        """No job runs and no rank is busy (a control-plane RPC may run)."""
        return not self.jobs.running() and all(v is None for v in self.busy.values())

    def late(self, now: float) -> list[Job]:
        with self.lock:
            return [j for j in self.running() if j.deadline is not None and now > j.deadline and not j.is_paused]

    def on_ranks(self, ranks: list[int]) -> list[Job]:
        with self.lock:
            return [j for j in self.running() if set(j.ranks) & set(ranks)]

    # ---- healing (the executor replaces its workers: :mod:`omni_ext.executor.tuned`) ---------------
    def group_of(self, ranks: list[int]) -> tuple[int, ...]:
        """Every worker process of the CFG groups that hold ``ranks`` (what fails with them)."""
        procs: set[int] = set()
        for group in self.layout.groups:
            members = set(self.units.expand(group))
            if members & set(ranks):
                procs |= members
        return tuple(sorted(procs or set(ranks)))

    def fail_on(self, ranks: tuple[int, ...], reason: str) -> list[Job]:
        """Fail every job running or paused on any of ``ranks`` with ``reason`` (it names what happened),
        take them out, and keep ``ranks`` busy until :meth:`respawned`: nothing starts or resumes there.
        Jobs elsewhere, queued or running, are untouched."""
        with self.lock:
            victims = [j for j in self.running() if set(j.ranks) & set(ranks)]
            for job in victims:
                self.jobs.abort(job.job_id)
                if job.is_paused:
                    progress.mark_paused([job.request_id], False)
                resolve(job, DiffusionOutput(error=f"{reason}; request {job.request_id} was "
                                                   f"{'paused' if job.is_paused else 'running'} on rank(s) {list(job.ranks)}"))
                for rid in job.request_ids:
                    progress.record_placement("failed", rid, ranks=list(job.ranks), reason=reason)
            for r in ranks:
                self.busy[r] = RESPAWNING
            if victims:
                self._report()
            self.lock.notify_all()
            return victims

    def stop_late(self, job: Job, reason: str, now: float) -> None:
        """The watchdog's first stage: ``job`` fails now with ``reason`` and its ranks stop it at their
        next denoise step (the cancel board), which frees them without killing anything."""
        with self.lock:
            job.stop_asked = now
            resolve(job, DiffusionOutput(error=reason))
            if job.dropped or self.jobs.get(job.job_id) is None:
                return
            job.dropped = True
            self.jobs.forget(job.job_id)
            for r in job.ranks:
                self.cancel_slots[r] = job.seq
            logger.warning("%s; stopping it at its next step on rank(s) %s", reason, list(job.ranks))
            self.dispatch()

    def respawned(self, ranks: tuple[int, ...]) -> None:
        """New workers answer on ``ranks`` (a group the executor replaced): they are free again, and what
        is queued starts there too."""
        with self.lock:
            for r in ranks:
                self.busy[r] = None
            self.dispatch()
            self.lock.notify_all()

    def describe(self) -> str:
        with self.lock:
            return (f"pending={[j.request_id for j in self.queued()]} "
                    f"running={[(j.request_id, j.ranks) for j in self.running()]} busy={self.busy} "
                    f"paused={[j.request_id for j in self.running() if j.is_paused]}")

    def paused_jobs(self) -> list[Job]:
        return [j for j in self.running() if j.is_paused]

    # ---- dispatch -------------------------------------------------------------------------------
    def cost_key(self, job: Job, mode: JobMode) -> str:
        """Measurements are kept per shape class AND per mode the ranks ran it in: a CFG job on a
        pair takes well under the time of the same job on one rank (half at best)."""
        return cost.mode_key(job.shape, mode.rank_mode.value)

    def _predict(self, entry: Entry[Job], model: CostModel) -> float | None:
        """Predicted seconds of a queued job in the mode it runs in whenever others wait
        (:func:`~omni_ext.scheduler.placement.predicted_mode`); a mode not measured yet is converted
        from the other one (:class:`~omni_ext.scheduler.cost.CostModel`)."""
        mode = placement.predicted_mode(entry.payload.needs.mode, self.cfg_mode)
        return model.predict_s(self.cost_key(entry.payload, mode), entry.units, steps=entry.n_steps)

    def _dispatch_after(self, seconds: float) -> None:
        def again() -> None:
            with self.lock:
                self.dispatch()

        timer = threading.Timer(seconds + 0.001, again)
        timer.daemon = True
        timer.start()

    def _recheck_after(self, seconds: float) -> None:
        """Dispatch again in ``seconds`` for a job that waits with a deadline: whether it would miss it
        by waiting changes as running jobs turn out slower or faster than predicted, with no event
        to say so. One such timer at a time (an earlier one stands)."""
        at = time.monotonic() + seconds
        if self._recheck_at is not None and self._recheck_at <= at + 1e-3:
            return
        self._recheck_at = at

        def again() -> None:
            with self.lock:
                if self._recheck_at == at:
                    self._recheck_at = None
                self.dispatch()

        timer = threading.Timer(seconds, again)
        timer.daemon = True
        timer.start()

    def _refresh_steps(self) -> None:
        """The running jobs' measured denoise steps, from their lead rank's step reports (the
        progress files the API process reads too): what a job has left is its steps left at its
        measured step time, which takes in how much slower it runs beside others than alone."""
        for entry in self.jobs.running():
            job = entry.payload
            if not (job.warm_up or job.all_ranks):
                self._read_steps(entry)

    @staticmethod
    def _read_steps(entry: Entry[Job]) -> None:
        step = progress.read_request(entry.payload.request_ids[0])
        if step is not None and step.done > 0:
            entry.steps = (step.done, step.total, step.t_last - step.t_start, step.before_loop_s)

    def dispatch(self) -> None:
        """Start what the order and placement rules allow now (under the lock; nothing while held):
        first the job a paused one paused for, then the paused jobs whose ranks are free again
        resume, then placement's starts on the other free ranks, then, when the next job still
        cannot start, a preemption for it (module docstring)."""
        if self.stopped:
            return
        now = time.monotonic()
        paused = [j for j in self.running() if j.pausing_for is not None]

        def units_of(jobs: list[Job]) -> set[int]:
            return {self.units.unit_of(r) for j in jobs for r in j.ranks}

        for victim in paused:  # 1. the job it paused for takes its ranks
            head = self.jobs.get(victim.pausing_for or "")
            if not victim.is_paused or self.hold or head is None or head.running:
                continue
            free = set(self.units.free_units(self.layout, self.busy)) - units_of([j for j in paused if j is not victim])
            for start in placement.next_placements([head.payload], free, self.layout, cfg_mode=self.cfg_mode, now=now):
                self._start(start.job, start.ranks, start.mode, now)
        if self.jobs.queued():
            self._refresh_steps()
        for victim in paused:  # 2. then paused jobs resume as soon as their ranks are free (also when it could not start)
            if victim.is_paused and not victim.dropped and all(self.busy.get(r) is None for r in victim.ranks):
                if not self._pass_on(victim, paused, now):
                    self._resume(victim, now)
        if not self.jobs.queued():
            return
        paused = [j for j in paused if j.pausing_for is not None]
        free = set(self.units.free_units(self.layout, self.busy)) - units_of(paused)
        ordered = [e.payload for e in self.jobs.ordered(now, len(self.layout.groups))]  # a job per group: risk seen early
        starts = placement.next_placements(
            ordered, free, self.layout,
            hold=bool(self.hold), cfg_mode=self.cfg_mode, now=now, settle_s=self.sched.settle_s,
        )
        for start in starts:
            self._start(start.job, start.ranks, start.mode, now)
            free.difference_update(start.ranks)
        blocked = len(starts) < len(ordered) and not free and not self.hold
        splitting = False
        for job in self.running():
            if job.splitting:
                splitting = True
            elif placement.splits(job.tentative_until, now, blocked=blocked) and job.pausing_for is None:
                self.split(job, ordered[len(starts)])
                splitting = True
        in_flight = splitting or any(not j.is_paused for j in paused)
        if len(starts) < len(ordered) and self.preempts and not self.hold:
            head = ordered[len(starts)]
            if in_flight or not self._maybe_preempt(head, free, paused, now):
                ticket = self.entry(head).ticket
                if preempt.deadline_pauses(self.sched.order) and ticket.deadline(self.sched.slo_factor) is not None:
                    self._recheck_after(RECHECK_S)  # only a deadline can come due with no event

    def _candidate(self, j: Job, now: float, held: set[int] = frozenset()) -> preempt.Running:
        """A running (or paused) job as :func:`omni_ext.scheduler.preempt.choose` sees it."""
        entry = self.entry(j)
        return preempt.Running(
            j.job_id, entry.ticket.priority, tuple(sorted({self.units.unit_of(r) for r in j.ranks})),
            remaining_s=self.jobs.remaining(entry, now), deadline=entry.ticket.deadline(self.sched.slo_factor),
            preemptions=j.pauses, arrival=entry.ticket.arrival,
            # a batch is not paused: its members' deadlines differ, and vLLM-Omni's batch path has no pause point
            preemptible=not (j.warm_up or j.dropped or j.batched or j.mode is None or held & set(j.ranks)
                             or j.splitting or _loop_done(entry)),
        )

    def _waiting(self, head: Job, now: float) -> preempt.Waiting:
        """The head as preemption judges it: its deadline, or an earlier one a job queued behind it
        needs (:func:`omni_ext.scheduler.admission.queue_pressure`)."""
        slo = self.sched.slo_factor
        ticket = self.entry(head).ticket
        queued = [e for e in self.jobs.ordered(now, len(self.layout.groups)) if e.payload is not head]
        head_first = [(ticket.predicted_s, ticket.deadline(slo))] + [(e.ticket.predicted_s, e.ticket.deadline(slo))
                                                                     for e in queued]
        # a slot per running job, free once it and the job paused under it are done; a paused job
        # whose ranks are free again (it resumes, unless it lets this head through) holds one too
        def left(j: Job) -> float:
            return self.jobs.remaining(self.entry(j), now) or 0.0

        running = [j for j in self.running() if not j.all_ranks]
        over = {j.pausing_for: j for j in running if j.is_paused}
        active = {j.job_id for j in running if not j.is_paused}
        slots = [left(j) + (left(over[j.job_id]) if j.job_id in over else 0.0) for j in running if not j.is_paused]
        slots += [left(p) for p in running if p.is_paused and p.pausing_for not in active]
        deadline, at_risk = admission.queue_pressure(now, slots, head_first, len(self.layout.groups))
        return preempt.Waiting(head.job_id, head.needs, ticket.priority, ticket.predicted_s, deadline, at_risk,
                               arrival=ticket.arrival)

    def _pass_on(self, victim: Job, paused: list[Job], now: float) -> bool:
        """A paused job whose ranks are free again lets the next queued job through first when a
        pause would be chosen for that job now (:func:`omni_ext.scheduler.preempt.choose` on the
        ranks free besides it, counted as one more pause): resuming it only to pause it again a step
        later would cost a step and a pause. True when the head started there."""
        if not self.preempts or self.hold or victim.dropped:
            return False
        ordered = [e.payload for e in self.jobs.ordered(now, len(self.layout.groups))]
        if not ordered or ordered[0].all_ranks or ordered[0].warm_up:
            return False
        head = ordered[0]
        others = {self.units.unit_of(r) for j in paused if j is not victim for r in j.ranks}
        free = set(self.units.free_units(self.layout, self.busy)) - others
        victim_units = {self.units.unit_of(r) for r in victim.ranks}
        # the jobs running elsewhere count for how long the head would wait, but only this one pauses
        cands = [self._candidate(victim, now)] + [
            dataclasses.replace(self._candidate(j, now), preemptible=False)
            for j in self.running() if not (j.all_ranks or j.is_paused or j.pausing_for is not None)]
        choice = preempt.choose(self._waiting(head, now), cands, free - victim_units, self.layout,
                                now=now, cfg_mode=self.cfg_mode, max_preemptions=self.sched.max_preemptions,
                                deadlines=preempt.deadline_pauses(self.sched.order))
        if choice is None or choice.victim != victim.job_id:
            return False
        starts = placement.next_placements([head], victim_units, self.layout, cfg_mode=self.cfg_mode, now=now)
        if not starts:
            return False
        victim.pausing_for, victim.pause_reason, victim.pauses = head.job_id, choice.reason, victim.pauses + 1
        self.preemptions[choice.reason] = self.preemptions.get(choice.reason, 0) + 1
        logger.info("omni-ext: request %s stays paused on rank(s) %s for request %s (reason %s: %s; pause %d of at "
                    "most %d)", victim.request_id, list(victim.ranks), head.request_id, choice.reason, choice.detail,
                    victim.pauses, self.sched.max_preemptions)
        progress.record_placement("preempt", victim.request_id, ranks=list(victim.ranks), reason=choice.reason,
                                  for_request=head.request_id, paused=True)
        self._report()
        for start in starts:
            self._start(start.job, start.ranks, start.mode, now)
        return True

    def split(self, job: Job, head: Job) -> None:
        """A tentative pair (placement rule 5: a CFG request that came alone started as a pair at once)
        became the first of a burst: ``head`` came within the settle time and finds no free rank. Its
        ranks stop it at their next step boundary, through the cancel board like a cancel (both stop
        at the same step), and it is queued again in front (:meth:`_split_answer`), where placement now
        puts it on one rank beside the burst. Its output bytes are the same either way; what it
        computed before the stop (its text encoding, at most a step) is spent again."""
        job.splitting, job.tentative_until, job.split_out = True, None, None
        for r in job.ranks:
            self.cancel_slots[r] = job.seq
        logger.info("omni-ext: request %s started alone as a CFG pair on rank(s) %s; request %s followed within "
                    "%.0f ms: the pair stops at its next step and the request starts again on one rank",
                    job.request_id, list(job.ranks), head.request_id, 1000 * self.sched.settle_s)
        progress.record_placement("split", job.request_id, ranks=list(job.ranks), for_request=head.request_id)

    def _split_answer(self, job: Job, rank: int, done: protocol.JobDone) -> None:
        """A rank of a splitting pair answered (under the lock): once all have, the job is answered when
        it had finished before the stop reached it, else it goes back to the queue's front with a fresh
        sequence number (its ranks' cancel slots still hold the old one)."""
        if self.busy.get(rank) == job.job_id:
            self.busy[rank] = None
        out = done.out
        if done.owner and out is not None and job.split_out is None:
            job.split_out = out
        job.longest_s = max(job.longest_s, done.seconds)
        if len(job.answered) < len(job.ranks):
            return
        out = job.split_out
        if isinstance(out, DiffusionOutput) and not out.error and not getattr(out, "aborted", False):
            job.splitting = False  # the stop came after its last step: it is done
            resolve(job, out)
            self._finished(job, out, False)
            return
        logger.info("omni-ext: request %s stopped as a pair on rank(s) %s after %.2f s; queued again in front",
                    job.request_id, list(job.ranks), job.longest_s)
        job.splitting, job.split_out, job.seq = False, None, self.next_id()
        job.ranks, job.mode, job.started, job.deadline, job.longest_s = (), None, None, None, 0.0
        job.answered, job.stops = set(), 0
        entry = self.entry(job)
        entry.steps, entry.where = (), None
        self.jobs.add(entry, front=True)

    def _maybe_preempt(self, head: Job, free: set[int], paused: list[Job], now: float) -> bool:
        """Ask :func:`omni_ext.scheduler.preempt.choose` whether a running job pauses for ``head`` (one
        pause in flight at a time), and ask its ranks to pause. A job running over a paused one (on
        any of its ranks) is not preemptible: a paused job waits for one job at a time. True when
        a pause was asked."""
        if head.all_ranks or head.warm_up:
            return False
        held = {r for j in paused for r in j.ranks}
        cands = [self._candidate(j, now, held) for j in self.running() if not (j.all_ranks or j.pausing_for is not None)]
        choice = preempt.choose(self._waiting(head, now), cands, free, self.layout, now=now, cfg_mode=self.cfg_mode,
                                max_preemptions=self.sched.max_preemptions,
                                deadlines=preempt.deadline_pauses(self.sched.order))
        if choice is None:
            return False
        victim = self.jobs.entries[choice.victim].payload
        victim.pausing_for, victim.pause_reason = head.job_id, choice.reason
        victim.paused.clear()
        token = pause_token(victim.seq, victim.stops + 1)  # the workers number the pauses they made
        world = len(self.busy)
        for r in victim.ranks:
            if len(self.cancel_slots) >= board_size(world):
                self.cancel_slots[PAUSE * world + r] = token
        logger.info("omni-ext: preempting request %s on rank(s) %s for request %s (reason %s: %s); it pauses at its "
                    "next step boundary and resumes there afterwards", victim.request_id, list(victim.ranks),
                    head.request_id, choice.reason, choice.detail)
        progress.record_placement("preempt", victim.request_id, ranks=list(victim.ranks), reason=choice.reason,
                                  for_request=head.request_id)
        return True

    def _resume(self, job: Job, now: float) -> None:
        paused_s = now - (job.paused_at or now)
        if job.deadline is not None:
            job.deadline += paused_s  # the time limit counts running time
        job.paused_at, job.pausing_for = None, None
        progress.mark_paused([job.request_id], False)
        for r in job.ranks:
            self.busy[r] = job.job_id
        ranks = sorted(job.paused)
        job.paused.clear()
        for r in ranks:
            self._post(r, protocol.ResumeJob(job.job_id))
        logger.info("omni-ext: resumed request %s on rank(s) %s after %.2f s paused", job.request_id, list(job.ranks),
                    paused_s)
        progress.record_placement("resumed", job.request_id, ranks=list(job.ranks), paused_s=paused_s)
        self._report()

    def _post(self, rank: int, msg: protocol.Message) -> None:
        try:
            self.send(rank, msg)
        except Exception as exc:  # a dead pipe: the monitor reports the death
            logger.error("omni-ext: could not send %s to worker %d: %s", type(msg).__name__, rank, exc)

    def _request_of(self, job_id: str | None) -> str | None:
        entry = self.jobs.get(job_id or "")
        return entry.payload.request_id if entry is not None else None

    def _report(self) -> None:
        """The preemption counts and paused jobs, for the API process's ``/metrics``."""
        progress.write_preemptions(self.preemptions, len(self.paused_jobs()))

    def _start(self, job: Job, units: tuple[int, ...], mode: JobMode, now: float) -> None:
        entry = self.entry(job)
        ranks = self.units.expand(units)  # the leader of the job's first unit first
        job.ranks, job.mode, job.started = ranks, mode, now
        if not (job.warm_up or job.batched or job.all_ranks):
            job.tentative_until = placement.tentative_until(mode, self.cfg_mode, job.needs, now=now,
                                                            settle_s=self.sched.settle_s)
        self.jobs.start(job.job_id, now, ranks, key=self.cost_key(job, mode))
        predicted = None if job.warm_up else entry.predicted_s
        # The warm-up pays first-call costs (compilation): only a fixed limit applies to it.
        limit = cost.job_time_limit_s(job.needs.units, None if job.warm_up else self.costs.rate(entry.key))
        if not job.warm_up:
            # Tell the API process the job runs now. Before the ranks get it, so that the lead
            # rank's step reports (same file) always come after this.
            progress.mark_started(list(job.request_ids), job.steps, mode.value)
        job.deadline = None if limit is None else now + limit
        for r in ranks:
            self.busy[r] = job.job_id
        run = protocol.RunJob(job.job_id, job.req, mode, self.cfg_size, job.seq, ranks, self.units.size)
        for r in ranks:  # one message for all of them: the executor pickles it once (TunedExecutor._post)
            try:
                self.send(r, run)
            except Exception as exc:  # a dead pipe: the monitor reports the death
                logger.error("omni-ext: could not send request %s to worker %d: %s", job.request_id, r, exc)
        waited = now - entry.ticket.arrival
        logger.info(
            "omni-ext: start %s on rank(s) %s (%s), waited %.2f s%s%s%s",
            f"batch of {len(job.members)} requests {list(job.members)}" if job.batched else f"request {job.request_id}",
            list(ranks), "warm-up" if job.all_ranks else mode.value, waited,
            "" if job.warm_up else f", priority {entry.ticket.priority}",
            f", predicted {predicted:.3f} s" if predicted is not None else "",
            f", time limit {limit:.0f} s" if limit is not None else "",
        )
        for rid in job.request_ids:
            progress.record_placement("start", rid, ranks=list(ranks), mode="warm-up" if job.all_ranks else mode.value,
                                      waited_s=waited, predicted_s=predicted,
                                      **({"batch": list(job.members)} if job.batched else {}))


def hops(arrival: float, started: float | None, began: float, ended: float, now: float) -> dict[str, float]:
    """Seconds one request spent around its pipeline run here, added to its answer's stage durations
    beside the pipeline profiler's (``X-Stage-Durations``, an image answer's ``metrics``), so that
    what the TunedExecutor adds per job is read per request (``bench cfg-parallel --single-jobs``
    takes the overhead over vLLM-Omni's executor apart with them): ``omni_ext.queue`` from its
    arrival here to its start (the queue and placement), ``omni_ext.to_worker`` from its start to
    its worker beginning it (the pipe and the worker's wake-up), ``omni_ext.worker`` the worker's run
    (the pipeline and its role set-up), ``omni_ext.from_worker`` from its output computed to here
    (shared memory, the pipe, the copy out). Empty without the worker's clock readings (a job that
    paused or ran as a batch is not timed: its hops are not one request's)."""
    if started is None or began <= 0.0 or ended < began:
        return {}
    return {"omni_ext.queue": max(0.0, started - arrival), "omni_ext.to_worker": max(0.0, began - started),
            "omni_ext.worker": ended - began, "omni_ext.from_worker": max(0.0, now - ended)}


def _outputs(req: Any) -> int:
    """Outputs one request asks for (``num_outputs_per_prompt``): its class predicts one."""
    n = getattr(getattr(req, "sampling_params", None), "num_outputs_per_prompt", 1)
    return n if isinstance(n, int) and n > 1 else 1


def _loop_done(entry: Entry[Job]) -> bool:
    """Its denoise loop has passed its last step (decoding now): no step boundary is left to pause at."""
    return bool(entry.steps) and entry.steps[0] >= entry.steps[1] > 0


@dataclass
class Part:
    """One request of a batched job, as the engine collects it (its own async output id and future)."""

    job: Job
    index: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    @property
    def request_id(self) -> str:
        return self.job.members[self.index]


def _split_batch(job: Job, parts: list[Part]) -> None:
    """When a batched job is answered (a list, one output per request; or one error for all), each
    request's future gets its own; a member cancelled meanwhile gets its abort."""

    def split(fut: concurrent.futures.Future) -> None:
        out = fut.result()
        for part in parts:
            if part.request_id in job.cancelled:
                one = DiffusionOutput(aborted=True, abort_message=f"Request {part.request_id} aborted.")
            elif isinstance(out, list):
                one = out[part.index] if part.index < len(out) else DiffusionOutput(
                    error=f"omni-ext: the batch returned no output for {part.request_id}")
            else:
                one = out
            if not part.future.done():
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    part.future.set_result(one)

    job.future.add_done_callback(split)


def resolve(job: Job, out: DiffusionOutput) -> None:
    """Answer the engine's future of ``job`` (once; later answers are ignored)."""
    if not job.future.done():
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            job.future.set_result(out)


def _small_warmup(req: Any) -> Any:
    """vLLM-Omni warms up at 512x512; on a CPU host every worker would spend a minute on it.
    There the warm-up runs at ``OMNI_EXT_CPU_WARMUP_SIZE`` (default 64) pixels a side."""
    side = int(environment.value("OMNI_EXT_CPU_WARMUP_SIZE"))
    req = copy.copy(req)
    req.sampling_params = copy.deepcopy(req.sampling_params)
    sp = req.sampling_params
    sp.height = min(sp.height or side, side)
    sp.width = min(sp.width or side, side)
    return req
