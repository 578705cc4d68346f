"""The request scheduler as a client sees it: priorities, admission (429 with Retry-After), queue
positions and predicted starts, omni-ext's metrics on ``/metrics``, and capacity freed at once by
``DELETE`` or a synchronous client that goes away.

Three layers: the pure parts (layout and slots, shapes, priorities, headers, the queue's account on
a fake clock and fake progress files); the routes in process (FastAPI's TestClient, a video handler
that blocks, no engine); and one real server, ``wan-sched`` (conftest.SERVERS: TunedExecutor, CFG 2,
``max_wait_s`` 3, a cost seed), driven by raw HTTP and the official ``openai`` SDK.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from omni_ext.api import limits
from omni_ext.api.disconnect import ClientGone, run_admitted
from omni_ext.api.errors import APIError, retry_headers, too_busy
from omni_ext.api.intake import Body, build_image_request, build_video_request, priority_of
from omni_ext.scheduler.layout import ServerLayout, server_layout
from omni_ext.api.intake import with_priority
from omni_ext.models.families import job_shape
from omni_ext.scheduler.priority import PRIORITY_ARG
from omni_ext.api.state import request_queue
from omni_ext.api.intake import ModelLimits
from omni_ext.models import families
from omni_ext.progress import StepProgress
from tests.helpers import (JOB, SHAPE, Engine, api_state, fake_queue, fill, placements, scrape, serve_in_process,
                           wait_all, wait_cpu_quiet, wait_idle)

TUNED = "omni_ext.executor.TunedExecutor"
WAN = ModelLimits("WanPipeline", 16, 1, True)


def sample(name: str, **labels: str) -> float:
    """A sample of this process's default registry (0 when absent)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


# ---- layout: how many jobs the server runs at once ---------------------------------------------
@pytest.mark.parametrize("executor,cfg,extra,cfg_mode,pipeline,slots", [
    (None, 2, None, "adaptive", "WanPipeline", 1),  # vLLM-Omni's executor: one request at a time
    (TUNED, 2, None, "adaptive", "WanPipeline", 2),  # every rank runs its own job
    (TUNED, 2, None, "single", "WanPipeline", 2),
    (TUNED, 2, None, "pair", "WanPipeline", 1),  # a CFG job takes the whole group
    (TUNED, 2, '{"omni_ext": {"data_parallel_size": 2}}', "adaptive", "WanPipeline", 4),
    (TUNED, 1, {"omni_ext": {"data_parallel_size": 3}}, "pair", "QwenImagePipeline", 3),
    (TUNED, 2, None, "adaptive", "FluxKontextPipeline", 1),  # no tuned pipeline: whole groups only
])
def test_slots_from_the_servers_arguments(executor, cfg, extra, cfg_mode, pipeline, slots) -> None:
    args = SimpleNamespace(distributed_executor_backend=executor, cfg_parallel_size=cfg, additional_config=extra)
    layout = server_layout(args)
    assert layout.tuned is (executor is not None)
    assert layout.slots(cfg_mode, pipeline) == slots


def test_layout_prefers_the_resolved_diffusion_stage() -> None:
    """A deploy YAML (or a preset) configures the stage, not the arguments: the stage wins."""
    stage = SimpleNamespace(
        stage_type=SimpleNamespace(value="diffusion"),
        parallel_config=SimpleNamespace(cfg_parallel_size=2, data_parallel_size=1),
        diffusion_config=SimpleNamespace(distributed_executor_backend=TUNED,
                                         additional_config={"omni_ext": {"scheduler": {"max_wait_s": 9}}}),
        runtime_config=SimpleNamespace(num_replicas=2, distributed_executor_backend=None),
    )
    args = SimpleNamespace(distributed_executor_backend=None, cfg_parallel_size=1, additional_config={})
    layout = server_layout(args, [stage])
    assert layout == ServerLayout(TUNED, cfg=2, dp=1, replicas=2, additional_config=stage.diffusion_config.additional_config)
    assert layout.slots("adaptive", "WanPipeline") == 4
    assert ServerLayout(executor=type("TunedExecutor", (), {})).tuned  # a class, as a deploy YAML may give


def test_a_bad_scheduler_option_stops_the_server_with_a_clear_message() -> None:
    for extra, needle in (({"omni_ext": {"scheduler": {"max_wait": 5}}}, "unknown omni_ext.scheduler option(s) ['max_wait']"),
                          ({"omni_ext": {"scheduler": {"max_wait_s": "soon"}}}, "max_wait_s must be a number"),
                          ({"omni_ext": {"scheduler": {"cfg_mode": "both"}}}, "cfg_mode must be one of")):
        args = SimpleNamespace(distributed_executor_backend=TUNED, cfg_parallel_size=2, additional_config=extra)
        with pytest.raises(ValueError) as err:
            request_queue(SimpleNamespace(), args, WAN, "m", 256)
        assert str(err.value).startswith("omni-ext: invalid --additional-config: ") and needle in str(err.value)
    args = SimpleNamespace(distributed_executor_backend=TUNED, cfg_parallel_size=2,
                           additional_config={"omni_ext": {"scheduler": {"max_wait_s": 7, "seconds_per_unit": 0.5}}})
    queue = request_queue(SimpleNamespace(), args, WAN, "m", 256)
    assert (queue.slots, queue.tuned, queue.config.max_wait_s, queue.cost.rate(), queue.max_jobs) == (2, True, 7.0, 0.5, 256)


