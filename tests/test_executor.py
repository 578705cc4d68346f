"""omni-ext's TunedExecutor on real ``vllm-omni serve`` processes (tiny Wan2.1 and Qwen-Image).

Servers (conftest.SERVERS): ``wan-tuned-cfg2`` / ``qwen-tuned-cfg2`` (one CFG group of 2 workers),
``wan-tuned-dp2`` (two groups of one worker each: real data parallel). They are compared with the
one-worker stock servers ``wan`` / ``qwen``. Killing a worker is ``tests/test_drills.py``'s drill (a server of
its own). Which rank ran which request is read from the
server's placement journal, ``GET /v1/omni_ext/placements`` (:func:`tests.helpers.executor_events`).

CFG parallel's identical output to one device is tested for vLLM-Omni's executor and this one
together (``tests/test_serving.py::test_cfg_parallel_2_*``); the placement rules themselves are
unit-tested in ``tests/test_scheduler.py``. Speed is not asserted here (that is ``omni-ext bench``);
these tests check behaviour.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path

import pytest
import requests

from tests.helpers import (
    IMAGE, rank_queue, events_mark, new_events, png_from, placements, until, video_sync, wait_for_events,
    wan_request,
)


def queued_ids(server, after: float) -> list[str]:
    """Engine request ids the executor queued (could not start at once) since ``after``, in order."""
    return [e["request_id"] for e in placements(server, after, kind="queued")]


def run_two_at_once(server, fields: dict, seeds: tuple[int, int]) -> tuple[list, list]:
    """Two video requests sent together; (responses, the executor events they produced)."""
    before = events_mark(server)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = [f.result() for f in [pool.submit(video_sync, server, **fields, seed=s) for s in seeds]]
    assert all(r.status_code == 200 for r in outs), [r.text[:200] for r in outs]
    return outs, wait_for_events(server, before, 2)


# --------------------------------------------------------------------------------------------------
# 0. Pure parts: Ascend defaults (no NPU, torch_npu is never imported here), the worker pipe messages
# --------------------------------------------------------------------------------------------------
def test_ascend_defaults_fill_only_what_the_user_did_not_set() -> None:
    from omni_ext.executor.ascend import ascend_worker_env

    env = ascend_worker_env({}, num_groups=1, group_size=2)
    assert env == {
        "TASK_QUEUE_ENABLE": "2",
        "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
        "CPU_AFFINITY_CONF": "1",
        "HCCL_OP_EXPANSION_MODE": "AIV",
    }
    user = {"TASK_QUEUE_ENABLE": "1", "HCCL_OP_EXPANSION_MODE": "HOST", "CPU_AFFINITY_CONF": "2"}
    assert ascend_worker_env(user, num_groups=1, group_size=2) == {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}


@pytest.mark.parametrize(
    "environ,groups,size,nodes",
    [({}, 2, 2, 1), ({}, 1, 1, 1), ({}, 1, 2, 2), ({"HCCL_DETERMINISTIC": "true"}, 1, 2, 1)],
    ids=["two-concurrent-comm-domains", "no-collective", "multi-node", "deterministic"],
)
def test_ascend_aiv_expansion_only_where_valid(environ, groups, size, nodes) -> None:
    from omni_ext.executor.ascend import ascend_worker_env

    env = ascend_worker_env(environ, num_groups=groups, group_size=size, nodes=nodes)
    assert "HCCL_OP_EXPANSION_MODE" not in env
    assert env["TASK_QUEUE_ENABLE"] == "2"


@pytest.mark.parametrize("groups,cfg,sp,domains,aiv", [
    (1, 1, 4, 1, True), (1, 2, 1, 1, True), (1, 2, 2, 1, False), (2, 1, 2, 1, False), (1, 1, 2, 1, True),
    (1, 1, 4, 2, False),
], ids=["one-sp-group", "one-cfg-group", "cfg-x-sp-concurrent-domains", "two-sp-groups", "one-tp-group",
        "tp-x-sp-in-a-unit"])
def test_ascend_aiv_expansion_under_sequence_parallel(groups, cfg, sp, domains, aiv) -> None:
    from omni_ext.executor.ascend import ascend_worker_env

    env = ascend_worker_env({}, num_groups=groups, group_size=cfg, unit_size=sp, unit_domains=domains)
    assert ("HCCL_OP_EXPANSION_MODE" in env) is aiv


def test_collectives_use_hccl_on_npu_and_torch_npu_is_not_needed() -> None:
    import sys

    from omni_ext.executor.ascend import collective_backend, npu_available

    assert collective_backend("npu") == "hccl" and collective_backend("cpu") == "gloo"
    assert npu_available() is False  # no torch_npu on this host: a clean False, not an ImportError
    assert "torch_npu" not in sys.modules


@pytest.mark.parametrize("section,device,expect", [
    ({}, "cpu", "forkserver"), ({}, "npu", "spawn"), ({}, "cuda", "spawn"),
    ({"worker_start": "spawn"}, "cpu", "spawn"), ({"worker_start": "forkserver"}, "npu", "forkserver"),
])
def test_worker_start_method_defaults_by_device_and_the_option_wins(section, device, expect) -> None:
    from omni_ext.executor.start import start_method

    assert start_method(section, device) == expect


def test_an_unknown_worker_start_method_is_refused_with_the_choices() -> None:
    from omni_ext.executor.start import start_method

    with pytest.raises(ValueError, match=r"omni_ext.worker_start must be one of \['spawn', 'forkserver'\], got 'fork'"):
        start_method({"worker_start": "fork"}, "cpu")


def test_a_forked_worker_takes_the_executors_environment_and_keeps_its_process_title() -> None:
    """A forked worker inherits its fork server's environment; apply_environ swaps it for the
    executor's without breaking setproctitle (vLLM names its workers through it: moving the C
    environment first left every worker titled "python")."""
    import subprocess
    import sys

    code = ("import os, setproctitle; from omni_ext.executor.start import apply_environ; "
            "env = dict(os.environ, OMNI_EXT_X='1'); env.pop('OMNI_EXT_GONE'); apply_environ(env); "
            "setproctitle.setproctitle('vLLM-Omni::DiffusionWorker_CFG1'); "
            "print(os.environ.get('OMNI_EXT_X'), os.environ.get('OMNI_EXT_GONE'), "
            "open(f'/proc/{os.getpid()}/cmdline').read().split(chr(0))[0].strip())")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMNI_EXT_GONE": "1"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "None", "vLLM-Omni::DiffusionWorker_CFG1"]


def test_executor_worker_messages_round_trip_over_a_pipe() -> None:
    import multiprocessing

    from omni_ext.executor import protocol
    from omni_ext.scheduler.placement import JobMode

    sent = [
        protocol.RunJob("omx-1", {"prompt": "a fox"}, JobMode.PAIR, 2, 1),
        protocol.JobDone("omx-1", 1, None, False, 0.5),
        protocol.CallRpc("rpc-2", "sleep", (1,), {"level": 1}),
        protocol.RpcResult("rpc-2", 0, False, "ValueError: x"),
        protocol.Ready(0, 1234),
        protocol.StartFailed(1, "OSError: y"),
        protocol.Shutdown(),
    ]
    here, there = multiprocessing.Pipe()
    for msg in sent:
        protocol.send(here, msg)
    got = [protocol.recv(there) for _ in sent]
    assert got == sent
    assert got[0].mode is JobMode.PAIR


# --------------------------------------------------------------------------------------------------
# 0b. The executor's queue mechanism, without worker processes (its pipes replaced by a list)
# --------------------------------------------------------------------------------------------------
def finish(ex, job, seconds: float = 1.0) -> None:
    """Every rank of ``job`` answers (the last one holds the output)."""
    from vllm_omni.diffusion.data import DiffusionOutput

    from omni_ext.executor import protocol

    for i, rank in enumerate(job.ranks):
        last = i == len(job.ranks) - 1
        ex.answer(rank, protocol.JobDone(job.job_id, rank, DiffusionOutput() if last else None, last, seconds))


def started(ex) -> list[tuple[str, tuple[int, ...], str]]:
    """(request id, ranks, mode) of each job sent to the workers, in order."""
    runs: dict[str, tuple] = {}
    for rank, msg in ex.sent:
        runs.setdefault(msg.job_id, (msg.mode, []))[1].append(rank)
    request_ids = {j.job_id: j.request_id for j in ex.outputs.values()}  # outputs nobody collected yet
    return [(request_ids[job_id], tuple(ranks), mode.value) for job_id, (mode, ranks) in runs.items()]


def test_executor_queue_orders_by_priority_places_adaptively_and_marks_starts(tmp_path, monkeypatch) -> None:
    from omni_ext import progress

    monkeypatch.setenv(progress.ENV, str(tmp_path))
    ex = rank_queue(settle_s=0.05)
    warm = ex.submit("dummy_req_id_0", wan_request(guidance=1.0))
    a, b = ex.submit("video_a-0000000a", wan_request()), ex.submit("video_b-0000000b", wan_request())
    urgent = ex.submit("video_c-0000000c", wan_request(priority="-1"))
    time.sleep(0.06)  # past the settle time: the burst is whole
    assert [ex.entry(j).ticket.priority for j in (warm, a, b, urgent)] == [-(10**6), 0, 0, -1]
    assert started(ex) == [("dummy_req_id_0", (0, 1), "single")]  # the warm-up, alone on every rank
    assert [p.name for p in tmp_path.iterdir()] == [progress.JOURNAL_DIR]  # no start marker for the warm-up
    assert [(e["kind"], e["request_id"], e.get("mode", e.get("priority"))) for e in progress.read_placements()[0]] == [
        ("start", "dummy_req_id_0", "warm-up"),  # ... but the placement journal has its start,
        ("queued", "video_a-0000000a", 0), ("queued", "video_b-0000000b", 0), ("queued", "video_c-0000000c", -1),
    ]  # and the jobs that could not start at once
    finish(ex, warm)
    # the group is free, three CFG jobs wait: the urgent one first, each on one rank (adaptive)
    assert started(ex)[1:] == [("video_c-0000000c", (0,), "single"), ("video_a-0000000a", (1,), "single")]
    marker = progress.read_progress("video_c")
    assert (marker.done, marker.total, marker.mode) == (0, 2, "single")
    finish(ex, urgent, seconds=2.0)
    finish(ex, a, seconds=2.0)
    assert started(ex)[3] == ("video_b-0000000b", (0,), "single")
    finish(ex, b, seconds=2.0)
    # measured per shape and mode: one rank ran it, in 2 s for its units
    single_key = "wan2.x-t2v:32x32x5:cfg:single"
    assert set(ex.jobs.cost.by_shape) == {single_key}
    assert ex.jobs.cost.by_shape[single_key] == pytest.approx(2.0 / a.needs.units)

    # idle: a CFG job that came alone takes the whole group at once (a tentative pair: rule 5)
    alone = ex.submit("video_d-0000000d", wan_request())
    assert started(ex)[4] == ("video_d-0000000d", (0, 1), "pair") and ex.queued() == []
    assert progress.read_progress("video_d").mode == "pair"
    time.sleep(0.06)  # past its settle time: a request now queues behind the pair instead of splitting it
    e = ex.submit("video_e-0000000e", wan_request())
    assert not alone.splitting and ex.queued() == [e]
    # a queued adaptive job is predicted as on one rank (measured), an upper bound of the pair time
    [ticket] = [entry.ticket for entry in ex.jobs.ordered(time.monotonic())]
    assert ticket.id == e.job_id and ticket.predicted_s == pytest.approx(2.0) and ticket.cost == ticket.predicted_s
    ex.abort(["video_e-0000000e"])  # cancelled while queued: out of the queue and its order at once
    assert e.future.result(timeout=1).aborted and ex.queued() == []
    finish(ex, alone, seconds=1.0)
    assert ex.jobs.cost.by_shape["wan2.x-t2v:32x32x5:cfg:pair"] == pytest.approx(1.0 / a.needs.units)
    assert len(started(ex)) == 5 and not ex.running() and not ex.jobs
    journal = [(e["kind"], e["request_id"][:7], tuple(e["ranks"])) for e in progress.read_placements()[0]
               if e["kind"] != "queued"]
    assert journal[-2:] == [("start", "video_d", (0, 1)), ("done", "video_d", (0, 1))], journal
    assert sum(k == "done" for k, _, _ in journal) == 5  # the warm-up and a-d; e was cancelled while queued


def test_a_pair_started_alone_gives_its_group_back_when_a_burst_follows(tmp_path, monkeypatch) -> None:
    """Placement rule 5's tentative pair: a CFG request that came alone starts as a pair at once; a
    request that follows within ``settle_s`` and finds no free rank stops it at its next step (the
    cancel board), and it starts again on one rank beside the newcomer, answered once, with a fresh
    sequence number. A pair whose stop came after its last step is answered with what it computed."""
    from vllm_omni.diffusion.data import DiffusionOutput

    from omni_ext import progress
    from omni_ext.executor import protocol

    monkeypatch.setenv(progress.ENV, str(tmp_path))
    ex = rank_queue(settle_s=0.5)

    def runs() -> list[tuple[str, int, str, int]]:
        return [(m.job_id, r, m.mode.value, m.seq) for r, m in ex.sent if isinstance(m, protocol.RunJob)]

    a = ex.submit("video_a-0000000a", wan_request())  # the first request: alone
    first_seq = a.seq
    assert runs() == [(a.job_id, 0, "pair", first_seq), (a.job_id, 1, "pair", first_seq)]
    b = ex.submit("video_b-0000000b", wan_request())  # a burst after all
    assert a.splitting and ex.queued() == [b] and list(ex.cancel_slots[:2]) == [first_seq, first_seq]
    stopped = DiffusionOutput(error="DiffusionRequestAbortedError: Request cancelled at a denoise step")
    ex.answer(0, protocol.JobDone(a.job_id, 0, stopped, True, 0.02))
    # the newcomer takes the rank that stopped (the layout is not idle: nothing settles); a waits for its partner
    assert [x[:3] for x in runs()[2:]] == [(b.job_id, 0, "single")] and not a.future.done()
    ex.answer(1, protocol.JobDone(a.job_id, 1, stopped, True, 0.03))
    assert not a.future.done() and a.seq != first_seq
    assert runs()[3] == (a.job_id, 1, "single", a.seq)  # again, on one rank, under its new number
    finish(ex, a, seconds=2.0)
    finish(ex, b, seconds=2.0)
    assert a.future.result(timeout=1).error is None and b.future.result(timeout=1).error is None
    kinds = [(e["kind"], e["request_id"][:7]) for e in progress.read_placements()[0]]
    assert ("split", "video_a") in kinds and kinds.count(("done", "video_a")) == 1
    # learned once, from the run that completed (one rank: 2 s), nothing from the stopped pair
    assert set(ex.jobs.cost.by_shape) == {"wan2.x-t2v:32x32x5:cfg:single"}

    # a stop that came after the pair's last step: it is answered with its output, not run again
    time.sleep(0.55)  # c comes alone
    c = ex.submit("video_c-0000000c", wan_request())
    time.sleep(0.01)
    c_gap = ex.submit("video_d-0000000d", wan_request())
    assert c.splitting
    ex.answer(1, protocol.JobDone(c.job_id, 1, None, False, 1.0))
    assert runs()[-1][:3] == (c_gap.job_id, 1, "single") and c_gap.tentative_until is None  # the rank it freed
    ex.answer(0, protocol.JobDone(c.job_id, 0, DiffusionOutput(), True, 1.0))
    assert c.future.result(timeout=1).error is None and not c.splitting and len(runs()) == 7
    ex.abort(["video_d-0000000d"])


@pytest.mark.parametrize("raw,expected", [(None, 0), (-1, -1), ("-2", -2), (3.0, 3), ("high", 0), (True, 0), (1.5, 0)])
def test_request_priority_from_extra_args(raw, expected: int) -> None:
    from types import SimpleNamespace

    from omni_ext.scheduler.priority import request_priority

    assert request_priority("r-1", SimpleNamespace(extra_args={} if raw is None else {"omni_ext_priority": raw})) == expected


def test_cancelled_head_job_lets_the_jobs_behind_it_start() -> None:
    # order "cost": the longer CFG job is the head (under "slo" the shorter CFG-free one would be)
    ex = rank_queue(cfg_mode="pair", settle_s=0, order="cost")
    busy = ex.submit("video_a-0000000a", wan_request(guidance=1.0))  # one rank
    head = ex.submit("video_b-0000000b", wan_request())  # needs the whole group: waits
    behind = ex.submit("video_c-0000000c", wan_request(guidance=1.0))  # would fit, but no overtaking
    assert [r for r, _, _ in started(ex)] == ["video_a-0000000a"]
    ex.abort(["video_b-0000000b"])
    assert started(ex)[1] == ("video_c-0000000c", (1,), "single") and ex.queued() == []
    assert head.future.result(timeout=1).aborted and busy.ranks == (0,) and behind.ranks == (1,)


@pytest.mark.parametrize("dp,cfg,sp", [(1, 2, 2), (2, 2, 2), (1, 1, 4), (2, 2, 4), (3, 1, 2)])
def test_units_are_vllm_omnis_sequence_parallel_groups(dp: int, cfg: int, sp: int) -> None:
    """The executor's units and groups against vLLM-Omni's own rank order (``RankGenerator`` with the
    order ``_initialize_model_parallel`` uses): unit u is an SP group, and the processes at the same
    place of a group's units are a CFG group, in CFG-rank order."""
    from vllm_omni.diffusion.distributed.parallel_state import RankGenerator

    from omni_ext.scheduler.placement import Layout, Units

    gen = RankGenerator(1, sp, 1, cfg, dp, order="tp-sp-pp-cfg-dp")
    units, layout = Units(sp), Layout.regular(dp, cfg)
    assert [list(units.ranks_of(u)) for u in layout.ranks] == gen.get_ranks("sp")
    cfg_groups = [[units.ranks_of(u)[s] for u in group] for group in layout.groups for s in range(sp)]
    assert sorted(cfg_groups) == sorted(gen.get_ranks("cfg"))
    assert all(units.cfg_rank(p, cfg) == i for g in cfg_groups for i, p in enumerate(g))


