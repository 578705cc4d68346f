"""Which queued job starts now, on which worker ranks, and how: the TunedExecutor's placement rules.

Pure decisions on plain data (no vLLM import), so that every rule is unit-tested
(``tests/test_scheduler.py``); the executor calls :func:`next_placements` under its lock each
time the queue or the set of free ranks changes, and only carries the answer out.

Rules, in queue order:

1. Queue order (:mod:`omni_ext.scheduler.admission`: priority, aging, longest first), no overtaking:
   the first job that cannot start now stops the scan, so a job that needs a whole CFG group is
   never starved by smaller jobs queued after it.
2. A :attr:`JobMode.PAIR` job (both guidance branches, on a cfg-2 layout) runs as the
   scheduler's ``cfg_mode`` says: ``"pair"`` takes the first CFG group whose ranks are all free
   (each rank runs one branch; lowest latency); ``"single"`` takes one rank like rule 3 and runs
   both branches there; ``"adaptive"`` runs as a pair while the free groups are enough for it and
   every job queued behind it, and as a single rank once others wait (a pair reaches ~1.45x of
   one device on a CPU host, two single ranks ~1.8x: under load a pair wastes a quarter of the
   group). Outputs are the same bytes either way.
3. A :attr:`JobMode.SINGLE` job takes one free rank, preferring a rank whose group partner is
   busy, so that whole groups stay free for pair jobs (ties: the lowest rank). A cfg-2 group thus
   serves two CFG-free requests at once.
4. A :attr:`JobMode.ALL_RANKS` job (vLLM-Omni's start-up warm-up) waits until every rank is free
   and runs on each of them alone, so every worker is warm before the first real request.
5. Settling: the requests of a burst reach the executor one by one, a few milliseconds apart. Once
   a request has come within ``settle_s`` of the one before it (its ``gap_s``), an idle layout
   starts nothing until its oldest queued job has waited ``settle_s``: a burst is then ordered and
   placed as a burst, not as an idle server that gets one request. A request that came alone is not
   held by that (the hold is pure overhead on an isolated job; a burst loses only the place of its
   first request, on one rank or its pair-mode group). Likewise an adaptive pair decision waits
   until the job has waited ``settle_s`` only when it came within ``settle_s`` of the request before
   it; a CFG request that came alone starts as a pair at once, *tentatively*: if a request follows
   it within ``settle_s`` and finds no free rank, the executor stops the pair at its next step
   boundary and starts it again on one rank (:meth:`omni_ext.executor.ranks.RankQueue.split`), so
   the burst behind it is placed as if the pair had waited. An isolated job thus pays nothing
   (50 ms before, issue 38); the first job of a burst pays what its pair computed before the stop
   (the text encoding, at most a step). A pair started blind and kept (tried on 12-06) took the
   whole group from the burst behind it, whose jobs then waited a pair's run and broke the
   admission promise by 0.2-0.6 s.
6. While the executor holds dispatch (a control-plane RPC waits for every rank to be idle),
   nothing starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Generic, Protocol, TypeVar

from omni_ext.scheduler.config import CfgMode


class JobMode(str, Enum):
    """How a job uses the ranks of the layout (a ``str``, so it travels and compares as its value)."""

    PAIR = "pair"  # one whole CFG group, one guidance branch per rank
    SINGLE = "single"  # one rank, all of the request on it (no collectives)
    ALL_RANKS = "all-ranks"  # every rank, each running the whole request alone (warm-up)

    def __str__(self) -> str:
        return self.value

    @property
    def rank_mode(self) -> JobMode:
        """How each rank the job is placed on runs it: what the worker is told."""
        return JobMode.SINGLE if self is JobMode.ALL_RANKS else self

    @classmethod
    def for_request(cls, *, needs_cfg: bool, group_size: int, warm_up: bool = False) -> JobMode:
        """The mode of a request: ``needs_cfg`` (it runs both guidance branches), the layout's CFG
        group size, and whether it is the engine's warm-up (only a CFG-free warm-up runs on all ranks).
        """
        if warm_up and not needs_cfg:
            return cls.ALL_RANKS
        if needs_cfg and group_size == 2:
            return cls.PAIR
        return cls.SINGLE


def predicted_mode(mode: JobMode, cfg_mode: CfgMode) -> JobMode:
    """The mode a queued job's seconds are predicted in: the mode its ranks run it in whenever others
    wait, which is when a prediction matters (rule 2: a PAIR job on one rank under "single", and
    under "adaptive" once others wait; a pair under "pair"). An upper bound of an adaptive job's time."""
    if mode is JobMode.PAIR and cfg_mode != CfgMode.PAIR:
        return JobMode.SINGLE
    return mode.rank_mode


