"""How the TunedExecutor starts its worker processes: ``spawn`` or a preloaded ``forkserver``.

A spawned worker imports torch and vLLM-Omni's diffusion stack from scratch: about 10 s of one core
per rank on a CPU host, paid again by every rank of every server (a 4-rank server spends ~40 core
seconds importing before it loads a weight). With ``forkserver`` one helper process imports them once
and every worker forks from it, copy-on-write: a worker starts with the modules loaded and shares
their pages with its siblings.

The default is ``forkserver`` on the CPU platform and ``spawn`` (vLLM-Omni's own choice) on a device:
there the device runtime (torch_npu, CUDA) is imported with the stack, and whether a child forked
after that import may initialise the device is not something this project has run on a card.
``--additional-config '{"omni_ext": {"worker_start": "spawn"}}'`` chooses explicitly.

A forked worker inherits the fork server's environment, not the executor's at the time of the fork,
so the executor hands each worker its environment (:func:`worker_environ`) and the worker applies it
first (:func:`apply_environ`); the thread count, the one setting read when torch loads, is set again
per worker by the CPU platform (:func:`omni_ext.platform.threads.apply_worker_threads`).
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

METHODS = ("spawn", "forkserver")
#: What the fork server imports before the first worker forks: what every worker imports first.
PRELOAD = ("torch", "vllm_omni.diffusion.worker.diffusion_worker", "omni_ext.executor.worker",
           "omni_ext.executor.fork_server")  # the last: the fork server outlives a stop signal for the group


def start_method(section: dict[str, Any], device_type: str) -> str:
    """The start method from the ``omni_ext`` section of ``additional_config``, or the default for
    ``device_type``; a ``ValueError`` naming the choices for anything else."""
    value = section.get("worker_start")
    if value is None:
        return "forkserver" if device_type == "cpu" else "spawn"
    if value not in METHODS:
        raise ValueError(f"omni_ext.worker_start must be one of {list(METHODS)}, got {value!r}")
    return value


def worker_context(method: str):
    """The ``multiprocessing`` context for ``method``; for ``forkserver``, its server is started now,
    in the caller's environment, with :data:`PRELOAD` imported (one server per process: a second
    executor in the same process, e.g. a second replica, forks from the same one)."""
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        from multiprocessing import forkserver

        ctx.set_forkserver_preload(list(PRELOAD))
        forkserver.ensure_running()
    return ctx


#: The executor's process id, in its workers' environment (:func:`omni_ext.executor.worker.worker_main`).
EXECUTOR_PID = "OMNI_EXT_EXECUTOR_PID"


def worker_environ() -> dict[str, str]:
    """The environment a worker started now should have (the executor's, as a spawn would pass it, and the
    executor's pid: a worker outlives a stop signal only while its executor lives)."""
    return {**os.environ, EXECUTOR_PID: str(os.getpid())}


def apply_environ(env: dict[str, str] | None) -> None:
    """Make this process's environment ``env`` (in a forked worker, before anything reads it)."""
    if env is None:
        return
    try:  # setproctitle finds the title's room next to the C environment: before that moves
        import setproctitle

        setproctitle.getproctitle()
    except ImportError:  # pragma: no cover - vLLM names its workers only when it is installed
        pass
    for key in set(os.environ) - set(env):
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
