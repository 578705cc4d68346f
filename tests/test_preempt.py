"""Step-level preemption without a server: the decision (``omni_ext.scheduler.preempt``), the pause
agreement on the shared board (``omni_ext.executor.role``), a job paused in its worker thread while
another runs and resumed with the same bytes (``omni_ext.executor.worker`` and ``suspend``, with
vLLM-Omni's own multistep scheduler and torch's global RNG), and the executor's queue mechanism (its
pipes replaced by a list). The same on real servers: ``tests/test_preemption.py``."""

from __future__ import annotations

import multiprocessing
import time
from types import SimpleNamespace

import pytest

from omni_ext.scheduler.config import CfgMode, SchedulerConfig
from omni_ext.scheduler.placement import JobMode, JobNeeds, Layout
from omni_ext.scheduler.preempt import Running, Waiting, choose

CFG2 = Layout.regular(1, 2)  # one CFG group [0, 1]
DP2 = Layout.regular(2, 1)  # two groups of one rank [0], [1]


# ---- the decision -----------------------------------------------------------------------------
def test_an_interactive_request_preempts_the_worst_priority_longest_job() -> None:
    head = Waiting("i", JobNeeds(JobMode.SINGLE), priority=-1, predicted_s=2.0)
    running = [Running("a", 0, (0,), remaining_s=30.0), Running("b", 0, (1,), remaining_s=60.0)]
    got = choose(head, running, [], DP2, now=0.0)
    assert (got.victim, got.for_job, got.reason) == ("b", "i", "priority")
    running.append(Running("c", 1, (1,), remaining_s=5.0))  # a worse priority goes first, whatever is left
    assert choose(head, running[:1] + running[2:], [], DP2, now=0.0).victim == "c"


def test_no_preemption_when_the_job_can_start_or_nobody_may_be_paused() -> None:
    head = Waiting("i", JobNeeds(JobMode.SINGLE), priority=-1)
    running = [Running("a", 0, (0,), remaining_s=30.0)]
    assert choose(head, running, [1], DP2, now=0.0) is None  # a free rank: it starts there
    assert choose(head, [Running("a", -1, (0,)), Running("b", 0, (1,), preemptible=False)], [], DP2, now=0.0) is None
    # the bound: a job paused max_preemptions times runs to its end
    assert choose(head, [Running("a", 0, (0,), preemptions=2), Running("b", 0, (1,), preemptions=2)], [], DP2,
                  now=0.0, max_preemptions=2) is None
    assert choose(head, [Running("a", 0, (0,), preemptions=1)], [], Layout.regular(1, 1), now=0.0,
                  max_preemptions=2).victim == "a"
    same = Waiting("s", JobNeeds(JobMode.SINGLE), priority=0)
    assert choose(same, running, [], Layout.regular(1, 1), now=0.0) is None  # same priority, no deadline: waits


def test_the_victim_must_free_ranks_the_waiting_job_can_use() -> None:
    pair = Waiting("p", JobNeeds(JobMode.PAIR), priority=-1)
    singles = [Running("a", 0, (0,), remaining_s=9.0), Running("b", 0, (1,), remaining_s=9.0)]
    # cfg_mode "pair": a CFG job needs the whole group, which no single victim frees
    assert choose(pair, singles, [], CFG2, now=0.0, cfg_mode=CfgMode.PAIR) is None
    # "adaptive": it runs on one rank when only one is free
    assert choose(pair, singles, [], CFG2, now=0.0, cfg_mode=CfgMode.ADAPTIVE).victim in ("a", "b")
    assert choose(pair, [Running("g", 0, (0, 1))], [], CFG2, now=0.0, cfg_mode=CfgMode.PAIR).victim == "g"


def test_a_job_about_to_miss_its_deadline_preempts_one_with_slack() -> None:
    one = Layout.regular(1, 1)
    head = Waiting("s", JobNeeds(JobMode.SINGLE), priority=0, predicted_s=2.0, deadline=6.0)
    long_ = Running("l", 0, (0,), remaining_s=20.0, deadline=100.0)
    got = choose(head, [long_], [], one, now=0.0)
    assert (got.victim, got.reason) == ("l", "deadline") and "slack" in got.detail
    # it meets its deadline by waiting: no pause
    assert choose(head, [Running("l", 0, (0,), remaining_s=3.0, deadline=100.0)], [], one, now=0.0) is None
    # the running job has no slack for it: no pause
    assert choose(head, [Running("l", 0, (0,), remaining_s=20.0, deadline=21.0)], [], one, now=0.0) is None
    # it misses its deadline even if it started now: still let out, late by its run instead of the long job's
    late = choose(Waiting("s", JobNeeds(JobMode.SINGLE), 0, 8.0, 6.0), [long_], [], one, now=0.0)
    assert late.victim == "l" and "2.0 s even if it starts now" in late.detail
    # ... but never at the victim's deadline
    assert choose(Waiting("s", JobNeeds(JobMode.SINGLE), 0, 8.0, 6.0), [Running("l", 0, (0,), remaining_s=20.0,
                  deadline=27.0)], [], one, now=0.0) is None
    # not between jobs of similar length: a pause would only swap who waits
    assert choose(Waiting("s", JobNeeds(JobMode.SINGLE), 0, 4.0, 9.0),
                  [Running("l", 0, (0,), remaining_s=7.0, deadline=100.0)], [], one, now=0.0) is None
    # never for a job of a better priority
    assert choose(head, [Running("l", -1, (0,), remaining_s=20.0, deadline=100.0)], [], one, now=0.0) is None
    # the most slack pays
    two = [Running("a", 0, (0,), remaining_s=20.0, deadline=40.0), Running("b", 0, (1,), remaining_s=20.0, deadline=90.0)]
    assert choose(head, two, [], DP2, now=0.0).victim == "b"


