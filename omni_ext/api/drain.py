"""A stop that loses no accepted job: drain on SIGTERM, and run the kept requests again at start.

On SIGTERM vLLM's ``serve_http`` stops the engine client (``engine_client.shutdown``, in a thread) and
only then the HTTP server. omni-ext puts its drain in front of that call (:func:`install`), so while it
runs the server still answers:

1. admission stops: every create answers 503 ``server_draining`` with Retry-After (never a 200 for a
   job that would then be lost; :func:`omni_ext.api.state.admitting_state`);
2. async video jobs that have not started are set aside: taken out of the engine, their records left
   ``queued`` and their requests kept on disk (:mod:`omni_ext.api.archive`);
3. running jobs (and synchronous requests) get ``omni_ext.api.drain_s`` (30 s) to finish;
4. those still running then fail with ``server_restarted``, and vLLM stops the engine.

At the next start (:func:`resume`), every job still queued with a kept request runs again under its id,
oldest first, re-read through the same checks; a queued job whose request was not kept (a store written
before this version) fails with ``server_restarted``, as does anything that was running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from omni_ext.api.state import ApiState

logger = logging.getLogger("omni_ext.api")

async def drain(state: ApiState, engine: Any) -> dict[str, int]:
    """Stop admitting, set queued jobs aside, let running ones finish within ``drain_s``; returns counts."""
    from omni_ext.api.videos import restart_failure

    state.draining = True
    t0 = time.monotonic()
    parked = [job_id for job_id in list(state.tasks) if not state.queue.running(job_id)]
    running = len(state.tasks) - len(parked)
    for job_id in parked:
        state.parked.add(job_id)
        state.tasks[job_id].cancel()
        with contextlib.suppress(Exception):
            await engine.abort(job_id)
    logger.warning("omni-ext: SIGTERM: admission stopped, %d queued job(s) kept for the next start, %d running "
                   "job(s) get %g s to finish (omni_ext.api.drain_s)", len(parked), running,
                   state.settings.drain_s)
    deadline = t0 + state.settings.drain_s
    while time.monotonic() < deadline:
        summary = state.queue.summary()
        if not [t for j, t in state.tasks.items() if j not in state.parked] and not summary["running"] \
                and not summary["queued"]:
            break
        await asyncio.sleep(0.1)
    cut = [job_id for job_id in list(state.tasks) if job_id not in state.parked]
    for job_id in cut:
        state.parked.add(job_id)  # its task ends without a word of its own: the record says server_restarted
        restart_failure(state, job_id)
        with contextlib.suppress(Exception):
            await engine.abort(job_id)
        task = state.tasks.get(job_id)
        if task is not None:
            task.cancel()
    logger.warning("omni-ext: drained in %.1f s: %d queued job(s) kept, %d running job(s) cut at the drain time",
                   time.monotonic() - t0, len(parked), len(cut))
    return {"kept": len(parked), "cut": len(cut)}


def start(state: ApiState, app_state: Any) -> None:
    """At start-up, on the event loop (after :func:`omni_ext.api.state.init_state`): put the drain in front of
    the engine's stop, and queue again the jobs a previous process kept."""
    loop = asyncio.get_running_loop()
    engine = getattr(app_state, "engine_client", None)
    if engine is not None:
        install(state, engine, loop)
    if state.archive.ids():
        state.resumer = loop.create_task(resume(state))


def install(state: ApiState, engine: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Run :func:`drain` before ``engine.shutdown`` (what vLLM's ``serve_http`` calls on SIGTERM, from a
    thread; coupling ``vllm-serve-http-shutdown``). Called on the loop's thread at start-up."""
    original = engine.shutdown
    loop_thread = threading.get_ident()
    done = threading.Event()

    def shutdown(*args: Any, **kwargs: Any) -> Any:
        if not done.is_set() and threading.get_ident() != loop_thread and loop.is_running():
            done.set()
            future = asyncio.run_coroutine_threadsafe(drain(state, engine), loop)
            try:
                future.result(timeout=state.settings.drain_s + 15)
            except Exception:
                logger.exception("omni-ext: the drain failed; stopping anyway")
        return original(*args, **kwargs)

    engine.shutdown = shutdown


async def resume(state: ApiState) -> int:
    """Queue again every job a previous process accepted and kept (oldest first); returns how many."""
    from omni_ext.api.videos import resume_job

    jobs = [j for j in state.store.queued("video") if j.id not in state.tasks]
    started = 0
    for job in jobs:
        if await resume_job(state, job):
            started += 1
    if jobs:
        logger.warning("omni-ext: %d accepted job(s) from before the restart queued again (%d could not be)",
                       started, len(jobs) - started)
    return started
