"""Sequence parallel inside omni-ext's TunedExecutor (issue 18 item 1), on real ``vllm-omni serve`` processes.

CFG 2 x Ulysses 2 = 4 worker processes (one thread each), tiny Wan2.1 and tiny Qwen-Image, each
against vLLM-Omni's own executor with the same layout: the same bytes for a CFG pair on all four
processes, for a CFG-free request on one unit (the two SP processes of one CFG half), and for two
CFG requests at once, each with both guidance branches on one unit (the adaptive scheduler under
load), after a running pair was cancelled (its four processes stop at the same step, or the next
jobs would hang in an all-to-all).

Each test has its two servers (stock and tuned) to itself (the ``own`` fixture of tests/conftest.py:
the Qwen-Image pair starts while the Wan test runs, 16 worker processes at most). The pure parts (the unit mapping against vLLM-Omni's
``RankGenerator``, the fan-out and leader answer, the workers' roles, the stop agreement of four
processes over real gloo collectives) are in ``tests/test_scheduler.py``, ``tests/test_executor.py``
and ``tests/test_executor_transfer.py``.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import requests

from tests.helpers import (
    FLOAT32,
    IMAGE, events_mark, image_gen, new_events, placements, png_from, video_sync, wait_for_events,
)

TUNED = "omni_ext.executor.TunedExecutor"
LAYOUT = ["--cfg-parallel-size", "2", "--ulysses-degree", "2"]
#: Four worker processes on this 2-core host: four CPU "devices", one thread per process.
ENV = {"OMNI_EXT_CPU_VISIBLE_DEVICES": "0,1,2,3", "OMP_NUM_THREADS": "1"}
SHAPE = dict(size="32x32", num_frames=5)


#: A test's two servers: vLLM-Omni's executor and omni-ext's, the same layout.
SERVERS = {"stock": (LAYOUT, ENV), "tuned": ([*LAYOUT, "--distributed-executor-backend", TUNED], ENV)}
#: Wan's, in float32 (tests.helpers.FLOAT32).
WAN_SERVERS = {name: ([*args, *FLOAT32], env) for name, (args, env) in SERVERS.items()}


def _starts(server, before: float, n: int) -> list[tuple[tuple[int, ...], str]]:
    return [(e[2], e[3]) for e in wait_for_events(server, before, n) if e[0] == "start"]


def _pair_then_single(stock, tuned, seeds: tuple[int, int]) -> None:
    """On 4 processes (2 units of 2): a CFG request alone takes the whole group, each CFG half on its
    unit; a CFG-free one takes one unit and leaves the other free. Both give vLLM-Omni's bytes."""
    log = tuned.log_text()
    assert "omni-ext TunedExecutor: 4 worker(s), 1 group(s) [[0, 1, 2, 3]] of cfg 2 x tp*sp 2" in log, log[-3000:]
    before = events_mark(tuned)
    a, b = video_sync(stock, **SHAPE, seed=seeds[0]), video_sync(tuned, **SHAPE, seed=seeds[0])
    assert a.status_code == b.status_code == 200, (a.text[:300], b.text[:300])
    assert a.content == b.content
    assert _starts(tuned, before, 1) == [((0, 1, 2, 3), "pair")]
    before = events_mark(tuned)
    a = video_sync(stock, **SHAPE, guidance_scale="1.0", seed=seeds[1])
    b = video_sync(tuned, **SHAPE, guidance_scale="1.0", seed=seeds[1])
    assert a.status_code == b.status_code == 200 and a.content == b.content
    assert _starts(tuned, before, 1) == [((0, 1), "single")]


