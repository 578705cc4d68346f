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

from omni_ext import environment


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
    fixed = environment.value("OMNI_EXT_JOB_TIMEOUT_S", env)
    if fixed:
        return float(fixed)
    if sec_per_unit is None or not math.isfinite(sec_per_unit) or sec_per_unit <= 0:
        return None
    factor = float(environment.value("OMNI_EXT_JOB_TIMEOUT_FACTOR", env))
    floor = float(environment.value("OMNI_EXT_JOB_TIMEOUT_MIN_S", env))
    return max(floor, factor * units * sec_per_unit)


#: How many times faster a request runs under a cache backend (``--cache-backend``) than without:
#: vLLM-Omni's published Qwen-Image 1024x1024 figures (50 steps, H200: 20.0 s; 10.47 s with TeaCache,
#: 10.8 s with cache-dit). A backend not listed is counted at 1 (no claim). Only the seed of the cost
#: model uses it (:func:`cached_seed`): a server measures its own cached runs, and every run of one
#: server has its backend, so learned classes never mix cached and uncached times.
CACHE_SPEEDUP: dict[str, float] = {"tea_cache": 1.91, "cache_dit": 1.85}


def cached_seed(seed_s_per_unit: float | None, cache_backend: str | None) -> float | None:
    """The cost model's seed (a preset's, measured without a cache) for a server that runs
    ``cache_backend``: a cached run costs less, so an uncached seed would over-predict every wait and
    answer 429 early until the server's own jobs replace it."""
    if seed_s_per_unit is None or cache_backend in (None, "", "none"):
        return seed_s_per_unit
    return seed_s_per_unit / CACHE_SPEEDUP.get(cache_backend, 1.0)


#: The run modes a job's time is kept per (:func:`mode_key`): "pair" (a CFG group, one guidance branch
#: per rank) and "single" (one rank runs all of the request).
MODES = ("single", "pair")

#: Seconds on one rank over seconds on a CFG pair, for a shape measured in one mode only, until some
#: shape has been measured in both (then their ratio is used). A single rank runs both guidance
#: branches that a pair splits, so it takes up to twice the pair's time (less only by the pair's
#: collectives and the parts both ranks run whole): the upper end, so that a burst after a paired
#: warm-up, which runs as single ranks (``cfg_mode`` "adaptive"), is not admitted at the pair's rate.
SINGLE_OVER_PAIR = 2.0


def mode_key(shape_key: str, mode: str) -> str:
    """The class a job's time is learned in: its shape class and the mode its ranks ran it in (the
    TunedExecutor's and the API's account share it, so both predict a mode the same way)."""
    return f"{shape_key}:{mode}"


#: What a batched job's class adds to its shape class (:func:`batch_key`).
BATCH_SEP = "|batch"


def batch_key(shape_key: str, size: int) -> str:
    """The class of one batched forward of ``size`` requests of one shape class (request batching,
    :mod:`omni_ext.scheduler.batching`): a batch is learned per shape and batch size, since a batch of
    ``k`` costs anything between one request (a card with spare width) and ``k`` (a busy CPU)."""
    return shape_key if size <= 1 else f"{shape_key}{BATCH_SEP}{size}"


def _split(key: str | None) -> tuple[str, str] | None:
    if key is None:
        return None
    shape, _, mode = key.rpartition(":")
    return (shape, mode) if shape and mode in MODES else None