def test_start_up_configures_the_dispatch_it_is_given_and_the_queue_reads_it() -> None:
    """The API holds the dispatch to replicas that its start-up hook passes (no module state of the
    mechanism): configured there from the layout, read for live capacity and binding times."""
    from omni_ext.dispatch.replicas import ReplicaDispatch

    args = SimpleNamespace(distributed_executor_backend=TUNED, cfg_parallel_size=2,
                           additional_config={"omni_ext": {"scheduler": {"max_wait_s": 7}}})
    dispatch = ReplicaDispatch()
    queue = request_queue(SimpleNamespace(), args, WAN, "m", 256, dispatch)
    settings = dispatch.settings
    assert (settings.slots_per_replica, settings.pipeline, settings.config.max_wait_s) == (2, "WanPipeline", 7.0)
    assert queue.live_slots == dispatch.capacity and queue.bound_since == dispatch.bound_since
    assert queue.live_slots() is None and queue.bound_since("job") is None  # no pool dispatches here
    plain = request_queue(SimpleNamespace(), args, WAN, "m", 256)  # no dispatch: the layout's slots
    assert plain.live_slots() is None and plain.bound_since("job") is None and plain.slots == 2


# ---- shapes and priorities ----------------------------------------------------------------------
def test_job_shape_follows_the_pipelines_cfg_rule() -> None:
    wan = job_shape("WanPipeline", width=64, height=64, frames=9, steps=4, guidance_scale=4.0)
    sp = SimpleNamespace(num_inference_steps=4, width=64, height=64, num_frames=9)
    assert wan.key == "wan2.x-t2v:64x64x9:cfg" and wan.units == families.cost_units("WanPipeline", sp, True) == 576
    assert job_shape("WanPipeline", width=64, height=64, frames=9, steps=4, guidance_scale=1.0).key.endswith(":nocfg")
    assert job_shape("WanPipeline", width=None, height=None).key == "wan2.x-t2v:832x480x81:cfg"  # native shape
    qwen = dict(width=32, height=32, steps=2, true_cfg_scale=4.0)
    assert job_shape("QwenImagePipeline", **qwen).key == "qwen-image:32x32x1:nocfg"  # no negative prompt
    with_neg = job_shape("QwenImagePipeline", negative_prompt="blurry", **qwen)
    assert with_neg.key == "qwen-image:32x32x1:cfg"
    assert job_shape("QwenImagePipeline", negative_prompt="blurry", n=3, **qwen).units == 3 * with_neg.units


def test_priority_field_and_where_it_travels(tmp_path: Path) -> None:
    assert [priority_of({"priority": v}) for v in (-1, "-1", " 5 ", 3.0, None)] == [-1, -1, 5, 3, 0]
    assert priority_of({}) == 0
    for bad in (limits.MIN_PRIORITY - 1, str(limits.MAX_PRIORITY + 1), "urgent", True, 1.5):
        with pytest.raises(APIError) as err:
            priority_of({"priority": bad})
        assert err.value.status == 400 and err.value.param == "priority"
    # Only a non-default priority travels, and a user's own key never overrides the parsed field.
    assert with_priority(None, 0) is None and with_priority({}, 0) == {}
    assert with_priority({"a": 1, PRIORITY_ARG: 9}, 0) == {"a": 1}
    assert with_priority(None, -1) == {PRIORITY_ARG: -1}
    state = api_state(tmp_path, WAN)
    body = {"prompt": "x", "size": "64x64", "num_frames": 9, "num_inference_steps": 4}
    spec = build_video_request(Body({**body, "priority": "-3", "extra_params": {"k": 1}}), state, {})
    assert spec.priority == -3 and spec.request.extra_params == {"k": 1, PRIORITY_ARG: -3}
    assert spec.shape.key == "wan2.x-t2v:64x64x9:cfg"
    spec = build_video_request(Body(body), state, {})
    assert spec.priority == 0 and spec.request.extra_params is None


