"""Denoise-step progress from the workers to the API process, through small files.

vLLM-Omni 0.30 has no per-step progress path to HTTP (``progress`` sits at 0, then jumps to 100).
Its pipelines do drive a progress bar per denoise loop (``ProgressBarMixin.progress_bar``) on rank 0,
and the engine request id of a job starts with the job id (``<job id>-<8 hex>``). So the worker,
through the ``step-progress`` patch, writes ``<request id>`` files holding ``done total t_start
t_last`` (and the start marker's mode and time, below) into a directory the API process chose (``OMNI_EXT_PROGRESS_DIR``, inherited by every
worker it spawns; in /dev/shm when available, so a write is a memory copy). The API process reads
the file for a job when a client polls. Works for inline, multi-process and replica layouts on one host.

omni-ext's TunedExecutor also writes a job's file when it hands the job to its worker ranks
(:func:`mark_started`, 0 steps done): until then the job only waits in the executor's queue, so the
file's existence is what tells the API process that a job really runs. The step reports that
replace the marker carry its mode and time on, so the API learns a job's time from its start on its
ranks and per run mode (a pair and a single rank take different times).

The same directory carries the placement journal (:func:`record_placement`, read by
:func:`read_placements`, served at ``GET /v1/omni_ext/placements``): where each request ran. Each
writing process (a TunedExecutor, one per replica; the head's replica dispatcher) appends JSON
lines to a file of its own, so concurrent writers never share a file and need no lock between
processes; a reader merges the files in time order and skips a line it cannot parse (a line being
appended). Each file is bounded: after ``2 * JOURNAL_KEEP`` appends the writer rewrites it with its
newest ``JOURNAL_KEEP`` events (kept in memory; an atomic replace, so a reader sees the old or
the new file).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV = "OMNI_EXT_PROGRESS_DIR"
#: The placement journal's sub-directory (a leading dot: no job id's ``<id>-*`` matches it).
JOURNAL_DIR = ".placements"
#: Events each writer keeps (its file holds between this many and twice this many).
JOURNAL_KEEP = 2000


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ensure_progress_dir(base: Path | None = None) -> Path:
    """Called in the API process before workers start: choose the directory and export it.

    One sub-directory per server process under a common parent; directories of servers that no
    longer run (killed before their exit handler) are removed here, so they never pile up.
    """
    existing = os.environ.get(ENV)
    if existing:
        path = Path(existing)
    else:
        if base is None:
            base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        parent = base / "omni-ext-progress"
        parent.mkdir(parents=True, exist_ok=True)
        for stale in parent.iterdir():
            if stale.name.isdigit() and not pid_alive(int(stale.name)):
                shutil.rmtree(stale, ignore_errors=True)
        path = parent / str(os.getpid())
        os.environ[ENV] = str(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def progress_dir() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def write_progress(request_ids: list[str], done: int, total: int, t_start: float, mode: str | None = None,
                   t_job: float | None = None) -> None:
    """Record that ``done`` of ``total`` denoise steps finished for these requests (the workers'
    step reports). ``mode``: the mode the executor's start marker (:func:`mark_started`) gave, and
    ``t_job``: the marker's time, which the step reports carry on (:func:`read_marker`), so that
    the API learns each job's time from its real start and per run mode."""
    root = progress_dir()
    if root is None:
        return
    tail = f" {mode or '-'} {t_job:.6f}" if t_job is not None else (f" {mode}" if mode else "")
    line = f"{done} {total} {t_start:.6f} {time.time():.6f}{tail}\n"
    for rid in request_ids:
        if "/" in rid or rid.startswith("."):
            continue
        tmp = root / f".{rid}.tmp"
        try:
            tmp.write_text(line)
            os.replace(tmp, root / rid)
        except OSError:
            return  # progress is best-effort; never disturb generation


def mark_started(request_ids: list[str], steps_total: int, mode: str | None = None) -> None:
    """Executor side: these engine requests (``<job id>-<suffix>``, the ids the workers report
    steps under) start on their worker ranks now, 0 of ``steps_total`` steps done.

    The job's lead rank then overwrites the same file with its step reports (``step-progress``;
    the first, 0 steps done, when its denoise loop begins): ``t_start`` becomes the loop's start,
    and ``mode`` ("pair": a CFG group runs it, one branch per rank; "single": one rank runs all
    of it), which those reports do not repeat, is gone."""
    write_progress(request_ids, 0, steps_total, time.time(), mode)


