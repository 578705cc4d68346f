"""The deadline order ``"slo"`` (omni_ext/scheduler/admission.py) on a stream and on a burst, played by
the discrete-event simulator (omni_ext/bench/stream_sim.py): pure, no server, a few seconds."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from omni_ext.bench import stream_sim as sim
from omni_ext.bench.schedule import optimal_makespan
from omni_ext.scheduler.admission import Admission, Ticket, in_order
from omni_ext.scheduler.config import SchedulerConfig, scheduler_config
from omni_ext.scheduler.queue import JobQueue

SLO, COST, FIFO = (SchedulerConfig(order=o) for o in ("slo", "cost", "fifo"))


@pytest.fixture(scope="module")
def table() -> dict:
    """Every order on the same Poisson streams (loads 0.5/0.7/0.9 of two slots, short 1 s / long 6 s,
    3 short for 1 long) and the same closed bursts."""
    return sim.run()


def test_slo_order_serves_a_stream_better_than_longest_first(table) -> None:
    at = table["stream"]
    for load in ("0.5", "0.7", "0.9"):
        assert at[load]["slo"]["slo3_attainment"] > max(at[load]["cost"]["slo3_attainment"],
                                                         at[load]["fifo"]["slo3_attainment"]), load
    # a clear margin at 0.7, and the short requests no longer wait behind every long one
    assert at["0.7"]["slo"]["slo3_attainment"] >= at["0.7"]["cost"]["slo3_attainment"] + 0.10
    assert at["0.7"]["slo"]["short_p99_slowdown"] <= at["0.7"]["cost"]["short_p99_slowdown"] / 2
    assert at["0.9"]["slo"]["short_p99_slowdown"] < at["0.9"]["cost"]["short_p99_slowdown"]


def test_a_closed_burst_stays_within_4_3_of_its_bound_where_fifo_does_not(table) -> None:
    for arrival, by_order in table["burst"].items():
        assert by_order["slo"]["makespan_over_bound"] <= 4 / 3, arrival
        assert by_order["cost"]["makespan_over_bound"] <= 4 / 3, arrival
    assert table["burst"]["longest_last"]["fifo"]["makespan_over_bound"] > 4 / 3  # the long job came last


def test_the_makespan_guard_keeps_random_bursts_within_4_3_of_the_optimum() -> None:
    """Deadline rescues in a burst (shorts first) would leave the long jobs for last: the guard stops
    them where they would cost more than longest-first's own 4/3 (unguarded, 2,2,2,8,8,8,2,8 on four
    slots took 16 s where 10 s is optimal)."""
    rng = random.Random(7)
    bursts = [(4, [2, 2, 2, 8, 8, 8, 2, 8])]
    for _ in range(150):
        classes = rng.choice([(1, 6), (2, 8), (1, 10), (1, 3, 9), (1, 5)])
        bursts.append((rng.choice([2, 3]), [rng.choice(classes) for _ in range(rng.randint(3, 8))]))
    for capacity, seconds in bursts:
        best = optimal_makespan(seconds, capacity)
        assert sim.burst(seconds, capacity, SLO)["makespan_s"] <= 4 / 3 * best + 1e-9, (capacity, seconds)


def T(name: str, seconds: float | None, arrival: float = 0.0, priority: int = 0, deadline_s: float | None = None) -> Ticket:
    return Ticket(name, priority, arrival, cost=seconds or 1.0, predicted_s=seconds, deadline_s=deadline_s)


def ids(tickets) -> list[str]:
    return [t.id for t in tickets]


def test_deadline_is_the_requests_own_else_slo_factor_times_its_prediction() -> None:
    assert T("a", 2.0, arrival=10.0).deadline(3.0) == 16.0
    assert T("a", 2.0, arrival=10.0, deadline_s=5.0).deadline(3.0) == 15.0
    assert T("a", None, arrival=10.0).deadline(3.0) is None  # nothing predicted: no deadline
    assert T("a", None, arrival=10.0, deadline_s=5.0).deadline(3.0) == 15.0


def test_a_burst_is_longest_first_and_a_stream_tightest_deadline_first() -> None:
    from omni_ext.scheduler.admission import BURST_GAP_S, bursts

    gap = BURST_GAP_S / 2
    burst = [T("s1", 1.0, 0.0), T("l1", 6.0, gap), T("s2", 1.0, 2 * gap), T("l2", 6.0, 3 * gap)]
    assert ids(in_order(burst, 0.5, SLO, capacity=2)) == ids(in_order(burst, 0.5, COST)) == ["l1", "l2", "s1", "s2"]
    apart = [T(t.id, t.predicted_s, 3 * BURST_GAP_S * k) for k, t in enumerate(burst)]  # the same jobs, a stream
    assert ids(in_order(apart, 1.0, SLO, capacity=2)) == ["s1", "s2", "l1", "l2"]
    # no more jobs than slots, or one slot: not a burst (its order does not change when it ends)
    assert bursts(burst[:2], 2) == {} and bursts(burst, 1) == {} and set(bursts(burst, 3)) == {"s1", "l1", "s2", "l2"}
    assert ids(in_order(burst, 0.5, SLO, capacity=1)) == ["s1", "s2", "l1", "l2"]
    # a burst takes its place by its tightest member: a later short job waits behind the burst's short one
    late = T("s3", 1.0, 1.0)
    assert ids(in_order([*burst, late], 1.1, SLO, capacity=2)) == ["l1", "l2", "s1", "s2", "s3"]
    assert ids(in_order([*burst[1::2], late], 1.1, SLO, capacity=2)) == ["s3", "l1", "l2"]  # two: no burst
    unknown = [T(t.id, None, t.arrival) for t in apart]  # no rate yet: no deadlines, ordered by units
    assert ids(in_order(unknown, 1.0, SLO)) == ids(in_order(unknown, 1.0, COST))


def test_the_short_job_goes_first_but_priority_stays_above() -> None:
    # longest-first would start the short job (due at 3.7 s) after both long ones
    queue = [T("long", 6.0, 0.0), T("long2", 6.0, 0.5), T("short", 1.0, 0.7)]
    assert ids(in_order(queue, 0.8, COST, capacity=2)) == ["long", "long2", "short"]
    assert ids(in_order(queue, 0.8, SLO, capacity=2)) == ["short", "long", "long2"]
    # an interactive long job still goes first: deadlines order within a priority
    vip = [*queue, T("vip", 6.0, 0.75, priority=-1)]
    assert ids(in_order(vip, 0.8, SLO, capacity=2)) == ["vip", "short", "long", "long2"]


def test_explicit_deadlines_are_respected_in_order() -> None:
    # one slot: "b" asked to be done within 9 s, tighter than "a"'s 24 s (3 x 8), and goes first;
    # "c" asked for 100 s, looser than its class's 3 s, and goes last
    queue = [T("a", 8.0, 0.0), T("b", 8.0, 0.1, deadline_s=9.0), T("c", 1.0, 0.2, deadline_s=100.0)]
    assert ids(in_order(queue, 0.2, SLO)) == ["b", "a", "c"]
    assert ids(in_order(queue, 0.2, COST)) == ["a", "b", "c"]  # "cost" ignores deadlines
    # with the default deadline (3 s) "c" is the tightest
    assert ids(in_order([*queue[:2], T("c", 1.0, 0.2)], 0.2, SLO)) == ["c", "b", "a"]


def test_explicit_deadlines_are_met_more_often_on_a_stream() -> None:
    """A fifth of the short requests of the 0.7 stream ask for 1.5x their standalone time: under
    "slo" they meet it clearly more often than the same requests without it, and than under "cost"."""
    jobs = sim.poisson_stream(load=0.7, capacity=2, n=3000, seed=0)
    tagged = {j.id for i, j in enumerate(jobs) if j.cls == "short" and i % 5 == 0}
    asked = [replace(j, deadline_s=1.5 * j.seconds) if j.id in tagged else j for j in jobs]

    def met(stream, config) -> float:
        done = [d for d in sim.simulate(stream, 2, config) if d.job.id in tagged]
        return sum(d.slowdown <= 1.5 + 1e-9 for d in done) / len(done)

    with_deadline = met(asked, SLO)
    assert with_deadline >= met(jobs, SLO) + 0.05
    assert with_deadline >= met(asked, COST) + 0.05


def test_the_job_queue_orders_by_relative_deadline() -> None:
    q: JobQueue[None] = JobQueue(SchedulerConfig(order="slo", seconds_per_unit=1.0))
    q.submit("run", None, priority=0, arrival=0.0, key="k", units=5)
    q.start("run", 0.0)
    q.submit("long", None, priority=0, arrival=0.0, key="k", units=6)
    q.submit("short", None, priority=0, arrival=0.5, key="k", units=1)
    q.submit("mine", None, priority=0, arrival=1.0, key="k", units=6, deadline_s=6.5)
    # relative deadlines: "short" 3 s (3 x 1), "mine" its own 6.5 s, "long" 18 s (3 x 6)
    assert [e.id for e in q.ordered(1.1, capacity=2)] == ["short", "mine", "long"]
    q.config = COST
    assert [e.id for e in q.ordered(1.1, capacity=2)][0] == "long"
    assert q.get("mine").ticket.deadline(3.0) == pytest.approx(7.5)


def test_admission_does_not_let_a_newcomer_break_the_promises_of_admitted_jobs() -> None:
    """Every newcomer to a full queue is at risk, and "slo" would start it ahead of admitted jobs of its
    priority: it is refused when that pushes one of them past max_wait_s (a priority -1 request still
    overtakes: tests/test_scheduler.py::test_interactive_request_counts_only_work_that_starts_before_it)."""
    a = Admission(SchedulerConfig(max_wait_s=10, retry_margin_s=0.5, order="slo"), capacity=2)
    running = [2.0, 2.5]
    queued = [T(f"q{i}", 3.0, 0.0) for i in range(6)]  # they start at 2, 2.5, 5, 5.5, 8 and 8.5 s
    d = a.decide(1.0, running, queued, T("n", 3.0, 1.0, deadline_s=5.0))
    # its deadline is the tightest: it would start first, at 2 s, within the bound, but q5 would then start at 11 s
    assert not d.admitted and d.wait_s == 2.0 and d.reason == "queue_full"
    assert d.retry_after_s == pytest.approx(11.0 - 10 + 0.5)  # when the queue ahead of it fits the bound
    assert a.decide(1.0, running, queued[:2], T("m", 3.0, 1.0, deadline_s=5.0)).admitted  # with room, it is admitted


def test_slo_factor_option() -> None:
    cfg = scheduler_config({"omni_ext": {"scheduler": {"order": "slo", "slo_factor": 5}}})
    assert (cfg.order, cfg.slo_factor) == ("slo", 5.0)
    for bad, needle in [({"slo_factor": 0.5}, "slo_factor must be >= 1"), ({"slo_factor": "3"}, "must be a number")]:
        with pytest.raises(ValueError, match=needle):
            scheduler_config({"omni_ext": {"scheduler": bad}})


def test_of_late_jobs_the_shortest_goes_first() -> None:
    """Jobs late whatever runs are ordered like the rest: the shortest of them delays the others least
    and its slowdown grows fastest, so it goes first (not the most overdue)."""
    # one slot, busy for 10 s: both are late by then; "old" (2 s) is the more overdue, "new" (1 s) the shorter
    queue = [T("old", 2.0, 0.0), T("new", 1.0, 0.5), T("long", 6.0, 0.6, deadline_s=100.0)]
    assert ids(in_order(queue, 1.0, SLO, capacity=1))[:2] == ["new", "old"]


# ---- with step-level preemption and runs that miss their prediction (simulate_preemptive) -------------
@pytest.fixture(scope="module")
def preemptive() -> dict:
    """bench stream's workload (run 3's yardstick, predictions and contention) on the simulator with
    preemption; 81/17-frame bursts."""
    return sim.preemptive_run()


def test_with_preemption_a_stream_at_0_7_meets_its_slo_and_bursts_keep_their_packing(preemptive) -> None:
    at = preemptive["stream"]
    assert at["0.5"]["slo3_attainment"] >= 0.97 and at["0.7"]["slo3_attainment"] >= 0.95
    # 0.854 and 3.8 on these seeds; 0.777 and 8.4 with 12-04's order (longest first, deadline rescues)
    assert at["0.9"]["slo3_attainment"] >= 0.83 and at["0.9"]["short_p99_slowdown"] < 4.5
    for arrival, figs in preemptive["burst"].items():
        assert figs["worst_makespan_over_bound"] <= 1.06, arrival  # 1.15-1.17 with pauses across a burst


def test_fifo_on_the_preemptive_simulator_pauses_only_for_priority() -> None:
    jobs = sim.poisson_stream(load=0.8, capacity=2, n=200, seed=3, short_s=0.5, long_s=3.5)
    base = {d.job.id: d.finish for d in sim.simulate(jobs, 2, FIFO)}
    ran = {d.job.id: d.finish for d in sim.simulate_preemptive(jobs, 2, FIFO, step_s=0.0)}
    assert ran == pytest.approx(base)  # exact runs, no priorities: the same schedule as without preemption