def test_deadline_field_and_where_it_travels(tmp_path: Path) -> None:
    from omni_ext.api.intake import deadline_of
    from omni_ext.scheduler.priority import DEADLINE_ARG, request_deadline_s

    assert [deadline_of({"deadline_s": v}) for v in (30, "30", " 2.5 ", 0.25, None)] == [30.0, 30.0, 2.5, 0.25, None]
    assert deadline_of({}) is None
    for bad in (0, "-1", "soon", True, float("inf"), "nan", [], {}, 10**400):
        with pytest.raises(APIError) as err:
            deadline_of({"deadline_s": bad})
        assert err.value.status == 400 and err.value.param == "deadline_s" and "positive number" in err.value.message
    # It travels beside the priority, only when given, and a user's own key never overrides it.
    assert with_priority({"a": 1, DEADLINE_ARG: 9}, 0) == {"a": 1}
    assert with_priority(None, -1, 12.5) == {PRIORITY_ARG: -1, DEADLINE_ARG: 12.5}
    state = api_state(tmp_path, WAN)
    body = {"prompt": "x", "size": "64x64", "num_frames": 9, "num_inference_steps": 4}
    spec = build_video_request(Body({**body, "deadline_s": "40"}), state, {})
    assert spec.request.extra_params == {DEADLINE_ARG: 40.0} and spec.deadline_s == 40.0
    assert request_deadline_s("r", SimpleNamespace(extra_args=spec.request.extra_params)) == 40.0
    state.queue.admit("timed", spec.priority, spec.shape, spec.deadline_s)  # the API's account orders by it too
    assert state.queue.jobs.get("timed").ticket.deadline_s == 40.0
    with pytest.raises(APIError) as err:
        build_video_request(Body({**body, "deadline_s": -3}), state, {})
    assert err.value.status == 400 and err.value.param == "deadline_s"
    image, _ = build_image_request({"prompt": "x", "deadline_s": 7}, api_state(tmp_path, ModelLimits("QwenImagePipeline", 16, 1, False)))
    assert image.request[1].extra_args == {DEADLINE_ARG: 7.0}
    # what the executor reads: a bad value (only a user's raw extra_args could carry one) is the default
    for raw in (None, 0, -1, "x", True, float("nan")):
        assert request_deadline_s("r", SimpleNamespace(extra_args={} if raw is None else {DEADLINE_ARG: raw})) is None


def test_retry_headers_and_the_openai_error_body() -> None:
    assert retry_headers(1.5) == {"retry-after": "2", "retry-after-ms": "1500"}
    assert retry_headers(2.0) == {"retry-after": "2", "retry-after-ms": "2000"}
    assert retry_headers(1.0004) == {"retry-after": "1", "retry-after-ms": "1000"}  # both from the same ms
    err = too_busy("busy", 3.25)
    assert err.status == 429 and err.headers == {"retry-after": "4", "retry-after-ms": "3250"}
    assert err.body() == {"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": "queue_full"}}


# ---- the queue's account, on a fake clock and fake progress files ----------------------------------
def test_admission_bound_429_and_capacity_freed_by_a_cancel() -> None:
    queue, clock, files = fake_queue()
    refused = sample("omni_ext:requests_refused_total", reason="queue_full")
    waits = [queue.admit(f"v{i}", 0, SHAPE).wait_s for i in range(3)]
    assert waits == [0.0, 1.0, 2.0]  # one slot, 1 s each, up to max_wait_s
    with pytest.raises(APIError) as err:
        queue.admit("v3", 0, SHAPE)
    assert (err.value.status, err.value.code) == (429, "queue_full") and "v3" not in queue.jobs
    assert err.value.headers == {"retry-after": "2", "retry-after-ms": "1500"}  # 3 s of work -> 2 s bound + 0.5 s margin
    assert "wait about 3 s" in err.value.message and "bound of 2 s" in err.value.message
    assert sample("omni_ext:requests_refused_total", reason="queue_full") == refused + 1
    assert queue.cancel("v1", "deleted") and not queue.cancel("v1", "deleted")  # capacity back at once
    assert queue.admit("v4", 0, SHAPE).wait_s == 2.0


def test_running_jobs_count_by_their_remaining_time_and_teach_the_cost_model() -> None:
    queue, clock, files = fake_queue()
    queue.admit("a", 0, SHAPE)
    queue.admit("b", 0, SHAPE)
    assert not queue.running("a")
    files["a"] = StepProgress(0, 4, t_start=clock.t, t_last=clock.t, mode="single")  # the executor's start marker
    assert queue.running("a") and queue.view("b") == queue.views()["b"] and queue.view("b").position == 0
    clock.t += 0.5
    assert queue.view("b").wait_s == pytest.approx(0.5)  # a's predicted 1 s, half of it spent
    files["a"] = StepProgress(2, 4, t_start=clock.t - 0.4, t_last=clock.t)  # 0.2 s a step measured
    assert queue.view("b").wait_s == pytest.approx(0.4 + (1.0 - 0.8))  # 2 steps left + what follows the loop
    clock.t += 1.5
    jobs_before = sample("omni_ext:job_seconds_count", model="tiny")
    assert queue.finish("a") == pytest.approx(2.0)  # from its start marker to its output
    assert queue.cost.rate(SHAPE.key) == pytest.approx(2.0 / 576)  # its shape's first measurement
    assert sample("omni_ext:job_seconds_count", model="tiny") == jobs_before + 1
    assert queue.finish("b") is None and "b" not in queue.jobs  # never seen running: nothing learned