def test_a_deadline_pause_keeps_a_margin_for_prediction_errors() -> None:
    """A waiting job that would end on its deadline by waiting, to the margin's share of its run, is
    let out: a pause timed to end it exactly on time misses whenever it runs slower than predicted."""
    from omni_ext.scheduler.preempt import DEADLINE_MARGIN

    one = Layout.regular(1, 1)
    head = Waiting("s", JobNeeds(JobMode.SINGLE), priority=0, predicted_s=0.5, deadline=3.0)
    margin = DEADLINE_MARGIN * 0.5

    def victim(wait: float) -> Running:
        return Running("l", 0, (0,), remaining_s=wait, deadline=100.0)

    inside = choose(head, [victim(2.5 - margin / 2)], [], one, now=0.0)  # ends inside the margin
    assert inside is not None and inside.reason == "deadline"
    assert "before its deadline, inside the margin" in inside.detail
    assert choose(head, [victim(2.5 - margin - 0.01)], [], one, now=0.0) is None  # ends before the margin


def test_within_a_burst_a_deadline_pause_takes_only_the_ranks_the_job_would_take_anyway() -> None:
    """Rule 3: a short job of a burst pauses the running job that frees first (it would have run
    there next anyway: the burst's packing is kept), never another one with more slack; a short job
    that arrived apart from them (a stream) pauses the one with the most slack."""
    from omni_ext.scheduler.preempt import BURST_WINDOW_S

    soon = Running("soon", 0, (0,), remaining_s=4.0, deadline=14.0, arrival=0.0)  # frees first, 8.5 s of slack
    later = Running("later", 0, (1,), remaining_s=6.0, deadline=30.0, arrival=0.0)  # more slack

    def head(arrival: float) -> Waiting:
        return Waiting("s", JobNeeds(JobMode.SINGLE), predicted_s=1.5, deadline=4.5, arrival=arrival)

    assert choose(head(BURST_WINDOW_S / 2), [soon, later], [], DP2, now=0.5).victim == "soon"
    assert choose(head(BURST_WINDOW_S * 2), [soon, later], [], DP2, now=0.5).victim == "later"
    # the one that frees first has no slack for it: within a burst no pause at all
    tight = Running("soon", 0, (0,), remaining_s=4.0, deadline=5.0, arrival=0.0)
    assert choose(head(0.0), [tight, later], [], DP2, now=0.5) is None
    assert choose(head(1.0), [tight, later], [], DP2, now=0.5).victim == "later"
    # arrivals unknown (a caller that does not say): rule 2 alone
    assert choose(Waiting("s", JobNeeds(JobMode.SINGLE), predicted_s=1.5, deadline=4.5),
                  [soon, later], [], DP2, now=0.5).victim == "later"


def test_a_victim_late_anyway_may_pause_for_a_deadline() -> None:
    """A running job that misses its deadline even undisturbed loses nothing a deadline counts by a
    pause, so a waiting job about to miss its own may pause it without a second deadline at risk."""
    one = Layout.regular(1, 1)
    head = Waiting("s", JobNeeds(JobMode.SINGLE), predicted_s=0.5, deadline=2.0)
    doomed = Running("l", 0, (0,), remaining_s=5.0, deadline=4.0)
    got = choose(head, [doomed], [], one, now=0.0)
    assert got is not None and got.victim == "l" and "late already" in got.detail
    assert choose(head, [Running("l", 0, (0,), remaining_s=5.0, deadline=5.2)], [], one, now=0.0) is None


def test_scheduler_options_for_preemption() -> None:
    from omni_ext.scheduler.config import scheduler_config

    assert SchedulerConfig().preempt is True and SchedulerConfig().max_preemptions == 8
    cfg = scheduler_config('{"omni_ext": {"scheduler": {"preempt": false, "max_preemptions": 1}}}')
    assert (cfg.preempt, cfg.max_preemptions) == (False, 1)
    with pytest.raises(ValueError, match="max_preemptions"):
        SchedulerConfig(max_preemptions=-1)
    with pytest.raises(ValueError, match="preempt"):
        SchedulerConfig(preempt="yes")


# ---- the pause agreement -------------------------------------------------------------------------
def _board(world: int):
    from omni_ext.executor.role import new_board

    return new_board(multiprocessing.get_context("spawn"), world)


