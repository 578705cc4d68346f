"""Per-worker thread counts on a CPU host.

vLLM does not size thread pools for CPU diffusion workers, so every worker of a cfg-parallel server
would use every core and they would fight (2 workers x 2 threads on 2 cores runs slower than 1 thread
each). omni-ext splits the cores evenly across the workers of one server. An explicit
``OMP_NUM_THREADS`` from the operator always wins. vLLM's executor may itself export
``OMP_NUM_THREADS`` before spawning workers, so the operator's original value is remembered in
``OMNI_EXT_USER_OMP_NUM_THREADS`` by the first omni-ext process (the API server) and inherited.
"""

from __future__ import annotations

import os

USER_OMP_ENV = "OMNI_EXT_USER_OMP_NUM_THREADS"
#: The worker processes of the whole server, set by the TunedExecutor in its workers' environment: each
#: of its CFG groups is a torch.distributed world of its own, so a worker's ``WORLD_SIZE`` counts only
#: its group, while the cores are shared by all of them.
HOST_WORKERS_ENV = "OMNI_EXT_HOST_WORKERS"


def workers_on_host(environ: dict[str, str] | None = None) -> int:
    """The workers that share this host's cores: the executor's count, else this worker's world."""
    env = os.environ if environ is None else environ
    for key in (HOST_WORKERS_ENV, "WORLD_SIZE"):
        raw = (env.get(key) or "").strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return 1


def remember_user_omp(environ: dict[str, str] | None = None) -> None:
    """Record, once per process tree, whether the operator set OMP_NUM_THREADS themselves."""
    env = os.environ if environ is None else environ
    if USER_OMP_ENV not in env:
        env[USER_OMP_ENV] = env.get("OMP_NUM_THREADS", "")


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def threads_per_worker(world_size: int, cores: int | None = None, environ: dict[str, str] | None = None) -> int:
    """Threads one worker of a ``world_size``-worker server should use."""
    env = os.environ if environ is None else environ
    user = env.get(USER_OMP_ENV, env.get("OMP_NUM_THREADS", ""))
    if user.strip():
        try:
            return max(1, int(user))
        except ValueError:
            pass
    cores = usable_cores() if cores is None else cores
    return max(1, cores // max(1, world_size))


def apply_worker_threads(world_size: int) -> int:
    """Set torch's intra-op threads for this worker process; returns the count used."""
    import torch

    n = threads_per_worker(world_size)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)
    return n