def test_the_account_learns_per_run_mode_and_predicts_a_burst_on_single_ranks() -> None:
    """Issue 19 item 5: a paired warm-up taught the pair's time only; the burst behind it runs on
    single ranks (adaptive), each slower than the pair. Admitted at the pair's rate, twice as many
    jobs were admitted as could start within max_wait_s."""
    from omni_ext.scheduler.cost import SINGLE_OVER_PAIR, mode_key

    queue, clock, files = fake_queue(slots=2, cfg_size=2, max_wait_s=3.0)  # one CFG-2 group, cfg_mode adaptive
    queue.admit("warm", 0, SHAPE)
    assert queue.jobs.get("warm").mode == "single"  # a queued CFG job is predicted on one rank
    t0 = clock.t
    clock.t += 0.3  # the account first sees it after its step reports replaced the executor's marker:
    files["warm"] = StepProgress(2, 4, t_start=t0 + 0.2, t_last=clock.t, mode="pair", t_job=t0)
    assert queue.running("warm") and queue.jobs.get("warm").mode == "pair"  # it runs on the pair
    clock.t = t0 + 0.5
    assert queue.finish("warm") == pytest.approx(0.5)  # from the marker's time, not the loop's
    assert queue.cost.by_shape == {mode_key(SHAPE.key, "pair"): pytest.approx(0.5 / 576)}
    admitted = []
    for i in range(12):
        try:
            admitted.append(queue.admit(f"b{i}", 0, SHAPE))
        except APIError:
            break
    # single ranks at SINGLE_OVER_PAIR (2) x the pair's 0.5 s: starts 0, 0, 1, 1, 2, 2, 3, 3 (the pair's rate
    # admitted 12 of 12 here, the last predicted to start at 2.5 s and starting at 5 s)
    single_s = 0.5 * SINGLE_OVER_PAIR
    assert [a.wait_s for a in admitted] == pytest.approx([single_s * (i // 2) for i in range(8)])


def test_a_running_pair_holds_both_ranks_of_its_group_until_it_runs_again_on_one() -> None:
    """A CFG job that came alone runs as a pair on both ranks of its group (placement rule 5). Within
    ``settle_s`` of its arrival it is tentative: a request then splits it (it runs again on one rank),
    so that request is predicted beside it. After that a job admitted behind it waits for the pair,
    not for a rank the account would think free. Split, it holds one slot (the executor's new marker)."""
    queue, clock, files = fake_queue(slots=2, cfg_size=2, max_wait_s=3.0)  # adaptive, settle_s 0.05
    queue.admit("p", 0, SHAPE)
    files["p"] = StepProgress(0, 4, t_start=clock.t, t_last=clock.t, mode="pair")
    assert queue.running("p") and (queue.jobs.get("p").mode, queue.jobs.get("p").slots) == ("pair", 2)
    clock.t += 0.01
    assert queue.admit("a", 0, SHAPE).wait_s == pytest.approx(0.0)  # within its settle time: it will split
    queue.cancel("a", "deleted")
    clock.t += 0.09
    assert queue.admit("b", 0, SHAPE).wait_s == pytest.approx(0.9)  # the pair's predicted rest: both ranks are its
    files["p"] = StepProgress(0, 4, t_start=clock.t, t_last=clock.t, mode="single")  # split: again, one rank
    assert queue.views()["b"].wait_s == pytest.approx(0.0)  # one rank is free again
    assert (queue.jobs.get("p").mode, queue.jobs.get("p").slots) == ("single", 1)
    # under cfg_mode "pair" a slot is a group: a pair holds one
    queue, clock, files = fake_queue(slots=1, cfg_size=2, cfg_mode="pair", max_wait_s=3.0)
    queue.admit("p", 0, SHAPE)
    files["p"] = StepProgress(0, 4, t_start=clock.t, t_last=clock.t, mode="pair")
    clock.t += 0.5
    assert queue.running("p") and queue.jobs.get("p").slots == 1 and queue.admit("b", 0, SHAPE).wait_s == pytest.approx(0.5)


def test_priority_orders_the_account_only_where_the_executor_applies_it() -> None:
    for tuned, expected in ((True, ["urgent", "a", "b"]), (False, ["a", "b", "urgent"])):
        queue, clock, files = fake_queue(tuned=tuned, max_wait_s=100)
        for job_id, priority in (("a", 0), ("b", 0), ("urgent", -1)):
            queue.admit(job_id, priority, SHAPE)
            clock.t += 0.1
        views = queue.views()
        assert sorted(views, key=lambda j: views[j].position) == expected
        assert queue.depth_by_priority() == {0: 2, -1: 1}  # the requested priorities, for the metric
        # The executor starts "urgent" on vLLM-Omni's own executor's (stock) on_started only.
        queue.mark_started("urgent")
        assert queue.running("urgent") is (not tuned)


def test_max_queued_refuses_past_the_job_count() -> None:
    queue, clock, files = fake_queue(max_jobs=2, max_wait_s=100)
    queue.admit("a", 0, SHAPE)
    queue.admit("b", 0, SHAPE)
    before = sample("omni_ext:requests_refused_total", reason="max_queued")
    with pytest.raises(APIError) as err:
        queue.admit("c", 0, SHAPE)
    assert err.value.status == 429 and "limit 2" in err.value.message and err.value.headers["retry-after"] == "1"
    assert sample("omni_ext:requests_refused_total", reason="max_queued") == before + 1


def test_queue_depth_is_read_when_metrics_are_scraped() -> None:
    queue, clock, files = fake_queue(max_wait_s=100)
    queue.admit("a", -7, SHAPE)
    queue.admit("b", -7, SHAPE)
    text = generate_latest(REGISTRY).decode()
    assert 'omni_ext:queue_depth{priority="-7"} 2.0' in text
    files["a"] = StepProgress(0, 4, clock.t, clock.t)
    assert 'omni_ext:queue_depth{priority="-7"} 1.0' in generate_latest(REGISTRY).decode()  # no request needed
    for name in ("omni_ext:requests_admitted_total", "omni_ext:predicted_wait_seconds_bucket", "omni_ext:queue_depth"):
        assert name in text


# ---- a synchronous client that goes away -------------------------------------------------------
class GoneRequest:
    """A request whose client disconnects after ``after`` seconds (the body was read already)."""

    def __init__(self, engine: Engine, after: float) -> None:
        self.app = SimpleNamespace(state=SimpleNamespace(engine_client=engine))
        self.after = after

    async def receive(self) -> dict:
        await asyncio.sleep(self.after)
        return {"type": "http.disconnect"}


def test_a_client_that_goes_away_frees_its_slot_at_once() -> None:
    queue, clock, files = fake_queue()
    engine, cancelled = Engine(), []

    async def generation() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return "never"

    async def quick() -> str:
        files["video_sync-b"] = StepProgress(1, 1, clock.t, clock.t)
        clock.t += 0.25
        return "mp4"

    before = sample("omni_ext:requests_cancelled_total", reason="client_disconnected")
    admitted = queue.admit("video_sync-a", 0, SHAPE)
    with pytest.raises(ClientGone):
        asyncio.run(run_admitted(GoneRequest(engine, 0.05), admitted, "video", generation()))
    assert cancelled == [True] and engine.aborted == ["video_sync-a"] and not queue.jobs
    assert sample("omni_ext:requests_cancelled_total", reason="client_disconnected") == before + 1
    admitted = queue.admit("video_sync-b", 0, SHAPE)
    assert asyncio.run(run_admitted(GoneRequest(engine, 30), admitted, "video", quick())) == "mp4"
    assert not queue.jobs and queue.cost.rate(SHAPE.key) == pytest.approx(0.25 / 576)


# ---- the routes in process: a video handler that blocks, no engine ---------------------------------
@pytest.fixture
def app_client(tmp_path: Path):
    with serve_in_process(tmp_path, WAN) as served:
        yield served


TINY = {"prompt": "a fox", "size": "64x64", "num_frames": 9, "num_inference_steps": 4, "guidance_scale": 4.0}


def test_routes_admit_refuse_report_and_cancel(app_client) -> None:
    client, state, files, handler, engine = app_client
    ids = [client.post("/v1/videos", json=TINY).json()["id"] for _ in range(3)]
    full = client.post("/v1/videos", json=TINY)
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
    assert full.headers["retry-after"] == "2" and full.headers["retry-after-ms"] == "1500"
    form = {**{k: (None, str(v)) for k, v in TINY.items()}, "priority": (None, "-1")}
    urgent = client.post("/v1/videos", files=form)  # multipart, as openai-python >= 2.27 sends extra_body
    assert urgent.status_code == 200, urgent.text
    urgent = urgent.json()
    assert urgent["priority"] == -1 and urgent["queue_position"] == 0 and urgent["predicted_wait_s"] == 0.0
    listed = {v["id"]: v for v in client.get("/v1/videos?limit=10").json()["data"]}
    assert [listed[i]["queue_position"] for i in ids] == [1, 2, 3]
    first = client.get(f"/v1/videos/{ids[0]}")
    body = first.json()
    assert body["status"] == "queued" and body["predicted_wait_s"] == 1.0
    assert body["predicted_start_at"] - time.time() == pytest.approx(1.0, abs=1.5)
    assert first.headers["openai-poll-after-ms"] == "250"  # a quarter of the predicted wait
    assert handler.requests[urgent["id"]].extra_params == {PRIORITY_ARG: -1}
    assert handler.requests[ids[0]].extra_params is None
    # The executor starts the urgent job: it runs, and the others move up.
    files[urgent["id"]] = StepProgress(0, 4, time.time(), time.time())
    running = client.get(f"/v1/videos/{urgent['id']}").json()
    assert running["status"] == "in_progress" and "queue_position" not in running
    assert client.get(f"/v1/videos/{ids[0]}").json()["queue_position"] == 0
    deleted = sample("omni_ext:requests_cancelled_total", reason="deleted")
    assert client.delete(f"/v1/videos/{ids[1]}").json()["deleted"] is True
    assert ids[1] not in state.queue.jobs and engine.aborted == [ids[1]]
    assert sample("omni_ext:requests_cancelled_total", reason="deleted") == deleted + 1
    assert client.get(f"/v1/videos/{ids[2]}").json()["queue_position"] == 1
    bad = client.post("/v1/videos", json={**TINY, "priority": limits.MAX_PRIORITY + 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    bad = client.post("/v1/videos", json={**TINY, "deadline_s": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "deadline_s"


def test_image_generations_are_admitted_and_accounted_while_they_run(tmp_path: Path, monkeypatch) -> None:
    from PIL import Image

    from omni_ext.api import images

    seen = []

    async def generate(request, spec, request_id, metrics=None):  # vLLM-Omni's engine call, stubbed
        state = request.app.state.omni_ext
        seen.append((spec.priority, request_id in state.queue.jobs))
        files[request_id] = StepProgress(2, 2, time.time() - 0.5, time.time())  # ran for 0.5 s
        return [Image.new("RGB", (32, 32))] * spec.n

    monkeypatch.setattr(images, "_generate", generate)
    body = {"prompt": "a cat", "size": "32x32", "n": 2, "num_inference_steps": 2, "priority": -2}
    with serve_in_process(tmp_path, ModelLimits("QwenImagePipeline", 16, 1, False)) as (client, state, files, _, _):
        learned = sample("omni_ext:job_seconds_count", model="tiny")
        resp = client.post("/v1/images/generations", json=body)
        assert resp.status_code == 200 and len(resp.json()["data"]) == 2
        assert seen == [(-2, True)] and not state.queue.jobs  # accounted while it ran, gone after
        assert sample("omni_ext:job_seconds_count", model="tiny") == learned + 1
        shape = build_image_request(body, state)[0].shape
        # learned from the job's 0.5 s (what ran after the stub returned adds ~40 ms on a busy host: a18)
        assert shape.units == 2 * 24 and state.queue.cost.rate(shape.key) == pytest.approx(0.5 / shape.units, rel=0.2)
        # a ~40 s job of priority -1 queued (of priority 0, the short image would start first: its deadline)
        state.queue.admit("video_long", -1, job_shape("WanPipeline", width=64, height=64, frames=9, steps=40))
        full = client.post("/v1/images/generations", json={**body, "priority": 0})  # queued behind it
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full" and len(seen) == 1
        assert client.post("/v1/images/generations", json=body).status_code == 200  # priority -2 goes first


# ---- one real server: wan-sched ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def burst(server_pool) -> dict:
    """``wan-sched`` filled up to its bound once; what the tests below look at."""
    server = server_pool.get("wan-sched", quiet=True)
    wait_idle(server)
    ids, refused = fill(server)
    listed = requests.get(server.url + "/v1/videos?limit=100", timeout=30).json()["data"]  # one snapshot
    queued = [v for v in listed if v["id"] in ids and v["status"] == "queued"]
    last = requests.get(f"{server.url}/v1/videos/{queued[-1]['id']}", timeout=30) if queued else None
    depth_while_full = scrape(server, "omni_ext:queue_depth", priority="0")
    done = wait_all(server, ids)
    return {"server": server, "ids": ids, "refused": refused, "queued": queued, "last": last,
            "depth_while_full": depth_while_full, "done": done}


def test_a_full_server_answers_429_with_retry_after(burst) -> None:
    refused = burst["refused"]
    assert refused is not None, f"{len(burst['ids'])} creates in a row were all admitted"
    assert len(burst["ids"]) >= 2  # two ranks: the first two start at once
    err = refused.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"], err["param"]) == ("rate_limit_error", "queue_full", None)
    assert "omni_ext.scheduler.max_wait_s" in err["message"] and "bound of 3 s" in err["message"]
    seconds, ms = int(refused.headers["retry-after"]), int(refused.headers["retry-after-ms"])
    assert seconds >= 1 and seconds == -(-ms // 1000), refused.headers


def test_queued_jobs_show_their_position_and_predicted_start(burst) -> None:
    queued = burst["queued"]
    assert queued, "no job of the burst was queued when the server refused"
    assert sorted(v["queue_position"] for v in queued) == list(range(len(queued)))  # in one listing: 0, 1, ...
    for body in queued:
        assert 0 <= body["predicted_wait_s"] < 60  # admitted within the bound; revised as jobs run
        assert body["predicted_start_at"] >= body["created_at"]
    last = burst["last"]
    if last.json()["status"] == "queued":  # (it may have started since the listing)
        assert {"queue_position", "predicted_wait_s", "predicted_start_at"} <= set(last.json())
        assert 100 <= int(last.headers["openai-poll-after-ms"]) <= 5000


def test_every_admitted_job_completes(burst) -> None:
    assert sorted(burst["done"]) == sorted(burst["ids"])
    assert {b["status"] for b in burst["done"].values()} == {"completed"}, burst["done"]


def test_scheduler_metrics_on_the_servers_metrics_endpoint(burst) -> None:
    server, n = burst["server"], len(burst["ids"])
    assert burst["depth_while_full"] >= 1
    assert scrape(server, "omni_ext:requests_admitted_total") >= n
    assert scrape(server, "omni_ext:requests_refused_total", reason="queue_full") >= 1
    assert scrape(server, "omni_ext:predicted_wait_seconds_count") >= n
    assert scrape(server, "omni_ext:job_seconds_count") >= n
    # the burst's jobs had deadlines (the server's cost seed predicts them): their attainment is reported
    text = requests.get(server.url + "/metrics", timeout=30).text
    att = [s.value for f in text_string_to_metric_families(text) for s in f.samples
           if s.name == "omni_ext:slo_attainment" and s.labels == {"window": "300s"}]
    assert len(att) == 1 and 0.0 <= att[0] <= 1.0, att


def test_openai_sdk_rides_out_a_full_server(server_pool) -> None:
    """The official SDK, with no code of its own: it retries 429 after retry-after-ms, and every
    request it got accepted completes."""
    import httpx
    import openai

    warnings.simplefilter("ignore", DeprecationWarning)
    server = server_pool.get("wan-sched", quiet=True)
    wait_idle(server)
    ids, refused = fill(server)
    assert refused is not None
    statuses: list[int] = []
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120,
                           http_client=httpx.Client(event_hooks={"response": [lambda r: statuses.append(r.status_code)]}))
    extra = {k: v for k, v in JOB.items() if k not in ("prompt", "size")}

    def create(seed: int) -> str:
        video = client.with_options(max_retries=8).videos.create(prompt="a paper boat", size="128x128",
                                                                  extra_body={**extra, "seed": seed})
        return video.id

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        sdk_ids = list(pool.map(create, range(4)))
    assert 429 in statuses and statuses.count(200) == 4, statuses
    done = wait_all(server, ids + sdk_ids)
    assert {b["status"] for b in done.values()} == {"completed"} and len(done) == len(ids) + 4


def post_until_admitted(server, body: dict, attempts: int = 5) -> requests.Response:
    """POST /v1/videos as a patient client: after a 429, wait its retry-after-ms and try again."""
    for _ in range(attempts):
        resp = requests.post(server.url + "/v1/videos", json=body, timeout=60)
        if resp.status_code != 429:
            return resp
        time.sleep(int(resp.headers["retry-after-ms"]) / 1000)
    return resp


def test_a_priority_job_is_queued_ahead_of_earlier_ones(server_pool) -> None:
    server = server_pool.get("wan-sched", quiet=True)
    wait_idle(server)
    ids, _ = fill(server, limit=6)
    # Its predicted wait is the running jobs' rest only (it goes first), so it is admitted.
    urgent = post_until_admitted(server, {**JOB, "priority": -1})
    assert urgent.status_code == 200, urgent.text
    listed = {v["id"]: v for v in requests.get(server.url + "/v1/videos?limit=100", timeout=30).json()["data"]}
    urgent = listed[urgent.json()["id"]]
    later = [listed[i]["queue_position"] for i in ids if listed[i]["status"] == "queued"]
    assert urgent["priority"] == -1 and later, listed  # priority-0 jobs sent before it still wait
    if urgent["status"] == "queued":
        assert urgent["queue_position"] == 0 and min(later) == 1, listed
    # (else a rank freed in between and the urgent job took it, ahead of those still queued)
    done = wait_all(server, ids + [urgent["id"]])
    assert {b["status"] for b in done.values()} == {"completed"}


def test_a_sync_client_that_disconnects_frees_its_slot(server_pool) -> None:
    import httpx

    server = server_pool.get("wan-sched", quiet=True)
    wait_idle(server)
    cancelled = scrape(server, "omni_ext:requests_cancelled_total", reason="client_disconnected")
    long = {**JOB, "size": "256x256", "num_inference_steps": 200}  # tens of seconds, predicted far over the bound
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/videos/sync", json=long, timeout=httpx.Timeout(30, read=3))
    t0 = time.monotonic()
    while scrape(server, "omni_ext:requests_cancelled_total", reason="client_disconnected") < cancelled + 1:
        assert time.monotonic() - t0 < 5, "the server did not notice the client leave"
        time.sleep(0.05)
    # The slot is freed (the metric) before the engine's abort is awaited; the log line follows the abort.
    while "client disconnected; generation aborted" not in server.log_text():
        assert time.monotonic() - t0 < 10, "the abort of the gone client's generation was not logged"
        time.sleep(0.05)
    quick = requests.post(server.url + "/v1/videos/sync", json=JOB, timeout=120)
    # Admitted (the gone request's ticket was dropped: its predicted rest would exceed the bound) and
    # run at once (the engine aborted it at its next step).
    assert quick.status_code == 200, quick.text[:300]
    assert time.monotonic() - t0 < 15


def test_slo_attainment_judges_each_finished_job_by_its_deadline_as_admitted() -> None:
    import gc

    from omni_ext.api import metrics

    queue, clock, files = fake_queue(max_wait_s=10.0)  # 1 s predicted per job: deadline 3 s after arrival
    queue.admit("a", 0, SHAPE)
    queue.admit("b", 0, SHAPE)
    queue.admit("tight", 0, SHAPE, deadline_s=0.5)  # the request's own deadline
    queue.admit("gone", 0, SHAPE)
    for job in ("a", "b", "tight"):  # one after the other, 1 s each: done at 1, 2 and 3 s
        files[job] = StepProgress(0, 4, t_start=clock.t, t_last=clock.t, mode="single")
        assert queue.running(job)
        clock.t += 1.0
        queue.finish(job)
    queue.cancel("gone", "deleted")  # cancelled: not judged
    assert queue.slo_counts(300) == (2, 3)  # a and b within 3 s; tight missed its 0.5 s
    gc.collect()  # other tests' queues
    live = [q.slo_counts(300) for q in list(metrics._DEPTH.queues)]
    assert sample("omni_ext:slo_attainment", window="300s") == pytest.approx(
        sum(m for m, _ in live) / sum(n for _, n in live))
    clock.t += 400
    assert queue.slo_counts(300) == (0, 0) and queue.slo_counts(3600) == (2, 3)


def test_attainment_keeps_the_longest_window_only() -> None:
    from omni_ext.scheduler.slo import Attainment

    att = Attainment((10.0, 100.0))
    assert att.record(5.0, deadline=6.0) is True and att.record(7.0, deadline=6.0) is False
    assert att.counts(8.0, 10.0) == (1, 2)
    att.record(200.0, deadline=250.0)  # the first two are past the longest window now: dropped
    assert len(att.finished) == 1 and att.counts(200.0, 100.0) == (1, 1)


#: max_wait_s of ``wan-sched`` (conftest.SERVERS) and the promise a 200 makes under a burst (issue 19 item 5).
SCHED_MAX_WAIT_S = 3.0
PROMISE_S = SCHED_MAX_WAIT_S * 1.25 + 1.0


def test_a_burst_after_a_paired_warm_up_keeps_the_admission_promise(server_pool) -> None:
    """One video alone (it runs as a CFG pair: the only time this shape class was measured), then a
    burst of 64 at once: the jobs of the burst run as single ranks (adaptive), each slower than the
    pair, while the API takes the burst's requests. Every admitted job must start within
    ``max_wait_s`` x 1.25 + 1 s of its request, and the burst must be at least 3x what was admitted."""
    server = server_pool.get("wan-sched", quiet=True)
    wait_idle(server)
    print(f"host CPU {wait_cpu_quiet():.0%} busy before the warm-up")
    # a shape class no other test of this server measures; 64x64 so that a job runs well under
    # max_wait_s (at 128x128 one took 3 s as a pair and 5 s on one rank on a CI-class host: only the
    # two ranks' first jobs could be admitted, and the burst tested nothing)
    job = {**JOB, "size": "64x64", "num_frames": 13, "seed": 11}
    warm = requests.post(server.url + "/v1/videos/sync", json=job, timeout=120)
    assert warm.status_code == 200, warm.text[:300]
    print(f"host CPU {wait_cpu_quiet(window_s=1.0):.0%} busy before the burst")
    mark = time.time()
    # at least 3x what is admitted: 16 of 32 were on a quiet host, 30 of 64 on CI's with the deadline
    # order of 12-04 (a newcomer of the burst's shape queues behind it instead of being refused for
    # overtaking it, so admission fills max_wait_s)
    burst = 128
    barrier = threading.Barrier(burst)

    def send(i: int) -> tuple[float, requests.Response]:
        barrier.wait()
        sent = time.time()
        return sent, requests.post(server.url + "/v1/videos", json={**job, "seed": 100 + i}, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(burst) as pool:
        answers = list(pool.map(send, range(burst)))
    assert {r.status_code for _, r in answers} <= {200, 429}, [r.text[:200] for _, r in answers]
    admitted = {r.json()["id"]: (sent, r.json()) for sent, r in answers if r.status_code == 200}
    done = wait_all(server, list(admitted))
    assert {b["status"] for b in done.values()} == {"completed"} and len(done) == len(admitted)
    starts = {}
    for e in placements(server, mark, kind="start"):
        job_id = next((j for j in admitted if e["request_id"] == j or e["request_id"].startswith(j + "-")), None)
        if job_id is not None:
            starts.setdefault(job_id, e["time"])
    assert set(starts) == set(admitted)
    late = {}
    for job_id, (sent, body) in sorted(admitted.items(), key=lambda kv: starts[kv[0]]):
        waited = starts[job_id] - sent
        print(f"{job_id}: started {waited:.2f} s after its request, predicted {body.get('predicted_wait_s')} s")
        if waited > PROMISE_S:
            late[job_id] = (round(waited, 2), body.get("predicted_wait_s"))
    assert not late, f"{len(late)} of {len(admitted)} admitted jobs started later than {PROMISE_S} s: {late}"
    # more than the two ranks take at once (a queue formed), and at most a third of the burst
    assert 3 <= len(admitted) and 3 * len(admitted) <= len(answers), len(admitted)