def test_the_processes_of_a_job_pause_at_the_same_step_and_may_pause_again() -> None:
    """Two processes of a pair, simulated in turn: the one ahead sees the pause token and sets the step
    after the furthest step the other published; each pause of a job is agreed afresh."""
    from omni_ext.executor import role
    from omni_ext.executor.role import PAUSE, PAUSED, ROLE, RUN, boundary, pause_token, set_role

    board = _board(2)
    roles = {}
    for r in (0, 1):
        ROLE.rank, ROLE.cancel_slots = r, board
        set_role(JobMode.PAIR, cfg_rank=r, cfg_size=2, seq=7)
        roles[r] = dict(vars(ROLE))

    def at(rank: int) -> str:
        vars(ROLE).update(roles[rank])
        got = boundary()
        if got == PAUSED:
            ROLE.pauses += 1  # role.pause_here without a hook
        roles[rank] = dict(vars(ROLE))
        return got

    assert [at(0), at(1), at(0), at(1), at(0)] == [RUN] * 5  # rank 0 is about to start step 3, rank 1 step 2
    board[PAUSE * 2 + 0] = board[PAUSE * 2 + 1] = pause_token(7, 1)
    assert at(1) == RUN  # rank 1 at step 2 sees rank 0 published step 2: the pause is at step 3
    assert at(1) == PAUSED and at(0) == PAUSED  # both before step 3
    assert [at(0), at(1)] == [RUN, RUN]  # the same token never pauses again
    board[PAUSE * 2 + 0] = board[PAUSE * 2 + 1] = pause_token(7, 2)
    assert [at(0), at(1)] == [PAUSED, PAUSED]  # the second pause, both before step 5
    assert roles[0]["pauses"] == roles[1]["pauses"] == 2
    role.set_role(role.NO_JOB)


# ---- a job paused in its worker thread while another runs ---------------------------------------------
class _Pipeline:
    """A denoise loop like Wan's: vLLM-Omni's multistep UniPC scheduler on the pipeline, per-request
    attributes on it, noise from torch's global RNG each step, a step boundary before each step."""

    def __init__(self) -> None:
        from vllm_omni.diffusion.models.schedulers import FlowUniPCMultistepScheduler

        self.scheduler = FlowUniPCMultistepScheduler()
        self._guidance_scale = None
        self.on_step = None

    def run(self, req) -> "object":
        import torch
        from vllm_omni.diffusion.data import DiffusionOutput

        from omni_ext.executor.role import aborted, stop_now

        torch.manual_seed(req.seed)
        self._guidance_scale = req.guidance
        self.scheduler.set_timesteps(req.steps, device="cpu")
        x = torch.randn(1, 4, 8, 8)
        for i, t in enumerate(self.scheduler.timesteps):
            if self.on_step is not None:
                self.on_step(i)
            if stop_now():
                raise aborted()
            noise = torch.randn_like(x) * self._guidance_scale
            x = self.scheduler.step(torch.tanh(x) + noise, t, x, return_dict=False)[0]
        return DiffusionOutput(output=x)


class _Worker:
    """vLLM-Omni's WorkerWrapperBase as the job thread sees it: ``.worker.model_runner.pipeline``,
    ``.worker.device``, ``execute_model``."""

    def __init__(self) -> None:
        self.pipeline = _Pipeline()
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(pipeline=self.pipeline), device=None)

    def execute_model(self, req, od_config):
        from vllm_omni.diffusion.data import DiffusionRequestAbortedError, DiffusionOutput

        try:
            return self.pipeline.run(req)
        except DiffusionRequestAbortedError as exc:
            return DiffusionOutput(aborted=True, abort_message=str(exc))


def _job(seq: int, **req) -> "object":
    from omni_ext.executor import protocol

    return protocol.RunJob(f"omx-{seq}", SimpleNamespace(**req), JobMode.SINGLE, 1, seq, (0,), 1)


def test_a_paused_job_resumes_with_the_bytes_of_an_uninterrupted_run() -> None:
    import torch

    from omni_ext.executor.role import PAUSE, ROLE, pause_token
    from omni_ext.executor.worker import JobThread

    board = _board(1)
    ROLE.rank, ROLE.cancel_slots = 0, board
    worker = _Worker()
    long_req, short_req = dict(seed=1, guidance=0.5, steps=8), dict(seed=2, guidance=0.9, steps=5)

    def run(seq: int, req: dict):
        job = JobThread(worker, None, 0, _job(seq, **req))
        job.start()
        assert job.settle() == "done"
        job.join()
        return job.done.out.output

    alone_long, alone_short = run(1, long_req), run(2, short_req)

    def ask_pause(i: int) -> None:  # the executor asks just before step 2's boundary: it pauses there
        if i == 2 and ROLE.seq == 3:
            board[PAUSE + 0] = pause_token(3, 1)

    worker.pipeline.on_step = ask_pause
    paused = JobThread(worker, None, 0, _job(3, **long_req))
    paused.start()
    assert paused.settle() == "paused" and paused.step == 2
    between = run(4, short_req)  # another job runs on the same pipeline and scheduler meanwhile
    paused.resume()
    assert paused.settle() == "done"
    paused.join()
    assert torch.equal(paused.done.out.output, alone_long)  # the same bytes
    assert torch.equal(between, alone_short)
    assert paused.paused_s > 0 and paused.done.seconds >= 0

    # cancelled while paused: it unwinds (aborted) instead of resuming
    worker.pipeline.on_step = lambda i: board.__setitem__(PAUSE, pause_token(5, 1)) if i == 1 and ROLE.seq == 5 else None
    dropped = JobThread(worker, None, 0, _job(5, **long_req))
    dropped.start()
    assert dropped.settle() == "paused"
    dropped.resume(drop=True)
    assert dropped.settle() == "done"
    dropped.join()
    assert dropped.done.out.aborted and "paused" in dropped.done.out.abort_message
    worker.pipeline.on_step = None
    assert torch.equal(run(6, long_req), alone_long)


