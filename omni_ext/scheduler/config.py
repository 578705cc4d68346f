"""The request scheduler's options, read from vLLM-Omni's own channel:
``--additional-config '{"omni_ext": {"scheduler": {...}}}'`` (or ``additional_config:`` in a deploy
YAML / a preset). Every option, its default and why that default, in one place; the reference page
``docs/reference/additional-config.md`` is generated from these classes and tables (:mod:`omni_ext.reference`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any, Literal


class CfgMode(str, Enum):
    """``cfg_mode``: how a request that runs both CFG branches uses a CFG-2 group (the rule is
    :mod:`omni_ext.scheduler.placement`'s). A ``str``, so that it reads, prints and serializes as its
    value ("pair" in JSON, logs and f-strings) and equals that string."""

    ADAPTIVE = "adaptive"
    PAIR = "pair"
    SINGLE = "single"

    def __str__(self) -> str:
        return self.value


Order = Literal["slo", "cost", "fifo"]
ORDERS: tuple[str, ...] = ("slo", "cost", "fifo")


@dataclass(frozen=True)
class SchedulerConfig:
    """Options of the request scheduler (all optional).

    ``max_wait_s`` (300): a request whose predicted wait before it starts exceeds this is refused
    with 429 and a Retry-After. 300 s is half of vLLM-Omni's 600 s ``/v1/videos/sync`` and output
    time-outs, so an admitted synchronous request still has the other half to run; it is also about
    one Wan2.1-1.3B 81-frame video on a 910B, so a client is never told "come back" for less
    than one video's worth of queue.
    ``aging_s`` (120): every ``aging_s`` a job has waited counts as one step better priority, so
    later arrivals (of the same priority) overtake a job for at most ``aging_s``, and a job of
    priority ``p`` is overtaken by a stream of priority ``p - k`` arrivals for at most
    ``(k + 1) * aging_s``.
    ``cfg_mode`` ("adaptive"): how a request that runs both CFG branches uses a CFG-2 group:
    ``"pair"`` both ranks (lowest latency), ``"single"`` one rank with both branches (the group
    serves two requests), ``"adaptive"`` a pair while the queue behind it fits the free groups,
    single ranks once others wait.
    ``settle_s`` (0.05): the requests of a burst reach the executor a few milliseconds apart (six
    async creates sent back to back spanned 36 ms on a 2-core host). So that the order and the
    adaptive rule see a burst whole instead of starting its first arrivals blind, once a request
    came within ``settle_s`` of the one before it, an idle executor starts nothing until its first
    queued job has waited ``settle_s`` (a request that came alone is not held), and an adaptive CFG
    job of such a burst runs as a pair only once it has waited ``settle_s`` with nobody behind it. An
    adaptive CFG job that came alone starts as a pair at once; if a request follows it within
    ``settle_s`` and finds no free rank, the pair stops at its next step and runs again on one rank
    beside the newcomer (placement rule 5). 0 turns both off (every pair decision is final at once).
    ``order`` ("slo"): ``"cost"`` starts the longest predicted job of the best (aged) priority
    first, which keeps a burst near its makespan bound whatever the arrival order; ``"fifo"``
    keeps arrival order within a priority (vLLM-Omni's own order; for comparisons); ``"slo"``
    starts the job with the tightest relative deadline first (with the default deadlines the
    shortest), except that jobs which arrived together (a burst) start longest first among
    themselves (the rule and which side wins: :mod:`omni_ext.scheduler.admission`), so a stream's
    short requests are not stuck behind long ones and a burst keeps ``"cost"``'s packing. It is the
    default because it is the one order that serves both: on the simulator
    (:mod:`omni_ext.bench.stream_sim`) its bursts stay at ``"cost"``'s makespan and its streams
    meet their SLO more often than either other order.
    ``slo_factor`` (3.0): a request's deadline is its arrival plus ``slo_factor`` x its predicted
    standalone seconds, unless it sets its own ``deadline_s``. 3 is the SLO of vLLM-Omni's RFC #290
    and of the serving papers that report attainment (finished within 3x the standalone time); it
    is what ``order: "slo"`` protects. At least 1: a tighter deadline is missed by every job.
    ``preempt`` (true): a running job may be paused at a denoise-step boundary so that a waiting one
    starts now, for a better requested priority or a deadline it would miss otherwise, and resumes
    later on the same ranks with the same output bytes (the rules: :mod:`omni_ext.scheduler.preempt`;
    the TunedExecutor with omni-ext's tuned pipelines only, never with a cache backend). An
    interactive request then waits one step of a long video instead of all of it.
    ``max_preemptions`` (8): how often one job may be paused, so that nothing starves: a paused job
    waits for one job at a time (when its ranks free up it resumes, or stays paused for the next
    job if that one would pause it again: one pause more), so its delay is at most this many runs
    of other jobs. A deadline pause also keeps the paused job's own deadline (its slack); 8 lets a
    long video let through the short requests that arrive during its run on a busy stream (at
    0.9 of capacity in ``omni-ext bench stream``, 4 was used up by both long jobs in turn).
    ``seconds_per_unit`` (None): seed of the cost model (seconds per cost unit) before the server
    has measured its own jobs; a preset writes it from its cost table.
    ``retry_margin_s`` (None: 5 % of ``max_wait_s``, at least 0.5 s): added to a Retry-After so
    that a client that comes back on time finds the queue below the bound despite small errors
    of the prediction.
    """

    max_wait_s: float = 300.0
    aging_s: float = 120.0
    cfg_mode: CfgMode = CfgMode.ADAPTIVE
    order: Order = "slo"
    slo_factor: float = 3.0
    settle_s: float = 0.05
    preempt: bool = True
    max_preemptions: int = 8
    seconds_per_unit: float | None = None
    retry_margin_s: float | None = None

    def __post_init__(self) -> None:
        if not self.max_wait_s > 0:
            raise ValueError(f"omni_ext.scheduler.max_wait_s must be > 0, got {self.max_wait_s!r}")
        if self.aging_s < 0:
            raise ValueError(f"omni_ext.scheduler.aging_s must be >= 0 (0: no aging), got {self.aging_s!r}")
        if self.settle_s < 0:
            raise ValueError(f"omni_ext.scheduler.settle_s must be >= 0, got {self.settle_s!r}")
        try:
            object.__setattr__(self, "cfg_mode", CfgMode(self.cfg_mode))
        except ValueError:
            modes = tuple(m.value for m in CfgMode)
            raise ValueError(f"omni_ext.scheduler.cfg_mode must be one of {modes}, got {self.cfg_mode!r}") from None
        if self.order not in ORDERS:
            raise ValueError(f"omni_ext.scheduler.order must be one of {ORDERS}, got {self.order!r}")
        if not self.slo_factor >= 1:
            raise ValueError(f"omni_ext.scheduler.slo_factor must be >= 1, got {self.slo_factor!r}")
        if not isinstance(self.preempt, bool):
            raise ValueError(f"omni_ext.scheduler.preempt must be true or false, got {self.preempt!r}")
        if isinstance(self.max_preemptions, bool) or not isinstance(self.max_preemptions, int) or not 0 <= self.max_preemptions <= 100:
            raise ValueError(f"omni_ext.scheduler.max_preemptions must be an integer from 0 to 100, got {self.max_preemptions!r}")
        if self.seconds_per_unit is not None and not self.seconds_per_unit > 0:
            raise ValueError(f"omni_ext.scheduler.seconds_per_unit must be > 0, got {self.seconds_per_unit!r}")

    @property
    def margin_s(self) -> float:
        return self.retry_margin_s if self.retry_margin_s is not None else max(0.5, 0.05 * self.max_wait_s)


_NUMBERS = {"max_wait_s", "aging_s", "settle_s", "seconds_per_unit", "retry_margin_s", "slo_factor"}


def omni_ext_section(additional_config: Any) -> dict[str, Any]:
    """The ``omni_ext`` object of vLLM-Omni's ``additional_config`` (a dict, or the JSON string of
    ``--additional-config``); empty when there is none."""
    raw = additional_config
    if isinstance(raw, str):
        raw = json.loads(raw) if raw.strip() else {}
    section = (raw or {}).get("omni_ext") if isinstance(raw, dict) else None
    return section if isinstance(section, dict) else {}


@dataclass(frozen=True)
class Option:
    """A key of the ``omni_ext`` object that no options dataclass declares (the keys beside its sections,
    and ``omni_ext.api``'s: :data:`omni_ext.api.settings.SETTINGS`), as a row the reference page
    ``docs/reference/additional-config.md`` is generated from."""

    key: str
    type: str  # its JSON type, in words
    default: Any  # what the reader uses when the key is not set (None: nothing, or computed: see ``meaning``)
    meaning: str
    env: str | None = None  # the environment variable that overrides it


#: The keys of the ``omni_ext`` object beside its sections (``api``, ``scheduler``, ``healing``:
#: :func:`omni_ext.reference.sections`).
OPTIONS: tuple[Option, ...] = (
    Option("data_parallel_size", "integer >= 1", None,
           "Data-parallel groups of the TunedExecutor, each a whole CFG x SP group that serves requests of its "
           "own (the `dp-world` patch gives vLLM-Omni's stage the same size); unset: the stage's own "
           "`data_parallel_size`."),
    Option("worker_start", '`"spawn"` or `"forkserver"`', None,
           "How the TunedExecutor starts its worker processes; unset: `forkserver` on the CPU platform (one "
           "process imports torch and vLLM-Omni once and every worker forks from it), `spawn` on a device."),
)


def scheduler_config(additional_config: Any, cache_backend: str | None = None) -> SchedulerConfig:
    """:class:`SchedulerConfig` from ``additional_config``; a clear ``ValueError`` for an unknown
    key or a value of the wrong type, so a typo fails at start-up, not silently. ``cache_backend``:
    the server's ``--cache-backend``, which scales the cost seed (:func:`~omni_ext.scheduler.cost.cached_seed`)."""
    config = SchedulerConfig(**_options(additional_config, "scheduler", SchedulerConfig, _NUMBERS))
    if cache_backend and config.seconds_per_unit is not None:
        from omni_ext.scheduler.cost import cached_seed

        config = replace(config, seconds_per_unit=cached_seed(config.seconds_per_unit, cache_backend))
    return config


@dataclass(frozen=True)
class HealingConfig:
    """How the TunedExecutor heals (``--additional-config '{"omni_ext": {"healing": {...}}}'``; the
    mechanism is :mod:`omni_ext.executor.tuned`'s, the budget rule :mod:`omni_ext.scheduler.respawn`).

    ``max_respawns`` (3): worker groups the executor may start again within ``window_s``; the next
    failure inside the window makes the server exit non-zero, so that a supervisor restarts it
    (a fault that comes back every few minutes is not one respawning hides). 0: never respawn.
    ``window_s`` (600): the window, in seconds, over which respawns are counted.
    ``grace_s`` (60): a job past its time limit is first stopped at its next denoise step; its
    workers are killed (and respawned) only if it has not stopped this many seconds later. A job
    past its denoise loop has no step left to stop at: its decode runs to its end (tens of seconds
    for a long video on a device), which the default leaves room for.
    """

    max_respawns: int = 3
    window_s: float = 600.0
    grace_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.max_respawns, bool) or not isinstance(self.max_respawns, int) or self.max_respawns < 0:
            raise ValueError(f"omni_ext.healing.max_respawns must be an integer >= 0, got {self.max_respawns!r}")
        if not self.window_s > 0:
            raise ValueError(f"omni_ext.healing.window_s must be > 0, got {self.window_s!r}")
        if not self.grace_s >= 0:
            raise ValueError(f"omni_ext.healing.grace_s must be >= 0, got {self.grace_s!r}")


def healing_config(additional_config: Any) -> HealingConfig:
    """:class:`HealingConfig` from ``additional_config``; a ``ValueError`` for an unknown key or a
    value of the wrong type, as :func:`scheduler_config`."""
    return HealingConfig(**_options(additional_config, "healing", HealingConfig, {"window_s", "grace_s"}))


def _options(additional_config: Any, name: str, cls: type, numbers: set[str]) -> dict[str, Any]:
    """The ``omni_ext.<name>`` object's options for ``cls``: a ``ValueError`` for a section that is not an
    object, an unknown key, or a non-number where ``numbers`` names one (those become floats)."""
    section = omni_ext_section(additional_config).get(name) or {}
    if not isinstance(section, dict):
        raise ValueError(f"omni_ext.{name} must be a JSON object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"unknown omni_ext.{name} option(s) {unknown}; known: {sorted(known)}")
    values: dict[str, Any] = {}
    for key, value in section.items():
        if key in numbers and value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"omni_ext.{name}.{key} must be a number, got {value!r}")
            value = float(value)
        values[key] = value
    return values
