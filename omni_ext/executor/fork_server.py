"""Imported by the TunedExecutor's fork server (one of :data:`omni_ext.executor.start.PRELOAD`): the fork
server ignores SIGTERM, as CPython's already ignores SIGINT ("protect the process from ^C").

A stop signal for the whole server (`kill -- -PGID`, a supervisor that signals every process) reaches
the fork server too. Killed by it, the fork server takes with it what the executor knows of its workers:
their exit status comes through the fork server, so the executor reads every live worker as dead (exit
code 255) and fails the running job that the API process is draining (:mod:`omni_ext.api.drain`). The
fork server still ends with the executor, when the pipe that keeps it alive closes. Importing this
module anywhere else changes nothing.
"""

from __future__ import annotations

import inspect
import signal


def _in_fork_server() -> bool:
    """Whether this import runs inside ``multiprocessing.forkserver.main`` (its preload)."""
    return any(f.function == "main" and f.filename.replace("\\", "/").endswith("multiprocessing/forkserver.py")
               for f in inspect.stack(context=0))


if _in_fork_server():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