# ---- the executor's queue: pause, the waiting job on the freed ranks, resume, cancel ----------------------
def test_the_executor_pauses_a_long_job_for_an_interactive_one_and_resumes_it(tmp_path, monkeypatch) -> None:
    from vllm_omni.diffusion.data import DiffusionOutput

    from omni_ext import progress
    from omni_ext.executor import protocol
    from omni_ext.executor.role import PAUSE, pause_token
    from tests.helpers import rank_queue, wan_request

    monkeypatch.setenv(progress.ENV, str(tmp_path))
    ex = rank_queue(settle_s=0.0, cfg_mode="pair", max_preemptions=2)
    long_ = ex.submit("video_l-0000000l", wan_request())
    assert [m.job_id for _, m in ex.sent] == [long_.job_id, long_.job_id] and long_.ranks == (0, 1)
    progress.write_progress([long_.request_id], 3, 10, time.time())
    urgent = ex.submit("video_u-0000000u", wan_request(priority="-1"))
    token = pause_token(long_.seq, 1)
    assert [ex.cancel_slots[PAUSE * 2 + r] for r in (0, 1)] == [token, token]  # asked through the board
    assert not urgent.ranks and long_.pausing_for == urgent.job_id
    ex.on_paused(0, protocol.Paused(long_.job_id, 0, 4))
    assert not urgent.ranks  # a pair pauses whole
    ex.on_paused(1, protocol.Paused(long_.job_id, 1, 4))
    assert urgent.ranks == (0, 1) and long_.is_paused  # the interactive job runs on the freed ranks
    assert progress.read_progress("video_l").mode == progress.PAUSED
    assert progress.read_preemptions(tmp_path) == ({"priority": 1, "deadline": 0}, 1)
    other = ex.submit("video_o-0000000o", wan_request(priority="-2"))  # not while a job is paused under it
    assert urgent.pausing_for is None and not other.ranks  # the job that runs over a paused one is not paused
    for r in (0, 1):
        ex.answer(r, protocol.JobDone(urgent.job_id, r, DiffusionOutput() if r == 1 else None, r == 1, 1.0))
    # its ranks are free, and the queued job would pause it again for its better priority: the paused job
    # stays paused and lets it through (its second pause of at most 2), instead of resuming for one step
    assert other.ranks == (0, 1) and long_.is_paused and long_.pauses == 2 and long_.pausing_for == other.job_id
    assert not [m for _, m in ex.sent if isinstance(m, protocol.ResumeJob)]
    assert [ex.cancel_slots[PAUSE * 2 + r] for r in (0, 1)] == [token, token]  # no second pause asked
    assert progress.read_preemptions(tmp_path) == ({"priority": 2, "deadline": 0}, 1)
    third = ex.submit("video_t-0000000t", wan_request(priority="-3"))
    for r in (0, 1):
        ex.answer(r, protocol.JobDone(other.job_id, r, DiffusionOutput() if r == 1 else None, r == 1, 1.0))
    # paused as often as it may be: it resumes there before the queued one, and is not asked to pause again
    resumed = [(r, m) for r, m in ex.sent if isinstance(m, protocol.ResumeJob)]
    assert resumed == [(0, protocol.ResumeJob(long_.job_id)), (1, protocol.ResumeJob(long_.job_id))]
    assert not long_.is_paused and progress.read_progress("video_l").mode is None
    assert not third.ranks and long_.pausing_for is None
    assert [ex.cancel_slots[PAUSE * 2 + r] for r in (0, 1)] == [token, token]
    ex.abort([third.request_id])
    assert third.future.result(timeout=1).aborted
    # paused for another request and cancelled while paused: unwound, not resumed
    for r in (0, 1):
        ex.answer(r, protocol.JobDone(long_.job_id, r, DiffusionOutput() if r == 1 else None, r == 1, 1.0))
    assert long_.future.result(timeout=1) is not None and not ex.jobs
    assert progress.read_preemptions(tmp_path) == ({"priority": 2, "deadline": 0}, 0)
    kinds = [e["kind"] for e in progress.read_placements()[0] if e["request_id"] == long_.request_id]
    assert kinds == ["start", "preempt", "paused", "preempt", "resumed", "done"], kinds


def test_a_job_paused_under_another_is_unwound_when_cancelled(tmp_path, monkeypatch) -> None:
    from vllm_omni.diffusion.data import DiffusionOutput

    from omni_ext import progress
    from omni_ext.executor import protocol
    from tests.helpers import rank_queue, wan_request

    monkeypatch.setenv(progress.ENV, str(tmp_path))
    ex = rank_queue(settle_s=0.0, cfg_mode="pair")
    long_ = ex.submit("video_l-0000000l", wan_request())
    urgent = ex.submit("video_u-0000000u", wan_request(priority="-1"))
    for r in (0, 1):
        ex.on_paused(r, protocol.Paused(long_.job_id, r, 4))
    assert urgent.ranks == (0, 1) and long_.is_paused
    ex.abort([long_.request_id])
    drops = [(r, m) for r, m in ex.sent if isinstance(m, protocol.ResumeJob) and m.drop]
    assert drops == [(0, protocol.ResumeJob(long_.job_id, True)), (1, protocol.ResumeJob(long_.job_id, True))]
    for r in (0, 1):
        ex.answer(r, protocol.JobDone(urgent.job_id, r, DiffusionOutput() if r == 1 else None, r == 1, 1.0))
    for r in (0, 1):
        ex.answer(r, protocol.JobDone(long_.job_id, r, DiffusionOutput(aborted=True) if r == 1 else None, r == 1, 1.0))
    assert long_.future.result(timeout=1).aborted and not ex.jobs
    assert not [m for _, m in ex.sent if isinstance(m, protocol.ResumeJob) and not m.drop]  # never resumed
    assert progress.read_preemptions(tmp_path) == ({"priority": 1, "deadline": 0}, 0)


