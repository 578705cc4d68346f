"""Every ``OMNI_EXT_*`` environment variable omni-ext reads, with its default and meaning, in one table.

The code reads a variable's default from here (:func:`value`), and the reference page
``docs/reference/environment.md`` is generated from the same rows (:mod:`omni_ext.reference`), whose
test also fails when the source names an ``OMNI_EXT_`` variable this table lacks. The
``OMNI_EXT_API_<KEY>`` overrides of ``omni_ext.api`` settings are not rows here: each is the ``env``
of its setting (:data:`omni_ext.api.settings.SETTINGS`).

Pure data: imported by the plugin's entry point, before anything heavy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None  # None: unset, the reader's behaviour without it is in ``meaning``
    meaning: str
    #: set by omni-ext for its own child processes: documented, not for operators to set
    internal: bool = False


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("OMNI_EXT_LOG_LEVEL", "INFO", "Level of omni-ext's own loggers (`DEBUG`, `INFO`, `WARNING`, ...)."),
    EnvVar("OMNI_EXT_DISABLE_PATCHES", "",
           "Comma-separated patch names (or `all`) that omni-ext does not apply: each restores vLLM-Omni's "
           "own behaviour (`omni-ext patches list` lists them)."),
    EnvVar("OMNI_EXT_CPU_PLATFORM", "auto",
           "omni-ext's CPU platform: `auto` activates it where no accelerator is found, `1` forces it on, "
           "`0` switches it off (`omni_ext/platform/detect.py`)."),
    EnvVar("OMNI_EXT_CPU_VISIBLE_DEVICES", None,
           "The CPU platform's `CUDA_VISIBLE_DEVICES`: the comma-separated \"devices\" (one rank each) a "
           "server may place ranks on; unset: the platform's device count. The TunedExecutor sets it per "
           "worker group."),
    EnvVar("OMNI_EXT_CPU_WARMUP_SIZE", "64",
           "Pixels a side of the TunedExecutor's warm-up request on a CPU host (vLLM-Omni warms up at 512)."),
    EnvVar("OMNI_EXT_WORKER_READY_TIMEOUT_S", "1800",
           "Seconds the TunedExecutor waits for a worker to load its model and report ready."),
    EnvVar("OMNI_EXT_JOB_TIMEOUT_S", None,
           "A fixed time limit in seconds for every job; unset: the limit is `OMNI_EXT_JOB_TIMEOUT_FACTOR` x "
           "the job's predicted time, at least `OMNI_EXT_JOB_TIMEOUT_MIN_S` (no limit before the first job "
           "is measured)."),
    EnvVar("OMNI_EXT_JOB_TIMEOUT_FACTOR", "10", "A job's time limit as a multiple of its predicted time."),
    EnvVar("OMNI_EXT_JOB_TIMEOUT_MIN_S", "120", "The smallest time limit of a job, in seconds."),
    EnvVar("OMNI_EXT_POLL_HOT_MS", "50",
           "`idle-poll-backoff`: milliseconds without an output after which the API process's output "
           "polls back off from 1 ms."),
    EnvVar("OMNI_EXT_POLL_IDLE_MS", "10",
           "`idle-poll-backoff`: the poll interval, in milliseconds, once backed off while requests are in "
           "flight (a diffusion result is answered at most this much later)."),
    EnvVar("OMNI_EXT_POLL_DEEP_IDLE_MS", "100",
           "`idle-poll-backoff`: the poll interval, in milliseconds, after a second with no request in flight."),
    EnvVar("OMNI_EXT_USER_OMP_NUM_THREADS", None,
           "The operator's own `OMP_NUM_THREADS` (empty: none), remembered by the first omni-ext process "
           "before vLLM exports its own, so that per-worker thread counts respect it.", internal=True),
    EnvVar("OMNI_EXT_HOST_WORKERS", None,
           "The worker processes of the whole server, in each TunedExecutor worker's environment: they share "
           "the host's cores.", internal=True),
    EnvVar("OMNI_EXT_PROGRESS_DIR", None,
           "The directory where workers record denoise-step progress for the API process to read.", internal=True),
    EnvVar("OMNI_EXT_EXECUTOR_PID", None,
           "The TunedExecutor's process id, in its workers' environment: a worker outlives a stop signal "
           "only while its executor lives.", internal=True),
)

BY_NAME: dict[str, EnvVar] = {v.name: v for v in ENV_VARS}


def value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """``name`` from ``environ`` (default: this process's), else its default from the table; a ``KeyError``
    for a name the table lacks, so that no variable is read without being documented."""
    env = os.environ if environ is None else environ
    return env.get(name, BY_NAME[name].default)
