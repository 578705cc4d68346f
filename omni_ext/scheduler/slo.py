"""SLO attainment: the share of finished requests that met their deadline, over recent windows.

A request's deadline is fixed when it is admitted (:meth:`omni_ext.scheduler.admission.Ticket.deadline`:
``slo_factor`` x its predicted standalone time, or its own ``deadline_s``), so what is judged is the
promise as it stood then, not a prediction corrected after the fact. A request admitted before the
server knew any rate has no deadline and is not counted; cancelled requests are not counted either.
"""

from __future__ import annotations

from collections import deque

#: The windows ``omni_ext:slo_attainment{window}`` reports, in seconds (label: ``"300s"``, ...).
WINDOWS_S: tuple[float, ...] = (300.0, 3600.0)


class Attainment:
    """Finished requests with a deadline, kept for the longest window: (finish time, met)."""

    def __init__(self, windows_s: tuple[float, ...] = WINDOWS_S) -> None:
        self.windows_s = windows_s
        self.finished: deque[tuple[float, bool]] = deque()

    def record(self, now: float, deadline: float) -> bool:
        """A request with ``deadline`` finished at ``now``; returns whether it met it."""
        met = now <= deadline
        self.finished.append((now, met))
        horizon = now - max(self.windows_s)
        while self.finished and self.finished[0][0] < horizon:
            self.finished.popleft()
        return met

    def counts(self, now: float, window_s: float) -> tuple[int, int]:
        """(met, finished) among the requests that finished within ``window_s`` before ``now``."""
        recent = [met for t, met in self.finished if t >= now - window_s]
        return sum(recent), len(recent)