def test_no_preemption_where_the_executor_cannot_pause_exactly() -> None:
    from tests.helpers import rank_queue, wan_request

    ex = rank_queue(settle_s=0.0, cfg_mode="pair", preempt=False)
    long_ = ex.submit("video_l-0000000l", wan_request())
    ex.submit("video_u-0000000u", wan_request(priority="-1"))
    assert long_.pausing_for is None and not any(ex.cancel_slots)


def test_a_paused_job_says_paused_in_its_progress_detail(tmp_path, monkeypatch) -> None:
    """``GET /v1/videos/{id}`` of a job the executor paused: ``status`` stays ``in_progress``,
    ``progress_detail.state`` is ``paused`` (from the executor's mark in the job's progress file)."""
    from omni_ext import progress
    from omni_ext.api.intake import ModelLimits
    from omni_ext.progress import StepProgress
    from tests.helpers import serve_in_process

    (tmp_path / "progress").mkdir()
    monkeypatch.setenv(progress.ENV, str(tmp_path / "progress"))
    body = {"prompt": "a fox", "size": "64x64", "num_frames": 9, "num_inference_steps": 10, "guidance_scale": 4.0}
    with serve_in_process(tmp_path, ModelLimits("WanPipeline", 16, 1, True)) as (client, _, files, _, _):
        job = client.post("/v1/videos", json=body).json()
        assert job["status"] == "queued"
        assert client.get(f"/v1/videos/{job['id']}").json()["progress_detail"] == {"state": "queued"}
        engine_id, t = f"{job['id']}-0000abcd", time.time()
        files[job["id"]] = StepProgress(3, 10, t, t)  # the API's account sees it run
        progress.write_progress([engine_id], 3, 10, t - 1.0)  # the lead rank's step report
        seen = client.get(f"/v1/videos/{job['id']}").json()
        assert seen["status"] == "in_progress"
        assert seen["progress_detail"] == {"state": "running", "steps_done": 3, "steps_total": 10}
        progress.mark_paused([engine_id], True)
        seen = client.get(f"/v1/videos/{job['id']}").json()
        assert seen["status"] == "in_progress" and seen["progress_detail"]["state"] == "paused"
        listed = client.get("/v1/videos").json()["data"]
        assert [v["progress_detail"]["state"] for v in listed if v["id"] == job["id"]] == ["paused"]
        progress.mark_paused([engine_id], False)
        after = progress.read_progress(job["id"])
        assert after.mode is None and after.done == 3 and after.t_start > t - 1.0  # the paused time is left out
        assert client.get(f"/v1/videos/{job['id']}").json()["progress_detail"]["state"] == "running"


def test_a_running_job_slower_than_predicted_is_seen_by_its_steps_and_the_waiting_job_preempts(tmp_path, monkeypatch) -> None:
    """The queue predicts a running job's time left from its lead rank's step reports, not only from
    the cost model: two jobs side by side on a CPU host run slower than each alone, and a short job that
    would wait for a long one's predicted end (in time) waits for its real end (too late). And when the
    long job's ranks free up while it is paused and the next short one would pause it again, it stays
    paused for it (one pause more) instead of resuming for one step."""
    from vllm_omni.diffusion.data import DiffusionOutput

    from omni_ext import progress
    from omni_ext.executor import protocol
    from omni_ext.executor.role import PAUSE, pause_token
    from tests.helpers import rank_queue, wan_request

    monkeypatch.setenv(progress.ENV, str(tmp_path))

    def req(deadline_s: float, steps: int, frames: int = 5) -> object:
        r = wan_request(guidance=1.0)
        r.sampling_params.num_inference_steps, r.sampling_params.num_frames = steps, frames
        r.sampling_params.extra_args = {"omni_ext_deadline_s": deadline_s}
        return r

    ex = rank_queue(world=1, cfg_size=1, settle_s=0.0, seconds_per_unit=0.01, max_preemptions=3)
    long_ = ex.submit("video_l-0000000l", req(600.0, 40, frames=81))
    predicted_long = ex.entry(long_).ticket.predicted_s
    short = ex.submit("video_s-0000000s", req(predicted_long * 1.3, 2))
    predicted_short = ex.entry(short).ticket.predicted_s
    assert predicted_long >= 5 * predicted_short and long_.ranks == (0,)
    # by the cost model the long job ends before the short one's latest start: it waits
    assert long_.pausing_for is None and not short.ranks
    # its step reports say it runs at twice its predicted pace: 4 of 40 steps in 0.2 x predicted
    now = time.time()
    progress.write_progress([long_.request_id], 4, 40, now - 0.2 * predicted_long)
    ex.dispatch()  # what the re-check timer does
    assert long_.pausing_for == short.job_id and ex.cancel_slots[PAUSE] == pause_token(long_.seq, 1)
    ex.on_paused(0, protocol.Paused(long_.job_id, 0, 4))
    assert short.ranks == (0,) and long_.is_paused
    short2 = ex.submit("video_t-0000000t", req(predicted_short * 1.5, 2))
    assert not short2.ranks  # the job over a paused one is not paused
    ex.answer(0, protocol.JobDone(short.job_id, 0, DiffusionOutput(), True, 0.1))
    assert short2.ranks == (0,) and long_.is_paused and long_.pauses == 2
    assert not [m for _, m in ex.sent if isinstance(m, protocol.ResumeJob)]
    ex.answer(0, protocol.JobDone(short2.job_id, 0, DiffusionOutput(), True, 0.1))
    assert [m for _, m in ex.sent if isinstance(m, protocol.ResumeJob)] == [protocol.ResumeJob(long_.job_id)]
    assert progress.read_preemptions(tmp_path) == ({"priority": 0, "deadline": 2}, 0)
    # a third short one: the long job's ranks pause it a second time (the token its workers expect:
    # they paused it once; the pass-on was no pause of theirs), its third preemption of at most 3
    short3 = ex.submit("video_u-0000000u", req(predicted_short * 1.5, 2))
    assert long_.pausing_for == short3.job_id and ex.cancel_slots[PAUSE] == pause_token(long_.seq, 2)
    ex.on_paused(0, protocol.Paused(long_.job_id, 0, 9))
    assert short3.ranks == (0,) and long_.pauses == 3 and long_.stops == 2
    ex.answer(0, protocol.JobDone(short3.job_id, 0, DiffusionOutput(), True, 0.1))
    short4 = ex.submit("video_v-0000000v", req(predicted_short * 1.5, 2))
    assert long_.pausing_for is None and not short4.ranks  # paused as often as it may be


