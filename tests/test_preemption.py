"""Step-level preemption on real ``vllm-omni serve`` processes (tiny Wan2.1 and Qwen-Image, the shared
pool's TunedExecutor servers ``wan-tuned-cfg2`` and ``qwen-tuned-cfg2``, tests/conftest.py): a running
job pauses at a denoise step for an interactive request (priority -1) or for a deadline, the other
job runs on its ranks, and the paused one resumes there with the bytes of an uninterrupted run (run
again afterwards, same seed). ``DELETE`` of a paused job unwinds it without resuming it. What the
API shows meanwhile: ``progress_detail.state == "paused"`` (status ``in_progress``),
``omni_ext:preemptions_total{reason}`` and ``omni_ext:paused_jobs``; the executor's journal
(``GET /v1/omni_ext/placements``) has ``preempt``, ``paused`` and ``resumed`` events.

Byte-identical resume: Wan as a CFG pair and on a single rank, Qwen-Image as a CFG pair and on a
single rank.

The decision rules, the pause agreement and the worker threads are unit-tested in
``tests/test_preempt.py``."""

from __future__ import annotations

import concurrent.futures
import time

import requests

from tests.helpers import IMAGE, VIDEO, events_mark, placements, png_from, scrape, until, video_sync, wait_all

#: A CFG video long enough to be caught running (its step time is measured below), and the short
#: interactive one that overtakes it (long enough that the paused state can be observed).
LONG = dict(size="64x64", num_frames=9, num_inference_steps=24, seed=81)
SHORT = dict(size="64x64", num_frames=9, num_inference_steps=10, seed=82)