@pytest.mark.parametrize("mode,ranks,expect", [
    # process -> (cfg rank, SP rank, the processes it agrees with on a cancel step, sends the output)
    ("pair", (0, 1, 2, 3), {0: (0, 0, (0, 1, 2, 3), True), 1: (0, 1, (0, 1, 2, 3), False),
                            2: (1, 0, (0, 1, 2, 3), False), 3: (1, 1, (0, 1, 2, 3), False)}),
    ("single", (2, 3), {2: (0, 0, (2, 3), True), 3: (0, 1, (2, 3), False)}),
    ("single", (0, 1, 2, 3), {1: (0, 1, (0, 1), False), 2: (0, 0, (2, 3), True)}),  # the warm-up: per unit
])
def test_worker_role_under_sequence_parallel(mode: str, ranks: tuple, expect: dict) -> None:
    """What each worker process of a CFG 2 x SP 2 layout is told for a job (the worker's own
    ``_run_job`` around a model call that reads its role): only a unit's leader sends the output."""
    from vllm_omni.diffusion.data import DiffusionOutput

    from omni_ext.executor import protocol, worker
    from omni_ext.executor.role import ROLE
    from omni_ext.scheduler.placement import JobMode

    class Model:  # the vLLM-Omni worker's execute_model, reduced to reading the role it runs in
        def execute_model(self, req, od_config):
            self.seen = (ROLE.cfg_rank, ROLE.sp_rank, ROLE.ranks)
            return DiffusionOutput()

    for rank, (cfg_rank, sp_rank, together, sends) in expect.items():
        model = Model()
        ROLE.rank = rank
        done = worker._run_job(model, None, rank, protocol.RunJob("omx-1", None, JobMode(mode), 2, 1, ranks, 2))
        assert model.seen == (cfg_rank, sp_rank, together), rank
        assert done.owner is sends and (done.out is not None) is sends, rank

    class Failing:
        def execute_model(self, req, od_config):
            raise RuntimeError("boom")

    ROLE.rank = ranks[-1]  # a non-leader's error is reported too: the request fails at once
    done = worker._run_job(Failing(), None, ranks[-1], protocol.RunJob("omx-2", None, JobMode(mode), 2, 2, ranks, 2))
    assert done.owner and "boom" in done.out.error
    ROLE.rank = 0


