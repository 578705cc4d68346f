"""The tuned executor's worker process: vLLM-Omni's own DiffusionWorker, driven over a pipe.

Each process builds ``current_omni_platform.get_diffusion_worker_cls()`` through vLLM-Omni's
``WorkerWrapperBase`` (device, torch.distributed world, CFG/DP groups, model load: all stock), after
registering the tuned pipeline classes in this process only. It then serves messages from the
executor, one at a time:

- ``("job", job_id, request, mode, cfg_size, seq)``: run one request (``mode`` "pair" or "single",
  see :mod:`omni_ext.executor.role`; ``seq`` is what the executor writes into this rank's
  ``cancel_slots`` entry to stop it) and answer ``("done", job_id, rank, output_or_None, owner, seconds)``;
- ``("rpc", rpc_id, method, args, kwargs)``: call a worker method, answer ``("rpc", rpc_id, rank, ok, result)``;
- ``("shutdown",)``.

Messages are pickled with the standard pickler (``send_bytes``): tensors travel by value, never as
torch shared-memory handles that die with the sender.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time
import traceback
from typing import Any

logger = logging.getLogger("omni_ext.executor")


def _send(conn, obj: Any) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


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
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.worker.diffusion_worker import WorkerWrapperBase
    from vllm_omni.platforms import current_omni_platform
    from vllm_omni.plugins import load_omni_general_plugins

    from omni_ext.executor.pipelines import register_tuned_pipelines
    from omni_ext.executor.role import ROLE, set_role

    ROLE.rank, ROLE.cancel_slots = rank, cancel_slots

    from omni_ext.patches import apply_patches

    load_omni_general_plugins()
    apply_patches(roles={"tuned-worker"})  # e.g. tuned-worker-skip-empty-kv-receive (registry)
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
        _send(conn, ("failed", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    _send(conn, ("ready", rank, os.getpid()))
    try:
        while True:
            msg = pickle.loads(conn.recv_bytes())
            kind = msg[0]
            if kind == "shutdown":
                break
            if kind == "job":
                _, job_id, req, mode, cfg_size, seq = msg
                set_role(mode, cfg_rank=rank % cfg_size if mode == "pair" else 0, cfg_size=cfg_size, seq=seq)
                t0 = time.perf_counter()
                try:
                    out = worker.execute_model(req, od_config)
                except Exception as exc:
                    logger.exception("omni-ext worker %d: request %s failed", rank, getattr(req, "request_id", job_id))
                    out = DiffusionOutput(error=f"{type(exc).__name__}: {exc}")
                    ROLE.owner = True  # report the error from every rank that saw it
                owner = ROLE.owner if mode == "pair" else True
                set_role("none")
                _send(conn, ("done", job_id, rank, out if owner else None, owner, time.perf_counter() - t0))
            elif kind == "rpc":
                _, rpc_id, method, args, kwargs = msg
                try:
                    result = worker.execute_method(method, *args, **(kwargs or {}))
                    _send(conn, ("rpc", rpc_id, rank, True, result))
                except Exception as exc:
                    logger.exception("omni-ext worker %d: rpc %s failed", rank, method)
                    _send(conn, ("rpc", rpc_id, rank, False, f"{type(exc).__name__}: {exc}"))
    except (EOFError, OSError):
        pass  # the executor went away
    except SystemExit:
        pass
    finally:
        try:
            worker.shutdown()
        except Exception as exc:  # pragma: no cover
            logger.warning("omni-ext worker %d: shutdown error: %s", rank, exc)
