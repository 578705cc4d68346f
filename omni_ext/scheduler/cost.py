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


class CostModel:
    """Predicted seconds of a job from its cost units: seconds per unit learned per shape class
    from finished jobs, falling back to the rate over all classes, then to a seed (a preset's cost
    table, ``omni_ext.scheduler.seconds_per_unit``). One model for admission, ordering and time
    limits, so what a client is told and what the executor enforces come from the same numbers."""

    def __init__(self, seed_s_per_unit: float | None = None) -> None:
        self.seed = seed_s_per_unit
        self.overall: float | None = None
        self.by_shape: dict[str, float] = {}

    def observe(self, key: str, units: float, seconds: float) -> None:
        """A job of ``units`` in shape class ``key`` ran to completion in ``seconds``."""
        if units <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        self.by_shape[key] = updated_rate(self.by_shape.get(key), seconds, units)
        self.overall = updated_rate(self.overall, seconds, units)

    def rate(self, key: str | None = None) -> float | None:
        """Seconds per unit for ``key`` (its class, else all classes, else the seed)."""
        if key is not None and key in self.by_shape:
            return self.by_shape[key]
        return self.overall if self.overall is not None else self.seed

    def predict_s(self, key: str | None, units: float) -> float | None:
        rate = self.rate(key)
        return None if rate is None else units * rate


def remaining_s(
    predicted_s: float | None, elapsed_s: float, steps_done: int = 0, steps_total: int = 0, steps_elapsed_s: float = 0.0
) -> float | None:
    """Predicted seconds left of a running job.

    Once denoise steps have been measured (``steps_done`` of ``steps_total`` in ``steps_elapsed_s``),
    the rest of the loop runs at the measured step time, and what the prediction holds beyond the
    loop (VAE decode, encoding) is added. Before that: the prediction minus the time already spent,
    never below a tenth of it (a job that overruns its prediction is still running).
    """
    if steps_done > 0 and steps_total > 0:
        per_step = steps_elapsed_s / steps_done
        loop = per_step * steps_total
        after_loop = max(0.0, predicted_s - loop) if predicted_s is not None else 0.0
        return per_step * max(0, steps_total - steps_done) + after_loop
    if predicted_s is None:
        return None
    return max(0.1 * predicted_s, predicted_s - elapsed_s)
