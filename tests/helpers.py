"""Helpers shared by test modules (a test module imports them from here, never from another test
module): requests as a client sends them, the TunedExecutor's placement as its log tells it, a
scheduler server's metrics and queue, the API in process (no engine), and the executor without
workers."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import time
from pathlib import Path
from types import SimpleNamespace

import requests
from prometheus_client.parser import text_string_to_metric_families

from omni_ext.api.jobs import JobStore
from omni_ext.api.queue import RequestQueue, job_shape
from omni_ext.api.settings import load_settings
from omni_ext.api.state import ApiState, VideoBackend
from omni_ext.api.validation import ModelLimits
from omni_ext.progress import StepProgress
from omni_ext.scheduler.config import SchedulerConfig

VIDEO = {"prompt": "a red fox running through fresh snow", "negative_prompt": "blurry, low quality",
         "num_inference_steps": "2", "guidance_scale": "4.0", "seed": "1234", "fps": "8"}
IMAGE = {"prompt": "a lighthouse at dusk", "negative_prompt": "blurry", "true_cfg_scale": 4.0,
         "num_inference_steps": 2, "seed": 77}


def video_sync(server, **fields) -> requests.Response:
    data = {**VIDEO, **{k: str(v) for k, v in fields.items()}}
    # multipart/form-data, exactly as vLLM-Omni's curl examples send it
    return requests.post(server.url + "/v1/videos/sync", files={k: (None, v) for k, v in data.items()}, timeout=300)


def image_gen(server, **fields) -> requests.Response:
    return requests.post(server.url + "/v1/images/generations", json={**IMAGE, **fields}, timeout=300)


def png_from(resp: requests.Response) -> bytes:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return base64.b64decode(body["data"][0]["b64_json"])


# The TunedExecutor's INFO lines: ``omni-ext: start request <id> on rank(s) [..] (<mode>)`` and
# ``omni-ext: done request <id> on rank(s) [..]``, in the order the server wrote them.
START = re.compile(r"omni-ext: start request (\S+) on rank\(s\) \[([\d, ]+)\] \((\w+(?:-\w+)?)\)")
DONE = re.compile(r"omni-ext: done request (\S+) on rank\(s\) \[([\d, ]+)\]")


def executor_events(log: str) -> list[tuple[str, str, tuple[int, ...], str]]:
    """("start"|"done", request_id, ranks, mode) in log order."""
    events = []
    for line in log.splitlines():
        m = START.search(line)
        if m:
            events.append(("start", m.group(1), tuple(int(x) for x in m.group(2).split(",")), m.group(3)))
            continue
        m = DONE.search(line)
        if m:
            events.append(("done", m.group(1), tuple(int(x) for x in m.group(2).split(",")), ""))
    return events


def new_events(server, before: int) -> list:
    return executor_events(server.log_text())[before:]


def wait_for_events(server, before: int, n_done: int, timeout: float = 60.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = new_events(server, before)
        if sum(1 for e in ev if e[0] == "done") >= n_done:
            return ev
        time.sleep(0.2)
    return new_events(server, before)


# ---- a scheduler server over HTTP (tests/test_admission.py, tests/test_drills.py) ---------------
#: A CFG video of about 1 s predicted on ``wan-sched`` (conftest.SERVERS).
JOB = {"prompt": "a lantern in the fog", "negative_prompt": "blurry", "size": "128x128", "num_frames": 17,
       "num_inference_steps": 8, "guidance_scale": 4.0, "seed": 5}


def scrape(server, name: str, **labels: str) -> float:
    """The sum of the samples ``name`` with ``labels`` on the server's ``/metrics``."""
    text = requests.get(server.url + "/metrics", timeout=30).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def wait_idle(server, timeout: float = 120) -> None:
    """Until no video of this server is queued or running (a test that fills it starts from empty)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = requests.get(server.url + "/v1/videos?limit=100", timeout=30).json()["data"]
        if not any(v["status"] in ("queued", "in_progress") for v in data):
            return
        time.sleep(0.2)
    raise AssertionError("the server did not drain")


def wait_all(server, ids: list[str], timeout: float = 180) -> dict[str, dict]:
    deadline, done = time.monotonic() + timeout, {}
    while time.monotonic() < deadline and len(done) < len(ids):
        for i in set(ids) - set(done):
            body = requests.get(f"{server.url}/v1/videos/{i}", timeout=30).json()
            if body["status"] in ("completed", "failed"):
                done[i] = body
        time.sleep(0.2)
    return done


def fill(server, limit: int = 40, **fields) -> tuple[list[str], requests.Response | None]:
    """Async creates sent back to back until the first 429: (admitted ids, that 429 answer)."""
    ids = []
    for _ in range(limit):
        resp = requests.post(server.url + "/v1/videos", json={**JOB, **fields}, timeout=60)
        if resp.status_code == 429:
            return ids, resp
        assert resp.status_code == 200, resp.text
        ids.append(resp.json()["id"])
    return ids, None


# ---- the queue's account on a fake clock, and the API in process: no server, no engine ----------
def api_state(tmp_path: Path, limits: ModelLimits, **fields) -> ApiState:
    """An :class:`ApiState` on ``tmp_path`` (no server); ``fields`` override others (e.g. ``queue``)."""
    settings = load_settings(SimpleNamespace(port=1, additional_config=None), {"OMNI_EXT_API_DATA_DIR": str(tmp_path)})
    settings.media_dir.mkdir(parents=True, exist_ok=True)
    return ApiState(settings=settings, store=JobStore(settings.db_path), model_name="m", model_path="m", limits=limits,
                    **fields)


class Clock:
    """A clock the test moves by hand (``clock.t += 0.5``)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fake_queue(*, tuned: bool = True, slots: int = 1, max_jobs: int | None = None, seed: float = 1 / 576,
               max_wait_s: float = 2.0) -> tuple[RequestQueue, Clock, dict[str, StepProgress]]:
    """A queue whose 64x64x9, 4-step Wan jobs (576 units) are predicted at 1 s each."""
    clock, files = Clock(), {}
    queue = RequestQueue(SchedulerConfig(max_wait_s=max_wait_s, seconds_per_unit=seed), slots, tuned=tuned, model="tiny",
                         max_jobs=max_jobs, clock=clock, wall=clock, progress=files.get)
    return queue, clock, files


