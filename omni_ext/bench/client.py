"""HTTP client side of the benchmarks: synchronous videos, asynchronous jobs, answers to 429.

``sync_request`` / ``sync_burst`` time ``POST /v1/videos/sync`` from the client (the executor
benchmarks). ``post_video`` creates an asynchronous job (``POST /v1/videos``) and classifies the
answer; :class:`JobTracker` waits for jobs to end, taking each end time from the server log
(:class:`omni_ext.bench.logwatch.LogWatcher`, to ~50 ms) or, failing that, from polling
``GET /v1/videos`` (one request for all jobs, so polling does not load the host).
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from dataclasses import dataclass, field
from typing import Any

from omni_ext.bench.common import Progress

TERMINAL = ("completed", "failed", "cancelled")


def _form(fields: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    """Multipart form parts; a ``bytes`` value is an uploaded PNG (``input_reference``, ``image``)."""
    return {k: (f"{k}.png", v, "image/png") if isinstance(v, bytes) else (None, str(v))
            for k, v in fields.items() if v is not None}


class RequestFailed(RuntimeError):
    """A non-200 answer; ``status`` is its HTTP status (a benchmark counts errors by it)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"request failed ({status}): {text[:300]}")
        self.status = status


def sync_request(url: str, fields: dict[str, Any], timeout: float = 1800,
                 headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One ``POST /v1/videos/sync``: client latency, size, the server's stage durations.
    Raises :class:`RequestFailed` on a non-200 answer."""
    import requests

    t0 = time.perf_counter()
    r = requests.post(url + "/v1/videos/sync", files=_form(fields), timeout=timeout, headers=headers)
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise RequestFailed(r.status_code, r.text)
    stages = {}
    raw = r.headers.get("X-Stage-Durations")
    if raw:
        try:
            stages = json.loads(raw)
        except ValueError:
            stages = {}
    return {"latency_s": dt, "bytes": len(r.content), "stages": stages, "request_id": r.headers.get("X-Request-Id")}


def sync_edit_request(url: str, fields: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """One ``POST /v1/images/edits`` (its ``image`` a PNG in ``fields``): the same record as
    :func:`sync_request`, the stage durations from the answer's ``metrics``."""
    return _sync_image(url + "/v1/images/edits", timeout, files=_form(fields))


def sync_image_request(url: str, fields: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """One ``POST /v1/images/generations`` (a JSON body): the same record as :func:`sync_edit_request`
    (the stage durations of its answer's ``metrics``, which vLLM-Omni's route and omni-ext's both give)."""
    return _sync_image(url + "/v1/images/generations", timeout, json=fields)


def _sync_image(endpoint: str, timeout: float, **payload: Any) -> dict[str, Any]:
    import requests

    t0 = time.perf_counter()
    r = requests.post(endpoint, timeout=timeout, **payload)
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise RequestFailed(r.status_code, r.text)
    body = r.json()
    stages = (body.get("metrics") or {}).get("stage_durations") or {}
    return {"latency_s": dt, "bytes": len(r.content), "stages": stages, "request_id": r.headers.get("X-Request-Id")}


def sync_burst(url: str, fields: dict[str, Any], n: int, progress: Progress | None = None) -> dict[str, Any]:
    """``n`` synchronous requests at once (a closed burst): wall time, throughput, latencies."""

    def one(i: int) -> float:
        lat = sync_request(url, {**fields, "seed": 100 + i})["latency_s"]
        if progress is not None:
            progress.advance()
        return lat

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        lats = list(pool.map(one, range(n)))
    wall = time.perf_counter() - t0
    return {"requests": n, "wall_s": wall, "throughput_rps": n / wall, "latencies_s": lats}


# ---- asynchronous jobs ------------------------------------------------------------------------------
def retry_delay_s(headers: dict[str, str]) -> float | None:
    """Seconds a refused client waits: ``retry-after-ms`` when present, else ``Retry-After`` (integer
    seconds); None when the answer names neither (or an unreadable value)."""
    h = {k.lower(): v for k, v in headers.items()}
    for key, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        raw = h.get(key)
        if raw is None:
            continue
        try:
            value = float(str(raw).strip()) / scale
        except ValueError:
            continue
        if value >= 0:
            return value
    return None


def classify(status: int, body: Any, headers: dict[str, str]) -> str:
    """``"job"`` (200 with a job id), ``"refused"`` (429 with a usable Retry-After) or ``"error"``
    (anything else, including a 429 that does not say when to come back)."""
    if status == 200 and isinstance(body, dict) and body.get("id"):
        return "job"
    if status == 429 and retry_delay_s(headers) is not None:
        return "refused"
    return "error"


def error_code(body: Any) -> str | None:
    err = body.get("error") if isinstance(body, dict) else None
    return err.get("code") if isinstance(err, dict) else None


@dataclass
class Answer:
    status: int
    body: Any
    headers: dict[str, str]
    sent_at: float  # monotonic
    answered_at: float
    kind: str = ""  # classify()

    @property
    def job_id(self) -> str | None:
        return self.body.get("id") if self.kind == "job" else None

    @property
    def retry_s(self) -> float | None:
        return retry_delay_s(self.headers)

    def record(self) -> dict[str, Any]:
        keep = {k: v for k, v in self.headers.items() if k.lower() in ("retry-after", "retry-after-ms")}
        out: dict[str, Any] = {"status": self.status, "kind": self.kind, "sent_at": self.sent_at,
                               "answer_s": self.answered_at - self.sent_at, "headers": keep}
        if self.kind == "job":
            out["id"] = self.job_id
            for k in ("queue_position", "predicted_start_at", "status"):
                if isinstance(self.body, dict) and k in self.body:
                    out[k] = self.body[k]
        else:
            out["error_code"] = error_code(self.body)
            out["body"] = self.body if isinstance(self.body, dict) else str(self.body)[:500]
        return out


def post_video(url: str, fields: dict[str, Any], priority: int | None = None, timeout: float = 120) -> Answer:
    """``POST /v1/videos`` (multipart, as current SDKs send it), with ``priority`` when given."""
    import requests

    body = {**fields, **({"priority": priority} if priority is not None else {})}
    t0 = time.monotonic()
    try:
        r = requests.post(url + "/v1/videos", files=_form(body), timeout=timeout)
    except requests.RequestException as exc:
        t1 = time.monotonic()
        return Answer(0, f"{type(exc).__name__}: {exc}", {}, t0, t1, "error")
    t1 = time.monotonic()
    try:
        parsed: Any = r.json()
    except ValueError:
        parsed = r.text[:500]
    headers = dict(r.headers)
    return Answer(r.status_code, parsed, headers, t0, t1, classify(r.status_code, parsed, headers))


def get_video(url: str, video_id: str, timeout: float = 30) -> dict[str, Any] | None:
    import requests

    try:
        r = requests.get(f"{url}/v1/videos/{video_id}", timeout=timeout)
    except requests.RequestException:
        return None
    return r.json() if r.status_code == 200 else None


def list_videos(url: str, timeout: float = 30) -> dict[str, dict[str, Any]]:
    """Every video job the server lists (all pages), by id."""
    import requests

    out: dict[str, dict[str, Any]] = {}
    after = None
    for _ in range(1000):
        params = {"limit": "100", "order": "asc", **({"after": after} if after else {})}
        r = requests.get(f"{url}/v1/videos", params=params, timeout=timeout)
        r.raise_for_status()
        page = r.json()
        for obj in page.get("data", []):
            out[obj["id"]] = obj
        if not page.get("has_more") or not page.get("last_id"):
            break
        after = page["last_id"]
    return out


@dataclass
class JobEnd:
    status: str
    ended_at: float  # monotonic, when the client learnt it
    source: str  # "log" or "poll"
    error: Any = None


@dataclass
class JobTracker:
    """Waits for asynchronous jobs to end. An end time comes from the API's ``video <id> completed``
    log line when the watcher saw it (to ~50 ms), else from the executor's ``done request`` line,
    else from the list poll that first saw the job ended (to ``poll_s``); ``source`` says which."""

    url: str
    watcher: Any = None  # LogWatcher or None
    poll_s: float = 0.5
    ends: dict[str, JobEnd] = field(default_factory=dict)

    def wait(self, ids: list[str], timeout: float, progress: Progress | None = None) -> dict[str, JobEnd]:
        deadline = time.monotonic() + timeout
        pending = [i for i in ids if i not in self.ends]
        while pending and time.monotonic() < deadline:
            now = time.monotonic()
            try:
                listed = list_videos(self.url)
            except Exception:  # a slow answer under load: try again
                listed = {}
            for vid in list(pending):
                obj = listed.get(vid)
                if obj is None or obj.get("status") not in TERMINAL:
                    continue
                end = JobEnd(obj["status"], now, "poll", obj.get("error"))
                if obj["status"] == "completed" and self.watcher is not None:
                    # The API's "stored" line; else the executor's "done" line (before the MP4 encoding).
                    for kind, source in (("completed", "log"), ("done", "log-executor")):
                        seen = self.watcher.first(kind, vid)
                        if seen is not None and seen.t <= now:
                            end = JobEnd("completed", seen.t, source)
                            break
                self.ends[vid] = end
                pending.remove(vid)
                if progress is not None:
                    progress.advance()
            if pending:
                time.sleep(self.poll_s)
        for vid in pending:
            self.ends[vid] = JobEnd("timeout", time.monotonic(), "poll")
        return {i: self.ends[i] for i in ids}
