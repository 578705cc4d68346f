"""Durable job records in an embedded SQLite database; media lives in files next to it.

Why SQLite: a restart of ``vllm-omni serve`` must not lose finished jobs (their mp4s stay listed and
downloadable) nor accepted ones: at start-up a queued job whose request was kept runs again
(:mod:`omni_ext.api.drain`), and a job that was running (or queued without a kept request) is marked
``failed`` with ``error.code = "server_restarted"``. Finished jobs, completed or failed, expire with
their media after the TTL (:meth:`JobStore.expired`). One small table, WAL mode, one lock:
each call is a sub-millisecond local write, cheap enough to run on the event loop.

A full (or failing) disk must not leave a job "in progress" forever nor turn a status poll into a
500: an update the database cannot take (:meth:`JobStore.save`) is kept in memory, shown by
:meth:`JobStore.get`/:meth:`JobStore.list` in place of the stored row, and written as soon as the
database takes writes again (tried before every later call). A new job that cannot be stored
(:meth:`JobStore.add`) raises: the caller refuses it.
"""

from __future__ import annotations

import copy
import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omni_ext.models.families import JobShape

ACTIVE = ("queued", "in_progress")

logger = logging.getLogger("omni_ext.api")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    model TEXT,
    prompt TEXT,
    seconds TEXT,
    size TEXT,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at INTEGER,
    error_code TEXT,
    error_message TEXT,
    media TEXT,
    meta TEXT NOT NULL DEFAULT '{}',
    owner TEXT
);
CREATE INDEX IF NOT EXISTS jobs_kind_seq ON jobs(kind, seq);
"""

_COLUMNS = ("id", "kind", "status", "progress", "model", "prompt", "seconds", "size", "created_at",
            "completed_at", "expires_at", "error_code", "error_message", "media", "meta", "owner")


@dataclass(frozen=True)
class JobSpec:
    """One generation request, parsed and checked once (:mod:`omni_ext.api.intake`) before
    anything is admitted: what its job record, the queue and the
    engine call need, and nothing the route still has to look up.

    ``request``: vLLM-Omni's request for the engine call, a ``VideoGenerationRequest`` (videos) or
    the ``(OmniTextPrompt, OmniDiffusionSamplingParams)`` pair of its image call (images), with
    ``priority`` and ``deadline_s`` (the request's own, seconds from arrival, or None) already carried
    in its extra parameters. ``reference``: the ``input_reference``
    image (PIL) or None. ``width``/``height``/``frames``/``steps``: as the request resolves them
    (None: the pipeline's own default). ``seconds``: OpenAI's video length (videos only).
    ``uploads``: a video request's uploaded media persisted for vLLM-Omni's generation call
    (:class:`omni_ext.api.intake.Uploads`: ``input_references``, ``control_reference``, latent-edit
    sources), whose temporary files go when the job ends; None when it has none.
    """

    request: Any
    prompt: str
    shape: JobShape
    priority: int = 0
    deadline_s: float | None = None
    width: int | None = None
    height: int | None = None
    frames: int | None = None
    fps: int | None = None
    steps: int | None = None
    seconds: str | None = None
    n: int = 1
    reference: Any = None
    #: an ``input_reference`` upload that is a video (bytes): decoded at generation by vLLM-Omni's decoder,
    #: to the frames the pipeline keeps, as its route decodes it
    reference_video: bytes | None = None
    uploads: Any = None
    #: what the job keeps of its request for a remix (:func:`omni_ext.api.intake.remix_fields`), or None
    remix: dict[str, Any] | None = None


@dataclass
class Job:
    id: str
    kind: str
    status: str = "queued"
    progress: int = 0
    model: str | None = None
    prompt: str | None = None
    seconds: str | None = None
    size: str | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    expires_at: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    media: dict[str, str] = field(default_factory=dict)  # variant -> file name under media_dir
    meta: dict[str, Any] = field(default_factory=dict)
    #: the SHA-256 of the API key that created the job (:mod:`omni_ext.api.tenants`); None without keys
    owner: str | None = None

    @property
    def active(self) -> bool:
        return self.status in ACTIVE


class JobStore:
    def __init__(self, db_path: Path) -> None:
        db_path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(jobs)")}
        if "owner" not in columns:  # a store written before jobs had owners: its jobs are the admins' only
            self._db.execute("ALTER TABLE jobs ADD COLUMN owner TEXT")
        self._db.execute("CREATE INDEX IF NOT EXISTS jobs_owner_kind_seq ON jobs(owner, kind, seq)")
        self._pending: dict[str, Job] = {}  # updates the database did not take yet (a full disk)

    # ---- rows <-> jobs -------------------------------------------------------------------
    @staticmethod
    def _row(job: Job) -> tuple[Any, ...]:
        values = []
        for c in _COLUMNS:
            v = getattr(job, c)
            values.append(json.dumps(v) if c in ("media", "meta") else v)
        return tuple(values)

    @staticmethod
    def _job(row: tuple[Any, ...]) -> Job:
        data = dict(zip(_COLUMNS, row))
        data["media"] = json.loads(data["media"] or "{}")
        data["meta"] = json.loads(data["meta"] or "{}")
        return Job(**data)

    def _query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def _update(self, job: Job) -> None:
        sets = ", ".join(f"{c} = ?" for c in _COLUMNS[1:])
        self._db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", self._row(job)[1:] + (job.id,))

    def _flush(self) -> None:
        """Write the pending updates (under the lock); those the database still refuses stay pending."""
        for job_id, job in list(self._pending.items()):
            try:
                self._update(job)
            except sqlite3.Error:
                return
            del self._pending[job_id]
            if not self._pending:
                logger.info("omni-ext: job store writable again; pending job updates written")

    def _overlay(self, jobs: list[Job]) -> list[Job]:
        return [copy.deepcopy(self._pending[j.id]) if j.id in self._pending else j for j in jobs]

    @property
    def pending(self) -> int:
        """Job updates held in memory because the database did not take them (0 when all are stored)."""
        return len(self._pending)

    # ---- API -----------------------------------------------------------------------------
    def add(self, job: Job) -> Job:
        """Store a new job; raises ``sqlite3.Error`` if the database cannot take it (nothing is kept)."""
        with self._lock:
            self._flush()
            self._db.execute(
                f"INSERT INTO jobs ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})", self._row(job)
            )
        return job

    def create(self, **fields: Any) -> Job:
        """Store a new :class:`Job` made of ``fields`` (see :meth:`add`)."""
        return self.add(Job(**fields))

    def save(self, job: Job) -> Job:
        """Store a job's new state; if the database cannot take it now, it is kept in memory (never raises for that)."""
        with self._lock:
            self._flush()
            if self._pending:  # keep the order of updates: this one waits behind the pending ones
                self._pending[job.id] = copy.deepcopy(job)
                return job
            try:
                self._update(job)
            except sqlite3.Error as exc:
                logger.warning("omni-ext: job store refused the update of %s (%s); kept in memory until it can be "
                               "written", job.id, exc)
                self._pending[job.id] = copy.deepcopy(job)
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            if self._pending:
                self._flush()
            rows = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE id = ?", (job_id,)).fetchall()
            return self._overlay([self._job(rows[0])])[0] if rows else None

    def delete(self, job_id: str) -> None:
        """Remove a job; raises ``sqlite3.Error`` if the database cannot take it."""
        with self._lock:
            self._flush()
            self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            self._pending.pop(job_id, None)

    def list(self, kind: str, *, after: str | None, limit: int, order: str,
             owner: str | None = None) -> tuple[list[Job], bool]:
        """A page of jobs after the job ``after`` in creation order (``asc``/``desc``); returns (jobs, has_more).
        ``owner``: only that owner's jobs (``after`` must be one of them); None: every job."""
        desc = order == "desc"
        where, params = "kind = ?", [kind]
        if owner is not None:
            where += " AND owner = ?"
            params.append(owner)
        if after is not None:
            anchor = self._query(f"SELECT seq FROM jobs WHERE id = ? AND {where}", (after, *params))
            if not anchor:
                raise KeyError(after)
            where += " AND seq < ?" if desc else " AND seq > ?"
            params.append(anchor[0][0])
        rows = self._query(
            f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE {where} ORDER BY seq {'DESC' if desc else 'ASC'} LIMIT ?",
            (*params, limit + 1),
        )
        with self._lock:
            jobs = self._overlay([self._job(r) for r in rows[:limit]])
        return jobs, len(rows) > limit

    def fail_interrupted(self, now: int | None = None, ttl_s: int = 0, kept: set[str] = frozenset()) -> list[str]:
        """Mark jobs left queued/running by a previous process as failed (expiring ``ttl_s`` later, like any
        finished job; 0: never), except the queued ones in ``kept`` (their requests are kept: they run
        again); returns the failed ids."""
        now = int(time.time()) if now is None else now
        rows = self._query("SELECT id, status FROM jobs WHERE status IN (?, ?)", ACTIVE)
        ids = [i for i, status in rows if not (status == "queued" and i in kept)]
        for job_id in ids:
            self._query(
                "UPDATE jobs SET status = 'failed', error_code = 'server_restarted', completed_at = ?, expires_at = ?, "
                "error_message = 'The server restarted while this job was running; submit it again.' "
                "WHERE id = ?",
                (now, now + ttl_s if ttl_s else None, job_id),
            )
        return ids

    def queued(self, kind: str) -> list[Job]:
        """The ``kind`` jobs still queued, oldest first."""
        rows = self._query(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE kind = ? AND status = 'queued' ORDER BY seq",
                           (kind,))
        return [self._job(r) for r in rows]

    def expired(self, now: int | None = None) -> list[Job]:
        """Finished jobs (completed or failed) whose time is up, the oldest expiry first."""
        now = int(time.time()) if now is None else now
        rows = self._query(
            f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ? "
            "AND status NOT IN (?, ?) ORDER BY expires_at, seq",
            (now, *ACTIVE),
        )
        return [self._job(r) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