SHAPE = job_shape("WanPipeline", width=64, height=64, frames=9, steps=4)


class Engine:
    """vLLM-Omni's engine client as the routes call it on a cancel: it records the aborts."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class BlockingHandler:
    """vLLM-Omni's video handler as the routes call it; every generation waits until cancelled."""

    def __init__(self) -> None:
        self.requests: dict[str, object] = {}

    async def _run_and_extract(self, vreq, request_id, reference_image=None, on_started=None):
        self.requests[request_id] = vreq
        await asyncio.Event().wait()


@contextlib.contextmanager
def serve_in_process(tmp_path: Path, limits: ModelLimits):
    """omni-ext's router on a bare FastAPI app (a :class:`BlockingHandler`, no engine): one slot,
    1 s predicted per 576 cost units (a 64x64, 9-frame, 4-step video), a 2 s bound."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from omni_ext.api.routes import build_router

    files: dict[str, StepProgress] = {}
    queue = RequestQueue(SchedulerConfig(max_wait_s=2, seconds_per_unit=1 / 576), 1, tuned=True, model="tiny",
                         progress=files.get)
    state = api_state(tmp_path, limits, queue=queue)
    handler, engine = BlockingHandler(), Engine()
    state.video = VideoBackend(handler=handler, defaults={})
    app = FastAPI()
    app.include_router(build_router())
    app.state.omni_ext, app.state.engine_client = state, engine
    with TestClient(app) as client:
        yield client, state, files, handler, engine
        for job_id in list(state.tasks):  # stop the blocked generations on the client's loop
            client.delete(f"/v1/videos/{job_id}")


# ---- the TunedExecutor's queue mechanism without worker processes (its pipes replaced by a list) ----
def bare_executor(world: int = 2, cfg_size: int = 2, **options):
    """A TunedExecutor for the Wan family with its state but no workers; what it sends lands in ``.sent``."""
    from omni_ext.executor.tuned import TunedExecutor
    from omni_ext.scheduler.placement import Layout

    ex = TunedExecutor.__new__(TunedExecutor)
    ex.world, ex.cfg_size, ex.layout = world, cfg_size, Layout.regular(world // cfg_size, cfg_size)
    ex.sched = SchedulerConfig(**options)
    ex.model_arch, ex._tuned_model, ex.cfg_mode, ex.device_type = "WanPipeline", True, ex.sched.cfg_mode, "cpu"
    ex._init_state()
    ex._cancel_slots = [0] * world
    ex.sent = []
    ex._post = lambda rank, msg: ex.sent.append((rank, msg))
    return ex


def wan_request(priority=None, guidance: float = 4.0):
    """A Wan request as the engine hands it to the executor (32x32, 5 frames, 2 steps)."""
    sp = SimpleNamespace(guidance_scale=guidance, guidance_scale_provided=True, width=32, height=32, num_frames=5,
                         num_inference_steps=2, extra_args={} if priority is None else {"omni_ext_priority": priority})
    return SimpleNamespace(prompt={"prompt": "a fox", "negative_prompt": "blurry"}, sampling_params=sp)