def test_sequence_parallel_units_take_every_process_and_answer_from_the_leader() -> None:
    """CFG 2 x Ulysses 2 (issue 18 item 1): placement sees two units, [0, 1] and [2, 3]; a job goes to
    every process of its units, the answer comes from the leader of the unit holding the output, and a
    unit is free only when all of its processes have answered."""
    from vllm_omni.diffusion.data import DiffusionOutput

    from omni_ext.executor import protocol

    ex = rank_queue(world=4, cfg_size=2, sp=2, cfg_mode="adaptive", settle_s=0)
    warm = ex.submit("dummy_req_id_0", wan_request(guidance=1.0))
    assert started(ex) == [("dummy_req_id_0", (0, 1, 2, 3), "single")]  # the warm-up: each unit alone
    assert all(msg.ranks == (0, 1, 2, 3) and msg.unit_size == 2 for _, msg in ex.sent)
    finish(ex, warm)
    pair = ex.submit("video_a-0000000a", wan_request())  # alone on an idle layout: the whole group
    assert started(ex)[1] == ("video_a-0000000a", (0, 1, 2, 3), "pair") and pair.ranks == (0, 1, 2, 3)
    assert [msg.ranks for _, msg in ex.sent[-4:]] == [(0, 1, 2, 3)] * 4
    ex.abort(["video_a-0000000a"])  # running: the cancel reaches every process of both units
    assert list(ex.cancel_slots)[:4] == [pair.seq] * 4
    finish(ex, pair)
    assert pair.future.result(timeout=1).aborted

    a = ex.submit("video_b-0000000b", wan_request(guidance=1.0))  # CFG-free: one unit
    b = ex.submit("video_c-0000000c", wan_request(guidance=1.0))
    assert (a.ranks, b.ranks) == ((0, 1), (2, 3)) and started(ex)[-1][2] == "single"
    # the non-leader of a's unit answers first (no output): the request waits for its leader
    ex.answer(1, protocol.JobDone(a.job_id, 1, None, False, 1.0))
    assert not a.future.done()
    # the leader answers: the request is answered, but its unit is free only once both processes are
    c = ex.submit("video_d-0000000d", wan_request(guidance=1.0))
    ex.answer(2, protocol.JobDone(b.job_id, 2, DiffusionOutput(), True, 1.0))
    assert b.future.done() and ex.queued() == [c]  # process 3 still runs b: unit 1 is not free
    ex.answer(3, protocol.JobDone(b.job_id, 3, None, False, 1.0))
    assert c.ranks == (2, 3) and ex.queued() == []
    ex.answer(0, protocol.JobDone(a.job_id, 0, DiffusionOutput(), True, 1.0))
    assert a.future.result(timeout=1).error is None
    finish(ex, c)
    assert ex.idle()


