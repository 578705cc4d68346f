"""``TunedExecutor``: CFG parallel end to end, real data parallel, no wasted rank, fast failure.

Selected with ``--distributed-executor-backend omni_ext.executor.TunedExecutor`` (or a deploy
YAML's ``distributed_executor_backend``); what it gives a user, its limits and its measured figures
are the README's "Tuned executor" section. It implements vLLM-Omni 0.30's ``DiffusionExecutor``
contract; the engine, scheduler, model runner, worker and pipelines are vLLM-Omni's own (the
pipelines as thin subclasses, :mod:`omni_ext.executor.pipelines`).

This module is the mechanism only. What it decides with it is pure code, documented where it is
done: which queued job starts first (:mod:`omni_ext.scheduler.order`), on which ranks and in which
mode (:mod:`omni_ext.scheduler.placement`: pair, single rank, warm-up on every rank, ``cfg_mode``,
settling), what a job is expected to cost and its time limit (:mod:`omni_ext.scheduler.cost`),
whether a request runs CFG and its cost units (:mod:`omni_ext.models.families`); the options are
:mod:`omni_ext.scheduler.config`.

Processes. ``W = data_parallel_size x cfg_parallel_size`` spawned worker processes
(:mod:`omni_ext.executor.worker`), rank ``r`` on local device ``r``; group ``g`` is ranks
``[g*cfg, g*cfg + cfg)``, vLLM-Omni's own layout, and its CFG process group the one vLLM-Omni's
workers create. ``data_parallel_size`` is the stage's (patch ``dp-world``) or
``omni_ext.data_parallel_size``.

Pipes and futures. ``execute_batch`` does not block the engine: it queues each scheduled request as
a job and returns at once with an ``async_output_id``; the engine waits on ``wait_output_ready``'s
future outside its busy loop, so it schedules the next request at once. Under one lock, each change
to the queue or to the free ranks (a submit, an answer, a cancel, the settle timer) asks placement
what starts now, marks it started for the API process (:func:`omni_ext.progress.mark_started`) and
sends it to its ranks' pipes (:mod:`omni_ext.executor.protocol`). One reader thread per rank takes
the answers: a rank is free again as soon as it answers, and a request is answered as soon as the
rank holding its output answers (for Qwen-Image CFG rank 1 skips the VAE decode and is free early).
A cancel reaches a running rank through shared memory (:mod:`omni_ext.executor.role`), not the pipe.

Failure. A monitor thread waits on the worker processes' sentinels: when one dies, every request
queued or running fails at once with an error naming the worker, the signal and the request, the
remaining workers are stopped, ``check_health`` raises ``EngineDeadError`` (``/health`` -> 503) and
the engine's failure callbacks run. A watchdog thread fails the executor the same way when a job
overruns its time limit (its CFG group can no longer be trusted).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.engine.exceptions import EngineDeadError

from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.executor.abstract import DiffusionExecutor

from omni_ext import progress
from omni_ext.executor import ascend, protocol
from omni_ext.executor.role import new_board
from omni_ext.models import families
from omni_ext.platform import devices
from omni_ext.scheduler import cost, placement
from omni_ext.scheduler.config import CfgMode, omni_ext_section, scheduler_config
from omni_ext.scheduler.order import Ticket, request_priority, request_waited_s, sort_key
from omni_ext.scheduler.placement import JobMode, JobNeeds

logger = logging.getLogger("omni_ext.executor")

_READY_TIMEOUT_S = float(os.environ.get("OMNI_EXT_WORKER_READY_TIMEOUT_S", "1800"))
#: vLLM-Omni's start-up warm-up request ids start with this
#: (``vllm_omni.diffusion.request.DUMMY_DIFFUSION_REQUEST_ID`` in 0.30).
DUMMY_REQUEST_PREFIX = "dummy_req_id"
#: The warm-up's priority: it is the only job at start-up, and it stays ahead of anything queued meanwhile.
WARM_UP_PRIORITY = -(10**6)


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class _Job:
    job_id: str
    request_id: str
    req: Any
    needs: JobNeeds  # mode and expected cost, what placement reads
    ticket: Ticket  # priority, arrival and predicted cost, what ordering reads
    shape: str = ""  # its shape class (cost.shape_key); measurements are kept per shape and mode
    steps: int = 0  # denoise steps, for the start marker
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    ranks: tuple[int, ...] = ()
    mode: JobMode | None = None  # how its ranks run it, once started
    answered: set[int] = field(default_factory=set)
    started: float | None = None
    deadline: float | None = None
    longest_s: float = 0.0
    dropped: bool = False
    first_out: Any = None
    seq: int = 0  # written into the ranks' cancel slots to stop the job while it runs

    @property
    def all_ranks(self) -> bool:
        """The warm-up of a tuned model: runs once on every rank and answers when all are done."""
        return self.needs.mode is JobMode.ALL_RANKS

    @property
    def warm_up(self) -> bool:
        """vLLM-Omni's start-up request (resized here on a CPU host, and pays first-call costs)."""
        return self.request_id.startswith(DUMMY_REQUEST_PREFIX)