class CostModel:
    """Predicted seconds of a job from its cost units: seconds per unit learned per class from
    finished jobs (a shape class, or a shape class and run mode: :func:`mode_key`), falling back to
    the rate over all classes, then to a seed (a preset's cost table,
    ``omni_ext.scheduler.seconds_per_unit``). One model for admission, ordering and time limits, so
    what a client is told and what the executor enforces come from the same numbers.

    A class with a run mode that was not measured yet is predicted from the other mode of its shape
    (or of all shapes) times the single-over-pair ratio (:meth:`mode_ratio`): after a paired
    warm-up, the single-rank jobs of a burst are predicted at what they cost, not at the pair's rate.

    **A class's first job runs cold.** It pays once what a new shape costs (kernels built for its
    tensor shapes; on an NPU, operators compiled for them): the second job of a class replaces its
    time instead of being averaged with it, and the single-over-pair ratio is read only from shapes
    measured warm (twice or more) in both modes. On a fresh CPU server (tiny Wan, 64x64) a shape's first
    paired job took 0.316 s and its third 0.267 s; the ratio read from that cold pair was about 0.8
    (0.9 against the warm pair), the next shape's about 1.0, and that shape's burst after a paired
    warm-up started a job 5.08 s after its request against a promise of 4.75 s (issue 19 item 5).
    With this rule the same five bursts (13, 9, 17, 5, 21 frames) started every job within 3.5 s.

    **Fixed costs.** Cost units grow with the steps, but part of a job does not: text encoding, the
    VAE decode, the transfer of the output, the serving path around it. Units price that part with a
    guess (``decode_units``), so a class learned from 8-step jobs under-predicts its 1-step jobs
    (issue 38: few-step distilled models). A job whose denoise loop was measured (its step reports:
    ``loop_s`` over ``steps``) teaches its class both parts in seconds, what ran outside the loop and
    the time of one step, and the class then predicts ``fixed + steps x per_step`` for any step count;
    classes without such a measurement, and requests whose steps are unknown, keep the unit rate."""

    def __init__(self, seed_s_per_unit: float | None = None) -> None:
        self.seed = seed_s_per_unit
        self.overall: float | None = None
        self.by_shape: dict[str, float] = {}
        self.by_mode: dict[str, float] = {}
        self.samples: dict[str, int] = {}  # jobs measured per class (the first one ran cold)
        self.fixed: dict[str, float] = {}  # class -> seconds of a job outside its denoise loop
        self.per_step: dict[str, float] = {}  # class -> seconds of one denoise step
        self.loops: dict[str, int] = {}  # jobs of the class whose loop was measured (the first ran cold)

    def observe(self, key: str, units: float, seconds: float, mode: str | None = None, *, steps: int = 0,
                loop_s: float | None = None) -> None:
        """A job of ``units`` in class ``key`` (run in ``mode``: the class is :func:`mode_key`) ran to
        completion in ``seconds``, ``loop_s`` of them in its ``steps`` denoise steps when measured;
        the class's second job replaces its first (cold) one."""
        if units <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        key = mode_key(key, mode) if mode else key
        if steps > 0 and loop_s is not None and math.isfinite(loop_s) and 0 < loop_s <= seconds:
            looped = self.loops.get(key, 0)
            cold = looped == 1  # replace the first (cold) measurement
            self.fixed[key] = _averaged(None if cold else self.fixed.get(key), seconds - loop_s)
            self.per_step[key] = _averaged(None if cold else self.per_step.get(key), loop_s / steps)
            self.loops[key] = looped + 1
        seen = self.samples.get(key, 0)
        self.by_shape[key] = updated_rate(self.by_shape.get(key) if seen != 1 else None, seconds, units)
        self.samples[key] = seen + 1
        self.overall = updated_rate(self.overall, seconds, units)
        split = _split(key)
        if split is not None:
            self.by_mode[split[1]] = updated_rate(self.by_mode.get(split[1]), seconds, units)

    def mode_ratio(self, mode: str, other: str) -> float:
        """Seconds in ``mode`` over seconds in ``other`` for the same job: the median over the shapes
        measured warm in both, else :data:`SINGLE_OVER_PAIR`."""
        ratios = sorted(rate / self.by_shape[mode_key(shape, other)] for shape, m, rate in self._moded()
                        if m == mode and self._warm(mode_key(shape, mode)) and self._warm(mode_key(shape, other)))
        if ratios:
            return ratios[len(ratios) // 2]
        return SINGLE_OVER_PAIR if (mode, other) == ("single", "pair") else 1.0 / SINGLE_OVER_PAIR

    def _warm(self, key: str) -> bool:
        return self.samples.get(key, 0) >= 2

    def _moded(self) -> list[tuple[str, str, float]]:
        return [(*split, rate) for key, rate in self.by_shape.items() if (split := _split(key)) is not None]

    def rate(self, key: str | None = None, mode: str | None = None) -> float | None:
        """Seconds per unit for ``key`` (in ``mode``): its class; for a class with a run mode not
        measured yet, the other mode of its shape (for a batch size not measured yet, its unbatched
        shape class's rate), else the mode over all shapes, else the other mode
        over all shapes (each converted by :meth:`mode_ratio`); else all classes; else the seed."""
        if key is not None and mode:
            key = mode_key(key, mode)
        if key is not None and key in self.by_shape:
            return self.by_shape[key]
        split = _split(key)
        if split is not None:
            shape, mode = split
            other = next(m for m in MODES if m != mode)
            if mode_key(shape, other) in self.by_shape:
                return self.by_shape[mode_key(shape, other)] * self.mode_ratio(mode, other)
            if BATCH_SEP in shape:  # a batch size not measured yet: its shape's rate, k times one request
                return self.rate(mode_key(shape.split(BATCH_SEP)[0], mode))
            if mode in self.by_mode:
                return self.by_mode[mode]
            if other in self.by_mode:
                return self.by_mode[other] * self.mode_ratio(mode, other)
        return self.overall if self.overall is not None else self.seed

    def predict_s(self, key: str | None, units: float, mode: str | None = None, steps: int = 0) -> float | None:
        """Seconds of a job of ``units`` (``steps`` denoise steps, 0: unknown) in class ``key`` (in
        ``mode``): its class's fixed and per-step seconds when measured, else units at :meth:`rate`."""
        cls = mode_key(key, mode) if key is not None and mode else key
        if steps > 0 and cls in self.per_step:
            return self.fixed[cls] + steps * self.per_step[cls]
        rate = self.rate(key, mode)
        return None if rate is None else units * rate


def _averaged(previous: float | None, measured: float) -> float:
    """The exponential average :func:`updated_rate` keeps, of a value measured directly."""
    return measured if previous is None else (1 - RATE_WEIGHT) * previous + RATE_WEIGHT * measured


def remaining_s(
    predicted_s: float | None, elapsed_s: float, steps_done: int = 0, steps_total: int = 0, steps_elapsed_s: float = 0.0,
    before_loop_s: float = 0.0,
) -> float | None:
    """Predicted seconds left of a running job.

    Once denoise steps have been measured (``steps_done`` of ``steps_total`` in ``steps_elapsed_s``),
    the rest of the loop runs at the measured step time, and what the prediction holds beyond the
    loop (VAE decode, encoding) is added: the prediction less the loop and what ran before it
    (``before_loop_s``: text encoding, from the job's start to its loop's). Before that: the
    prediction minus the time already spent, never below a tenth of it (a job that overruns its
    prediction is still running).
    """
    if steps_done > 0 and steps_total > 0:
        per_step = steps_elapsed_s / steps_done
        loop = per_step * steps_total
        after_loop = max(0.0, predicted_s - loop - before_loop_s) if predicted_s is not None else 0.0
        return per_step * max(0, steps_total - steps_done) + after_loop
    if predicted_s is None:
        return None
    return max(0.1 * predicted_s, predicted_s - elapsed_s)