# --------------------------------------------------------------------------------------------------
# 1. No wasted rank: CFG-free requests on a cfg-2 group run once each, two at a time
# --------------------------------------------------------------------------------------------------
def test_cfg_free_requests_on_cfg2_group_run_once_each_on_different_ranks(server_pool) -> None:
    one, tuned = server_pool.get("wan"), server_pool.get("wan-tuned-cfg2")
    fields = dict(size="32x32", num_frames=5, guidance_scale="1.0", num_inference_steps=40)
    outs, ev = run_two_at_once(tuned, fields, (11, 12))
    starts = [e for e in ev if e[0] == "start"]
    assert len(starts) == 2, ev  # computed once each (stock runs each on both ranks)
    assert all(e[3] == "single" and len(e[2]) == 1 for e in starts), starts
    assert {e[2][0] for e in starts} == {0, 1}, starts  # the two ranks served two requests
    assert [e[0] for e in ev][:2] == ["start", "start"], ev  # both started before either finished
    # ... and each is still the one-device result
    ref = video_sync(one, **fields, seed=11)
    assert ref.content == outs[0].content


def test_qwen_image_without_negative_prompt_runs_on_one_rank(server_pool) -> None:
    one, tuned = server_pool.get("qwen"), server_pool.get("qwen-tuned-cfg2")
    before = events_mark(tuned)
    body = {k: v for k, v in IMAGE.items() if k != "negative_prompt"}
    r = requests.post(tuned.url + "/v1/images/generations", json={**body, "size": "32x32"}, timeout=300)
    ref = requests.post(one.url + "/v1/images/generations", json={**body, "size": "32x32"}, timeout=300)
    assert png_from(r) == png_from(ref)
    ev = wait_for_events(tuned, before, 1)
    assert [(e[2], e[3]) for e in ev if e[0] == "start"] in ([((0,), "single")], [((1,), "single")]), ev


