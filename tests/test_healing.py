"""A server that heals itself, without a server: the respawn budget and the watchdog's two stages
(``omni_ext.scheduler.respawn``), their options (``omni_ext.scheduler.config``), the executor's queue
failing only the jobs on a dead group (its pipes replaced by a list), and the healing records the API
process reads (``omni_ext.progress``, ``omni_ext.healing``). On real servers: ``tests/test_drills.py``'s
worker-kill drill."""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace
from pathlib import Path

import pytest

from omni_ext import healing, progress
from omni_ext.scheduler.config import HealingConfig, healing_config
from omni_ext.scheduler.respawn import RespawnBudget, Watchdog, watchdog_action
from tests.helpers import rank_queue, wan_request


def test_respawn_budget_counts_respawns_in_a_sliding_window() -> None:
    budget = RespawnBudget(HealingConfig(max_respawns=2, window_s=100.0))
    assert budget.allow(0.0) and budget.allow(10.0)
    assert not budget.allow(50.0)  # a third within 100 s: give up
    assert "2 respawn(s) within the last 100 s" in budget.refusal(50.0)
    assert budget.allow(100.0)  # the first left the window (the refused one was never counted)
    assert not budget.allow(109.0) and budget.allow(110.0)
    assert not RespawnBudget(HealingConfig(max_respawns=0)).allow(0.0)  # 0: never respawn


def test_the_watchdog_stops_first_and_kills_only_after_the_grace_period() -> None:
    assert watchdog_action(10.0, None, None, 5.0) is Watchdog.NOTHING  # no limit
    assert watchdog_action(10.0, 10.0, None, 5.0) is Watchdog.NOTHING  # not past it
    assert watchdog_action(10.5, 10.0, None, 5.0) is Watchdog.STOP
    assert watchdog_action(15.5, 10.0, 10.5, 5.0) is Watchdog.NOTHING  # asked, still within the grace
    assert watchdog_action(15.6, 10.0, 10.5, 5.0) is Watchdog.KILL


def test_healing_options_come_from_additional_config_and_typos_fail() -> None:
    assert healing_config(None) == HealingConfig()
    got = healing_config('{"omni_ext": {"healing": {"max_respawns": 1, "window_s": 60, "grace_s": 2}}}')
    assert got == HealingConfig(max_respawns=1, window_s=60.0, grace_s=2.0)
    for bad, needle in (({"max_respawn": 1}, "unknown omni_ext.healing option"), ({"max_respawns": -1}, ">= 0"),
                        ({"max_respawns": True}, "integer"), ({"window_s": "5"}, "number"), ({"window_s": 0}, "> 0")):
        with pytest.raises(ValueError, match=needle):
            healing_config({"omni_ext": {"healing": bad}})


def test_a_dead_group_fails_only_its_jobs_the_other_group_serves_the_queue_meanwhile() -> None:
    rq = rank_queue(world=2, cfg_size=1, settle_s=0, preempt=False)  # two groups of one rank: [0], [1]
    a, b, c, d = (rq.submit(f"r{i}", wan_request()) for i in range(4))
    assert {a.ranks, b.ranks} == {(0,), (1,)} and c.ranks == () and d.ranks == ()
    dead = a if a.ranks == (0,) else b
    other = b if dead is a else a
    assert rq.group_of([0]) == (0,)
    assert rq.fail_on((0,), "omni-ext: diffusion worker DiffusionWorker-0 (rank 0, pid 1) died with SIGKILL") == [dead]
    err = dead.future.result(timeout=1).error
    assert "died with SIGKILL" in err and f"request {dead.request_id} was running on rank(s) [0]" in err
    assert not other.future.done() and not c.future.done() and rq.busy[0] == "respawning"
    assert c.ranks == () and d.ranks == ()  # rank 1 is busy, rank 0 is being replaced
    from omni_ext.executor.protocol import JobDone
    from vllm_omni.diffusion.data import DiffusionOutput

    rq.on_done(1, JobDone(other.job_id, 1, DiffusionOutput(output=None), True, 0.1))
    assert other.future.done() and not other.future.result().error
    assert c.ranks == (1,) and d.ranks == ()  # the serving group takes the queue; nothing goes to rank 0
    rq.respawned((0,))
    assert d.ranks == (0,) and rq.busy[0] == d.job_id  # the new workers take the next one


