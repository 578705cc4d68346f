"""The tuned executor's worker process: vLLM-Omni's own DiffusionWorker, driven over a pipe.

Each process builds ``current_omni_platform.get_diffusion_worker_cls()`` through vLLM-Omni's
``WorkerWrapperBase`` (device, torch.distributed world, CFG/DP groups, model load: all stock), after
registering the tuned pipeline classes in this process only. It then serves the executor's
messages (:mod:`omni_ext.executor.protocol`) one at a time: a :class:`~protocol.RunJob` is answered
with a :class:`~protocol.JobDone`, a :class:`~protocol.CallRpc` with a :class:`~protocol.RpcResult`,
and :class:`~protocol.Shutdown` ends the loop.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from typing import Any

from omni_ext.executor import protocol
from omni_ext.executor.role import NO_JOB, ROLE, set_role
from omni_ext.scheduler.placement import JobMode

logger = logging.getLogger("omni_ext.executor")


def worker_main(rank: int, od_config, conn, cancel_slots=None) -> None:
    shutdown = False

    def on_signal(signum, frame):
        nonlocal shutdown
        if not shutdown:
            shutdown = True
            raise SystemExit(128 + signum)

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
            gpu_id=rank,
            od_config=od_config,
            base_worker_class=resolve_obj_by_qualname(current_omni_platform.get_diffusion_worker_cls()),
            worker_extension_cls=od_config.worker_extension_cls,
            custom_pipeline_args=getattr(od_config, "custom_pipeline_args", None),
        )
    except BaseException as exc:
        protocol.send(conn, protocol.StartFailed(rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    protocol.send(conn, protocol.Ready(rank, os.getpid()))
    try:
        while True:
            msg = protocol.recv(conn)
            if isinstance(msg, protocol.Shutdown):
                break
            if isinstance(msg, protocol.RunJob):
                protocol.send(conn, _run_job(worker, od_config, rank, msg))
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


def _run_job(worker: Any, od_config: Any, rank: int, job: protocol.RunJob) -> protocol.JobDone:
    """Run one request in the role the executor gave this rank; an exception becomes an error output."""
    from vllm_omni.diffusion.data import DiffusionOutput

    pair = job.mode == JobMode.PAIR
    set_role(job.mode, cfg_rank=rank % job.cfg_size if pair else 0, cfg_size=job.cfg_size, seq=job.seq)
    t0 = time.perf_counter()
    try:
        out = worker.execute_model(job.req, od_config)
    except Exception as exc:
        logger.exception("omni-ext worker %d: request %s failed", rank, getattr(job.req, "request_id", job.job_id))
        out = DiffusionOutput(error=f"{type(exc).__name__}: {exc}")
        ROLE.owner = True  # report the error from every rank that saw it
    owner = ROLE.owner if pair else True
    set_role(NO_JOB)
    return protocol.JobDone(job.job_id, rank, out if owner else None, owner, time.perf_counter() - t0)


def _call(conn: Any, worker: Any, rank: int, call: protocol.CallRpc) -> None:
    """Call one worker method and answer; an exception (also one sending the result) is answered
    as a failed call."""
    try:
        result = worker.execute_method(call.method, *call.args, **(call.kwargs or {}))
        protocol.send(conn, protocol.RpcResult(call.rpc_id, rank, True, result))
    except Exception as exc:
        logger.exception("omni-ext worker %d: rpc %s failed", rank, call.method)
        protocol.send(conn, protocol.RpcResult(call.rpc_id, rank, False, f"{type(exc).__name__}: {exc}"))
