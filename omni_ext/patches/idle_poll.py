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

Mechanics: the two modules call ``asyncio.sleep`` through their module-level ``asyncio`` name;
this replaces that name (in those two modules only) by a proxy whose ``sleep`` applies the rule
and forwards everything else to :mod:`asyncio`. ``sleep(0)`` (the loops' "I just did work") and
every poll that finds an output mark the loops hot.
"""

from __future__ import annotations

import asyncio
import os
import time
import types

from omni_ext.patches import patch_attr

_POLL_S = 0.001  # the cadence vLLM-Omni polls at when idle


class _PollClock:
    def __init__(self) -> None:
        self.hot_s = float(os.environ.get("OMNI_EXT_POLL_HOT_MS", "50")) / 1000.0
        self.idle_s = float(os.environ.get("OMNI_EXT_POLL_IDLE_MS", "10")) / 1000.0
        self.last_activity = time.monotonic()

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def idle_delay(self, delay: float) -> float:
        """The delay an idle poll of ``delay`` seconds should really sleep."""
        if 0 < delay <= _POLL_S and time.monotonic() - self.last_activity > self.hot_s:
            return max(delay, self.idle_s)
        return delay


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
