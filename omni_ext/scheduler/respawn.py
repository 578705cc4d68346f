"""When the TunedExecutor may start its workers again, and when it must give up instead: pure rules.

The executor (:mod:`omni_ext.executor.tuned`) asks :meth:`RespawnBudget.allow` each time its workers
must be replaced (a worker died, or the watchdog had to kill a job that would not stop). A respawn is
allowed while fewer than ``max_respawns`` respawns happened within the last ``window_s`` seconds;
otherwise the server exits non-zero so that its supervisor restarts it: a fault that returns every
few minutes (a bad device, a model that always crashes) is not something respawning can hide.

The watchdog's two stages are here too (:func:`watchdog_action`): a job past its time limit is first
asked to stop at its next denoise step; only a job still running ``grace_s`` after that is killed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from omni_ext.scheduler.config import HealingConfig


@dataclass
class RespawnBudget:
    """The respawns of the last ``config.window_s`` seconds (monotonic times)."""

    config: HealingConfig = field(default_factory=HealingConfig)
    times: deque[float] = field(default_factory=deque)

    def used(self, now: float) -> int:
        """Respawns within the window ending at ``now``."""
        while self.times and now - self.times[0] >= self.config.window_s:
            self.times.popleft()
        return len(self.times)

    def allow(self, now: float) -> bool:
        """Whether a respawn may happen at ``now``; when it may, it is counted."""
        if self.used(now) >= self.config.max_respawns:
            return False
        self.times.append(now)
        return True

    def refusal(self, now: float) -> str:
        """Why :meth:`allow` said no, for the log and the exit message."""
        return (f"{self.used(now)} respawn(s) within the last {self.config.window_s:g} s, the limit "
                f"(omni_ext.healing.max_respawns {self.config.max_respawns}); exiting so that a supervisor "
                "restarts the server")


class Watchdog(str, Enum):
    """What the watchdog does with a running job."""

    NOTHING = "nothing"
    STOP = "stop"  # ask it to stop at its next denoise step (the job fails with the watchdog's reason)
    KILL = "kill"  # it did not stop within the grace period: kill its workers (and respawn)


def watchdog_action(now: float, deadline: float | None, stop_asked: float | None, grace_s: float) -> Watchdog:
    """The watchdog's decision for one running (not paused) job: ``deadline`` is its time limit
    (monotonic; None: none), ``stop_asked`` when it was asked to stop (None: not yet)."""
    if deadline is None or now <= deadline:
        return Watchdog.NOTHING
    if stop_asked is None:
        return Watchdog.STOP
    return Watchdog.KILL if now - stop_asked > grace_s else Watchdog.NOTHING