def _create(server, **fields) -> str:
    """An async video (multipart, exactly as :func:`tests.helpers.video_sync` sends it)."""
    data = {**VIDEO, **{k: str(v) for k, v in fields.items()}}
    resp = requests.post(server.url + "/v1/videos", files={k: (None, v) for k, v in data.items()}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


def _video(server, job: str) -> dict:
    return requests.get(f"{server.url}/v1/videos/{job}", timeout=30).json()


def _when(server, job: str, test, what: str, timeout: float = 120.0) -> dict:
    """Poll the video object until ``test(progress_detail)`` holds; return the object."""
    def check():
        seen = _video(server, job)
        return seen if test(seen.get("progress_detail") or {}) else None

    return until(check, timeout, f"{what} ({job})")


def _events(server, before: float, job: str) -> list[dict]:
    return [e for e in placements(server, before) if e["request_id"].startswith(job + "-")]


def _content(server, job: str) -> bytes:
    resp = requests.get(f"{server.url}/v1/videos/{job}/content", timeout=60)
    assert resp.status_code == 200, resp.text[:300]
    return resp.content


def test_an_interactive_request_pauses_a_running_cfg_pair_which_resumes_with_the_same_bytes(server_pool) -> None:
    server = server_pool.get("wan-tuned-cfg2", quiet=True)
    before = events_mark(server)
    preempted0 = scrape(server, "omni_ext:preemptions_total", reason="priority")
    long_job = _create(server, **LONG)
    _when(server, long_job, lambda d: d.get("state") == "running" and d.get("steps_done", 0) >= 2, "2 steps done")
    urgent = _create(server, **SHORT, priority=-1)
    paused = _when(server, long_job, lambda d: d.get("state") == "paused", "the long job paused")
    assert paused["status"] == "in_progress" and 2 <= paused["progress_detail"]["steps_done"] < LONG["num_inference_steps"]
    assert scrape(server, "omni_ext:paused_jobs") == 1
    done = wait_all(server, [long_job, urgent])
    assert {v["status"] for v in done.values()} == {"completed"}, done
    assert scrape(server, "omni_ext:preemptions_total", reason="priority") == preempted0 + 1
    assert scrape(server, "omni_ext:paused_jobs") == 0

    ev_long, ev_urgent = _events(server, before, long_job), _events(server, before, urgent)
    kinds = [e["kind"] for e in ev_long if e["kind"] != "queued"]
    assert kinds == ["start", "preempt", "paused", "resumed", "done"], ev_long
    at = {e["kind"]: e for e in ev_long}
    start_u = next(e for e in ev_urgent if e["kind"] == "start")
    done_u = next(e for e in ev_urgent if e["kind"] == "done")
    assert at["paused"]["time"] <= start_u["time"] <= done_u["time"] <= at["resumed"]["time"] <= at["done"]["time"]
    assert start_u["ranks"] == [0, 1] and at["paused"]["reason"] == "priority"
    # it started within about one step of the running job (the pause waits for the step in flight)
    step_s = at["done"]["seconds"] / LONG["num_inference_steps"]
    assert start_u["time"] - at["preempt"]["time"] <= 1.5 * step_s + 0.5, (start_u, at["preempt"], step_s)
    log = server.log_text()
    assert f"omni-ext: preempting request {at['preempt']['request_id']}" in log and "(reason priority" in log

    # the same bytes as the same request uninterrupted, run again now (and the interactive one too)
    assert _content(server, long_job) == video_sync(server, **LONG).content
    assert _content(server, urgent) == video_sync(server, **SHORT).content


def test_a_job_about_to_miss_its_deadline_pauses_a_single_rank_job_with_slack(server_pool) -> None:
    """CFG-free videos run on one rank each; with both ranks busy, a short request whose own
    ``deadline_s`` the queue would miss pauses one of them (the one with the most slack)."""
    server = server_pool.get("wan-tuned-cfg2", quiet=True)
    free = dict(guidance_scale="1.0")
    assert video_sync(server, **LONG, **free).status_code == 200  # the server knows this shape's cost
    before = events_mark(server)
    preempted0 = scrape(server, "omni_ext:preemptions_total", reason="deadline")
    # 200 steps at 128x128: ~3 s alone on a quiet host (at LONG's 64x64, 0.8 s: over before the short came)
    longs = [_create(server, **{**LONG, "size": "128x128", "seed": seed, "num_inference_steps": 200}, **free)
             for seed in (91, 92)]
    for job in longs:
        _when(server, job, lambda d: d.get("state") == "running" and d.get("steps_done", 0) >= 1, "a step done")
    # ~0.1 s of work due within 1 s, behind two jobs with seconds left (each due within 3x its own time)
    short = _create(server, size="32x32", num_frames=5, num_inference_steps=2, seed=93, deadline_s=1, **free)
    done = wait_all(server, [*longs, short])
    assert {v["status"] for v in done.values()} == {"completed"}, done
    assert scrape(server, "omni_ext:preemptions_total", reason="deadline") == preempted0 + 1
    victims = [j for j in longs if any(e["kind"] == "paused" for e in _events(server, before, j))]
    assert len(victims) == 1, [_events(server, before, j) for j in longs]
    [victim] = victims
    ev = [e for e in _events(server, before, victim) if e["kind"] != "queued"]
    assert [e["kind"] for e in ev] == ["start", "preempt", "paused", "resumed", "done"], ev
    assert len(ev[0]["ranks"]) == 1 and ev[0]["mode"] == "single"
    assert ev[2]["reason"] == "deadline"
    start_s = next(e for e in _events(server, before, short) if e["kind"] == "start")
    assert start_s["ranks"] == ev[0]["ranks"] and ev[2]["time"] <= start_s["time"] <= ev[3]["time"]  # on its rank
    fields = {**LONG, "size": "128x128", "seed": 91 if victim == longs[0] else 92, "num_inference_steps": 200}
    assert _content(server, victim) == video_sync(server, **fields, **free).content


def test_delete_of_a_paused_job_unwinds_it_without_resuming(server_pool) -> None:
    server = server_pool.get("wan-tuned-cfg2", quiet=True)
    before = events_mark(server)
    long_job = _create(server, **{**LONG, "num_inference_steps": 200, "seed": 85})
    _when(server, long_job, lambda d: d.get("state") == "running" and d.get("steps_done", 0) >= 1, "a step done")
    urgent = _create(server, **{**SHORT, "num_inference_steps": 60}, priority=-1)  # ~1.5 s: time to DELETE
    _when(server, long_job, lambda d: d.get("state") == "paused", "the long job paused")
    assert requests.delete(f"{server.url}/v1/videos/{long_job}", timeout=60).json()["deleted"] is True
    done = wait_all(server, [urgent])
    assert done[urgent]["status"] == "completed"
    until(lambda: any(e["kind"] == "done" for e in _events(server, before, long_job)), 60, "the paused job's end")
    kinds = [e["kind"] for e in _events(server, before, long_job) if e["kind"] != "queued"]
    assert kinds == ["start", "preempt", "paused", "done"], kinds  # never resumed
    assert scrape(server, "omni_ext:paused_jobs") == 0
    log = server.log_text()
    assert f"omni-ext: cancelling running request {long_job}-" in log and "(paused: it unwinds" in log and "was cancelled while paused; it unwinds" in log
    # its ranks are free: a CFG request takes the whole group at once
    assert video_sync(server, size="32x32", num_frames=5).status_code == 200


def test_qwen_image_pair_pauses_for_an_interactive_image_with_the_same_bytes(server_pool) -> None:
    server = server_pool.get("qwen-tuned-cfg2", quiet=True)
    long_body = {**IMAGE, "size": "64x64", "num_inference_steps": 300, "seed": 87}  # ~8 s: still running (a19: 40 ended first)
    before = events_mark(server)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long_f = pool.submit(requests.post, server.url + "/v1/images/generations", json=long_body, timeout=300)
        until(lambda: [e for e in placements(server, before) if e["kind"] == "start"], 120, "the long image to start")
        time.sleep(0.3)
        urgent = requests.post(server.url + "/v1/images/generations",
                               json={**IMAGE, "size": "64x64", "num_inference_steps": 4, "seed": 88, "priority": -1},
                               timeout=300)
        long_png = png_from(long_f.result())
    assert png_from(urgent)
    ev = placements(server, before)
    kinds = [e["kind"] for e in ev if e["kind"] in ("preempt", "paused", "resumed")]
    assert kinds == ["preempt", "paused", "resumed"], ev
    again = requests.post(server.url + "/v1/images/generations", json=long_body, timeout=300)
    assert png_from(again) == long_png


def test_qwen_image_single_rank_job_pauses_for_an_interactive_image_with_the_same_bytes(server_pool) -> None:
    """Without a negative prompt Qwen-Image runs CFG-free, one request per rank: with both ranks busy,
    an interactive image pauses the one with the most time left, which resumes on its rank."""
    server = server_pool.get("qwen-tuned-cfg2", quiet=True)
    free = {k: v for k, v in IMAGE.items() if k != "negative_prompt"}
    # ~300 steps a second on one rank of this host: 3.3 s and 2.3 s, still running when the interactive
    # image comes; the 1000-step one (the most a request may ask) has more left, so it is the one
    # paused (rule 1: of the jobs of worse priority, the most time left)
    longer, shorter = ({**free, "size": "64x64", "num_inference_steps": n, "seed": s} for n, s in ((1000, 95), (700, 96)))
    before = events_mark(server)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(requests.post, server.url + "/v1/images/generations", json=body, timeout=300)
                for body in (longer, shorter)]
        def both_started() -> bool:
            for f in futs:  # a refused one would never start
                assert not f.done() or f.result().status_code == 200, f.result().text[:300]
            return len([e for e in placements(server, before) if e["kind"] == "start"]) == 2

        until(both_started, 120, "both long images to start")
        time.sleep(0.3)
        urgent = requests.post(server.url + "/v1/images/generations",
                               json={**free, "size": "64x64", "num_inference_steps": 4, "seed": 97, "priority": -1},
                               timeout=300)
        longer_png, _ = (png_from(f.result()) for f in futs)
    assert png_from(urgent)
    ev = placements(server, before)
    starts = [e for e in ev if e["kind"] == "start"]
    assert all(e["mode"] == "single" and len(e["ranks"]) == 1 for e in starts), starts
    [paused] = [e for e in ev if e["kind"] == "paused"]
    assert paused["reason"] == "priority"
    victim = [e for e in ev if e["request_id"] == paused["request_id"] and e["kind"] != "queued"]
    assert [e["kind"] for e in victim] == ["start", "preempt", "paused", "resumed", "done"], victim
    # the victim is the 1000-step image (its own running time, pauses left out, is the longest)
    done = {e["request_id"]: e["seconds"] for e in ev if e["kind"] == "done" and not e.get("error")}
    assert done[paused["request_id"]] == max(done.values()), done
    urgent_start = next(e for e in starts if e["request_id"] not in {s["request_id"] for s in starts[:2]})
    assert urgent_start["ranks"] == victim[0]["ranks"]  # the interactive image ran on the paused job's rank
    again = requests.post(server.url + "/v1/images/generations", json=longer, timeout=300)
    assert png_from(again) == longer_png