@dataclass(frozen=True)
class JobNeeds:
    """What placement knows of a queued job: its mode, and its expected cost (abstract units of
    :func:`omni_ext.models.families.cost_units`, for time limits and later cost-aware ordering)."""

    mode: JobMode
    units: float = 0.0
    arrival: float = 0.0  # monotonic seconds it was queued (the adaptive rule's settle time)
    gap_s: float = 0.0  # seconds since the request before it arrived (rule 5: a job that came alone is not held)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", JobMode(self.mode))  # accept the plain value too


@dataclass(frozen=True)
class Layout:
    """The worker ranks as CFG groups: group ``g`` of a regular layout is ranks ``[g*size, (g+1)*size)``,
    vLLM-Omni's own CFG process groups. Under sequence parallel each rank here is a unit of
    processes (:class:`Units`)."""

    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def regular(cls, num_groups: int, group_size: int) -> Layout:
        return cls(tuple(tuple(range(g * group_size, (g + 1) * group_size)) for g in range(num_groups)))

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for g in self.groups for r in g)

    def group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.groups if rank in g)


@dataclass(frozen=True)
class Units:
    """Placement's ranks are *units*: ``size`` worker processes that always run a job together, the
    tensor- and sequence-parallel group of one CFG half (TP x Ulysses x Ring, or vLLM-Omni's
    all-gather degree; 1 without either). Placement, the queue and the layout's groups count units;
    the executor fans a job out to every process of its units and takes the answer from a unit's leader.

    Why unit ``u`` is processes ``[u*size, (u+1)*size)``: vLLM-Omni orders its ranks
    ``order="tp-sp-pp-cfg-dp"`` (``RankGenerator`` in ``diffusion/distributed/parallel_state.py``
    ``_initialize_model_parallel``; a coupling in :mod:`omni_ext.patches.couplings`), so with PP 1
    (the TunedExecutor refuses it) process ``p = tp_rank + tp * (sp_rank + sp * (cfg_rank + cfg *
    dp_rank))``: its TP x SP groups are the contiguous blocks of ``size = tp * sp`` processes, and a
    CFG group pairs process ``s`` of one unit with process ``s`` of the next (``[s, s + size]``).
    Unit ``u = cfg_rank + cfg * dp_rank`` is then exactly placement's rank ``u`` of
    :meth:`Layout.regular`."""

    size: int = 1

    def ranks_of(self, unit: int) -> tuple[int, ...]:
        """The worker processes of ``unit``, its leader first."""
        return tuple(range(unit * self.size, (unit + 1) * self.size))

    def expand(self, units: Iterable[int]) -> tuple[int, ...]:
        """The worker processes of ``units``, in unit order (the first unit's leader first)."""
        return tuple(p for u in units for p in self.ranks_of(u))

    def unit_of(self, rank: int) -> int:
        return rank // self.size

    def sp_rank(self, rank: int) -> int:
        """The process's rank in its unit (vLLM-Omni's ``get_sequence_parallel_rank``); 0: the leader,
        the one process of the unit that answers with the output."""
        return rank % self.size

    def cfg_rank(self, rank: int, cfg_size: int) -> int:
        """The process's CFG rank (vLLM-Omni's ``get_classifier_free_guidance_rank``)."""
        return self.unit_of(rank) % cfg_size

    def free_units(self, layout: Layout, busy: Mapping[int, object]) -> list[int]:
        """The units of ``layout`` none of whose processes is busy (``busy``: process -> what it runs, None if idle)."""
        return [u for u in layout.ranks if all(busy.get(p) is None for p in self.ranks_of(u))]


#: One process a unit (no tensor or sequence parallel): the default.
ONE_PROCESS_UNITS = Units()