class TunedExecutor(DiffusionExecutor):
    uses_multiproc: bool = True

    # ------------------------------------------------------------------ set-up
    def _init_executor(self) -> None:
        from vllm_omni.platforms import current_omni_platform

        cfg = self.od_config
        pc = cfg.parallel_config
        if getattr(cfg, "step_execution", False):
            raise ValueError("omni-ext TunedExecutor runs whole requests; drop --step-execution / streaming output.")
        for name in ("tensor_parallel_size", "sequence_parallel_size", "pipeline_parallel_size"):
            if int(getattr(pc, name, 1) or 1) != 1:
                raise ValueError(f"omni-ext TunedExecutor supports CFG and data parallel only ({name}={getattr(pc, name)}).")
        if getattr(pc, "use_hsdp", False):
            raise ValueError("omni-ext TunedExecutor does not support HSDP.")
        if int(getattr(pc, "vae_patch_parallel_size", 1) or 1) > 1:
            # vLLM-Omni's VAE patch parallel runs collectives over the whole worker world, which
            # cannot work while ranks run different requests (data parallel, single-rank jobs).
            raise ValueError(
                f"omni-ext TunedExecutor: drop --vae-patch-parallel-size {pc.vae_patch_parallel_size}; the TunedExecutor "
                "splits the Wan VAE decode (tiled or not) between the two ranks of a CFG pair itself "
                "(omni_ext/executor/vae_pipeline.py), or serve with vLLM-Omni's executor to use its VAE patch parallel."
            )
        self.cfg_size = int(pc.cfg_parallel_size or 1)
        if self.cfg_size not in (1, 2):
            raise ValueError(f"omni-ext TunedExecutor supports cfg_parallel_size 1 or 2, got {self.cfg_size}.")
        additional = getattr(cfg, "additional_config", None)
        try:
            self.sched = scheduler_config(additional)
        except ValueError as exc:
            raise ValueError(f"omni-ext TunedExecutor: {exc}") from None
        # The registered patch dp-world has already made omni-ext's data_parallel_size the stage's
        # own, so vLLM-Omni's start-up counted, split and checked devices for this whole world; the
        # check below is the executor's own (rank r uses local device r), for a start-up without it.
        dp = int(omni_ext_section(additional).get("data_parallel_size") or 0) or int(pc.data_parallel_size or 1)
        world = dp * self.cfg_size
        visible, source = devices.visible_devices(current_omni_platform)
        if world > visible:
            raise ValueError(
                f"omni-ext TunedExecutor: data_parallel_size {dp} x cfg_parallel_size {self.cfg_size} needs "
                f"{world} devices (one per rank), but {visible} are visible ({source})."
            )
        pc.data_parallel_size = dp
        pc.world_size = world
        cfg.num_gpus = world
        self.dp = dp
        self.world = world
        self.layout = placement.Layout.regular(dp, self.cfg_size)
        self.model_arch = getattr(cfg, "model_class_name", None)
        family = families.family_of(self.model_arch)
        # A request may use part of a CFG group only where omni-ext's tuned pipeline runs (it keeps a
        # one-rank job out of the group's collectives and runs both guidance branches there); any
        # other model's requests take the whole group, as under vLLM-Omni's own executor, and its
        # warm-up is an ordinary request.
        self._tuned_model = family is not None and family.splits_cfg_groups
        self.cfg_mode = self.sched.cfg_mode if self._tuned_model else CfgMode.PAIR

        # vLLM-Omni's engine waits at most VLLM_OMNI_ASYNC_OUTPUT_TIMEOUT (600 s) for an async output;
        # here a request may queue behind others and long videos take longer, and this executor
        # enforces its own cost-based limits, so lift that fixed cap unless the operator set it.
        os.environ.setdefault("VLLM_OMNI_ASYNC_OUTPUT_TIMEOUT", "86400")

        device_type = self.device_type = getattr(current_omni_platform, "device_type", "cpu")
        worker_env: dict[str, str] = {}
        if device_type == "npu":
            worker_env = ascend.ascend_worker_env(num_groups=dp, group_size=self.cfg_size)
        expected = ascend.collective_backend(device_type)
        backend = getattr(current_omni_platform, "dist_backend", expected)
        if device_type in ("npu", "cuda", "cpu") and backend != expected:
            raise RuntimeError(f"omni-ext TunedExecutor: platform {device_type} uses {backend!r}, expected {expected!r}.")
        self.worker_env = worker_env

        self._init_state()
        self._launch_workers()
        self._threads = [
            threading.Thread(target=self._reader, args=(r,), daemon=True, name=f"omni-ext-reader-{r}")
            for r in range(world)
        ]
        self._threads.append(threading.Thread(target=self._monitor, daemon=True, name="omni-ext-monitor"))
        self._threads.append(threading.Thread(target=self._watchdog, daemon=True, name="omni-ext-watchdog"))
        for t in self._threads:
            t.start()
        logger.info(
            "omni-ext TunedExecutor: %d worker(s), %d group(s) %s of cfg %d, backend %s, scheduler cfg_mode=%s "
            "order=%s%s%s",
            world, dp, [list(g) for g in self.layout.groups], self.cfg_size, backend, self.cfg_mode, self.sched.order,
            "" if self.cfg_mode == self.sched.cfg_mode else f" (configured {self.sched.cfg_mode}: no tuned pipeline)",
            f", worker env {worker_env}" if worker_env else "",
        )

    def _init_state(self) -> None:
        """The queue, rank and cost state (needs ``world``, ``layout``, ``sched`` and ``cfg_mode``)."""
        self._lock = threading.Condition(threading.RLock())
        self._closed = False
        self._failed = False
        self._failure: str | None = None
        self._callbacks: list = []
        self._pending: list[_Job] = []  # ordered at each dispatch (omni_ext.scheduler.order)
        self._running: dict[str, _Job] = {}
        self._outputs: dict[str, _Job] = {}
        self._busy: dict[int, str | None] = {r: None for r in range(self.world)}
        self._ids = itertools.count(1)
        self.costs = cost.CostModel(self.sched.seconds_per_unit)
        self._rpc_barrier = 0
        self._rpc_replies: dict[str, dict[int, tuple[bool, Any]]] = {}

    def _launch_workers(self) -> None:
        from vllm.v1.executor.multiproc_executor import set_multiprocessing_worker_envs

        from omni_ext.executor.worker import worker_main

        set_multiprocessing_worker_envs()
        ctx = multiprocessing.get_context("spawn")
        # One slot per rank: the sequence number of the job that rank must stop (shared memory, so
        # a cancel reaches a rank in the middle of its forward without any message), and the cells
        # in which a CFG pair agrees on its stop step (omni_ext.executor.role.pair_stop_now).
        self._cancel_slots = new_board(ctx, self.world)
        self._procs: list = []
        self._conns: list = []
        self._send_locks = [threading.Lock() for _ in range(self.world)]
        children = []
        with _environ(self.worker_env):
            for rank in range(self.world):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=worker_main,
                    args=(rank, self.od_config, child, self._cancel_slots),
                    name=f"DiffusionWorker-{rank}",
                    daemon=True,
                )
                proc.start()
                self._procs.append(proc)
                self._conns.append(parent)
                children.append(child)
        for child in children:
            child.close()
        self._pids = {}
        try:
            for rank, conn in enumerate(self._conns):
                deadline = time.monotonic() + _READY_TIMEOUT_S
                while not conn.poll(1.0):
                    if not self._procs[rank].is_alive():
                        raise RuntimeError(
                            f"omni-ext: diffusion worker {rank} exited during start-up (exitcode {self._procs[rank].exitcode})"
                        )
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"omni-ext: diffusion worker {rank} not ready after {_READY_TIMEOUT_S:.0f} s")
                msg = protocol.recv(conn)
                if not isinstance(msg, protocol.Ready):
                    raise RuntimeError(f"omni-ext: diffusion worker {rank} failed to start: {getattr(msg, 'error', msg)}")
                self._pids[rank] = msg.pid
        except BaseException:
            self._kill_workers()
            raise

    # ------------------------------------------------------------------ contract
    @property
    def is_dead(self) -> bool:
        return self._closed or self._failed

    def register_failure_callback(self, callback) -> None:
        self._callbacks.append(callback)

    def _ensure_alive(self) -> None:
        if self._failed:
            raise EngineDeadError(self._failure or "omni-ext TunedExecutor failed")
        if self._closed:
            raise RuntimeError("omni-ext TunedExecutor is shut down")

    def execute_request(self, scheduler_output) -> Any:
        return self.execute_batch(scheduler_output)

    def execute_batch(self, scheduler_output) -> Any:
        from vllm_omni.diffusion.worker.utils import BatchRunnerOutput, RunnerOutput

        self._ensure_alive()
        outs = []
        for new_req in scheduler_output.scheduled_new_reqs:
            job = self._submit(new_req.request_id, new_req.req)
            outs.append(
                RunnerOutput(
                    request_id=new_req.request_id, step_index=None, finished=True, result=None, async_output_id=job.job_id
                )
            )
        return BatchRunnerOutput.from_list(outs)

    def execute_step(self, scheduler_output) -> Any:
        raise NotImplementedError("omni-ext TunedExecutor does not support step execution")

    def wait_output_ready(self, async_output_id: str) -> concurrent.futures.Future:
        with self._lock:
            job = self._outputs.pop(async_output_id, None)
        if job is None:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.set_result(DiffusionOutput(error=f"omni-ext: unknown or already collected output {async_output_id}"))
            return fut
        return job.future

    def drop_output(self, async_output_id: str) -> None:
        with self._lock:
            job = self._outputs.pop(async_output_id, None)
            if job is not None:
                self._cancel_locked(job)
                self._dispatch_locked()

    def abort_requests(self, request_ids) -> None:
        """Stop these requests, queued or running (called by the ``executor-abort-hook`` patch when
        the engine aborts them, e.g. on ``DELETE /v1/videos/{id}``).

        vLLM-Omni's engine hands a request to an async executor and forgets it; its own abort then
        never reaches the executor, and the request would run to the end."""
        ids = set(request_ids)
        with self._lock:
            for job in [*self._pending, *self._running.values()]:
                if job.request_id in ids:
                    self._cancel_locked(job)
            self._dispatch_locked()

    def _cancel_locked(self, job: _Job) -> None:
        """Cancel a job (under the lock). A queued one leaves the queue, and with it the ordering,
        at once (the caller dispatches next: jobs it held back may start now)."""
        if job.dropped:
            return
        job.dropped = True
        if job in self._pending:
            self._pending.remove(job)
            self._resolve(job, DiffusionOutput(aborted=True, abort_message=f"Request {job.request_id} aborted."))
            logger.info("omni-ext: cancelled queued request %s", job.request_id)
        elif job.job_id in self._running and not job.all_ranks:
            # Running: its rank(s) stop at the next denoise step and are free for the next job.
            for r in job.ranks:
                self._cancel_slots[r] = job.seq
            logger.info("omni-ext: cancelling running request %s on rank(s) %s", job.request_id, list(job.ranks))

    def describe_pending_state(self, async_output_id: str | None = None) -> str:
        with self._lock:
            return (
                f"async_output_id={async_output_id} pending={[j.request_id for j in self._pending]} "
                f"running={[(j.request_id, j.ranks) for j in self._running.values()]} busy={self._busy}"
            )

    def check_health(self) -> None:
        self._ensure_alive()
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                self._on_worker_death([rank])
                self._ensure_alive()

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        unique_reply_rank: int | None = None,
        exec_all_ranks: bool = False,
    ) -> Any:
        """Control-plane RPC: waits until no request runs (nothing new starts meanwhile), then calls
        ``method`` on every rank (or only on ``unique_reply_rank`` unless ``exec_all_ranks``)."""
        self._ensure_alive()
        deadline = None if timeout is None else time.monotonic() + timeout
        ranks = list(range(self.world)) if (unique_reply_rank is None or exec_all_ranks) else [unique_reply_rank]
        rpc_id = f"rpc-{next(self._ids)}"
        with self._lock:
            self._rpc_barrier += 1
            try:
                while self._running or any(v is not None for v in self._busy.values()):
                    self._ensure_alive()
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"RPC call to {method} timed out waiting for running requests.")
                    self._lock.wait(timeout=0.5 if left is None else min(0.5, left))
                self._rpc_replies[rpc_id] = {}
                for r in ranks:
                    self._busy[r] = rpc_id
                    self._post(r, protocol.CallRpc(rpc_id, method, args, kwargs or {}))
                while len(self._rpc_replies[rpc_id]) < len(ranks):
                    self._ensure_alive()
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"RPC call to {method} timed out.")
                    self._lock.wait(timeout=0.5 if left is None else min(0.5, left))
                replies = self._rpc_replies.pop(rpc_id)
            finally:
                self._rpc_barrier -= 1
                self._dispatch_locked()
        failed = {r: v for r, (ok, v) in replies.items() if not ok}
        if failed:
            raise RuntimeError(f"RPC '{method}' failed on worker rank(s): {failed}")
        if unique_reply_rank is not None:
            return replies[unique_reply_rank][1]
        return [replies[r][1] for r in ranks]

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._pending) + list(self._running.values())
            self._pending.clear()
            self._running.clear()
        for job in jobs:
            self._resolve(job, DiffusionOutput(error="omni-ext TunedExecutor shut down"))
        for rank in range(self.world):
            with contextlib.suppress(Exception):
                self._post(rank, protocol.Shutdown())
        deadline = time.monotonic() + 10
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill_workers()
        # The workers are gone: each reader reads what is still in its pipe (freeing the shared
        # memory of any last output) and stops at end of file; only then are the pipes closed.
        for reader in getattr(self, "_threads", [])[: self.world]:
            if reader is not threading.current_thread():
                reader.join(max(0.5, deadline + 5 - time.monotonic()))
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.close()

    # ------------------------------------------------------------------ jobs
    def _submit(self, request_id: str, req: Any) -> _Job:
        sp = getattr(req, "sampling_params", None)
        cfg = not self._tuned_model or families.needs_cfg(self.model_arch, getattr(req, "prompt", None), sp)
        # Warm every worker with vLLM-Omni's start-up request (tuned models: it runs CFG-free).
        warm_up = request_id.startswith(DUMMY_REQUEST_PREFIX)
        mode = JobMode.for_request(needs_cfg=cfg, group_size=self.cfg_size, warm_up=warm_up and self._tuned_model)
        seq = next(self._ids)
        arrival = time.monotonic() - request_waited_s(sp)  # a job bound by the head waited there first
        shape, steps = cost.request_shape(self.model_arch, sp, cfg)
        job = _Job(
            job_id=f"omx-{seq}",
            seq=seq,
            request_id=request_id,
            req=req,
            needs=JobNeeds(mode, families.cost_units(self.model_arch, sp, cfg), arrival=arrival),
            ticket=Ticket(f"omx-{seq}", WARM_UP_PRIORITY if warm_up else request_priority(request_id, sp), arrival=arrival),
            shape=shape,
            steps=steps,
        )
        if job.all_ranks and self.device_type == "cpu":
            job.req = self._small_warmup(req)
        with self._lock:
            self._ensure_alive()
            self._outputs[job.job_id] = job
            self._pending.append(job)
            self._dispatch_locked()
            if job in self._pending and self.sched.settle_s > 0:
                self._dispatch_after(self.sched.settle_s)  # a settle hold (placement rule 5) ends then
            if job in self._pending:
                logger.info(
                    "omni-ext: queued request %s (priority %d, %d waiting)",
                    request_id, job.ticket.priority, len(self._pending),
                )
        return job

    def _cost_key(self, job: _Job, mode: JobMode) -> str:
        """Measurements are kept per shape class AND per mode the ranks ran it in: a CFG job on a
        pair takes well under the time of the same job on one rank (half at best)."""
        return f"{job.shape}:{mode.rank_mode.value}"

    def _predicted_s(self, job: _Job) -> float | None:
        """Predicted seconds of a queued job. One that may run on a pair or on one rank (cfg_mode
        "adaptive") is predicted as on one rank when that was measured: an upper bound, and the mode
        it runs in whenever others wait, which is when the prediction matters."""
        if job.needs.mode is JobMode.PAIR and self.cfg_mode != CfgMode.PAIR:
            modes = (JobMode.SINGLE, JobMode.PAIR) if self.cfg_mode == CfgMode.ADAPTIVE else (JobMode.SINGLE,)
        else:
            modes = (job.needs.mode,)
        known = [key for key in (self._cost_key(job, m) for m in modes) if key in self.costs.by_shape]
        return self.costs.predict_s(known[0] if known else None, job.needs.units)

    def _ordered_pending(self) -> list[_Job]:
        """The queue in the scheduler's order (:func:`omni_ext.scheduler.order.sort_key`), each ticket's
        cost refreshed from the cost model, so that all share one measure: predicted seconds once the
        server knows any rate (measured or seeded), else cost units."""
        now = time.monotonic()
        for job in self._pending:
            job.ticket.price(self._predicted_s(job), job.needs.units)
        return sorted(self._pending, key=lambda j: sort_key(j.ticket, now, self.sched))

    @staticmethod
    def _small_warmup(req: Any) -> Any:
        """vLLM-Omni warms up at 512x512; on a CPU host every worker would spend a minute on it.
        There the warm-up runs at ``OMNI_EXT_CPU_WARMUP_SIZE`` (default 64) pixels a side."""
        import copy

        side = int(os.environ.get("OMNI_EXT_CPU_WARMUP_SIZE", "64"))
        req = copy.copy(req)
        req.sampling_params = copy.deepcopy(req.sampling_params)
        sp = req.sampling_params
        sp.height = min(sp.height or side, side)
        sp.width = min(sp.width or side, side)
        return req

    def _free_ranks(self) -> list[int]:
        return [r for r, v in self._busy.items() if v is None]

    def _dispatch_after(self, seconds: float) -> None:
        def again() -> None:
            with self._lock:
                self._dispatch_locked()

        timer = threading.Timer(seconds + 0.001, again)
        timer.daemon = True
        timer.start()

    def _dispatch_locked(self) -> None:
        """Start what the order and placement rules allow now (under the lock; nothing while an RPC waits)."""
        if self._failed or self._closed or not self._pending:
            return
        starts = placement.next_placements(
            self._ordered_pending(), self._free_ranks(), self.layout, hold=bool(self._rpc_barrier),
            cfg_mode=self.cfg_mode, now=time.monotonic(), settle_s=self.sched.settle_s,
        )
        for start in starts:
            self._pending.remove(start.job)
            self._start_locked(start.job, start.ranks, start.mode)

    def _start_locked(self, job: _Job, ranks: tuple[int, ...], mode: JobMode) -> None:
        job.ranks, job.mode = ranks, mode
        job.started = time.monotonic()
        key = self._cost_key(job, mode)
        predicted = None if job.warm_up else self.costs.predict_s(key, job.needs.units)
        # The warm-up pays first-call costs (compilation): only a fixed limit applies to it.
        limit = cost.job_time_limit_s(job.needs.units, None if job.warm_up else self.costs.rate(key))
        if not job.warm_up:
            # Tell the API process the job runs now. Before the ranks get it, so that the lead
            # rank's step reports (same file) always come after this.
            progress.mark_started([job.request_id], job.steps, mode.value)
        job.deadline = None if limit is None else job.started + limit
        self._running[job.job_id] = job
        for r in ranks:
            self._busy[r] = job.job_id
        for r in ranks:
            try:
                self._post(r, protocol.RunJob(job.job_id, job.req, mode, self.cfg_size, job.seq))
            except Exception as exc:  # a dead pipe: the monitor reports the death
                logger.error("omni-ext: could not send request %s to worker %d: %s", job.request_id, r, exc)
        logger.info(
            "omni-ext: start request %s on rank(s) %s (%s), waited %.2f s%s%s%s",
            job.request_id, list(ranks), "warm-up" if job.all_ranks else mode.value, job.started - job.ticket.arrival,
            "" if job.warm_up else f", priority {job.ticket.priority}",
            f", predicted {predicted:.1f} s" if predicted is not None else "",
            f", time limit {limit:.0f} s" if limit is not None else "",
        )

    def _post(self, rank: int, msg: protocol.Message) -> None:
        with self._send_locks[rank]:
            protocol.send(self._conns[rank], msg)

    def _resolve(self, job: _Job, out: DiffusionOutput) -> None:
        if not job.future.done():
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                job.future.set_result(out)

    def _on_done(self, rank: int, done: protocol.JobDone) -> None:
        job_id, out, owner = done.job_id, done.out, done.owner
        with self._lock:
            if self._busy.get(rank) == job_id:
                self._busy[rank] = None
            job = self._running.get(job_id)
            if job is None:
                self._dispatch_locked()
                self._lock.notify_all()
                return
            job.answered.add(rank)
            job.longest_s = max(job.longest_s, done.seconds)
            is_error = isinstance(out, DiffusionOutput) and bool(getattr(out, "error", None))
            if job.all_ranks:
                if rank == job.ranks[0] or is_error:
                    job.first_out = out  # the warm-up answers once every rank is done
            elif ((owner and out is not None) or is_error) and not job.dropped:
                self._resolve(job, out)  # answer now, even if the partner rank is still finishing
            if len(job.answered) == len(job.ranks):
                del self._running[job_id]
                logger.info(
                    "omni-ext: done request %s on rank(s) %s in %.2f s%s",
                    job.request_id, list(job.ranks), job.longest_s, " (error)" if is_error else "",
                )
                if job.all_ranks:
                    self._resolve(job, job.first_out if job.first_out is not None else out)
                elif job.dropped:
                    self._resolve(job, DiffusionOutput(aborted=True, abort_message=f"Request {job.request_id} aborted."))
                elif not job.future.done():
                    self._resolve(job, DiffusionOutput(error=f"omni-ext: no rank returned an output for {job.request_id}"))
                # Learn from complete runs only (a warm-up is resized and pays first-call costs; a
                # cancelled job stopped early), in the mode the job really ran in.
                if not is_error and not job.warm_up and not job.dropped:
                    self.costs.observe(self._cost_key(job, job.mode), job.needs.units, job.longest_s)
            self._dispatch_locked()
            self._lock.notify_all()

    # ------------------------------------------------------------------ threads
    def _reader(self, rank: int) -> None:
        conn = self._conns[rank]
        while True:
            try:
                msg = protocol.recv(conn)
            except (EOFError, OSError):
                return
            except Exception:
                logger.exception("omni-ext: bad message from worker %d", rank)
                continue
            if isinstance(msg, protocol.JobDone):
                self._on_done(rank, self._received(rank, msg))
            elif isinstance(msg, protocol.RpcResult):
                self._on_rpc_result(rank, msg)

    @staticmethod
    def _received(rank: int, done: protocol.JobDone) -> protocol.JobDone:
        """The output of a job as host tensors: copied out of the shared memory the worker put it in
        (:mod:`omni_ext.executor.protocol`), and the segments unlinked, here in this rank's reader
        thread (not under the executor's lock) and for every answer, also one that ``_on_done`` will
        discard (a cancelled job, a shut-down executor), so that nothing is left in ``/dev/shm``."""
        try:
            protocol.output_from_shared_memory(done.out)
        except Exception as exc:
            logger.exception("omni-ext: the output of %s from worker %d could not be read", done.job_id, rank)
            out = DiffusionOutput(error=f"omni-ext: the output from worker {rank} could not be read: {exc}")
            return protocol.JobDone(done.job_id, rank, out, True, done.seconds)
        return done

    def _on_rpc_result(self, rank: int, reply: protocol.RpcResult) -> None:
        with self._lock:
            if self._busy.get(rank) == reply.rpc_id:
                self._busy[rank] = None
            if reply.rpc_id in self._rpc_replies:
                self._rpc_replies[reply.rpc_id][rank] = (reply.ok, reply.result)
            self._lock.notify_all()

    def _monitor(self) -> None:
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        try:
            ready = multiprocessing.connection.wait(list(sentinels))
        except OSError:
            return
        if self._closed:
            return
        self._on_worker_death([sentinels[s] for s in ready])

    def _watchdog(self) -> None:
        while not (self._closed or self._failed):
            time.sleep(1.0)
            now = time.monotonic()
            with self._lock:
                late = [j for j in self._running.values() if j.deadline is not None and now > j.deadline]
            if late:
                job = late[0]
                self._fail(
                    f"omni-ext: request {job.request_id} exceeded its time limit of "
                    f"{job.deadline - job.started:.0f} s (about 10x its expected cost) on worker(s) {list(job.ranks)}; "
                    "the worker group is stopped (set OMNI_EXT_JOB_TIMEOUT_FACTOR or OMNI_EXT_JOB_TIMEOUT_S to change)",
                    culprit=job,
                )

    def _on_worker_death(self, ranks: list[int]) -> None:
        details = []
        for r in ranks:
            p = self._procs[r]
            p.join(1.0)  # its sentinel fired: reap it so that the exit code/signal is known
            code = p.exitcode
            if code is not None and code < 0:
                try:
                    how = signal.Signals(-code).name
                except ValueError:
                    how = f"signal {-code}"
            else:
                how = f"exit code {code}"
            details.append(f"{p.name} (rank {r}, pid {p.pid}) died with {how}")
        with self._lock:
            victims = [j for j in self._running.values() if set(j.ranks) & set(ranks)]
        what = "; ".join(details)
        culprit = victims[0] if victims else None
        self._fail(
            f"omni-ext: diffusion worker {what}"
            + (f" while running request {culprit.request_id}" if culprit else "")
            + "; the executor is stopped and /health reports unhealthy",
            culprit=culprit,
        )

    def _fail(self, reason: str, culprit: _Job | None = None) -> None:
        with self._lock:
            if self._failed or self._closed:
                return
            self._failed = True
            self._failure = reason
            jobs = list(self._running.values()) + list(self._pending)
            self._running.clear()
            self._pending.clear()
            self._lock.notify_all()
        logger.error("%s", reason)
        for job in jobs:
            msg = reason if job is culprit else f"{reason} (request {job.request_id} was queued or running)"
            self._resolve(job, DiffusionOutput(error=msg))
        self._kill_workers()
        for cb in self._callbacks:
            try:
                cb()
            except Exception:
                logger.exception("failure callback raised")

    def _kill_workers(self) -> None:
        for action, grace in (("terminate", 5.0), ("kill", 5.0)):
            alive = [p for p in getattr(self, "_procs", []) if p.is_alive()]
            if not alive:
                return
            for p in alive:
                with contextlib.suppress(Exception):
                    getattr(p, action)()
            deadline = time.monotonic() + grace
            for p in alive:
                p.join(max(0.0, deadline - time.monotonic()))