def test_step_reports_after_a_pause_leave_the_paused_time_out(tmp_path, monkeypatch) -> None:
    """The lead rank's step reports after a resume: the loop's start (and the job's) move on by the
    time the job was paused, so the executor's and the API's predicted time left, computed from the
    rate of the steps, is that of the steps, not of the steps and the pause."""
    from types import SimpleNamespace

    from omni_ext import progress
    from omni_ext.executor.role import ROLE, set_role
    from omni_ext.patches.step_progress import _ReportingBar

    monkeypatch.setenv(progress.ENV, str(tmp_path))
    progress.mark_started(["video_p-00000001"], 10, "single")
    set_role("single")
    bar = _ReportingBar(SimpleNamespace(update=lambda n: None), 10, ["video_p-00000001"], True)
    monkeypatch.setattr("omni_ext.executor.role.check_step_cancel", lambda: None)
    bar.update(1)
    before = progress.read_request("video_p-00000001")
    ROLE.paused_s = 5.0  # what pause_here adds once the job resumed
    bar.update(1)
    after = progress.read_request("video_p-00000001")
    assert after.done == 2 and after.t_start == pytest.approx(before.t_start + 5.0)
    assert after.t_job == pytest.approx(before.t_job + 5.0)
    # the rate of two steps, not of two steps and a 5-s pause
    assert after.remaining_s() == pytest.approx(max(1e-3, (after.t_last - before.t_start - 5.0) / 2) * 8)
    from omni_ext.executor.role import pause_here

    ROLE.pause_hook = lambda: time.sleep(0.05)  # the worker's hook blocks until the job resumes
    pause_here()
    assert ROLE.paused_s >= 5.05 and ROLE.pauses == 1
    set_role("none")
    assert ROLE.paused_s == 0.0


def test_the_queue_behind_the_head_sets_the_deadline_it_is_judged_by() -> None:
    """A queue of short jobs behind two long ones: the head meets its own deadline by waiting, the
    third does not; the head is judged by the deadline that job needs (its own less the two runs
    before it on the same ranks), and a pause is made for it."""
    from omni_ext.scheduler.admission import queue_pressure

    slots = [5.0, 5.0]
    assert queue_pressure(0.0, slots, [(0.5, 10.0), (0.5, 10.0), (0.5, 5.8)], 2) == (pytest.approx(4.8), 1)
    assert queue_pressure(0.0, slots, [(0.5, 10.0), (0.5, 10.0), (0.5, 6.5)], 2) == (10.0, 0)  # all in time
    assert queue_pressure(0.0, slots, [(0.5, None), (0.5, 5.2)], 2) == (pytest.approx(4.7), 1)
    assert queue_pressure(0.0, slots, [(0.5, 5.2), (0.5, 5.2)], 2) == (pytest.approx(4.7), 2)
    assert queue_pressure(0.0, [], [], 2) == (None, 0)
    assert queue_pressure(0.0, slots, [(0.5, 10.0), (None, 1.0), (0.5, 1.0)], 2) == (10.0, 0)  # unpredicted: the look ends
    assert queue_pressure(0.0, slots, [(0.5, 10.0)] + [(0.5, 10.0)] * 8 + [(0.5, 1.0)], 2, depth=8) == (10.0, 0)
    one = Layout.regular(1, 1)
    deadline, at_risk = queue_pressure(0.0, [5.0], [(0.5, 10.0), (0.5, 5.0)], 1)
    head = Waiting("s", JobNeeds(JobMode.SINGLE), predicted_s=0.5, deadline=deadline, at_risk=at_risk)
    got = choose(head, [Running("l", 0, (0,), remaining_s=5.0, deadline=100.0)], [], one, now=0.0)
    assert got is not None and got.victim == "l"
    alone = Waiting("s", JobNeeds(JobMode.SINGLE), predicted_s=0.5, deadline=10.0)
    assert choose(alone, [Running("l", 0, (0,), remaining_s=5.0, deadline=100.0)], [], one, now=0.0) is None