class Queued(Protocol):
    """A queued job as placement sees it (the executor's job objects)."""

    @property
    def needs(self) -> JobNeeds: ...


J = TypeVar("J", bound=Queued)


@dataclass(frozen=True)
class Start(Generic[J]):
    """Start ``job`` on ``ranks``; ``mode`` is how each of those ranks runs it (PAIR or SINGLE)."""

    job: J
    ranks: tuple[int, ...]
    mode: JobMode


def next_placements(
    pending: Iterable[J],
    free_ranks: Iterable[int],
    layout: Layout,
    *,
    hold: bool = False,
    cfg_mode: CfgMode = CfgMode.PAIR,
    now: float = 0.0,
    settle_s: float = 0.0,
) -> list[Start[J]]:
    """The jobs to start now, in order (a prefix of ``pending``, which is already in the order the
    scheduler wants), each with its ranks and how they run it (see the rules in the module
    docstring). ``hold``: start nothing. ``now``: the clock of the jobs' ``arrival``."""
    if hold:
        return []
    queue = list(pending)
    free = set(free_ranks)
    burst = [j for j in queue if j.needs.mode is not JobMode.ALL_RANKS]  # the start-up warm-up never waits
    if (burst and free.issuperset(layout.ranks) and now - min(j.needs.arrival for j in burst) < settle_s
            and any(j.needs.gap_s < settle_s for j in burst)):
        return []  # idle, and a burst is arriving: let the rest of it arrive first
    starts: list[Start[J]] = []
    for i, job in enumerate(queue):
        mode = _mode_now(job.needs.mode, cfg_mode, waiting=len(queue) - i, free=free, layout=layout)
        if (mode is JobMode.PAIR and cfg_mode == CfgMode.ADAPTIVE and now - job.needs.arrival < settle_s
                and job.needs.gap_s < settle_s):
            break  # part of a burst, too early to tell how much of it is still arriving
        ranks = _ranks_for(mode, free, layout)
        if ranks is None:
            break  # later jobs wait for this one
        free.difference_update(ranks)
        starts.append(Start(job, ranks, mode.rank_mode))
    return starts


def tentative_until(mode: JobMode, cfg_mode: CfgMode, needs: JobNeeds, *, now: float, settle_s: float) -> float | None:
    """Until when a job started now in ``mode`` is a tentative pair (rule 5: an adaptive CFG job that
    came alone, started before it waited ``settle_s``), None when it is not one."""
    if mode is JobMode.PAIR and cfg_mode == CfgMode.ADAPTIVE and settle_s > 0 and now - needs.arrival < settle_s:
        return needs.arrival + settle_s
    return None


def splits(until: float | None, now: float, *, blocked: bool) -> bool:
    """Whether a tentative pair (``until``: :func:`tentative_until`) gives its group back now: a job
    queued within its settle time (``blocked``: it found no free rank) makes it the first of a burst."""
    return until is not None and now < until and blocked


def _whole_free_groups(free: set[int], layout: Layout) -> int:
    return sum(1 for g in layout.groups if free.issuperset(g))


def _mode_now(mode: JobMode, cfg_mode: CfgMode, *, waiting: int, free: set[int], layout: Layout) -> JobMode:
    """How a job placed now runs: a PAIR job becomes SINGLE under ``cfg_mode`` "single", and under
    "adaptive" when the whole free groups are fewer than the ``waiting`` jobs (it and those behind it)."""
    if mode is not JobMode.PAIR or cfg_mode == CfgMode.PAIR:
        return mode
    if cfg_mode == CfgMode.ADAPTIVE and _whole_free_groups(free, layout) >= waiting:
        return JobMode.PAIR
    return JobMode.SINGLE


def _ranks_for(mode: JobMode, free: set[int], layout: Layout) -> tuple[int, ...] | None:
    if mode is JobMode.ALL_RANKS:
        return layout.ranks if free.issuperset(layout.ranks) else None
    if mode is JobMode.PAIR:
        return next((g for g in layout.groups if free.issuperset(g)), None)
    if not free:
        return None

    def free_in_group(rank: int) -> tuple[int, int]:
        return (sum(1 for r in layout.group_of(rank) if r in free), rank)

    return (min(free, key=free_in_group),)