# --------------------------------------------------------------------------------------------------
# 1b. Progress and cancellation of running jobs under the tuned executor
# --------------------------------------------------------------------------------------------------
def _start_long_video(server, **over) -> dict:
    body = {"prompt": "a red fox", "negative_prompt": "blurry", "size": "256x256", "num_frames": 17,
            "num_inference_steps": 200, "guidance_scale": 4.0, "seed": 3, **over}
    job = requests.post(server.url + "/v1/videos", json=body, timeout=60).json()
    assert job.get("id"), job
    return job


def _wait_progress(server, job_id: str, at_least: int, timeout: float = 120.0) -> dict:
    def check():
        seen = requests.get(f"{server.url}/v1/videos/{job_id}", timeout=30).json()
        return seen if seen.get("status") == "in_progress" and int(seen.get("progress") or 0) >= at_least else None

    return until(check, timeout, f"progress >= {at_least} of {job_id}")


@pytest.mark.parametrize("mode", ["pair", "single"])
def test_delete_stops_a_running_tuned_job_and_frees_its_ranks(server_pool, mode: str) -> None:
    server = server_pool.get("wan-tuned-cfg2", quiet=True)
    before, stopped0 = events_mark(server), server.log_text().count("Stopped cancelled diffusion request(s)")
    # "pair": CFG on, both ranks, stop step agreed through shared memory; "single": CFG off, one rank.
    job = _start_long_video(server, **({} if mode == "pair" else {"guidance_scale": 1.0}))
    _wait_progress(server, job["id"], 3)  # progress moves under the tuned executor too (past the start)
    t0 = time.monotonic()
    assert requests.delete(f"{server.url}/v1/videos/{job['id']}", timeout=60).json()["deleted"] is True
    ev = wait_for_events(server, before, 1, timeout=60)
    stopped_after = time.monotonic() - t0
    starts = [e for e in ev if e[0] == "start"]
    assert starts and starts[0][3] == mode, ev
    assert any(e[0] == "done" for e in ev), ev
    assert stopped_after < 20, stopped_after  # 200 steps would take minutes
    log = server.log_text()
    # pair: both ranks stop at the same step; single: its one rank
    assert log.count("Stopped cancelled diffusion request(s)") - stopped0 == (2 if mode == "pair" else 1)
    # the ranks are free: a small CFG request (needs the whole group) runs right away
    quick = video_sync(server, size="32x32", num_frames=5)
    assert quick.status_code == 200, quick.text[:300]