def test_a_victim_without_slack_pauses_only_when_two_or_more_deadlines_are_saved() -> None:
    """Count-based attainment: a long job that would be late after the pause (no slack) is paused
    when the head and a job behind it would both miss theirs waiting (two saved for at most one
    lost), not for the head alone (one for one); of several, the one least late after it."""
    one = Layout.regular(1, 1)
    tight = Running("l", 0, (0,), remaining_s=5.0, deadline=5.2)
    head = Waiting("s", JobNeeds(JobMode.SINGLE), predicted_s=0.5, deadline=2.0)
    assert choose(head, [tight], [], one, now=0.0) is None
    two = Waiting("s", JobNeeds(JobMode.SINGLE), predicted_s=0.5, deadline=2.0, at_risk=2)
    assert choose(two, [tight], [], one, now=0.0).victim == "l"
    a, b = Running("a", 0, (0,), remaining_s=5.0, deadline=5.1), Running("b", 0, (1,), remaining_s=5.0, deadline=5.3)
    assert choose(two, [a, b], [], Layout.regular(2, 1), now=0.0).victim == "b"
    # ... unless one is late anyway: its pause loses no deadline at all
    doomed = Running("a", 0, (0,), remaining_s=5.0, deadline=4.0)
    assert choose(two, [doomed, b], [], Layout.regular(2, 1), now=0.0).victim == "a"
    # the bound on preemptions and the gain still hold
    assert choose(two, [Running("l", 0, (0,), remaining_s=5.0, deadline=5.2, preemptions=8)], [], one, now=0.0) is None
    assert choose(two, [Running("l", 0, (0,), remaining_s=0.9, deadline=5.2)], [], one, now=0.0) is None


def test_deadline_pauses_belong_to_the_slo_order() -> None:
    """Under ``order: cost`` (a burst's makespan) and ``fifo`` a job pauses only for priority."""
    from omni_ext.scheduler.preempt import deadline_pauses

    assert deadline_pauses("slo") and not deadline_pauses("cost") and not deadline_pauses("fifo")
    one = Layout.regular(1, 1)
    long_ = Running("l", 0, (0,), remaining_s=20.0, deadline=100.0)
    head = Waiting("s", JobNeeds(JobMode.SINGLE), priority=0, predicted_s=2.0, deadline=6.0)
    assert choose(head, [long_], [], one, now=0.0).reason == "deadline"
    assert choose(head, [long_], [], one, now=0.0, deadlines=False) is None
    urgent = Waiting("u", JobNeeds(JobMode.SINGLE), priority=-1, predicted_s=2.0)
    assert choose(urgent, [long_], [], one, now=0.0, deadlines=False).reason == "priority"


# ---- start predictions with the pauses the executor makes --------------------------------------------
def test_a_short_job_behind_long_ones_is_predicted_to_start_at_a_step_boundary() -> None:
    """``bench stream`` at 0.9 of capacity (seed 1, 2026-12-07): short jobs were told they would wait
    3.8 s at the median (until a long job ended) and waited 0.18 s (a deadline pause a step later)."""
    from omni_ext.scheduler.admission import Busy, predicted_starts
    from omni_ext.scheduler.admission import start_times

    longs = [Busy(6.0, boundary_s=0.3, deadline=100.0), Busy(8.0, boundary_s=0.1, deadline=100.0)]
    short = Waiting("s", priority=0, predicted_s=1.0, deadline=3.0)
    assert start_times([6.0, 8.0], [1.0], 2) == [6.0]
    # the victim is the one with the most slack (its deadline after the short run): 100 - 7 > 100 - 9
    assert predicted_starts(0.0, longs, [short], 2) == [0.3]
    # a job that meets its deadline (with the margin) by waiting waits; so does one under "cost"/"fifo"
    relaxed = Waiting("r", priority=0, predicted_s=1.0, deadline=9.0)
    assert predicted_starts(0.0, longs, [relaxed], 2) == [6.0]
    assert predicted_starts(0.0, longs, [short], 2, deadlines=False) == [6.0]
    # nothing that may pause (no boundary), or no pauses left: the list schedule
    assert predicted_starts(0.0, [Busy(6.0), Busy(8.0)], [short], 2) == [6.0]
    spent = [Busy(6.0, 0.3, deadline=100.0, preemptions=8), Busy(8.0, 0.1, deadline=100.0, preemptions=8)]
    assert predicted_starts(0.0, spent, [short], 2) == [6.0]
    # a better priority pauses without a deadline: the worst priority, then the most time left
    urgent = Waiting("u", priority=-1, predicted_s=1.0)
    assert predicted_starts(0.0, [Busy(6.0, 0.3), Busy(8.0, 0.1)], [urgent], 2) == [0.1]