def read_marker(request_id: str) -> tuple[float, str | None] | None:
    """Worker side, when a denoise loop begins: the start marker's (time, mode) of this engine request,
    for the step reports to carry on; None without a marker (vLLM-Omni's own executor)."""
    p = read_request(request_id)
    if p is None:
        return None
    if p.t_job is not None:
        return p.t_job, p.mode
    return (p.t_start, p.mode) if p.done == 0 and p.mode else None


@dataclass(frozen=True)
class StepProgress:
    """One progress file: ``done`` of ``total`` steps, when the job (start marker) or its denoise
    loop (step reports) began and the latest write (``time.time()``), and the start marker's mode
    until the step reports replace it."""

    done: int
    total: int
    t_start: float
    t_last: float
    mode: str | None = None
    t_job: float | None = None  # the start marker's time, once step reports replaced it (t_start: the loop's)

    @property
    def started_at(self) -> float:
        """When the job started on its ranks (the start marker), else when its denoise loop began."""
        return self.t_job if self.t_job is not None else self.t_start

    @property
    def before_loop_s(self) -> float:
        """Seconds from the job's start to its denoise loop's (text encoding)."""
        return max(0.0, self.t_start - self.t_job) if self.t_job is not None else 0.0

    @property
    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total > 0 else 0.0

    def remaining_s(self) -> float | None:
        if self.done <= 0:
            return None
        per_step = max(1e-3, (self.t_last - self.t_start) / self.done)
        return per_step * max(0, self.total - self.done)


def read_request(request_id: str) -> StepProgress | None:
    """One engine request's progress file (None: none, or no progress dir): the executor's and the worker's read."""
    root = progress_dir()
    if root is None or "/" in request_id or request_id.startswith("."):
        return None
    try:
        return _parse((root / request_id).read_text())
    except (OSError, ValueError):
        return None


def read_progress(job_id: str) -> StepProgress | None:
    """API side: the newest step progress of any engine request belonging to ``job_id``."""
    root = progress_dir()
    if root is None:
        return None
    best: StepProgress | None = None
    for path in root.glob(f"{job_id}-*"):
        try:
            p = _parse(path.read_text())
        except (OSError, ValueError):
            continue
        if best is None or p.t_last > best.t_last:
            best = p
    return best


def _parse(text: str) -> StepProgress:
    """One progress line: ``done total t_start t_last [mode [t_job]]`` (mode "-": none)."""
    done, total, t0, t1, *rest = text.split()
    mode = rest[0] if rest and rest[0] != "-" else None
    return StepProgress(int(done), int(total), float(t0), float(t1), mode, float(rest[1]) if len(rest) > 1 else None)


#: The start marker's word for a job paused by step-level preemption (its ``mode`` while paused).
PAUSED = "paused"


def mark_paused(request_ids: list[str], paused: bool) -> None:
    """Executor side: these engine requests are paused (``paused``) or run again. The file keeps its
    steps; ``mode`` says :data:`PAUSED` while paused, and at the resume ``t_start`` moves on by the
    paused time, so that the rate of the steps (the predicted remaining time) leaves it out."""
    root = progress_dir()
    if root is None:
        return
    now = time.time()
    for rid in request_ids:
        try:
            p = _parse((root / rid).read_text())
        except (OSError, ValueError):
            continue
        if paused:
            write_progress([rid], p.done, p.total, p.t_start, PAUSED, p.t_job)
        else:  # the job's own start moves on too: its time (what the API learns) leaves the pause out
            shift = max(0.0, now - p.t_last)
            write_progress([rid], p.done, p.total, p.t_start + shift, None,
                           p.t_job + shift if p.t_job is not None else None)


def clear_progress(job_id: str) -> None:
    root = progress_dir()
    if root is None:
        return
    for path in root.glob(f"{job_id}-*"):
        try:
            path.unlink()
        except OSError:
            pass


# ---- preemption counts ----------------------------------------------------------------------------
#: The sub-directory where each executor process keeps its preemption counts (``<pid>.json``).
PREEMPT_DIR = ".preemptions"


def write_preemptions(counts: dict[str, int], paused: int) -> None:
    """Executor side: this process's preemptions so far, by reason, and its jobs paused now (a file of
    its own, replaced atomically). Best-effort: never raises."""
    _write_record(PREEMPT_DIR, {"preemptions": counts, "paused": paused})


def read_preemptions(root: Path | None = None) -> tuple[dict[str, int], int]:
    """API side: preemptions by reason summed over every executor process of this server, and the
    jobs paused now (only in processes still alive)."""
    root = root or progress_dir()
    counts: dict[str, int] = {}
    paused = 0
    if root is None:
        return counts, paused
    for path in sorted((root / PREEMPT_DIR).glob("*.json")):
        try:
            data = json.loads(path.read_text())
            for reason, n in data.get("preemptions", {}).items():
                counts[reason] = counts.get(reason, 0) + int(n)
            if pid_alive(int(path.stem)):
                paused += int(data.get("paused", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return counts, paused


# ---- healing: worker deaths, respawns, and whether an executor is respawning now ----------------
#: The sub-directory where each executor process keeps its healing record (``<pid>.json``).
HEALING_DIR = ".healing"


@dataclass(frozen=True)
class Healing:
    """The healing records of this server's executors, as the API process reads them.

    ``respawning``: every live executor is replacing all its workers now (no job can start: admission
    answers 503 and ``/health`` says so); ``groups_respawning``/``groups``: worker groups being
    replaced now, of how many (some being replaced while others serve: ``/health`` says "degraded",
    admission admits); ``reason``/``since``: the newest respawn's cause and wall start time;
    ``counts``: events summed over the executors (``worker_deaths``, ``respawns``, ``watchdog_stops``,
    ``watchdog_kills``)."""

    respawning: bool = False
    groups_respawning: int = 0
    groups: int = 0
    reason: str = ""
    since: float | None = None
    counts: dict[str, int] = field(default_factory=dict)
    start_s: float = 0.0  # how long the respawning executor's workers took to start last time
    exhausted: str | None = None  # an executor gave up (its respawn budget is spent): why


def write_healing(record: dict[str, Any]) -> None:
    """Executor side: this process's healing record (``state``: "serving", "degraded", "respawning" or "exhausted",
    ``reason``, ``since``, and counts), replaced atomically. Best-effort: never raises."""
    _write_record(HEALING_DIR, record)


def _write_record(subdir: str, data: dict[str, Any]) -> None:
    """This process's record ``<subdir>/<pid>.json`` under the progress directory, replaced atomically;
    best-effort (nothing when there is no progress directory or the write fails)."""
    root = progress_dir()
    if root is None:
        return
    try:
        path = root / subdir / f"{os.getpid()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        return


_healing_cache: dict[str, tuple[int, dict[str, Any]]] = {}


def read_healing(root: Path | None = None) -> Healing:
    """API side: :class:`Healing` over the records of this server's live executor processes. Cheap
    enough for every admission: a directory listing and a ``stat`` per executor (a record is parsed
    again only when it changed)."""
    root = root or progress_dir()
    if root is None:
        return Healing()
    try:
        entries = [e for e in os.scandir(root / HEALING_DIR) if e.name.endswith(".json") and e.name[:-5].isdigit()]
    except OSError:
        return Healing()
    counts: dict[str, int] = {}
    states: list[dict[str, Any]] = []  # the records of live executors
    gave_up: str | None = None  # an executor's process ends once it gave up: any record counts
    for entry in entries:
        try:
            mtime = entry.stat().st_mtime_ns
            cached = _healing_cache.get(entry.path)
            if cached is None or cached[0] != mtime:
                cached = (mtime, json.loads(Path(entry.path).read_text()))
                _healing_cache[entry.path] = cached
            data = cached[1]
            for key, n in data.get("counts", {}).items():
                counts[key] = counts.get(key, 0) + int(n)
            if data.get("state") == "exhausted":
                gave_up = str(data.get("reason", ""))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        if pid_alive(int(entry.name[:-5])):
            states.append(data)
    down = [s for s in states if s.get("state") in ("respawning", "degraded")]
    newest = max(down, key=lambda s: s.get("since") or 0.0, default={})
    respawning = bool(states) and all(s.get("state") == "respawning" for s in states)
    groups = sum(int(s.get("groups") or 1) for s in states)
    groups_down = sum(int(s.get("groups_respawning") or (s.get("state") == "respawning")) for s in down)
    return Healing(respawning, groups_down, groups, str(newest.get("reason", "")), newest.get("since"), counts,
                   float(newest.get("start_s") or 0.0), gave_up)


# ---- the placement journal -------------------------------------------------------------------
class _Journal:
    """This process's journal file and its newest events (for the rewrite that bounds the file)."""

    def __init__(self, path: Path, keep: int) -> None:
        self.path, self.keep = path, keep
        self.lines: deque[str] = deque(maxlen=keep)
        self.appended = 0
        self.count = 0
        self.lock = threading.Lock()

    def write(self, event: dict[str, Any]) -> None:
        with self.lock:
            self.count += 1
            line = json.dumps({**event, "n": self.count}, separators=(",", ":")) + "\n"
            self.lines.append(line)
            if self.appended + 1 >= 2 * self.keep:
                tmp = self.path.with_name(f".{self.path.name}.tmp")
                tmp.write_text("".join(self.lines))
                os.replace(tmp, self.path)
                self.appended = len(self.lines)
            else:
                if self.appended == 0:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a") as f:
                    f.write(line)
                self.appended += 1


_journal: _Journal | None = None
_journal_lock = threading.Lock()


def _forget_journal() -> None:
    """A forked child writes a file of its own (its pid), with a fresh lock."""
    global _journal, _journal_lock
    _journal, _journal_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_journal)


def _this_journal(root: Path) -> _Journal:
    global _journal
    with _journal_lock:
        path = root / JOURNAL_DIR / f"{os.getpid()}.jsonl"
        if _journal is None or _journal.path != path:
            _journal = _Journal(path, JOURNAL_KEEP)
        return _journal


def record_placement(kind: str, request_id: str, **fields: Any) -> None:
    """Journal one placement event of this process: ``kind`` is ``queued`` (the executor could not
    start the request at once), ``start`` (the executor hands the
    request to ``ranks`` in ``mode``), ``done`` (every rank answered), ``bind`` (the head's
    dispatcher binds it to a stage replica), or for step-level preemption ``preempt`` (the executor
    asks it to pause, ``reason``, ``for_request``), ``paused`` (every rank paused, before ``step``)
    and ``resumed`` (after ``paused_s``), or ``split`` (a tentative CFG pair stops at its next step to
    start again on one rank, ``for_request`` the request behind it: placement rule 5). Floats are rounded to the millisecond. Best-effort:
    never raises, never disturbs generation."""
    root = progress_dir()
    if root is None:
        return
    try:
        event = {"time": round(time.time(), 6), "kind": kind, "request_id": request_id, "pid": os.getpid()}
        event.update({k: round(v, 3) if isinstance(v, float) else v for k, v in fields.items()})
        _this_journal(root).write(event)
    except Exception:  # noqa: BLE001 - the journal is best-effort
        return


def read_placements(after: float | None = None, limit: int | None = None,
                    root: Path | None = None,
                    keep: Callable[[dict[str, Any]], bool] | None = None) -> tuple[list[dict[str, Any]], bool]:
    """The journalled events of every writer, merged in time order (ties: by writer, then its own
    order): the first ``limit`` events after the unix time ``after``, or without ``after`` the
    newest ``limit``; and whether more events matched than were returned. ``keep``: only the events
    it accepts count (the caller's own requests)."""
    root = root or progress_dir()
    events: list[dict[str, Any]] = []
    if root is not None:
        for path in sorted((root / JOURNAL_DIR).glob("*.jsonl")):
            try:
                text = path.read_text()
            except OSError:
                continue
            for line in text.splitlines():
                try:
                    event = json.loads(line)
                    t = float(event["time"])
                except (ValueError, TypeError, KeyError):
                    continue
                if isinstance(event, dict) and (after is None or t > after) and (keep is None or keep(event)):
                    events.append(event)
    events.sort(key=lambda e: (e["time"], e.get("pid", 0), e.get("n", 0)))
    if limit is None or len(events) <= limit:
        return events, False
    return (events[:limit] if after is not None else events[len(events) - limit:]), True