# --------------------------------------------------------------------------------------------------
# 1c. Scheduling on a CFG group: adaptive pair/single, priority order
# --------------------------------------------------------------------------------------------------
#: The shape of the scheduling tests' requests (tiny, CFG on by VIDEO's guidance and negative prompt).
SHAPE = dict(size="64x64", num_frames=9)


def queue_behind_blocker(server, *batches: list[dict]) -> tuple[list, list[str], list[str], list]:
    """Hold the CFG group with a long request (SHAPE, 200 steps), send each batch of requests (the
    requests of a batch at once, the next batch once all of them are queued in the executor), then
    cancel the long request.

    One short request of SHAPE runs first, so that the API process has measured the shape and
    predicts the long request within its admission bound (``max_wait_s``). The queued requests
    carry a distant ``deadline_s``, so that none pauses the long request for its deadline
    (step-level preemption; a better priority still does, ``tests/test_preemption.py``). Returns (responses,
    their engine request ids, the engine ids in the order the executor queued them, the executor
    events other than those of the long request), the first two in the order the fields were given."""
    assert video_sync(server, **SHAPE).status_code == 200
    before = events_mark(server)
    blocker = _start_long_video(server, **SHAPE)
    until(lambda: any(e[0] == "start" for e in new_events(server, before)), what="the long request to start")
    queued0 = events_mark(server)
    futures = []
    with concurrent.futures.ThreadPoolExecutor(sum(len(b) for b in batches)) as pool:
        for batch in batches:
            futures += [pool.submit(video_sync, server, **SHAPE, **{"deadline_s": 3600, **fields}) for fields in batch]
            n = len(futures)
            until(lambda n=n: len(queued_ids(server, queued0)) >= n, what=f"{n} request(s) to queue")
        assert requests.delete(f"{server.url}/v1/videos/{blocker['id']}", timeout=60).json()["deleted"] is True
        outs = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in outs), [r.text[:200] for r in outs]
    log = server.log_text()
    assert f"cancelling running request {blocker['id']}-" in log, "the long request ended before the others queued"
    queued = queued_ids(server, queued0)
    # engine request ids are <job id>-<8 characters>; the sync route's job id is its X-Request-Id
    by_job = {rid.rsplit("-", 1)[0]: rid for rid in queued}
    ids = [by_job[r.headers["X-Request-Id"]] for r in outs]
    ev = wait_for_events(server, before, 1 + len(outs))
    return outs, ids, queued, [e for e in ev if not e[1].startswith(blocker["id"])]


