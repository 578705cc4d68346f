"""The arithmetic of the scheduler benchmarks (pure; unit-tested in ``tests/test_bench.py``).

- makespan lower bound of a closed burst on identical groups: ``max(total work / groups, longest job)``;
- what list scheduling gives for a given start order (FIFO = arrival order, LPT = longest first),
  and the optimal makespan by exhaustive search (small bursts only), from the jobs' times alone;
- how many requests of a burst admission should take: ``capacity * (floor(max_wait_s / job_s) + 1)``,
  the jobs whose predicted start (list scheduling of identical jobs) is within ``max_wait_s``;
- arrival orders for the mixed-length burst, including "the longest arrives last".
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence


def makespan_bound(job_s: Sequence[float], groups: int) -> dict[str, float]:
    """The lower bound of a burst's makespan on ``groups`` identical groups, and its inputs."""
    total = float(sum(job_s))
    longest = float(max(job_s)) if job_s else 0.0
    per_group = total / max(1, groups)
    return {"total_s": total, "longest_s": longest, "total_over_groups_s": per_group,
            "bound_s": max(per_group, longest)}


def list_schedule(job_s: Sequence[float], groups: int) -> float:
    """Makespan when the jobs start in the given order, each on the group that frees first."""
    free = [0.0] * max(1, groups)
    heapq.heapify(free)
    for s in job_s:
        heapq.heappush(free, heapq.heappop(free) + s)
    return max(free)


def lpt_makespan(job_s: Sequence[float], groups: int) -> float:
    """Longest processing time first (Graham; within 4/3 of the optimum)."""
    return list_schedule(sorted(job_s, reverse=True), groups)


def optimal_makespan(job_s: Sequence[float], groups: int, max_jobs: int = 14) -> float | None:
    """The best makespan over all assignments of jobs to groups (None above ``max_jobs`` jobs)."""
    jobs = sorted(job_s, reverse=True)
    if len(jobs) > max_jobs:
        return None
    if not jobs:
        return 0.0
    g = max(1, groups)
    best = math.inf
    # The first job goes to group 0 (groups are identical), the rest anywhere.
    for rest in itertools.product(range(g), repeat=len(jobs) - 1):
        loads = [0.0] * g
        loads[0] = jobs[0]
        for s, k in zip(jobs[1:], rest):
            loads[k] += s
        best = min(best, max(loads))
    return best


def expected_admitted(capacity: int, max_wait_s: float, job_s: float) -> int:
    """Requests of a burst of identical jobs whose predicted start is within ``max_wait_s``: job ``j``
    (0-based, in arrival order) starts at ``floor(j / capacity) * job_s``."""
    if job_s <= 0:
        raise ValueError("job_s must be > 0")
    return max(1, capacity) * (int(math.floor(max_wait_s / job_s + 1e-9)) + 1)


def burst_size(admitted: int, factor: float, cap: int) -> int:
    """``factor`` x what admission takes, at most ``cap`` (at least ``admitted + 1``, so something is refused)."""
    return max(admitted + 1, min(cap, int(math.ceil(factor * admitted))))


def parse_frames(text: str) -> list[int]:
    """``"81,17,81"`` -> ``[81, 17, 81]`` (positive integers)."""
    out = [int(x) for x in str(text).replace(" ", "").split(",") if x]
    if not out or any(f < 1 for f in out):
        raise ValueError(f"--frames wants a comma-separated list of positive frame counts, got {text!r}")
    return out


def alternating(frames: Sequence[int], short_first: bool = True) -> list[int]:
    """Shortest and longest alternately (``17, 81, 17, 81, ...``), or longest first."""
    asc = sorted(frames)
    lo, hi = 0, len(asc) - 1
    out: list[int] = []
    take_short = short_first
    while lo <= hi:
        if take_short:
            out.append(asc[lo])
            lo += 1
        else:
            out.append(asc[hi])
            hi -= 1
        take_short = not take_short
    return out


def arrival_orders(frames: Sequence[int], variants: bool) -> dict[str, list[int]]:
    """The arrival orders to run: the given one, and with ``variants`` the longest last
    (ascending) and short/long alternating from the shortest; duplicates left out."""
    orders: dict[str, list[int]] = {"given": list(frames)}
    if variants:
        for name, order in (("longest_last", sorted(frames)), ("alternating_short_first", alternating(frames))):
            if order not in orders.values():
                orders[name] = order
    return orders
