"""The TunedExecutor's scheduling decisions as pure code (``omni_ext.scheduler``): every placement
rule, the cost rate and the time limits, on plain data, without vLLM or a server."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from omni_ext.scheduler.cost import job_time_limit_s, updated_rate
from omni_ext.scheduler.placement import JobMode, JobNeeds, Layout, next_placements

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