@pytest.mark.server
@pytest.mark.own_servers("wan2.1-t2v", WAN_SERVERS)
def test_wan_cfg2_ulysses2_is_byte_identical_to_vllm_omnis_executor(own) -> None:
    stock, tuned = own["stock"], own["tuned"]
    _pair_then_single(stock, tuned, seeds=(11, 12))

    # a long pair is cancelled while two CFG requests queue behind it: its four processes stop at the
    # same step, and the two requests then run at once, both guidance branches on one unit each
    # (128x128x17, 200 steps: ~20 s alone, so that it still runs when the two requests have queued on a
    # host busy with the next test's servers; 200 is /v1/videos' most steps)
    warm = events_mark(tuned)
    assert video_sync(tuned, size="128x128", num_frames=17).status_code == 200  # the shape's cost is known
    wait_for_events(tuned, warm, 1)  # done on its ranks too: the long one, alone, runs as a pair
    before = events_mark(tuned)
    resp = requests.post(tuned.url + "/v1/videos", json={
        "prompt": "a red fox", "negative_prompt": "blurry", "size": "128x128", "num_frames": 17,
        "num_inference_steps": 200, "guidance_scale": 4.0, "seed": 3}, timeout=60)
    assert resp.status_code == 200, resp.text
    long = resp.json()
    deadline = time.monotonic() + 120
    while not any(e[0] == "start" for e in new_events(tuned, before)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(e[0] == "start" for e in new_events(tuned, before)), "the long pair never started"
    queued0 = events_mark(tuned)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # with time to spare (deadline_s): waiting, they do not preempt the long pair (tests/test_preemption.py)
        futures = [pool.submit(video_sync, tuned, **SHAPE, num_inference_steps=4, seed=s, deadline_s=3600)
                   for s in (21, 22)]
        while len(placements(tuned, queued0, kind="queued")) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        status = requests.get(f"{tuned.url}/v1/videos/{long['id']}", timeout=60).json()["status"]
        assert status == "in_progress", f"the long pair was {status} when the two requests had queued"
        assert requests.delete(f"{tuned.url}/v1/videos/{long['id']}", timeout=60).json()["deleted"] is True
        outs = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in outs), [r.text[:200] for r in outs]
    assert f"cancelling running request {long['id']}-" in tuned.log_text()
    ev = [e for e in wait_for_events(tuned, queued0, 3) if not e[1].startswith(long["id"])]  # and the long one
    starts = [(e[2], e[3]) for e in ev if e[0] == "start"]
    assert sorted(starts) == [((0, 1), "single"), ((2, 3), "single")], ev
    assert [e[0] for e in ev][:2] == ["start", "start"], ev  # both units at once
    for seed, out in zip((21, 22), outs):
        assert video_sync(stock, **SHAPE, num_inference_steps=4, seed=seed).content == out.content


@pytest.mark.server
@pytest.mark.own_servers("qwen-image", SERVERS)
def test_qwen_image_cfg2_ulysses2_is_byte_identical_to_vllm_omnis_executor(own) -> None:
    stock, tuned = own["stock"], own["tuned"]
    before = events_mark(tuned)
    assert png_from(image_gen(tuned, size="32x32")) == png_from(image_gen(stock, size="32x32"))  # CFG: a pair
    assert _starts(tuned, before, 1) == [((0, 1, 2, 3), "pair")]
    before = events_mark(tuned)
    # Qwen-Image runs CFG only with a negative prompt: without one, one unit
    body = {**{k: v for k, v in IMAGE.items() if k != "negative_prompt"}, "size": "32x32"}
    a, b = (requests.post(s.url + "/v1/images/generations", json=body, timeout=300) for s in (tuned, stock))
    assert png_from(a) == png_from(b)
    assert _starts(tuned, before, 1) == [((0, 1), "single")]


#: CFG 2 x TP 2 (the Wan2.2-A14B presets' layout, whose TP fits the weights): 4 processes, each unit the
#: two TP processes of one CFG half.
TP_LAYOUT = ["--cfg-parallel-size", "2", "--tensor-parallel-size", "2", *FLOAT32]
TP_SERVERS = {"stock": (TP_LAYOUT, ENV), "tuned": ([*TP_LAYOUT, "--distributed-executor-backend", TUNED], ENV)}


@pytest.mark.server
@pytest.mark.own_servers("wan2.1-t2v", TP_SERVERS)
def test_wan_cfg2_tp2_is_byte_identical_to_vllm_omnis_executor(own) -> None:
    _pair_then_single(own["stock"], own["tuned"], seeds=(31, 32))