def test_adaptive_cfg_request_alone_runs_on_the_whole_group(server_pool) -> None:
    tuned = server_pool.get("wan-tuned-cfg2")
    assert "scheduler cfg_mode=adaptive order=slo" in tuned.log_text()
    before = events_mark(tuned)
    r = video_sync(tuned, size="32x32", num_frames=5, seed=31)
    assert r.status_code == 200, r.text[:300]
    ev = wait_for_events(tuned, before, 1)
    assert [(e[2], e[3]) for e in ev if e[0] == "start"] == [((0, 1), "pair")], ev


def test_placements_route_shows_where_a_request_ran(server_pool) -> None:
    """``GET /v1/omni_ext/placements``: the executor's start (ranks, mode, wait) and done (ranks,
    seconds, no error) of a video job, under the job's engine request id, in time order."""
    tuned = server_pool.get("wan-tuned-cfg2")
    before = events_mark(tuned)
    created = requests.post(tuned.url + "/v1/videos", json={"prompt": "a fox", "negative_prompt": "blurry",
                                                            "size": "32x32", "num_frames": 5,
                                                            "num_inference_steps": 2, "seed": 33}, timeout=60)
    assert created.status_code == 200, created.text
    job = created.json()["id"]
    until(lambda: any(e["kind"] == "done" for e in placements(tuned, before)), what="the job's done event")
    events = [e for e in placements(tuned, before) if e["request_id"].startswith(job + "-")]
    assert [e["kind"] for e in events if e["kind"] == "queued"] in ([], ["queued"])  # held while a burst settles
    events = [e for e in events if e["kind"] != "queued"]
    assert [(e["kind"], e["ranks"]) for e in events] == [("start", [0, 1]), ("done", [0, 1])], events
    start, done = events
    assert start["object"] == "omni_ext.placement" and start["mode"] == "pair" and start["waited_s"] >= 0
    assert done["request_id"] == start["request_id"] and done["error"] is False and done["seconds"] > 0
    assert start["time"] <= done["time"]


def test_adaptive_cfg_requests_run_on_one_rank_each_under_load_with_one_device_output(server_pool) -> None:
    one, tuned = server_pool.get("wan"), server_pool.get("wan-tuned-cfg2")
    sent = [dict(num_inference_steps=6, seed=41), dict(num_inference_steps=6, seed=42)]
    outs, ids, _, ev = queue_behind_blocker(tuned, sent)
    starts = [e for e in ev if e[0] == "start"]
    assert sorted(e[1] for e in starts) == sorted(ids), ev
    assert all(e[3] == "single" for e in starts), starts  # CFG on, yet one rank each: both branches there
    assert {e[2] for e in starts} == {(0,), (1,)}, starts
    assert [e[0] for e in ev][:2] == ["start", "start"], ev  # the group served both at once
    for fields, out in zip(sent, outs):
        assert video_sync(one, **SHAPE, **fields).content == out.content  # the same bytes as one device


