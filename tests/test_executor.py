"""omni-ext's TunedExecutor on real ``vllm-omni serve`` processes (tiny Wan2.1 and Qwen-Image).

Servers (conftest.SERVERS): ``wan-tuned-cfg2`` / ``qwen-tuned-cfg2`` (one CFG group of 2 workers),
``wan-tuned-dp2`` (two groups of one worker each: real data parallel). They are compared with the
one-worker stock servers ``wan`` / ``qwen``. Which rank ran which request is read from the
executor's INFO lines (:func:`tests.helpers.executor_events`).

CFG parallel's identical output to one device is tested for vLLM-Omni's executor and this one
together (``tests/test_serving.py::test_cfg_parallel_2_*``); the placement rules themselves are
unit-tested in ``tests/test_scheduler.py``. Speed is not asserted here (that is ``omni-ext bench``);
these tests check behaviour.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time

import pytest
import requests

from tests.helpers import IMAGE, executor_events, new_events, png_from, video_sync, wait_for_events


def run_two_at_once(server, fields: dict, seeds: tuple[int, int]) -> tuple[list, list]:
    """Two video requests sent together; (responses, the executor events they produced)."""
    before = len(executor_events(server.log_text()))
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


def test_collectives_use_hccl_on_npu_and_torch_npu_is_not_needed() -> None:
    import sys

    from omni_ext.executor.ascend import collective_backend, npu_available

    assert collective_backend("npu") == "hccl" and collective_backend("cpu") == "gloo"
    assert npu_available() is False  # no torch_npu on this host: a clean False, not an ImportError
    assert "torch_npu" not in sys.modules


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
    before = len(executor_events(tuned.log_text()))
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
    deadline = time.monotonic() + timeout
    seen = {}
    while time.monotonic() < deadline:
        seen = requests.get(f"{server.url}/v1/videos/{job_id}", timeout=30).json()
        if seen.get("status") == "in_progress" and int(seen.get("progress") or 0) >= at_least:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"no progress >= {at_least}: {seen}")


@pytest.mark.parametrize("mode", ["pair", "single"])
def test_delete_stops_a_running_tuned_job_and_frees_its_ranks(server_pool, mode: str) -> None:
    server = server_pool.get("wan-tuned-cfg2", quiet=True)
    log0 = server.log_text()
    before, stopped0 = len(executor_events(log0)), log0.count("Stopped cancelled diffusion request(s)")
    # "pair": CFG on, both ranks, cancel decided inside the all-gather; "single": CFG off, one rank.
    job = _start_long_video(server, **({} if mode == "pair" else {"guidance_scale": 1.0}))
    _wait_progress(server, job["id"], 1)  # progress moves under the tuned executor too
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
# 2. Real data parallel: two groups run two requests at the same time
# --------------------------------------------------------------------------------------------------
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
# 3. Failure: a killed worker fails its request fast and /health says so
#    (kills a worker of wan-tuned-dp2: keep this the last test that uses that server)
# --------------------------------------------------------------------------------------------------
def test_killed_worker_fails_request_fast_and_health_reports_it(server_pool) -> None:
    server = server_pool.get("wan-tuned-dp2")
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    pids = {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"loaded in DiffusionWorker-(\d+) \(pid (\d+)", server.log_text())}
    assert set(pids) == {0, 1}, pids
    before = len(executor_events(server.log_text()))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(video_sync, server, size="128x128", num_frames=33, num_inference_steps=200, seed=5)
        deadline = time.monotonic() + 60
        victim = None
        while victim is None and time.monotonic() < deadline:
            starts = [e for e in new_events(server, before) if e[0] == "start"]
            if starts:
                victim = pids[starts[0][2][0]]
            time.sleep(0.1)
        assert victim is not None, "the long request never started"
        time.sleep(1.0)  # well inside its denoise loop
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        resp = fut.result(timeout=60)
        failed_after = time.monotonic() - killed_at
    assert failed_after < 30, failed_after
    assert resp.status_code >= 500, resp.status_code
    assert "died with SIGKILL" in resp.text and f"pid {victim}" in resp.text, resp.text[:500]
    health = requests.get(server.url + "/health", timeout=10)
    assert health.status_code == 503, health.text
    again = video_sync(server, size="32x32", num_frames=5)  # refused, not queued forever
    assert again.status_code >= 500, again.text[:300]