def test_a_death_seen_by_the_monitor_and_by_health_at_once_is_reported_once() -> None:
    """The sentinel monitor and ``/health`` (``check_health``) can both see a worker die before the
    executor has marked its group: the death is counted and healed once (a CI run counted 4 deaths
    for 3 kills)."""
    from omni_ext.executor.tuned import TunedExecutor

    ex = object.__new__(TunedExecutor)
    ex._lock = threading.Condition()
    ex._expected = set()
    ex._counts = {"worker_deaths": 0}
    ex._procs = [SimpleNamespace(name="DiffusionWorker-0", pid=1, exitcode=-9, join=lambda t: time.sleep(0.05)),
                 SimpleNamespace(name="DiffusionWorker-1", pid=2, exitcode=None, join=lambda t: None)]
    healed = []
    ex._heal = lambda ranks, reason: healed.append((ranks, reason))
    threads = [threading.Thread(target=ex._on_worker_death, args=([0],)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ex._counts["worker_deaths"] == 1
    assert healed == [([0], "omni-ext: diffusion worker DiffusionWorker-0 (rank 0, pid 1) died with SIGKILL")]
    ex._on_worker_death([0, 1])  # a later death of another rank is still reported
    assert ex._counts["worker_deaths"] == 2 and healed[-1][0] == [1]


def test_the_watchdog_stop_fails_the_job_with_its_reason_and_cancels_it_at_the_next_step() -> None:
    rq = rank_queue(world=2, cfg_size=1, settle_s=0, preempt=False)
    job = rq.submit("slow", wan_request())
    job.deadline = time.monotonic()  # its time limit (none yet: nothing measured)
    rq.stop_late(job, "omni-ext: request slow exceeded its time limit", time.monotonic())
    assert job.future.result(timeout=1).error == "omni-ext: request slow exceeded its time limit"
    assert all(rq.cancel_slots[r] == job.seq for r in job.ranks) and job.stop_asked is not None
    assert rq.late(job.deadline + 1) == [job]  # still running until it stops: the grace period counts from here


def test_the_api_reads_respawning_exhausted_and_counts_from_the_executors_records(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(progress.ENV, str(tmp_path))
    assert healing.refusal() is None and progress.read_healing() == progress.Healing()
    progress.write_healing({"state": "respawning", "reason": "worker died", "since": time.time(), "start_s": 30.0,
                            "counts": {"worker_deaths": 1, "respawns": 1}})
    state = progress.read_healing()
    assert state.respawning and state.reason == "worker died" and state.counts == {"worker_deaths": 1, "respawns": 1}
    refused = healing.refusal()
    assert refused.status == 503 and refused.code == "respawning" and 28 <= int(refused.headers["retry-after"]) <= 30
    # a record of a process that is gone counts, but says nothing about now; another live one serving: admit
    dead = tmp_path / progress.HEALING_DIR / "999999999.json"
    dead.write_text(json.dumps({"state": "respawning", "counts": {"respawns": 2}}))
    progress.write_healing({"state": "serving", "counts": {"worker_deaths": 1, "respawns": 1}})
    state = progress.read_healing()
    assert not state.respawning and state.counts["respawns"] == 3 and healing.refusal() is None
    dead.write_text(json.dumps({"state": "exhausted", "reason": "4 respawn(s)", "counts": {}}))
    os.utime(dead, ns=(1, 1))  # a changed record is read again even with an older time stamp
    assert progress.read_healing().exhausted == "4 respawn(s)" and healing.refusal().code == "server_stopping"


def _health_client(stock, tmp_path: Path, monkeypatch):
    """``/health`` as omni-ext puts it in front of ``stock`` (vLLM-Omni's endpoint), in process, reading the
    healing records under ``tmp_path``; admission's copy of the records is restored after the test."""
    from fastapi import APIRouter, FastAPI
    from fastapi.testclient import TestClient

    router = APIRouter()
    router.add_api_route("/health", healing.health_route(stock), methods=["GET"])
    app = FastAPI()
    app.include_router(router)
    monkeypatch.setenv(progress.ENV, str(tmp_path))
    monkeypatch.setattr(healing, "LATEST", healing.LATEST)  # restored after: /health updates admission's copy
    return TestClient(app)


def test_health_says_respawning_with_a_retry_after_and_is_the_stock_answer_otherwise(tmp_path: Path, monkeypatch) -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse

    async def stock(raw_request: Request) -> JSONResponse:
        return JSONResponse({"status": "healthy", "path": raw_request.url.path})

    client = _health_client(stock, tmp_path, monkeypatch)
    assert client.get("/health").json() == {"status": "healthy", "path": "/health"}
    progress.write_healing({"state": "respawning", "reason": "worker died", "since": time.time(), "start_s": 5.0,
                            "counts": {}})
    got = client.get("/health")
    assert got.status_code == 503 and got.json()["status"] == "respawning" and got.json()["reason"] == "worker died"
    assert healing.LATEST.respawning  # what /health said, admission now refuses with (no 200 after a 503 health)
    assert 1 <= int(got.headers["retry-after"]) <= 5


def test_a_group_replaced_while_others_serve_is_degraded_not_refused(tmp_path: Path, monkeypatch) -> None:
    """One executor with two groups, one being replaced: admission admits (the other group serves),
    ``/health`` answers 200 ``degraded`` naming the groups; both replaced: 503 ``respawning``."""
    from fastapi import Request
    from fastapi.responses import Response

    async def stock(raw_request: Request) -> Response:
        return Response(status_code=200)

    client = _health_client(stock, tmp_path, monkeypatch)
    progress.write_healing({"state": "degraded", "reason": "worker 0 died", "since": time.time(), "start_s": 4.0,
                            "groups": 2, "groups_respawning": 1, "counts": {"respawns": 1}})
    state = progress.read_healing()
    assert not state.respawning and (state.groups_respawning, state.groups) == (1, 2) and healing.refusal() is None
    got = client.get("/health")
    assert got.status_code == 200 and got.json() == {"status": "degraded", "reason": "worker 0 died",
                                                      "groups_respawning": 1, "groups": 2}
    progress.write_healing({"state": "respawning", "reason": "both died", "since": time.time(), "start_s": 4.0,
                            "groups": 2, "groups_respawning": 2, "counts": {"respawns": 2}})
    assert client.get("/health").status_code == 503 and healing.refusal().code == "respawning"
    progress.write_healing({"state": "serving", "groups": 2, "groups_respawning": 0, "counts": {}})
    assert client.get("/health").status_code == 200 and client.get("/health").content == b""


def test_the_executor_record_says_degraded_while_some_groups_are_replaced(tmp_path: Path, monkeypatch) -> None:
    from omni_ext.executor.tuned import TunedExecutor

    monkeypatch.setenv(progress.ENV, str(tmp_path))
    ex = object.__new__(TunedExecutor)
    ex.dp, ex._respawning, ex._state, ex._start_s, ex._counts = 2, set(), {}, 3.0, {"respawns": 0}
    ex._record()
    assert progress.read_healing().groups_respawning == 0
    ex._respawning.add(1)
    ex._record("worker 1 died")
    assert ex._state["state"] == "degraded" and progress.read_healing().reason == "worker 1 died"
    ex._respawning.add(0)
    ex._record("worker 0 died")
    assert ex._state["state"] == "respawning" and progress.read_healing().respawning
    ex._respawning.clear()
    ex._record()
    assert ex._state == {"state": "serving", "reason": "", "since": ex._state["since"]}
    ex._record("budget spent", exhausted=True)
    ex._record()  # a later count update keeps the verdict
    assert ex._state["state"] == "exhausted" and progress.read_healing().exhausted == "budget spent"
