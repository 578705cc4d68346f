"""The one queue state machine (omni_ext/scheduler/queue.py) and the layout rules (omni_ext/scheduler/layout.py)."""

from __future__ import annotations

import pytest

from omni_ext.scheduler.config import SchedulerConfig
from omni_ext.scheduler.layout import Parallel, tuned_refusal
from omni_ext.scheduler.queue import JobQueue, is_warm_up


def test_a_job_goes_queued_running_finished_and_teaches_the_cost_model() -> None:
    q: JobQueue[str] = JobQueue(SchedulerConfig(seconds_per_unit=None))
    a = q.submit("a", "payload-a", priority=0, arrival=0.0, key="s", units=10)
    q.submit("b", "payload-b", priority=0, arrival=0.1, key="s", units=20)
    assert a.ticket.predicted_s is None and a.ticket.cost == 10  # no rate yet: ordered by units
    assert [e.id for e in q.ordered(1.0)] == ["a", "b"]  # the default order: the tightest deadline (3 x units) first
    q.config = SchedulerConfig(seconds_per_unit=None, order="cost")
    assert [e.id for e in q.ordered(1.0)] == ["b", "a"]  # longest first
    q.start("b", 1.0, where=(0,))
    assert [e.id for e in q.queued()] == ["a"] and [e.where for e in q.running()] == [(0,)]
    assert q.remaining(q.get("b"), 2.0) is None  # nothing known yet
    assert q.finish("b", 5.0) == pytest.approx(4.0)
    assert q.cost.rate("s") == pytest.approx(0.2) and "b" not in q
    # now a rate is known: predictions in seconds, remaining time of a running job
    assert q.price(q.get("a")).predicted_s == pytest.approx(2.0)
    q.start("a", 10.0)
    assert q.remaining(q.get("a"), 10.5) == pytest.approx(1.5)
    assert q.snapshot(10.5) == ([pytest.approx(1.5)], [])


def test_aborted_forgotten_and_warm_up_jobs_teach_nothing() -> None:
    q: JobQueue[None] = JobQueue(SchedulerConfig(seconds_per_unit=None))
    q.submit("w", None, priority=-5, arrival=0.0, key="s", units=1, learns=not is_warm_up("w"))
    q.submit("dummy_req_id_0", None, priority=-5, arrival=0.0, key="s", units=1, learns=not is_warm_up("dummy_req_id_0"))
    q.submit("x", None, priority=0, arrival=0.0, key="s", units=1)
    q.start("dummy_req_id_0", 0.0)
    q.start("x", 0.0)
    q.forget("x")  # aborted while running: holds its place until released
    assert len(q.running()) == 2
    assert q.finish("dummy_req_id_0", 3.0) == 3.0 and q.finish("x", 3.0) == 3.0
    assert q.cost.rate() is None
    assert q.finish("w", 3.0) is None  # never started: nothing learned
    assert q.abort("w") is None and not q


def test_estimates_and_a_job_that_goes_back_to_the_front() -> None:
    q: JobQueue[None] = JobQueue(SchedulerConfig(seconds_per_unit=1.0, order="fifo"))
    for i, job in enumerate("abc"):
        q.submit(job, None, priority=0, arrival=float(i), key="s", units=2)
    q.start("a", 0.0)
    est = q.estimates(1.0, capacity=1)
    assert {k: (v.position, v.start_in_s) for k, v in est.items()} == {"b": (0, 1.0), "c": (1, 3.0)}
    entry = q.abort("a")
    q.add(entry, front=True)  # a send that failed: it had not started, it goes first again
    assert not entry.running and list(q.entries) == ["a", "b", "c"]


@pytest.mark.parametrize("parallel,option", [
    (Parallel(pp=2), "--pipeline-parallel-size 2"),
    (Parallel(cfg=4), "--cfg-parallel-size 4"),
    (Parallel(vae_patch=2), "--vae-patch-parallel-size 2"),
    (Parallel(hsdp=True), "--use-hsdp"),
    (Parallel(step_execution=True), "--step-execution"),
])
def test_each_refused_layout_names_its_flag_and_an_alternative(parallel: Parallel, option: str) -> None:
    refusal = tuned_refusal(parallel)
    assert refusal is not None and refusal.option == option
    assert refusal.message().startswith(f"omni-ext TunedExecutor: drop {option}: ") and refusal.instead in refusal.message()


def test_cfg_sequence_and_data_parallel_layouts_run() -> None:
    assert tuned_refusal(Parallel()) is None and tuned_refusal(Parallel(cfg=2)) is None
    # issue 18 item 1: a CFG half is a unit of Ulysses x Ring processes (omni_ext.scheduler.placement.Units)
    for sp in (Parallel(ulysses=2), Parallel(cfg=2, ulysses=2), Parallel(ring=2), Parallel(cfg=2, ulysses=2, ring=2)):
        assert tuned_refusal(sp) is None, sp
    # and of TP x Ulysses x Ring processes: tensor parallel runs inside a unit too (the Wan2.2-A14B presets)
    for tp in (Parallel(tp=2), Parallel(cfg=2, tp=2), Parallel(cfg=2, ulysses=2, tp=2)):
        assert tuned_refusal(tp) is None, tp