def test_priority_request_starts_before_earlier_queued_ones(server_pool) -> None:
    tuned = server_pool.get("wan-tuned-cfg2")
    outs, ids, queued, ev = queue_behind_blocker(tuned, [dict(seed=51), dict(seed=52), dict(seed=53)],
                                                 [dict(seed=54, priority=-1)])
    urgent = ids[3]
    assert queued[-1] == urgent and f"omni-ext: queued request {urgent} (priority -1," in tuned.log_text()
    starts = [e[1] for e in ev if e[0] == "start"]
    assert starts[0] == urgent, starts  # queued last, started first
    assert starts[1:] == queued[:3], starts  # the same priority and cost: arrival order


# --------------------------------------------------------------------------------------------------
# 2. Real data parallel: two groups run two requests at the same time
# --------------------------------------------------------------------------------------------------
def test_cpu_workers_fork_from_a_preloaded_server_and_keep_vllm_omnis_names(server_pool) -> None:
    """On the CPU platform the workers fork from one fork server that imported torch and vLLM-Omni
    once (omni_ext.executor.start), and still carry vLLM-Omni's process titles for ``ps``."""
    server = server_pool.get("wan-tuned-cfg2")
    assert "workers started by forkserver" in server.log_text()
    titles = set()
    for proc in server.processes():
        try:
            titles.add(" ".join(proc.cmdline()).strip())
        except Exception:
            continue
    assert {"vLLM-Omni::DiffusionWorker_CFG0", "vLLM-Omni::DiffusionWorker_CFG1"} <= titles, titles
    assert any("multiprocessing.forkserver" in t for t in titles), titles


def test_two_groups_run_two_requests_concurrently(server_pool) -> None:
    one, dp2 = server_pool.get("wan"), server_pool.get("wan-tuned-dp2")
    assert "2 worker(s), 2 group(s) [[0], [1]] of cfg 1" in dp2.log_text()
    fields = dict(size="32x32", num_frames=5, num_inference_steps=30)
    outs, ev = run_two_at_once(dp2, fields, (21, 22))
    starts = [e for e in ev if e[0] == "start"]
    assert sorted(e[2] for e in starts) == [(0,), (1,)], ev
    assert [e[0] for e in ev][:2] == ["start", "start"], ev  # overlapped in time
    ref = video_sync(one, **fields, seed=22)
    assert ref.content in (outs[0].content, outs[1].content)
    assert outs[0].content != outs[1].content  # different seeds: really two different requests


# --------------------------------------------------------------------------------------------------
# 2b. The accelerator path on CPU (issue 17): outputs through shared memory, per-rank peak memory
#     (the pure parts and the CFG pair's cancel agreement: tests/test_executor_transfer.py)
# --------------------------------------------------------------------------------------------------
def _shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("psm_*")}


def test_outputs_cross_the_worker_pipe_through_shared_memory_and_leave_none_behind(server_pool) -> None:
    """The worker's pipe refuses a result that holds a tensor or more than a few hundred KiB
    (omni_ext.executor.protocol), so each 200 below is an output that travelled as host memory
    in shared memory; none of the segments is left in /dev/shm once the answer is back."""
    wan, qwen = server_pool.get("wan-tuned-cfg2"), server_pool.get("qwen-tuned-cfg2")
    before_ev, before = events_mark(wan), _shm_segments()
    # CFG pairs whose video ends on rank 1: 128x128x17 (3.3 MB as float32, vLLM-Omni's own large-tensor
    # path) and 32x32x5 (below its 1 MB threshold: moved all the same); a Qwen-Image pair's image.
    big = video_sync(wan, size="128x128", num_frames=17, seed=61)
    small = video_sync(wan, size="32x32", num_frames=5, seed=62)
    image = requests.post(qwen.url + "/v1/images/generations", json={**IMAGE, "size": "32x32"}, timeout=300)
    assert big.status_code == 200 and small.status_code == 200, (big.text[:300], small.text[:300])
    assert png_from(image)
    ev = wait_for_events(wan, before_ev, 2)
    assert [e[3] for e in ev if e[0] == "start"] == ["pair", "pair"], ev
    assert len(big.content) > len(small.content) > 0
    assert not _shm_segments() - before, _shm_segments() - before
    for server in (wan, qwen):
        assert "could not be returned" not in server.log_text() and "could not be read" not in server.log_text()


def test_each_job_reports_the_peak_memory_of_its_own_rank(server_pool) -> None:
    """vLLM-Omni samples peak memory on global rank 0 only: a job on rank 1 reported 0 MB."""
    dp2 = server_pool.get("wan-tuned-dp2")
    outs, ev = run_two_at_once(dp2, dict(size="32x32", num_frames=5, num_inference_steps=10), (71, 72))
    on_rank = {e[2][0]: e[1].rsplit("-", 1)[0] for e in ev if e[0] == "start"}
    assert set(on_rank) == {0, 1}, ev
    peak = {r.headers["X-Request-Id"]: float(r.headers["X-Peak-Memory-MB"]) for r in outs}
    assert peak[on_rank[1]] > 0 and peak[on_rank[0]] > 0, (peak, on_rank)
