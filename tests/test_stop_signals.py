"""A stop signal for the whole server's process group leaves the TunedExecutor's fork server and workers
alive while their executor lives, so that the API process can drain (``omni_ext.api.drain``); the real
drain is ``tests/test_drills.py::test_restart_with_a_full_queue_loses_no_accepted_job``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# In a process of its own (a fork server is one per process): start a fork server with omni-ext's preload,
# signal it as `kill -- -PGID` would, and fork a child from it afterwards.
_SCRIPT = textwrap.dedent("""
    import multiprocessing, os, signal, sys, time
    from multiprocessing import forkserver
    preload = sys.argv[1:]
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    first = ctx.Process(target=time.sleep, args=(0.1,))
    first.start(); first.join(30)  # forked: the fork server has run its preload and serves
    pid = forkserver._forkserver._forkserver_pid
    os.kill(pid, signal.SIGTERM)
    time.sleep(1.0)
    with open(f"/proc/{pid}/stat") as f:  # a killed fork server is a zombie until its parent reaps it
        alive = f.read().rsplit(")", 1)[1].split()[0] != "Z"
    p = ctx.Process(target=time.sleep, args=(0.1,))
    p.start(); p.join(30)
    # the same fork server forked it (ensure_running replaces a dead one silently)
    ok = p.exitcode == 0 and forkserver._forkserver._forkserver_pid == pid
    print("ALIVE", alive, "CHILD", ok, flush=True)
""")


def _run(*preload: str) -> str:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, *preload], capture_output=True, text=True, timeout=120)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]


def test_the_fork_server_outlives_a_sigterm_for_the_group_and_still_forks() -> None:
    assert _run("os") == "ALIVE False CHILD False"  # CPython's fork server dies of it (it ignores SIGINT only)
    assert _run("omni_ext.executor.fork_server") == "ALIVE True CHILD True"


def test_importing_it_elsewhere_changes_nothing() -> None:
    out = subprocess.run([sys.executable, "-c", "import signal, omni_ext.executor.fork_server as f; "
                          "print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr
