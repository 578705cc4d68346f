"""Denoise-step progress from the workers to the API process, through small files.

vLLM-Omni 0.30 has no per-step progress path to HTTP (``progress`` sits at 0, then jumps to 100).
Its pipelines do drive a progress bar per denoise loop (``ProgressBarMixin.progress_bar``) on rank 0,
and the engine request id of a job starts with the job id (``<job id>-<8 hex>``). So the worker,
through the ``step-progress`` patch, writes ``<request id>`` files holding ``done total t_start
t_last`` into a directory the API process chose (``OMNI_EXT_PROGRESS_DIR``, inherited by every
worker it spawns; in /dev/shm when available, so a write is a memory copy). The API process reads
the file for a job when a client polls. Works for inline, multi-process and replica layouts on one host.

omni-ext's TunedExecutor also writes a job's file when it hands the job to its worker ranks
(:func:`mark_started`, 0 steps done): until then the job only waits in the executor's queue, so the
file's existence is what tells the API process that a job really runs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "OMNI_EXT_PROGRESS_DIR"


def _pid_alive(pid: int) -> bool:
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
            if stale.name.isdigit() and not _pid_alive(int(stale.name)):
                shutil.rmtree(stale, ignore_errors=True)
        path = parent / str(os.getpid())
        os.environ[ENV] = str(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def progress_dir() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def write_progress(request_ids: list[str], done: int, total: int, t_start: float, mode: str | None = None) -> None:
    """Record that ``done`` of ``total`` denoise steps finished for these requests (the workers'
    step reports; ``mode``: only the executor's start marker, :func:`mark_started`)."""
    root = progress_dir()
    if root is None:
        return
    line = f"{done} {total} {t_start:.6f} {time.time():.6f}{f' {mode}' if mode else ''}\n"
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

    @property
    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total > 0 else 0.0

    def remaining_s(self) -> float | None:
        if self.done <= 0:
            return None
        per_step = max(1e-3, (self.t_last - self.t_start) / self.done)
        return per_step * max(0, self.total - self.done)


def read_progress(job_id: str) -> StepProgress | None:
    """API side: the newest step progress of any engine request belonging to ``job_id``."""
    root = progress_dir()
    if root is None:
        return None
    best: StepProgress | None = None
    for path in root.glob(f"{job_id}-*"):
        try:
            done, total, t0, t1, *mode = path.read_text().split()
            p = StepProgress(int(done), int(total), float(t0), float(t1), mode[0] if mode else None)
        except (OSError, ValueError):
            continue
        if best is None or p.t_last > best.t_last:
            best = p
    return best


def clear_progress(job_id: str) -> None:
    root = progress_dir()
    if root is None:
        return
    for path in root.glob(f"{job_id}-*"):
        try:
            path.unlink()
        except OSError:
            pass
