"""The placement journal (:mod:`omni_ext.progress`) and its route, without a server: bounded files,
one merged time order over concurrent writers (threads of one process, several processes), lines
being written or broken skipped, and the route's paging and OpenAI-style 400s. That a real server's
executors and dispatcher journal their decisions is tested with them (``tests/test_executor.py``,
``tests/test_replicas.py``)."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import pytest

from omni_ext import progress


@pytest.fixture
def journal_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(progress.ENV, str(tmp_path))
    return tmp_path


def _files(root: Path) -> list[Path]:
    return sorted((root / progress.JOURNAL_DIR).glob("*.jsonl"))


def test_events_round_trip_in_order(journal_dir: Path) -> None:
    progress.record_placement("start", "video_a-1", ranks=[0, 1], mode="pair", waited_s=0.12345, predicted_s=None)
    progress.record_placement("done", "video_a-1", ranks=[0, 1], seconds=2.0001, error=False)
    events, more = progress.read_placements()
    assert not more
    assert [(e["kind"], e["request_id"], e["ranks"]) for e in events] == [("start", "video_a-1", [0, 1]),
                                                                        ("done", "video_a-1", [0, 1])]
    assert events[0]["mode"] == "pair" and events[0]["waited_s"] == 0.123 and events[0]["predicted_s"] is None
    assert events[1]["seconds"] == 2.0 and events[1]["error"] is False
    assert events[0]["time"] <= events[1]["time"]
    # after: strictly later events; limit: the first after ``after``, or the newest without it
    assert progress.read_placements(after=events[0]["time"]) == ([events[1]], False)
    assert progress.read_placements(limit=1) == ([events[1]], True)
    assert progress.read_placements(after=0, limit=1) == ([events[0]], True)


def test_no_directory_no_journal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(progress.ENV, raising=False)
    progress.record_placement("start", "video_a-1", ranks=[0])  # a no-op, never an error
    assert progress.read_placements() == ([], False)


def test_each_file_is_bounded_to_the_newest_events(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "JOURNAL_KEEP", 5)
    for i in range(23):
        progress.record_placement("bind", f"r-{i}", stage=0, replica=i % 2)
        lines = _files(journal_dir)[0].read_text().splitlines()
        assert len(lines) < 2 * 5
    events, _ = progress.read_placements()
    assert len(events) >= 5
    assert [e["request_id"] for e in events] == [f"r-{i}" for i in range(23 - len(events), 23)]


def test_lines_being_written_or_broken_are_skipped(journal_dir: Path) -> None:
    progress.record_placement("start", "video_a-1", ranks=[0], mode="single")
    path = _files(journal_dir)[0]
    with open(path, "a") as f:
        f.write('not json\n[1, 2]\n{"kind": "start"}\n{"time": "x"}\n{"time": 1.0, "kind": "done", "requ')
    events, _ = progress.read_placements()
    assert [e["request_id"] for e in events] == ["video_a-1"]


def _write_many(root: str, tag: str, n: int) -> None:
    import os

    os.environ[progress.ENV] = root
    for i in range(n):
        progress.record_placement("start", f"{tag}-{i}", ranks=[0], mode="single")


def test_concurrent_writers_merge_in_time_order(journal_dir: Path) -> None:
    """Three processes (as three replicas' executors) and two threads of this one write at once:
    one file per process, every event read back once, in one time order."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_many, args=(str(journal_dir), f"p{k}", 200)) for k in range(3)]
    threads = [threading.Thread(target=_write_many, args=(str(journal_dir), f"t{k}", 200)) for k in range(2)]
    for w in [*procs, *threads]:
        w.start()
    for w in [*procs, *threads]:
        w.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    assert len(_files(journal_dir)) == 4
    events, more = progress.read_placements()
    assert not more and len(events) == 5 * 200
    assert [e["time"] for e in events] == sorted(e["time"] for e in events)
    for tag in ("p0", "p1", "p2", "t0", "t1"):  # each writer's own order is kept
        assert [e["request_id"] for e in events if e["request_id"].startswith(tag + "-")] == \
            [f"{tag}-{i}" for i in range(200)]


def test_route_lists_and_rejects_bad_queries(journal_dir: Path, tmp_path: Path) -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from omni_ext.api.intake import ModelLimits
    from omni_ext.api.routes import build_router
    from tests.helpers import api_state

    for i in range(3):
        progress.record_placement("bind", f"r-{i}", stage=0, replica=i)
    app = FastAPI()
    app.include_router(build_router())
    app.state.omni_ext = api_state(tmp_path / "api", ModelLimits("WanPipeline", 16, 1, True))  # no keys: all events
    with TestClient(app) as client:
        body = client.get("/v1/omni_ext/placements").json()
        assert body["object"] == "list" and body["has_more"] is False
        assert [(e["object"], e["kind"], e["request_id"], e["replica"]) for e in body["data"]] == \
            [("omni_ext.placement", "bind", f"r-{i}", i) for i in range(3)]
        page = client.get("/v1/omni_ext/placements", params={"after": body["data"][0]["time"], "limit": 1}).json()
        assert [e["request_id"] for e in page["data"]] == ["r-1"] and page["has_more"] is True
        for params, param in [({"after": "yesterday"}, "after"), ({"after": "nan"}, "after"),
                              ({"after": "-1"}, "after"), ({"limit": "0"}, "limit"), ({"limit": "1001"}, "limit"),
                              ({"limit": "many"}, "limit")]:
            resp = client.get("/v1/omni_ext/placements", params=params)
            assert resp.status_code == 400, (params, resp.text)
            err = resp.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
