"""List scheduling on a server's slots: when each job ahead starts, the rule
:mod:`omni_ext.scheduler.admission` tells clients and :mod:`omni_ext.scheduler.preempt` weighs
deadlines by (each job takes the slot that frees first). Pure; its own module because both use it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def slot_free_times(running_remaining: Sequence[float], capacity: int) -> list[float]:
    """A heap of the seconds from now at which each of ``capacity`` slots frees for the queue:
    ``running_remaining`` (one entry per running job) hold their slots first; more running jobs
    than slots (a layout change) queue up."""
    capacity = max(1, int(capacity))
    slots = [0.0] * capacity
    running = sorted((max(0.0, r) for r in running_remaining), reverse=True)
    for i, rest in enumerate(running[:capacity]):
        slots[i] = rest
    heapq.heapify(slots)
    for rest in running[capacity:]:
        heapq.heappush(slots, heapq.heappop(slots) + rest)
    return slots


def start_times(running_remaining: Sequence[float], queued: Sequence[float], capacity: int) -> list[float]:
    """Seconds from now until each of the ``queued`` jobs (service seconds, in start order) starts:
    ``running_remaining`` (one entry per running job) hold their slots first, then each queued job
    takes the slot that frees first, on ``capacity`` slots."""
    slots = slot_free_times(running_remaining, capacity)
    starts = []
    for seconds in queued:
        start = heapq.heappop(slots)
        starts.append(start)
        heapq.heappush(slots, start + max(0.0, seconds))
    return starts
