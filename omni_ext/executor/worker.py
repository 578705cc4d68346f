"""The tuned executor's worker process: vLLM-Omni's own DiffusionWorker, driven over a pipe.

Each process builds ``current_omni_platform.get_diffusion_worker_cls()`` through vLLM-Omni's
``WorkerWrapperBase`` (device, torch.distributed world, CFG/DP groups, model load: all stock), after
registering the tuned pipeline classes in this process only. It then serves the executor's
messages (:mod:`omni_ext.executor.protocol`) one at a time: a :class:`~protocol.RunJob` is answered
with a :class:`~protocol.JobDone`, a :class:`~protocol.CallRpc` with a :class:`~protocol.RpcResult`,
and :class:`~protocol.Shutdown` ends the loop.

A job's output leaves the worker as host memory in POSIX shared memory
(:func:`~protocol.output_to_shared_memory`), never as a pickled tensor; its ``peak_memory_mb`` is this
rank's own peak during the job (:func:`_run_job`).

Each job runs in a thread of its own (:class:`JobThread`), while the loop waits for it to settle:
done (answered with :class:`~protocol.JobDone`) or paused at a step boundary (step-level
preemption: answered with :class:`~protocol.Paused`; the loop then serves the next message, e.g.
another job). A paused job's thread keeps its frames (latents, step, generator) and waits; what the
next job would clobber is saved and restored around the pause (:mod:`omni_ext.executor.suspend`). A
:class:`~protocol.ResumeJob` releases it (or, ``drop``, lets it unwind as cancelled, which frees its
memory) and the loop waits for it again. One job thread runs at a time; a paused one only waits.

A paused job that is cancelled therefore unwinds only once the job running on its rank is done: the
loop reads its ``ResumeJob(drop=True)`` then. Unwinding earlier would run vLLM-Omni's exit paths
(the forward context, the job role) in the middle of the running job, whose state they would reset.
Nothing waits for that memory meanwhile: the running job started beside it, and the drop reaches the
pipe ahead of any later job on that rank, so it is freed before the next job starts there.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
import traceback
from typing import Any

from omni_ext.executor import protocol
from omni_ext.executor.role import NO_JOB, ROLE, answers_output, set_role
from omni_ext.scheduler.placement import JobMode, Units

logger = logging.getLogger("omni_ext.executor")

#: A worker stopped by SIGTERM or SIGINT exits with this plus the signal's number (a shell's convention).
STOPPED_BASE = 128


def worker_main(rank: int, od_config, conn, cancel_slots=None, environ: dict[str, str] | None = None,
                world_rank: int | None = None) -> None:
    """Worker process ``rank`` of the executor: its place in its group's torch.distributed world is
    ``world_rank`` (vLLM-Omni's rank and device index there; default ``rank``), while ``rank`` names it
    to the executor (its pipe, its cells of the cancel board, its logs)."""
    from omni_ext.executor.start import EXECUTOR_PID, apply_environ
    from omni_ext.progress import pid_alive

    apply_environ(environ)  # a forked worker: the executor's environment, not its fork server's
    shutdown = False
    stop_code = 0

    executor = int(os.environ.get(EXECUTOR_PID, "0") or 0)

    def on_signal(signum, frame):
        # A stop signal for the whole server (`kill -- -PGID`, a terminal's Ctrl-C, a supervisor that signals
        # every process, or the death signal of a fork server that got it) while the executor lives: the
        # API process drains (running jobs finish, omni_ext.api.drain) and then stops this worker through
        # the executor. Dying now would take the running job with it.
        nonlocal shutdown, stop_code
        if executor and pid_alive(executor):
            logger.info("omni-ext worker %d: %s ignored while the executor (pid %d) lives: it stops this worker",
                        rank, signal.Signals(signum).name, executor)
            return
        if not shutdown:
            shutdown, stop_code = True, STOPPED_BASE + signum
            raise SystemExit(stop_code)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: stacks to the log
    from vllm_omni.engine.stage_init_utils import set_death_signal

    set_death_signal(signal.SIGTERM)  # die with the engine process

    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm_omni.diffusion.worker.diffusion_worker import WorkerWrapperBase
    from vllm_omni.platforms import current_omni_platform
    from vllm_omni.plugins import load_omni_general_plugins

    from omni_ext.executor.pipelines import register_tuned_pipelines

    # Before the plugins load: omni-ext's activation then applies the patches of the
    # "tuned-worker" role in this process (e.g. tuned-worker-skip-empty-kv-receive).
    ROLE.rank, ROLE.cancel_slots, ROLE.tuned_worker = rank, cancel_slots, True
    load_omni_general_plugins()
    register_tuned_pipelines()
    try:
        worker = WorkerWrapperBase(
            gpu_id=rank if world_rank is None else world_rank,
            od_config=od_config,
            base_worker_class=resolve_obj_by_qualname(current_omni_platform.get_diffusion_worker_cls()),
            worker_extension_cls=od_config.worker_extension_cls,
            custom_pipeline_args=getattr(od_config, "custom_pipeline_args", None),
        )
    except BaseException as exc:
        protocol.send(conn, protocol.StartFailed(rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    from omni_ext.platform.memory import keep_freed_heap

    # Jobs run in threads of their own (JobThread), on arenas glibc would trim. Only after the load:
    # kept from the start, what loading freed stayed too (+1.4 GiB per worker of the 1.3B transformer).
    keep_freed_heap()
    protocol.send(conn, protocol.Ready(rank, os.getpid()))
    paused: dict[str, JobThread] = {}
    try:
        while True:
            msg = protocol.recv(conn)
            if isinstance(msg, protocol.Shutdown):
                break
            if isinstance(msg, protocol.RunJob):
                job = JobThread(worker, od_config, rank, msg)
                job.start()
                _follow(conn, job, paused)
            elif isinstance(msg, protocol.ResumeJob):
                job = paused.pop(msg.job_id, None)
                if job is None:
                    logger.warning("omni-ext worker %d: no paused job %s to resume", rank, msg.job_id)
                    continue
                job.resume(drop=msg.drop)
                _follow(conn, job, paused)
            elif isinstance(msg, protocol.CallRpc):
                _call(conn, worker, rank, msg)
    except (EOFError, OSError):
        pass  # the executor went away
    except SystemExit:
        pass
    finally:
        try:
            worker.shutdown()
        except Exception as exc:  # pragma: no cover
            logger.warning("omni-ext worker %d: shutdown error: %s", rank, exc)
        if shutdown:  # stopped by SIGTERM/SIGINT: say so in the exit status
            os._exit(stop_code)


class JobThread(threading.Thread):
    """One job on this worker, in its own thread, so that it can pause at a step boundary while
    the worker runs another (module docstring). States: ``running`` -> ``paused`` (blocked in
    :meth:`pause`, the role's ``pause_hook``) -> ``running`` ... -> ``done``."""

    def __init__(self, worker: Any, od_config: Any, rank: int, job: protocol.RunJob) -> None:
        super().__init__(name=f"omni-ext-job-{job.job_id}", daemon=True)
        self.worker, self.od_config, self.rank, self.job = worker, od_config, rank, job
        self.state = "running"
        self.cv = threading.Condition()
        self.drop = False
        self.paused_s = 0.0  # seconds spent paused, not counted as the job's time
        self.step = 0  # the step boundary it paused at (ROLE.step)
        self.done: protocol.JobDone | None = None

    @property
    def job_id(self) -> str:
        return self.job.job_id

    def run(self) -> None:
        from omni_ext.executor import suspend

        try:
            suspend.bind_device(_device(self.worker))
            self.done = _run_job(self.worker, self.od_config, self.rank, self.job, thread=self)
        except BaseException as exc:  # never leave the loop waiting
            from vllm_omni.diffusion.data import DiffusionOutput

            logger.exception("omni-ext worker %d: job %s failed", self.rank, self.job_id)
            self.done = protocol.JobDone(self.job_id, self.rank, DiffusionOutput(error=f"{type(exc).__name__}: {exc}"),
                                         True, 0.0)
        finally:
            with self.cv:
                self.state = "done"
                self.cv.notify_all()

    def pause(self) -> None:
        """In the job's thread, at the agreed pause step: save what another job would clobber, report
        paused, wait; then restore it, or unwind as cancelled when dropped."""
        from omni_ext.executor import suspend
        from omni_ext.executor.role import ROLE, aborted

        pipeline, device = _pipeline(self.worker), _device(self.worker)
        snap = suspend.save(pipeline, device)
        self.step = ROLE.step - 1
        t0 = time.perf_counter()
        with self.cv:
            self.state = "paused"
            self.cv.notify_all()
            while self.state == "paused":
                self.cv.wait()
        self.paused_s += time.perf_counter() - t0
        suspend.bind_device(device)
        suspend.restore(snap, pipeline, device)
        if self.drop:
            logger.info("omni-ext worker %d: job %s was cancelled while paused; it unwinds without resuming",
                        self.rank, self.job_id)
            raise aborted("Request cancelled while paused")

    def resume(self, drop: bool = False) -> None:
        with self.cv:
            self.drop = drop
            self.state = "running"
            self.cv.notify_all()

    def settle(self) -> str:
        """Wait until the job is done or paused; which one (in the loop's thread)."""
        with self.cv:
            while self.state == "running":
                self.cv.wait(1.0)
            return self.state


def _follow(conn: Any, job: JobThread, paused: dict[str, JobThread]) -> None:
    """Wait for ``job`` to settle and answer: Paused (kept in ``paused``) or its JobDone."""
    if job.settle() == "paused":
        paused[job.job_id] = job
        protocol.send(conn, protocol.Paused(job.job_id, job.rank, job.step))
        return
    job.join()
    done = job.done
    if job.drop:  # a paused job cancelled instead of resumed: its frames are gone, give the memory back
        job.done = None
        gc.collect()
        _empty_cache()
    _answer_job(conn, done)


def _pipeline(worker: Any) -> Any:
    runner = getattr(getattr(worker, "worker", None), "model_runner", None)
    return getattr(runner, "pipeline", None)


def _device(worker: Any) -> Any:
    return getattr(getattr(worker, "worker", None), "device", None)


def _empty_cache() -> None:
    from vllm_omni.platforms import current_omni_platform

    try:
        current_omni_platform.empty_cache()
    except Exception as exc:  # a platform without a caching allocator
        logger.debug("omni-ext: empty_cache: %s", exc)


def _run_job(worker: Any, od_config: Any, rank: int, job: protocol.RunJob, thread: JobThread | None = None) -> protocol.JobDone:
    """Run one request in the role the executor gave this rank; an exception becomes an error output.

    Peak memory: vLLM-Omni samples ``peak_memory_mb`` on global rank 0 only, so under this executor
    (where every rank runs jobs of its own) any other rank's job reported 0. Each rank resets the
    platform's peak counter before the job and reads it after (device memory on CUDA/NPU; on CPU the
    worker process's resident-set high-water mark, :mod:`omni_ext.platform.memory`).
    The owner's output then leaves as host memory in shared memory (:func:`_answer_job`). Its
    ``seconds`` leave out the time it spent paused (``thread``)."""
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.platforms import current_omni_platform

    pair = job.mode == JobMode.PAIR
    units = Units(job.unit_size)
    # The processes that run this job's collectives with this one: all of a pair's, a SINGLE job's unit.
    together = tuple(job.ranks) if pair else units.ranks_of(units.unit_of(rank))
    set_role(job.mode, cfg_rank=units.cfg_rank(rank, job.cfg_size) if pair else 0, cfg_size=job.cfg_size,
             seq=job.seq, ranks=together, sp_rank=units.sp_rank(rank))
    ROLE.pause_hook = thread.pause if thread is not None else None
    t0, began = time.perf_counter(), time.monotonic()
    _reset_peak(current_omni_platform)
    try:
        if isinstance(job.req, list):
            out = _run_batch(worker, job.req, od_config)
        else:
            out = worker.execute_model(job.req, od_config)
    except Exception as exc:
        logger.exception("omni-ext worker %d: request %s failed", rank, getattr(job.req, "request_id", job.job_id))
        out = DiffusionOutput(error=f"{type(exc).__name__}: {exc}")
        ROLE.owner, ROLE.sp_rank = True, 0  # report the error from every rank that saw it
    owner = answers_output() if pair else ROLE.sp_rank == 0
    set_role(NO_JOB)
    if owner:
        peak = _peak_mb(current_omni_platform)
        for one in out if isinstance(out, list) else [out]:
            if isinstance(one, DiffusionOutput):
                one.peak_memory_mb = max(float(one.peak_memory_mb or 0.0), peak)
    seconds = time.perf_counter() - t0 - (thread.paused_s if thread is not None else 0.0)
    return protocol.JobDone(job.job_id, rank, out if owner else None, owner, seconds, began, time.monotonic())


def _run_batch(worker: Any, reqs: list, od_config: Any) -> list:
    """One batched forward of several requests (request batching): vLLM-Omni's own request-batch
    path (``execute_model_batch``, the one its executor calls for a wave of ``--max-num-seqs``), so a
    batch computes what it computes under vLLM-Omni's executor. One output per request, in order."""
    from vllm_omni.diffusion.sched.interface import CachedRequestData, DiffusionSchedulerOutput, NewRequestData

    wave = DiffusionSchedulerOutput(
        step_id=0, scheduled_new_reqs=[NewRequestData(request_id=r.request_id, req=r) for r in reqs],
        scheduled_cached_reqs=CachedRequestData.make_empty(), finished_req_ids=set(),
        num_running_reqs=len(reqs), num_waiting_reqs=0,
    )
    result = worker.execute_model_batch(wave, od_config)
    outs = [ro.result for ro in result.runner_outputs]
    if len(outs) != len(reqs):
        raise RuntimeError(f"a batch of {len(reqs)} requests returned {len(outs)} outputs")
    return outs


def _reset_peak(platform: Any) -> None:
    try:
        platform.reset_peak_memory_stats()
    except Exception as exc:  # a platform without peak statistics: the figure stays what vLLM-Omni set
        logger.debug("omni-ext: reset_peak_memory_stats: %s", exc)


def _peak_mb(platform: Any) -> float:
    try:
        return platform.max_memory_reserved() / (1024**2)
    except Exception as exc:
        logger.debug("omni-ext: max_memory_reserved: %s", exc)
        return 0.0


def _answer_job(conn: Any, done: protocol.JobDone) -> None:
    """Send a job's answer, its output as host memory in shared memory. A failed move (or a result
    the protocol refuses) is answered as an error output; if the answer cannot be sent at all, the
    segments are unlinked here, so that nothing is left in ``/dev/shm``."""
    from vllm_omni.diffusion.data import DiffusionOutput

    try:
        protocol.output_to_shared_memory(done.out)  # on failure it has unlinked what it made
        data = protocol.encode(done)
    except Exception as exc:  # e.g. /dev/shm full, or a tensor outside the shared-memory fields
        logger.exception("omni-ext worker %d: the result of %s could not be returned", done.rank, done.job_id)
        protocol.output_from_shared_memory(done.out)
        error = DiffusionOutput(error=f"omni-ext: the result could not be returned: {type(exc).__name__}: {exc}")
    else:
        try:
            conn.send_bytes(data)
        except BaseException:  # the executor is gone (or this worker is being stopped)
            protocol.output_from_shared_memory(done.out)
            raise
        return
    protocol.send(conn, protocol.JobDone(done.job_id, done.rank, error, True, done.seconds, done.began, done.ended))


def _call(conn: Any, worker: Any, rank: int, call: protocol.CallRpc) -> None:
    """Call one worker method and answer; an exception (also one sending the result) is answered
    as a failed call."""
    try:
        result = worker.execute_method(call.method, *call.args, **(call.kwargs or {}))
        protocol.send(conn, protocol.RpcResult(call.rpc_id, rank, True, result))
    except Exception as exc:
        logger.exception("omni-ext worker %d: rpc %s failed", rank, call.method)
        protocol.send(conn, protocol.RpcResult(call.rpc_id, rank, False, f"{type(exc).__name__}: {exc}"))
