"""Time a job is expected to take, learned from finished jobs, and the time limit that follows.

A request's work is measured in the abstract units of
:func:`omni_ext.models.families.cost_units`; the executor learns how many seconds one unit takes
on its workers from the jobs that ran to completion, so limits follow each request's size instead
of vLLM-Omni's fixed 600 s.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

#: Weight of the newest measurement in the running average of seconds per unit.
RATE_WEIGHT = 0.3


def updated_rate(rate: float | None, seconds: float, units: float) -> float:
    """Seconds per cost unit after a job of ``units`` took ``seconds`` (an exponential average,
    so one slow or fast job moves the estimate without replacing it)."""
    measured = seconds / units
    return measured if rate is None else (1 - RATE_WEIGHT) * rate + RATE_WEIGHT * measured


def job_time_limit_s(units: float, sec_per_unit: float | None, environ: Mapping[str, str] | None = None) -> float | None:
    """Time limit for one job: a multiple of its expected cost, never a fixed per-forward timeout.

    ``OMNI_EXT_JOB_TIMEOUT_S`` forces a fixed limit; ``OMNI_EXT_JOB_TIMEOUT_FACTOR`` (default 10)
    scales the estimate; ``OMNI_EXT_JOB_TIMEOUT_MIN_S`` (default 120) is the floor. Before any
    request has been measured there is no estimate and no limit (worker death is still detected at
    once by the process monitor).
    """
    env = os.environ if environ is None else environ
    fixed = env.get("OMNI_EXT_JOB_TIMEOUT_S")
    if fixed:
        return float(fixed)
    if sec_per_unit is None or not math.isfinite(sec_per_unit) or sec_per_unit <= 0:
        return None
    factor = float(env.get("OMNI_EXT_JOB_TIMEOUT_FACTOR", "10"))
    floor = float(env.get("OMNI_EXT_JOB_TIMEOUT_MIN_S", "120"))
    return max(floor, factor * units * sec_per_unit)
