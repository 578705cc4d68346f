"""Patch body for ``idle-poll-backoff`` (see the registry in ``omni_ext.patches``).

vLLM-Omni 0.30's API process polls for outputs with ``asyncio.sleep(0.001)`` in two loops (the
orchestrator thread's stage poll and the final-output loop). An idle server therefore wakes up
about 2000 times a second and burns 10-15 % of a CPU core doing nothing; while a request runs, the
same wake-ups preempt the diffusion workers. On a small host this is what keeps CFG parallel from
scaling: two CFG ranks meet at an all-gather every step, so a worker preempted by the poll loop
stalls its partner too.

The fix keeps the 1 ms cadence while outputs flow and backs off when they do not: after a quiet
``OMNI_EXT_POLL_HOT_MS`` (default 50 ms) since the last output, an idle poll sleeps
``OMNI_EXT_POLL_IDLE_MS`` (default 10 ms) instead. A diffusion request is answered at most that
much later; LLM stages that stream tokens keep the loops hot and see no change.

With no request in flight at all (the orchestrator's ``request_states`` empty) for a second, the
polls sleep ``OMNI_EXT_POLL_DEEP_IDLE_MS`` (default 100 ms): at 10 ms an idle server still took
2.5 % of a core (0.9 % at 100 ms), and a host that keeps a dozen idle servers up (the test suite's
pool) paid a third of a core for it. Nothing can arrive then but the output of a request submitted
during the sleep, which is noticed at most one deep sleep after it was submitted: later only for a
request that finishes within that first sleep (a real one runs for seconds).

Mechanics: the two modules call ``asyncio.sleep`` through their module-level ``asyncio`` name;
this replaces that name (in those two modules only) by a proxy whose ``sleep`` applies the rule
and forwards everything else to :mod:`asyncio`. ``sleep(0)`` (the loops' "I just did work") and
every poll that finds an output mark the loops hot.
"""

from __future__ import annotations

import asyncio
import time
import types
import weakref

from omni_ext import environment
from omni_ext.patches import patch_attr

_POLL_S = 0.001  # the cadence vLLM-Omni polls at when idle


DEEP_AFTER_S = 1.0  # quiet seconds with nothing in flight before the deep idle cadence

#: The API process's orchestrators (one per engine), whose ``request_states`` say what is in flight.
ORCHESTRATORS: weakref.WeakSet = weakref.WeakSet()


def nothing_in_flight() -> bool:
    """Whether no orchestrator has a request in flight. Unknown (no orchestrator seen, or one without
    ``request_states``) counts as in flight: the deep cadence is only taken when it is certain."""
    orchestrators = list(ORCHESTRATORS)
    if not orchestrators:
        return False
    for orch in orchestrators:
        states = getattr(orch, "request_states", None)
        if not isinstance(states, dict) or states:
            return False
    return True


class _PollClock:
    def __init__(self) -> None:
        self.hot_s = float(environment.value("OMNI_EXT_POLL_HOT_MS")) / 1000.0
        self.idle_s = float(environment.value("OMNI_EXT_POLL_IDLE_MS")) / 1000.0
        self.deep_s = float(environment.value("OMNI_EXT_POLL_DEEP_IDLE_MS")) / 1000.0
        self.last_activity = time.monotonic()

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def idle_delay(self, delay: float, idle: bool | None = None) -> float:
        """The delay an idle poll of ``delay`` seconds should really sleep (``idle``: whether nothing
        is in flight; asked of :func:`nothing_in_flight` when not given)."""
        if not 0 < delay <= _POLL_S:
            return delay
        quiet = time.monotonic() - self.last_activity
        if quiet <= self.hot_s:
            return delay
        if quiet > DEEP_AFTER_S and self.deep_s > self.idle_s and (nothing_in_flight() if idle is None else idle):
            return max(delay, self.deep_s)
        return max(delay, self.idle_s)


CLOCK = _PollClock()


def _make_proxy() -> types.ModuleType:
    proxy = types.ModuleType("asyncio")  # stands in for the module-level ``asyncio`` name
    proxy.__dict__.update({k: v for k, v in vars(asyncio).items() if not k.startswith("__")})
    real_sleep = asyncio.sleep

    async def sleep(delay: float, result=None):
        if delay <= 0:
            CLOCK.touch()
        return await real_sleep(CLOCK.idle_delay(delay), result)

    proxy.sleep = sleep
    return proxy


def apply() -> None:
    from vllm_omni.engine import orchestrator
    from vllm_omni.entrypoints import async_omni_base

    proxy = _make_proxy()
    for module in (orchestrator, async_omni_base):
        patch_attr(module, "asyncio", proxy)

    # A poll that finds an output is activity even when the loop does not sleep(0) afterwards.
    from vllm_omni.engine.stage_pool import StagePool

    original = StagePool.poll_diffusion_output

    def poll_diffusion_output(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out is not None:
            CLOCK.touch()
        return out

    patch_attr(StagePool, "poll_diffusion_output", poll_diffusion_output)

    # Each orchestrator makes itself known, so an idle poll can see whether a request is in flight.
    original_init = orchestrator.OrchestratorBase.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        ORCHESTRATORS.add(self)

    patch_attr(orchestrator.OrchestratorBase, "__init__", __init__)
