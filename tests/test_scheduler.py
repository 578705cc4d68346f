"""The TunedExecutor's scheduling decisions as pure code (``omni_ext.scheduler``): every placement
rule, the cost rate and the time limits, on plain data, without vLLM or a server."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from omni_ext.scheduler.cost import job_time_limit_s, updated_rate
from omni_ext.scheduler.placement import JobMode, JobNeeds, Layout, Units, next_placements, splits, tentative_until

PAIR, SINGLE, ALL = JobMode.PAIR, JobMode.SINGLE, JobMode.ALL_RANKS
CFG2 = Layout.regular(num_groups=1, group_size=2)  # [[0, 1]]
CFG2_DP2 = Layout.regular(num_groups=2, group_size=2)  # [[0, 1], [2, 3]]
CFG1_DP2 = Layout.regular(num_groups=2, group_size=1)  # [[0], [1]]


@dataclass(frozen=True)
class Job:
    name: str
    needs: JobNeeds


def jobs(*modes: JobMode) -> list[Job]:
    return [Job(f"j{i}", JobNeeds(m)) for i, m in enumerate(modes)]


def placed(pending: list[Job], free, layout: Layout, **kw) -> list[tuple[str, tuple[int, ...], str]]:
    """(job name, ranks, rank mode) of each start, in order."""
    return [(s.job.name, s.ranks, s.mode.value) for s in next_placements(pending, free, layout, **kw)]


def test_layout_groups_are_vllm_omnis_cfg_groups() -> None:
    assert CFG2_DP2.groups == ((0, 1), (2, 3))
    assert CFG2_DP2.ranks == (0, 1, 2, 3)
    assert CFG2_DP2.group_of(3) == (2, 3)
    assert CFG1_DP2.groups == ((0,), (1,))


def test_a_unit_is_the_sequence_parallel_processes_of_one_cfg_half() -> None:
    """CFG 2 x Ulysses 2, two data-parallel groups: 8 processes in vLLM-Omni's "tp-sp-pp-cfg-dp" order
    (SP groups [0,1] [2,3] [4,5] [6,7], CFG groups [0,2] [1,3] [4,6] [5,7]; checked against vLLM-Omni's
    own RankGenerator in tests/test_executor.py). Placement's rank u is unit u."""
    units, layout = Units(2), CFG2_DP2
    assert [units.ranks_of(u) for u in layout.ranks] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert units.expand(layout.groups[1]) == (4, 5, 6, 7)
    assert [units.unit_of(p) for p in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [units.sp_rank(p) for p in range(8)] == [0, 1] * 4  # the leaders: 0, 2, 4, 6
    assert [units.cfg_rank(p, 2) for p in range(8)] == [0, 0, 1, 1] * 2
    busy = {p: None for p in range(8)} | {3: "job-1"}  # one process of unit 1 still finishing
    assert units.free_units(layout, busy) == [0, 2, 3]
    # without sequence parallel a unit is one process: the placement ranks are the processes
    assert Units().expand(layout.ranks) == layout.ranks and Units().cfg_rank(3, 2) == 1


@pytest.mark.parametrize(
    "needs_cfg,group_size,warm_up,mode",
    [
        (True, 2, False, PAIR),  # both branches on a cfg-2 layout: a whole group
        (False, 2, False, SINGLE),  # CFG off: one rank of the group
        (True, 1, False, SINGLE),  # cfg-1 layout: one rank runs both branches
        (False, 2, True, ALL),  # the engine's CFG-free warm-up: every rank
        (True, 2, True, PAIR),  # a warm-up that needs CFG is an ordinary job
    ],
)
def test_job_mode_of_a_request(needs_cfg: bool, group_size: int, warm_up: bool, mode: JobMode) -> None:
    assert JobMode.for_request(needs_cfg=needs_cfg, group_size=group_size, warm_up=warm_up) is mode


def test_modes_travel_as_their_values() -> None:
    assert JobMode.PAIR == "pair" and str(JobMode.SINGLE) == "single"
    assert JobNeeds("pair").mode is PAIR  # a plain value is accepted
    assert ALL.rank_mode is SINGLE and PAIR.rank_mode is PAIR and SINGLE.rank_mode is SINGLE


def test_pair_needs_a_whole_free_group() -> None:
    assert placed(jobs(PAIR), {0, 1}, CFG2) == [("j0", (0, 1), "pair")]
    assert placed(jobs(PAIR), {1}, CFG2) == []  # partner busy: wait
    assert placed(jobs(PAIR), {1, 2, 3}, CFG2_DP2) == [("j0", (2, 3), "pair")]  # the whole free group


def test_fifo_head_blocks_later_jobs() -> None:
    # A pair job waits for a whole group; the single job behind it does not overtake it, even
    # though a rank is free, so the pair job cannot starve.
    assert placed(jobs(PAIR, SINGLE), {1}, CFG2) == []
    assert placed(jobs(PAIR, SINGLE), {0, 1}, CFG2) == [("j0", (0, 1), "pair")]
    assert placed(jobs(SINGLE, PAIR, SINGLE), {0, 1}, CFG2) == [("j0", (0,), "single")]


def test_single_prefers_a_rank_whose_partner_is_busy() -> None:
    # Rank 1's partner (0) is busy, group [2, 3] is whole: take 1, keep [2, 3] for a pair job.
    assert placed(jobs(SINGLE), {1, 2, 3}, CFG2_DP2) == [("j0", (1,), "single")]
    # ... and so a pair job queued next still finds its group.
    assert placed(jobs(SINGLE, PAIR), {1, 2, 3}, CFG2_DP2) == [("j0", (1,), "single"), ("j1", (2, 3), "pair")]


def test_single_on_an_idle_layout_takes_the_lowest_rank_and_fills_its_group() -> None:
    assert placed(jobs(SINGLE, SINGLE), {0, 1, 2, 3}, CFG2_DP2) == [("j0", (0,), "single"), ("j1", (1,), "single")]
    # A cfg-2 group serves two CFG-free requests at once.
    assert placed(jobs(SINGLE, SINGLE, SINGLE), {0, 1}, CFG2) == [("j0", (0,), "single"), ("j1", (1,), "single")]


def test_cfg1_layout_places_one_job_per_rank() -> None:
    assert placed(jobs(SINGLE, SINGLE, SINGLE), {0, 1}, CFG1_DP2) == [("j0", (0,), "single"), ("j1", (1,), "single")]
    assert placed(jobs(SINGLE), {1}, CFG1_DP2) == [("j0", (1,), "single")]


def test_warm_up_needs_every_rank_and_runs_alone_on_each() -> None:
    assert placed(jobs(ALL), {0, 1, 2, 3}, CFG2_DP2) == [("j0", (0, 1, 2, 3), "single")]
    assert placed(jobs(ALL, SINGLE), {0, 1, 2}, CFG2_DP2) == []  # waits for rank 3, and blocks the queue
    assert placed(jobs(ALL, SINGLE), {0, 1}, CFG1_DP2) == [("j0", (0, 1), "single")]  # then nothing is free


def test_nothing_starts_while_held_or_with_no_free_rank() -> None:
    # hold: a control-plane RPC waits for every rank to be idle.
    assert placed(jobs(SINGLE), {0, 1}, CFG2, hold=True) == []
    assert placed(jobs(SINGLE, PAIR, ALL), set(), CFG2_DP2) == []
    assert placed([], {0, 1}, CFG2) == []


def test_multiple_groups_take_pairs_in_group_order() -> None:
    assert placed(jobs(PAIR, PAIR, PAIR), {0, 1, 2, 3}, CFG2_DP2) == [("j0", (0, 1), "pair"), ("j1", (2, 3), "pair")]
    assert placed(jobs(PAIR, SINGLE), {0, 2, 3}, CFG2_DP2) == [("j0", (2, 3), "pair"), ("j1", (0,), "single")]


def test_starts_are_a_prefix_of_the_queue_and_keep_the_job_objects() -> None:
    pending = jobs(SINGLE, PAIR, SINGLE)
    starts = next_placements(pending, {1, 2}, CFG2_DP2)
    # j0 takes rank 1 (its partner 0 is busy, tie with 2: the lower rank); the pair job finds no
    # whole group and the single job behind it waits although rank 2 is free.
    assert [(s.job, s.ranks) for s in starts] == [(pending[0], (1,))]
    assert starts[0].job is pending[0]


# --------------------------------------------------------------------------------------------------
# cost: seconds per unit and time limits
# --------------------------------------------------------------------------------------------------
def test_cost_rate_is_an_average_that_one_job_moves() -> None:
    assert updated_rate(None, 10.0, 100.0) == 0.1  # the first measurement is the estimate
    assert updated_rate(0.1, 30.0, 100.0) == pytest.approx(0.7 * 0.1 + 0.3 * 0.3)


def test_time_limit_follows_expected_cost_not_a_fixed_600_s() -> None:
    from omni_ext.models.families import cost_units

    class SP:  # the sampling-parameter fields the cost reads
        def __init__(self, steps, h, w, frames):
            self.num_inference_steps, self.height, self.width, self.num_frames = steps, h, w, frames

    short = cost_units("WanPipeline", SP(4, 64, 64, 9), True)
    long_video = cost_units("WanPipeline", SP(50, 480, 832, 81), True)
    assert long_video > 100 * short
    rate = 1e-3  # seconds per unit, as learned from finished requests
    assert job_time_limit_s(short, rate, {}) == 120.0  # floor
    assert job_time_limit_s(long_video, rate, {}) == pytest.approx(10 * long_video * rate)
    assert job_time_limit_s(long_video, rate, {}) > 600
    assert job_time_limit_s(long_video, None, {}) is None  # nothing measured yet: no guess
    assert job_time_limit_s(short, rate, {"OMNI_EXT_JOB_TIMEOUT_S": "42"}) == 42.0
    assert job_time_limit_s(short, rate, {"OMNI_EXT_JOB_TIMEOUT_FACTOR": "2", "OMNI_EXT_JOB_TIMEOUT_MIN_S": "0"}) == (
        pytest.approx(2 * short * rate)
    )


def test_scheduler_imports_without_vllm_or_torch() -> None:
    code = (
        "import sys, omni_ext.scheduler.placement, omni_ext.scheduler.cost, omni_ext.executor.protocol, "
        "omni_ext.executor.role; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'vllm_omni', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ---- options, order, admission, cost model (issue 10) --------------------------------------------
from omni_ext.scheduler import admission as adm  # noqa: E402
from omni_ext.scheduler.config import CfgMode, SchedulerConfig, scheduler_config  # noqa: E402
from omni_ext.models.families import shape_key  # noqa: E402
from omni_ext.scheduler.cost import CostModel, remaining_s  # noqa: E402
from omni_ext.scheduler.admission import Ticket, effective_priority, in_order  # noqa: E402


def test_options_come_from_additional_config_and_typos_fail() -> None:
    assert scheduler_config(None) == SchedulerConfig()
    assert scheduler_config('{"omni_ext": {"data_parallel_size": 2}}') == SchedulerConfig()
    cfg = scheduler_config({"omni_ext": {"scheduler": {"max_wait_s": 30, "cfg_mode": "pair", "order": "fifo"}}})
    assert (cfg.max_wait_s, cfg.cfg_mode, cfg.order) == (30.0, "pair", "fifo")
    # one enum, still its string wherever it is written (JSON, logs)
    assert cfg.cfg_mode is CfgMode.PAIR and json.dumps(cfg.cfg_mode) == '"pair"' and f"{cfg.cfg_mode}" == "pair"
    assert cfg.margin_s == 1.5  # 5 % of the bound
    assert SchedulerConfig(max_wait_s=4).margin_s == 0.5  # at least half a second
    for bad, needle in [
        ({"max_wait": 3}, "unknown omni_ext.scheduler option"),
        ({"max_wait_s": "3"}, "must be a number"),
        ({"max_wait_s": 0}, "must be > 0"),
        ({"cfg_mode": "both"}, "cfg_mode must be one of"),
        ({"order": "sjf"}, "order must be one of"),
    ]:
        with pytest.raises(ValueError, match=needle):
            scheduler_config({"omni_ext": {"scheduler": bad}})


def T(name: str, priority: int = 0, arrival: float = 0.0, seconds: float = 1.0) -> Ticket:
    return Ticket(name, priority=priority, arrival=arrival, cost=seconds, predicted_s=seconds)


def names(tickets) -> list[str]:
    return [t.id for t in tickets]


def test_order_is_priority_then_longest_first_then_arrival() -> None:
    cfg = SchedulerConfig(order="cost")  # "slo" (the default) is this order within a burst
    burst = [T("a81", 0, 0.0, 8), T("b17", 0, 0.1, 2), T("c81", 0, 0.2, 8), T("d17", 0, 0.3, 2), T("e49", -1, 0.4, 5)]
    assert names(in_order(burst, 1.0, cfg)) == ["e49", "a81", "c81", "b17", "d17"]
    assert names(in_order(burst, 1.0, SchedulerConfig(order="fifo"))) == ["e49", "a81", "b17", "c81", "d17"]


def test_aging_bounds_how_long_later_arrivals_overtake() -> None:
    cfg = SchedulerConfig(aging_s=10, order="cost")
    old_short = T("old", 0, 0.0, 1)
    assert effective_priority(old_short, 9.9, 10) == 0 and effective_priority(old_short, 10.0, 10) == -1
    # Within its first aging_s, longer arrivals of the same priority go first ...
    assert names(in_order([old_short, T("new_long", 0, 5.0, 9)], 6.0, cfg)) == ["new_long", "old"]
    # ... after it, no later arrival of the same priority overtakes it, and a stream of priority -1
    # arrivals overtakes it for at most 2 x aging_s.
    assert names(in_order([old_short, T("new_long", 0, 10.0, 9)], 10.0, cfg)) == ["old", "new_long"]
    assert names(in_order([old_short, T("vip", -1, 19.0, 9)], 19.0, cfg))[0] == "vip"
    assert names(in_order([old_short, T("vip", -1, 20.0, 9)], 20.0, cfg))[0] == "old"
    assert effective_priority(old_short, 1e6, 0) == 0  # aging_s 0: no aging


def test_longest_first_keeps_a_burst_near_its_bound_where_fifo_does_not() -> None:
    """The mixed burst of the issue on two groups: LPT stays within 10 % of the bound whatever the
    arrival order; FIFO with the longest job last leaves one group idle."""
    lengths = [2.0, 2.0, 2.0, 8.0, 8.0, 8.0]  # 17-frame and 81-frame jobs, longest last

    def makespan(order: str) -> float:
        tickets = [T(f"j{i}", 0, i * 0.01, s) for i, s in enumerate(lengths)]
        ordered = in_order(tickets, 0.1, SchedulerConfig(order=order), capacity=2)
        return _finish(ordered, 2)

    bound = max(sum(lengths) / 2, max(lengths))
    assert makespan("cost") / bound <= 1.10
    assert makespan("slo") == makespan("cost")  # arrived together: a burst, longest first
    assert makespan("fifo") / bound > 1.10


def _finish(ordered, slots: int) -> float:
    import heapq

    free = [0.0] * slots
    end = 0.0
    for t in ordered:
        start = heapq.heappop(free)
        heapq.heappush(free, start + t.predicted_s)
        end = max(end, start + t.predicted_s)
    return end


def test_predicted_start_is_list_scheduling_on_the_slots() -> None:
    assert adm.predict_start([], [], 2) == 0.0
    assert adm.predict_start([3.0], [], 2) == 0.0  # a slot is free
    assert adm.predict_start([3.0, 5.0], [], 2) == 3.0
    assert adm.predict_start([3.0, 5.0], [4.0], 2) == 5.0  # the job ahead takes the slot free at 3
    assert adm.predict_start([3.0, 5.0, 1.0], [], 2) == 4.0  # more running than slots: one queues
    assert adm.predict_start([2.0], [1.0, 1.0], 1) == 4.0


def test_admission_refuses_past_the_bound_with_staggered_retry_times() -> None:
    a = adm.Admission(SchedulerConfig(max_wait_s=10, retry_margin_s=0.5, order="cost"), capacity=2)
    running = [2.0, 2.5]
    queued = [T(f"q{i}", 0, 0.0, 3.0) for i in range(6)]  # slots free at 11 and 11.5 after them
    d1 = a.decide(1.0, running, queued, T("n1", 0, 1.0, 3.0))
    d2 = a.decide(1.0, running, queued, T("n2", 0, 1.0, 3.0))
    assert not d1.admitted and d1.reason == "queue_full" and d1.position == 6 and d1.wait_s == 11.0
    assert d1.retry_after_s == pytest.approx(11.0 - 10 + 0.5)
    assert d2.retry_after_s == pytest.approx(11.5 - 10 + 0.5)  # behind n1's promise
    # A request that fits is admitted, and an on-time retry redeems the earliest promise.
    short = a.decide(1.0, running, queued[:2], T("n3", 0, 1.0, 3.0))
    assert short.admitted and short.wait_s == 5.0 and short.retry_after_s is None
    assert len(a.promises) == 2
    assert a.decide(2.5, running, [], T("n1-retry", 0, 2.5, 3.0)).admitted
    assert len(a.promises) == 1
    a.forget_promises()
    assert a.promises == []


def test_interactive_request_counts_only_work_that_starts_before_it() -> None:
    a = adm.Admission(SchedulerConfig(max_wait_s=5), capacity=2)
    batch = [T(f"b{i}", 0, 0.0, 4.0) for i in range(8)]
    assert not a.decide(1.0, [3.0, 4.0], batch, T("batch", 0, 1.0, 4.0)).admitted
    vip = a.decide(1.0, [3.0, 4.0], batch, T("vip", -1, 1.0, 4.0))
    assert vip.admitted and vip.position == 0 and vip.wait_s == 3.0  # the first running job's end
    est = a.estimate(1.0, [3.0, 4.0], batch, batch[5])
    assert est.position == 5


def test_refused_clients_that_retry_on_time_are_admitted_first_try() -> None:
    """A simulated burst three times what the bound admits: clients told Retry-After come back then,
    and the work they find has drained below the bound (the promises staggered them)."""
    import heapq

    cfg = SchedulerConfig(max_wait_s=6, retry_margin_s=0.3)
    a = adm.Admission(cfg, capacity=2)
    job_s = 1.0
    slots: list[float] = [0.0, 0.0]  # when each slot frees (simulated executor, exact predictions)
    starts: list[tuple[float, float]] = []  # (start, end) of admitted jobs

    def state(now: float):
        running = [end - now for start, end in starts if start <= now < end]
        queued = [T(f"x{i}", 0, -1.0, job_s) for i, (start, _) in enumerate(starts) if start > now]
        return running, queued

    def admit(now: float) -> None:
        start = max(now, heapq.heappop(slots))
        heapq.heappush(slots, start + job_s)
        starts.append((start, start + job_s))

    retries: list[float] = []
    for i in range(3 * 14):
        running, queued = state(0.0)
        d = a.decide(0.0, running, queued, T(f"c{i}", 0, 0.0, job_s))
        if d.admitted:
            admit(0.0)
        else:
            retries.append(d.retry_after_s)
    assert 10 <= len(starts) <= 16 and len(retries) >= 2 * len(starts)
    first_try = 0
    for due in sorted(retries):
        running, queued = state(due)
        if a.decide(due, running, queued, T(f"r{due}", 0, due, job_s)).admitted:
            admit(due)
            first_try += 1
    assert first_try / len(retries) >= 0.9


def test_cost_model_learns_per_shape_and_falls_back() -> None:
    m = CostModel(seed_s_per_unit=0.01)
    small, big = shape_key("wan2.x-t2v", 64, 64, 9, True), shape_key("wan2.x-t2v", 128, 128, 81, True)
    assert small != big and small != shape_key("wan2.x-t2v", 64, 64, 9, False)
    assert m.predict_s(small, 100) == pytest.approx(1.0)  # the seed
    m.observe(small, 100, 2.0)
    assert m.rate(small) == pytest.approx(0.02) and m.rate(big) == pytest.approx(0.02)  # overall
    m.observe(big, 1000, 10.0)
    assert m.rate(big) == pytest.approx(0.01)
    assert m.rate(small) == pytest.approx(0.02)
    m.observe(small, 0, 5.0)  # nothing to learn from
    assert CostModel().predict_s(small, 100) is None


def test_a_run_mode_not_measured_yet_is_predicted_from_the_other() -> None:
    from omni_ext.scheduler.cost import SINGLE_OVER_PAIR, mode_key

    m = CostModel(seed_s_per_unit=0.01)
    small, big = shape_key("wan2.x-t2v", 64, 64, 9, True), shape_key("wan2.x-t2v", 128, 128, 81, True)
    m.observe(mode_key(small, "pair"), 100, 1.0)  # a paired warm-up: the only measurement
    assert m.rate(mode_key(small, "pair")) == pytest.approx(0.01)
    # the burst behind it runs on single ranks: predicted at the prior ratio, not at the pair's rate
    assert m.rate(mode_key(small, "single")) == pytest.approx(0.01 * SINGLE_OVER_PAIR)
    assert m.rate(mode_key(big, "single")) == pytest.approx(0.01 * SINGLE_OVER_PAIR)  # the pair rate of all shapes
    assert m.rate(mode_key(big, "pair")) == pytest.approx(0.01)
    m.observe(mode_key(small, "single"), 100, 1.5)  # both modes measured once: cold runs, the prior ratio stands
    assert m.mode_ratio("single", "pair") == pytest.approx(SINGLE_OVER_PAIR)
    m.observe(mode_key(small, "pair"), 100, 0.8)  # a class's second run replaces its first (cold) one
    m.observe(mode_key(small, "single"), 100, 1.2)
    assert m.rate(mode_key(small, "pair")) == pytest.approx(0.008)
    assert m.mode_ratio("single", "pair") == pytest.approx(1.5)  # both measured warm on one shape: their ratio
    m.observe(mode_key(big, "pair"), 1000, 4.0)
    assert m.rate(mode_key(big, "single")) == pytest.approx(0.004 * 1.5)  # its own pair rate x the learned ratio
    assert m.rate(mode_key(big, "pair")) == pytest.approx(0.004)
    assert m.rate(mode_key(small, "single")) == pytest.approx(0.012)  # measured: as measured
    m.observe(mode_key(small, "single"), 100, 2.2)  # from the third run on, an average (RATE_WEIGHT)
    assert m.rate(mode_key(small, "single")) == pytest.approx(0.7 * 0.012 + 0.3 * 0.022)
    fresh = CostModel()
    fresh.observe(mode_key(small, "single"), 100, 2.0)
    assert fresh.rate(mode_key(big, "pair")) == pytest.approx(0.02 / SINGLE_OVER_PAIR)


def test_a_queued_job_is_predicted_in_the_mode_it_runs_in_when_others_wait() -> None:
    from omni_ext.scheduler.placement import predicted_mode

    assert predicted_mode(JobMode.PAIR, CfgMode.ADAPTIVE) is JobMode.SINGLE
    assert predicted_mode(JobMode.PAIR, CfgMode.SINGLE) is JobMode.SINGLE
    assert predicted_mode(JobMode.PAIR, CfgMode.PAIR) is JobMode.PAIR
    assert predicted_mode(JobMode.SINGLE, CfgMode.PAIR) is JobMode.SINGLE
    assert predicted_mode(JobMode.ALL_RANKS, CfgMode.ADAPTIVE) is JobMode.SINGLE


def test_remaining_time_uses_measured_steps_once_there_are_some() -> None:
    assert remaining_s(None, 1.0) is None
    assert remaining_s(10.0, 4.0) == 6.0
    assert remaining_s(10.0, 30.0) == 1.0  # overran its prediction: still running
    # 5 of 20 steps in 2 s: 15 steps at 0.4 s + what the prediction holds beyond the loop (10 - 8).
    assert remaining_s(10.0, 3.0, 5, 20, 2.0) == pytest.approx(6.0 + 2.0)
    assert remaining_s(None, 3.0, 5, 20, 2.0) == pytest.approx(6.0)
    # 1 s of it ran before the loop (text encoding): the part after the loop is 10 - 8 - 1
    assert remaining_s(10.0, 4.0, 5, 20, 2.0, before_loop_s=1.0) == pytest.approx(6.0 + 1.0)


def test_adaptive_pairs_only_when_the_free_groups_cover_the_queue() -> None:
    cfg = [Job("c0", JobNeeds(PAIR)), Job("c1", JobNeeds(PAIR))]
    assert placed(cfg[:1], {0, 1}, CFG2, cfg_mode="adaptive") == [("c0", (0, 1), "pair")]  # alone: a pair
    assert placed(cfg, {0, 1}, CFG2, cfg_mode="adaptive") == [("c0", (0,), "single"), ("c1", (1,), "single")]
    assert placed(cfg, {0, 1, 2, 3}, CFG2_DP2, cfg_mode="adaptive") == [("c0", (0, 1), "pair"), ("c1", (2, 3), "pair")]
    assert placed(cfg[:1], {1}, CFG2, cfg_mode="adaptive") == [("c0", (1,), "single")]  # partner busy: work now
    assert placed(cfg[:1], {0, 1}, CFG2, cfg_mode="single") == [("c0", (0,), "single")]
    assert placed(cfg, {0, 1}, CFG2, cfg_mode="pair") == [("c0", (0, 1), "pair")]


def test_adaptive_pair_waits_its_settle_time_so_a_burst_is_seen_as_a_burst() -> None:
    first = Job("c0", JobNeeds(PAIR, arrival=10.0))
    assert placed([first], {0, 1}, CFG2, cfg_mode="adaptive", now=10.05, settle_s=0.1) == []
    assert placed([first], {0, 1}, CFG2, cfg_mode="adaptive", now=10.11, settle_s=0.1) == [("c0", (0, 1), "pair")]
    # the rest of the burst arrived meanwhile: singles once the idle settle time is over
    burst = [first, Job("c1", JobNeeds(PAIR, arrival=10.02))]
    assert placed(burst, {0, 1}, CFG2, cfg_mode="adaptive", now=10.03, settle_s=0.1) == []
    assert placed(burst, {0, 1}, CFG2, cfg_mode="adaptive", now=10.11, settle_s=0.1) == [
        ("c0", (0,), "single"), ("c1", (1,), "single")]
    # a pair-only layout that is busy elsewhere does not wait (only an idle layout settles)
    other = Job("c2", JobNeeds(PAIR, arrival=10.0))
    assert placed([other], {2, 3}, CFG2_DP2, cfg_mode="pair", now=10.0, settle_s=0.1) == [("c2", (2, 3), "pair")]


def test_an_idle_layout_waits_for_the_burst_then_orders_it_longest_first() -> None:
    short = Job("short", JobNeeds(SINGLE, units=1.0, arrival=10.0))
    assert placed([short], {0, 1}, CFG1_DP2, now=10.02, settle_s=0.05) == []  # idle: the burst may go on
    assert placed([short], {0, 1}, CFG1_DP2, now=10.06, settle_s=0.05) == [("short", (0,), "single")]
    assert placed([short], {1}, CFG1_DP2, now=10.0, settle_s=0.05) == [("short", (1,), "single")]  # busy: no wait
    warm = Job("warm", JobNeeds(ALL, arrival=10.0))
    assert placed([warm], {0, 1}, CFG1_DP2, now=10.0, settle_s=0.05) == [("warm", (0, 1), "single")]


def test_a_request_that_came_alone_starts_at_once_and_only_a_burst_settles() -> None:
    """Rule 5 holds an idle layout only once a request came within ``settle_s`` of the one before it:
    an isolated request is not held (a pair in pair mode, a single rank), while the rest of a burst
    that follows it is gathered and ordered as before; an adaptive pair starts at once too, tentatively
    (the executor splits it if a burst follows: tests/test_executor.py)."""
    alone = Job("c0", JobNeeds(PAIR, arrival=10.0, gap_s=5.0))
    assert placed([alone], {0, 1}, CFG2, cfg_mode="pair", now=10.0, settle_s=0.05) == [("c0", (0, 1), "pair")]
    assert placed([alone], {0, 1}, CFG2, cfg_mode="adaptive", now=10.0, settle_s=0.05) == [("c0", (0, 1), "pair")]
    assert tentative_until(PAIR, "adaptive", alone.needs, now=10.0, settle_s=0.05) == pytest.approx(10.05)
    assert tentative_until(PAIR, "adaptive", alone.needs, now=10.06, settle_s=0.05) is None  # it waited: decided
    assert tentative_until(PAIR, "pair", alone.needs, now=10.0, settle_s=0.05) is None  # pair mode: no choice made
    assert tentative_until(SINGLE, "adaptive", alone.needs, now=10.0, settle_s=0.05) is None
    assert tentative_until(PAIR, "adaptive", alone.needs, now=10.0, settle_s=0.0) is None
    # split while within its settle time and a job finds no free rank; never after, never when one is free
    assert splits(10.05, 10.01, blocked=True) and not splits(10.05, 10.01, blocked=False)
    assert not splits(10.05, 10.06, blocked=True) and not splits(None, 10.01, blocked=True)
    short = Job("s", JobNeeds(SINGLE, units=1.0, arrival=10.0, gap_s=float("inf")))  # the first request ever
    assert placed([short], {0, 1}, CFG1_DP2, now=10.0, settle_s=0.05) == [("s", (0,), "single")]
    # a request 10 ms after the one before it settles, idle layout or adaptive pair
    close = Job("c1", JobNeeds(PAIR, arrival=10.0, gap_s=0.01))
    assert placed([close], {0, 1}, CFG2, cfg_mode="adaptive", now=10.02, settle_s=0.05) == []
    assert placed([close], {0, 1}, CFG2, cfg_mode="adaptive", now=10.06, settle_s=0.05) == [("c1", (0, 1), "pair")]
    # a burst queued behind an isolated first job (the layout was busy): held until the oldest has settled
    later = Job("s2", JobNeeds(SINGLE, units=3.0, arrival=10.01, gap_s=0.01))
    assert placed([short, later], {0, 1}, CFG1_DP2, now=10.02, settle_s=0.05) == []
    assert placed([short, later], {0, 1}, CFG1_DP2, now=10.06, settle_s=0.05) == [
        ("s", (0,), "single"), ("s2", (1,), "single")]
    assert placed([alone], {0, 1}, CFG2, cfg_mode="adaptive", now=10.0, settle_s=0.0) == [("c0", (0, 1), "pair")]
    assert placed([alone], {0, 1}, CFG2, cfg_mode="adaptive", now=10.06, settle_s=0.05) == [("c0", (0, 1), "pair")]


def test_a_cache_backend_scales_the_cost_seed() -> None:
    """A preset's seed is measured without a cache; under ``--cache-backend`` a run costs less, so the
    seed is divided by the backend's published speed-up (an unknown backend: unchanged)."""
    from omni_ext.scheduler.config import scheduler_config
    from omni_ext.scheduler.cost import CACHE_SPEEDUP

    extra = {"omni_ext": {"scheduler": {"seconds_per_unit": 0.002}}}
    assert scheduler_config(extra).seconds_per_unit == 0.002
    assert scheduler_config(extra, "none").seconds_per_unit == 0.002
    assert scheduler_config(extra, "cache_dit").seconds_per_unit == pytest.approx(0.002 / CACHE_SPEEDUP["cache_dit"])
    assert scheduler_config(extra, "tea_cache").seconds_per_unit < scheduler_config(extra, "cache_dit").seconds_per_unit
    assert scheduler_config(extra, "mag_cache").seconds_per_unit == 0.002
    assert scheduler_config({}, "cache_dit").seconds_per_unit is None
