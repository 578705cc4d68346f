"""Follow a server's log as it is written and time the scheduler's events from the client's clock.

The log's own timestamps have one-second resolution, so the watcher reads the new bytes of the log
file every ``interval_s`` (50 ms) and stamps each line with ``time.monotonic()`` when it appears.
Lines it understands (the TunedExecutor's and the API's own):

- ``omni-ext: start request <id> on rank(s) [0, 1] (pair)`` (or ``(single)``, ``(warm-up)``), with the
  seconds the executor predicted for it (``predicted 0.412 s``) once its cost model knows a rate;
- ``omni-ext: done request <id> on rank(s) [0] in 2.34 s``;
- ``omni-ext video <job id> completed in 3.21 s`` (the API process, once the MP4 is stored);
- ``omni-ext dispatch: <id> -> stage-0 replica 2 (...)`` (the head binding a job to a replica: where a
  replica is on another host, its executor's lines are in that host's log, and this is its start).

The engine's request id of an asynchronous job is ``<job id>-<suffix>``: :func:`same_job` matches
either form.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_START = re.compile(r"omni-ext: start request (\S+) on rank\(s\) \[([\d,\s]*)\] \(([\w-]+)\)")
_PREDICTED = re.compile(r", predicted ([\d.]+) s")
_DONE = re.compile(r"omni-ext: done request (\S+) on rank\(s\) \[([\d,\s]*)\] in ([\d.]+) s")
_COMPLETED = re.compile(r"omni-ext video (\S+) completed in ([\d.]+) s")
_DISPATCH = re.compile(r"omni-ext dispatch: (\S+) -> stage-\d+ replica (\d+)")


@dataclass(frozen=True)
class LogEvent:
    kind: str  # "start", "done", "completed" or "dispatch" (ranks: the replica)
    request_id: str
    t: float  # monotonic time the line was seen
    ranks: tuple[int, ...] = ()
    mode: str | None = None  # start: "pair", "single", "warm-up"
    predicted_s: float | None = None  # start: the executor's prediction of its seconds (None: no rate known)
    seconds: float | None = None  # done / completed: the duration the line reports
    error: bool = False


def _ranks(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


def parse_line(line: str, t: float) -> LogEvent | None:
    """The event of one log line, or None."""
    m = _START.search(line)
    if m:
        p = _PREDICTED.search(line, m.end())
        return LogEvent("start", m.group(1), t, _ranks(m.group(2)), mode=m.group(3),
                        predicted_s=float(p.group(1)) if p else None)
    m = _DONE.search(line)
    if m:
        return LogEvent("done", m.group(1), t, _ranks(m.group(2)), seconds=float(m.group(3)),
                        error="(error)" in line[m.end():])
    m = _COMPLETED.search(line)
    if m:
        return LogEvent("completed", m.group(1), t, seconds=float(m.group(2)))
    m = _DISPATCH.search(line)
    if m:
        return LogEvent("dispatch", m.group(1), t, (int(m.group(2)),))
    return None


def same_job(request_id: str, job_id: str) -> bool:
    """Whether an engine request id belongs to job ``job_id`` (``<job id>`` or ``<job id>-<suffix>``)."""
    return request_id == job_id or request_id.startswith(job_id + "-")


def running_at(events: list[LogEvent], t: float) -> list[str]:
    """Request ids (not warm-ups) that had started and not finished at time ``t``."""
    started: dict[str, float] = {}
    for e in events:
        if e.kind == "start" and e.mode != "warm-up" and e.t <= t:
            started.setdefault(e.request_id, e.t)
        elif e.kind == "done" and e.t <= t:
            started.pop(e.request_id, None)
    return sorted(started, key=started.get)


def mode_counts(events: list[LogEvent], since: float = float("-inf"), until: float = float("inf")) -> dict[str, int]:
    """How many requests started in each mode (pair, single, ...) between ``since`` and ``until``."""
    counts: dict[str, int] = {}
    for e in events:
        if e.kind == "start" and since <= e.t <= until and e.mode:
            counts[e.mode] = counts.get(e.mode, 0) + 1
    return counts


class LogWatcher:
    """Tails one log file in a thread; :meth:`first` and :meth:`wait` look events up by job id."""

    def __init__(self, path: str | Path, interval_s: float = 0.05) -> None:
        self.path = Path(path)
        self.interval_s = interval_s
        self._events: list[LogEvent] = []
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._offset = 0
        self._partial = b""

    def start(self, from_end: bool = True) -> LogWatcher:
        """Start following; with ``from_end`` only lines written from now on count."""
        try:
            self._offset = self.path.stat().st_size if from_end else 0
        except OSError:
            self._offset = 0
        self._thread = threading.Thread(target=self._run, name=f"logwatch-{self.path.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._read()  # whatever was written last

    def __enter__(self) -> LogWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._read()
            self._stop.wait(self.interval_s)

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        if not data:
            return
        t = time.monotonic()
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        new = [e for e in (parse_line(raw.decode("utf-8", "replace"), t) for raw in lines) if e is not None]
        if new:
            with self._lock:
                self._events.extend(new)
                self._lock.notify_all()

    @property
    def events(self) -> list[LogEvent]:
        with self._lock:
            return list(self._events)

    def first(self, kind: str, job_id: str) -> LogEvent | None:
        with self._lock:
            return next((e for e in self._events if e.kind == kind and same_job(e.request_id, job_id)), None)

    def wait(self, kind: str, job_id: str, timeout: float) -> LogEvent | None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                hit = next((e for e in self._events if e.kind == kind and same_job(e.request_id, job_id)), None)
                left = deadline - time.monotonic()
                if hit is not None or left <= 0:
                    return hit
                self._lock.wait(min(left, 0.5))