def test_a_paused_job_lets_a_queue_of_short_jobs_through_one_after_another() -> None:
    """The executor's pass-on: the paused job does not resume between short jobs that each need the
    pause; the second starts when the first ends, not when the long job does. A job that fits its
    deadline behind them waits for the slot that frees first."""
    from omni_ext.scheduler.admission import Busy, predicted_starts

    long_ = Busy(10.0, boundary_s=0.2, deadline=100.0)
    a = Waiting("a", predicted_s=1.0, deadline=3.0)
    b = Waiting("b", predicted_s=1.0, deadline=3.5)
    assert predicted_starts(0.0, [long_], [a, b], 1) == pytest.approx([0.2, 1.2])
    roomy = Waiting("c", predicted_s=1.0, deadline=50.0)
    assert predicted_starts(0.0, [long_], [a, b, roomy], 1) == pytest.approx([0.2, 1.2, 12.0])
    # the bound holds in the prediction too: one pause left, so the second waits for the long job
    assert predicted_starts(0.0, [long_], [a, b], 1, max_preemptions=1) == pytest.approx([0.2, 11.0])


def test_the_queue_predicts_boundaries_from_measured_steps_and_admission_counts_them() -> None:
    """A running job's next step boundary: from its reported steps (step time, when the last ended),
    before them one predicted step; none where it cannot pause. What a newcomer is told follows."""
    from omni_ext.scheduler.admission import Admission
    from omni_ext.scheduler.queue import JobQueue

    config = SchedulerConfig(seconds_per_unit=1.0, max_wait_s=60.0)
    q: JobQueue[None] = JobQueue(config)
    q.submit("long", None, priority=0, arrival=0.0, key="s", units=20.0, n_steps=20)
    q.start("long", 0.0)
    assert q.boundary(q.get("long"), 0.5) == pytest.approx(1.0)  # no step measured: 20 s / 20 steps
    entry = q.get("long")
    entry.steps = (4, 20, 4.0, 0.5)  # 4 steps of 1 s after 0.5 s of text encoding: the 4th ended at 4.5
    assert q.boundary(entry, 4.8) == pytest.approx(0.7)
    assert q.boundary(entry, 7.0) is None  # 1.5 steps overdue: paused under another job
    # after a pause of 3 s the reports leave the pause out: the latest step's end says where it is
    entry.steps, entry.step_at = (5, 20, 5.0, 0.5), 8.5
    assert q.boundary(entry, 8.8) == pytest.approx(0.7)
    entry.step_at = None
    entry.steps = (20, 20, 20.0, 0.5)
    assert q.boundary(entry, 20.6) is None  # its loop is done: decoding
    entry.steps = (4, 20, 4.0, 0.5)
    new = q.entry("short", None, priority=0, arrival=4.8, key="s", units=1.0)
    decision = Admission(config, 1).decide(4.8, *q.snapshot(4.8), new.ticket)
    assert decision.admitted and decision.wait_s == pytest.approx(0.7)  # not the long job's 16 s left
    off: JobQueue[None] = JobQueue(SchedulerConfig(seconds_per_unit=1.0, max_wait_s=60.0, preempt=False))
    off.submit("long", None, priority=0, arrival=0.0, key="s", units=20.0, n_steps=20)
    off.start("long", 0.0)
    off.get("long").steps = (4, 20, 4.0, 0.5)
    assert off.boundary(off.get("long"), 4.8) is None
    new = off.entry("short", None, priority=0, arrival=4.8, key="s", units=1.0)
    assert Admission(off.config, 1).decide(4.8, *off.snapshot(4.8), new.ticket).wait_s == pytest.approx(16.0)  # 16 steps left


def test_a_paused_job_waits_under_the_job_on_its_ranks_and_passes_the_slot_on() -> None:
    """The API process sees a paused job by its progress file (mode ``paused``): it holds no slot of
    its own but frees its slot after the job running over it, and may let the next job through when
    that one ends (``bench stream`` seed 1 at 0.9: a few-step job told 4.6 s started in 0.08 s so)."""
    from omni_ext.scheduler.admission import Admission
    from omni_ext.scheduler.queue import JobQueue

    config = SchedulerConfig(seconds_per_unit=1.0, max_wait_s=60.0)
    q: JobQueue[None] = JobQueue(config)
    for job, units, at in (("paused", 20.0, 0.0), ("short", 1.0, 4.0), ("long", 20.0, 1.0)):
        q.submit(job, None, priority=0, arrival=at, key="s", units=units, n_steps=20 if units > 1 else 4)
        q.start(job, at)
    q.get("paused").paused = True
    q.get("paused").steps, q.get("paused").step_at = (4, 20, 4.0, 0.0), 4.0
    long_ = q.get("long")
    long_.steps, long_.step_at = (3, 20, 3.0, 0.0), 4.0
    held = sorted(q._held(4.2), key=lambda b: b.remaining_s)
    assert [b.remaining_s for b in held] == pytest.approx([0.8 + 16.0, 17.0])
    assert [b.boundary_s for b in held] == pytest.approx([0.8, 0.8])  # the long one's next step; the short's end
    few = q.entry("few", None, priority=0, arrival=4.2, key="s", units=0.3)
    decision = Admission(config, 2).decide(4.2, *q.snapshot(4.2), few.ticket)
    assert decision.wait_s == pytest.approx(0.8)  # not 16.8 s: a pause, at the first boundary on offer
