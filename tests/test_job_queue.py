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
    running, queued = q.snapshot(10.5)
    assert [b.remaining_s for b in running] == [pytest.approx(1.5)] and queued == []
    assert running[0].boundary_s is None  # its steps are unknown: no pause point is predicted


def test_a_class_learns_its_fixed_and_per_step_seconds_so_few_step_jobs_are_predicted() -> None:
    """Issue 38: units scale with the steps, a job's text encoding, decode and serving path do not. A
    finished job whose whole denoise loop was reported teaches its class both parts in seconds."""
    from omni_ext.scheduler.cost import CostModel

    units = lambda steps: 100.0 * (2 * steps + 1)  # noqa: E731 (tokens x (steps x branches + decode))
    m = CostModel()
    m.observe("k", units(8), 3.0, "pair", steps=8, loop_s=2.2)  # the class's first job ran cold: replaced
    m.observe("k", units(8), 1.1, "pair", steps=8, loop_s=0.8)  # 0.3 s outside the loop, 0.1 s a step
    assert m.predict_s("k", units(1), "pair", steps=1) == pytest.approx(0.4)
    assert m.predict_s("k", units(50), "pair", steps=50) == pytest.approx(5.3)
    # the unit rate alone (steps unknown) puts the 1-step job at a fifth of what it costs
    assert m.predict_s("k", units(1), "pair") == pytest.approx(1.1 / units(8) * units(1))
    m.observe("k", units(2), 0.52, "pair", steps=2, loop_s=0.2)  # averaged: 0.3 -> 0.306, 0.1 stays
    assert m.fixed["k:pair"] == pytest.approx(0.7 * 0.3 + 0.3 * 0.32)
    assert m.per_step["k:pair"] == pytest.approx(0.1)
    # a loop longer than the job, or none, teaches only the unit rate; another mode keeps to the rate
    m.observe("k", units(4), 0.5, "single", steps=4, loop_s=0.6)
    assert "k:single" not in m.per_step and m.predict_s("k", units(4), "single", steps=4) == pytest.approx(0.5)

    # through the queue: a job whose step reports covered its loop teaches both; one cut short only the rate
    q: JobQueue[str] = JobQueue(SchedulerConfig(seconds_per_unit=None))
    for job_id, steps, took, loop in (("a", 8, 2.0, 1.6), ("b", 8, 1.0, 0.8)):
        q.submit(job_id, job_id, priority=0, arrival=0.0, key="s", units=units(steps), n_steps=steps)
        q.start(job_id, 0.0)
        q.get(job_id).steps = (steps, steps, loop, 0.05)
        q.finish(job_id, 0.0, seconds=took)
    assert q.cost.fixed["s"] == pytest.approx(0.2) and q.cost.per_step["s"] == pytest.approx(0.1)
    one = q.submit("c", "c", priority=0, arrival=0.0, key="s", units=units(1), n_steps=1)
    assert one.ticket.predicted_s == pytest.approx(0.3)
    q.start("c", 0.0)
    q.get("c").steps = (0, 1, 0.0, 0.0)
    assert q.remaining(q.get("c"), 0.1) == pytest.approx(0.2)  # its prediction less the time it ran
    q.get("c").steps = (1, 2, 0.1, 0.05)  # reported 1 of 2 steps: not its whole loop (no fixed cost learned)
    q.finish("c", 0.0, seconds=0.5)
    assert q.cost.fixed["s"] == pytest.approx(0.2) and q.cost.loops["s"] == 2


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
