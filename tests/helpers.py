"""Helpers shared by test modules (a test module imports them from here, never from another test
module): requests as a client sends them, placements as the server's journal tells them, a
scheduler server's metrics and queue, the API in process (no engine), the executor without
workers, and servers of a test's own."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from omni_ext.api.jobs import JobStore
from omni_ext.api.queue import RequestQueue
from omni_ext.models.families import job_shape
from omni_ext.api.settings import load_settings
from omni_ext.api.state import ApiState, VideoBackend
from omni_ext.api.intake import ModelLimits
from omni_ext.progress import StepProgress
from omni_ext.scheduler.config import CfgMode, SchedulerConfig
from omni_ext.server_process import ServeProcess

VIDEO = {"prompt": "a red fox running through fresh snow", "negative_prompt": "blurry, low quality",
         "num_inference_steps": "2", "guidance_scale": "4.0", "seed": "1234", "fps": "8"}
IMAGE = {"prompt": "a lighthouse at dusk", "negative_prompt": "blurry", "true_cfg_scale": 4.0,
         "num_inference_steps": 2, "seed": 77}


def until(check, timeout: float = 60.0, what: str = "condition", every: float = 0.05):
    """Poll ``check()`` every ``every`` s until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def video_sync(server, **fields) -> requests.Response:
    data = {**VIDEO, **{k: str(v) for k, v in fields.items()}}
    # multipart/form-data, exactly as vLLM-Omni's curl examples send it
    return requests.post(server.url + "/v1/videos/sync", files={k: (None, v) for k, v in data.items()},
                         headers=auth(server), timeout=300)


def auth(server) -> dict[str, str]:
    """The headers of the first key a server was started with (``--api-key``), or none."""
    args = list(server.args)
    return {"Authorization": f"Bearer {args[args.index('--api-key') + 1]}"} if "--api-key" in args else {}


def image_gen(server, **fields) -> requests.Response:
    return requests.post(server.url + "/v1/images/generations", json={**IMAGE, **fields}, headers=auth(server),
                         timeout=300)


def png_from(resp: requests.Response) -> bytes:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return base64.b64decode(body["data"][0]["b64_json"])


def placements(server, after: float = 0.0, kind: str | None = None) -> list[dict]:
    """The server's placement journal (``GET /v1/omni_ext/placements``) after the unix time ``after``,
    oldest first, every page; only events of ``kind`` (queued, start, done, bind) when given."""
    events: list[dict] = []
    while True:
        resp = requests.get(server.url + "/v1/omni_ext/placements", params={"after": repr(after), "limit": 1000},
                            headers=auth(server),
                            timeout=30)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        events += body["data"]
        if not body["has_more"] or not body["data"]:
            return [e for e in events if kind is None or e["kind"] == kind]
        after = body["data"][-1]["time"]


def events_mark(server) -> float:
    """A cursor for :func:`new_events`: the time of the newest placement event so far (0 if none)."""
    resp = requests.get(server.url + "/v1/omni_ext/placements", params={"limit": 1}, headers=auth(server), timeout=30)
    assert resp.status_code == 200, resp.text
    data = resp.json()["data"]
    return data[-1]["time"] if data else 0.0


def executor_events(server, after: float = 0.0) -> list[tuple[str, str, tuple[int, ...], str]]:
    """The TunedExecutors' ("start"|"done", request_id, ranks, mode) in time order, from the
    placement journal (``mode``: "pair", "single", "warm-up"; "" for done)."""
    return [(e["kind"], e["request_id"], tuple(e["ranks"]), e.get("mode", "") if e["kind"] == "start" else "")
            for e in placements(server, after) if e["kind"] in ("start", "done")]


def new_events(server, before: float) -> list:
    """:func:`executor_events` since the cursor ``before`` (:func:`events_mark`)."""
    return executor_events(server, before)


def wait_for_events(server, before: float, n_done: int, timeout: float = 60.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = new_events(server, before)
        if sum(1 for e in ev if e[0] == "done") >= n_done:
            return ev
        time.sleep(0.2)
    return new_events(server, before)


def cpu_busy(window_s: float = 1.0) -> float:
    """The share of the host's CPU time (all cores) that was busy over the next ``window_s`` (/proc/stat)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(window_s)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_cpu_quiet(max_busy: float = 0.3, window_s: float = 2.0, timeout: float = 90.0) -> float:
    """Wait until the host's CPU was at most ``max_busy`` busy over one ``window_s`` (at most ``timeout``)
    and return the last share measured. A check of a latency promise on this 2-core host (jobs starting
    when predicted) needs the cores the prediction was learned on: right after the shared pool's dozen
    servers came up, CI saw the first jobs of a burst run 1.8x slower than the same jobs 3 s later."""
    deadline = time.monotonic() + timeout
    while True:
        busy = cpu_busy(window_s)
        if busy <= max_busy or time.monotonic() >= deadline:
            return busy


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
               max_wait_s: float = 2.0, cfg_size: int = 1,
               cfg_mode: str = "adaptive") -> tuple[RequestQueue, Clock, dict[str, StepProgress]]:
    """A queue whose 64x64x9, 4-step Wan jobs (576 units) are predicted at 1 s each."""
    clock, files = Clock(), {}
    queue = RequestQueue(SchedulerConfig(max_wait_s=max_wait_s, seconds_per_unit=seed), slots, tuned=tuned, model="tiny",
                         max_jobs=max_jobs, clock=clock, wall=clock, progress=files.get, cfg_size=cfg_size,
                         cfg_mode=CfgMode(cfg_mode))
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


# ---- the TunedExecutor's queue over its ranks, without worker processes (its pipes replaced by a list) ----
#: The queues :func:`rank_queue` made in the running test, drained after it (tests/conftest.py): a queue
#: left with a job waiting on a deadline re-arms its 0.2-s re-check timer for the rest of the session.
OPEN_RANK_QUEUES: list = []


def rank_queue(world: int = 2, cfg_size: int = 2, sp: int = 1, **options):
    """The TunedExecutor's :class:`~omni_ext.executor.ranks.RankQueue` for the Wan family on ``world``
    worker processes in CFG groups of ``cfg_size`` units of ``sp`` processes (sequence parallel); what it
    sends to a process lands in ``.sent`` as (rank, message)."""
    from omni_ext.executor.ranks import RankQueue
    from omni_ext.executor.role import board_size
    from omni_ext.scheduler.placement import Layout, Units

    sched = SchedulerConfig(**options)
    sent: list = []
    rq = RankQueue(Layout.regular(world // (cfg_size * sp), cfg_size), sched, model_arch="WanPipeline", tuned_model=True,
                   cfg_mode=sched.cfg_mode, send=lambda rank, msg: sent.append((rank, msg)), cancel_slots=[0] * board_size(world),
                   small_warmup=True, units=Units(sp))
    rq.sent = sent
    OPEN_RANK_QUEUES.append(rq)
    return rq


def wan_request(priority=None, guidance: float = 4.0):
    """A Wan request as the engine hands it to the executor (32x32, 5 frames, 2 steps)."""
    sp = SimpleNamespace(guidance_scale=guidance, guidance_scale_provided=True, width=32, height=32, num_frames=5,
                         num_inference_steps=2, extra_args={} if priority is None else {"omni_ext_priority": priority})
    return SimpleNamespace(prompt={"prompt": "a fox", "negative_prompt": "blurry"}, sampling_params=sp)


# ---- a server of a test's own: a test that kills or restarts a server never shares it ----------------
START_TIMEOUT_S = float(os.environ.get("OMNI_EXT_TEST_START_TIMEOUT", "600"))
#: Served in float32 (vLLM-Omni's default is bfloat16): on an x86 CPU without AVX512-BF16 or AMX a
#: bfloat16 linear is ~15x and a conv3d ~7x slower than float32 (the CI's AMD EPYC with AVX2 only: one
#: 64x64 Qwen-Image-Edit took 62 s in bfloat16, 5 s in float32, and the suite ran past CI's 90 minutes).
#: Servers that compare bytes between executors use it: Wan's tiny models (built in bfloat16) as they
#: are; the Qwen-Image family only built in float32 (:func:`float32_models`), since its bfloat16 text
#: encoder stays bfloat16 and meets a float32 VAE. The drills, the shared pool and the cancel and
#: preemption tests keep the default, whose speed their job lengths assume.
FLOAT32 = ["--dtype", "float32"]


def float32_models(names, root: Path) -> dict[str, Path]:
    """The tiny models ``names`` built in float32 under ``root`` (for :data:`FLOAT32` servers)."""
    from omni_ext.models.tiny import build_tiny_model

    return {m: build_tiny_model(m, root / m, dtype="float32") for m in names}
#: ``wan-drill`` (tests/conftest.py) and the restart drill's own servers: one TunedExecutor worker (one
#: slot) on one thread (with two, the worker's parallel regions wait on a thread that a busy host has
#: descheduled: 9x slower in a test run), a bound on the predicted wait that admits 20 long requests,
#: and max_queued 24 so that "full" is a known number of jobs.
DRILL_ARGS = ["--distributed-executor-backend", "omni_ext.executor.TunedExecutor",
              "--additional-config", '{"omni_ext": {"scheduler": {"max_wait_s": 3600}}}']
DRILL_ENV = {"OMNI_EXT_API_MAX_QUEUED": "24", "OMP_NUM_THREADS": "1"}
#: The deploy YAML of two vLLM-Omni replicas in one server, each a TunedExecutor of one worker
#: (tests/test_replicas.py's own server).
REPLICAS2_DEPLOY = {"async_chunk": False, "stages": [{
    "stage_id": 0, "num_replicas": 2, "devices": "0,1", "distributed_executor_backend": "omni_ext.executor.TunedExecutor",
    "flow_shift": 5.0, "boundary_ratio": 0.875}]}


#: Own servers started ahead of their test (:func:`prestart`), by :func:`_spec_key`; not waited for yet.
_AHEAD: dict[tuple, ServeProcess] = {}


def _spec_key(model: Path, name: str, args: list[str], env: dict[str, str], deploy: dict | None) -> tuple:
    return str(model), name, tuple(args), tuple(sorted(env.items())), repr(deploy)


def _launch(model: Path, workdir: Path, name: str, args: list[str], env: dict[str, str],
            deploy: dict | None) -> ServeProcess:
    (workdir / name).mkdir(parents=True, exist_ok=True)
    if deploy is not None:
        import yaml

        (workdir / name / "deploy.yaml").write_text(yaml.safe_dump(deploy, sort_keys=False))
        args = [*args, "--deploy-config", str(workdir / name / "deploy.yaml")]
    return ServeProcess(
        model=str(model), args=list(args), log_path=workdir / name / "serve.log",
        env={"VLLM_OMNI_SERVER_STORAGE__PATH": str(workdir / name / "storage"),
             "OMNI_EXT_API_DATA_DIR": str(workdir / name / "api"), "OMP_NUM_THREADS": "1", **env}).start()


def prestart(model: Path, specs: dict[str, tuple[list[str], dict[str, str]]], deploy: dict | None = None, *,
             workdir: Path) -> None:
    """Start the servers that :func:`own_servers` will be asked for with the same arguments, without
    waiting for them: tests/conftest.py starts the next own-server test's servers while the current
    test runs (own-server tests keep ~1.3 of the two cores busy; a start is ~30-60 s of both)."""
    for name, (args, env) in specs.items():
        key = _spec_key(model, name, args, env, deploy)
        if key not in _AHEAD:
            _AHEAD[key] = _launch(model, workdir, name, args, env, deploy)


def quiet_ahead(timeout: float = START_TIMEOUT_S) -> None:
    """Wait until the servers :func:`prestart` started for the next test are up (or have failed: the
    test that adopts one reports that). A start is ~30-60 s of both cores; a check that needs the host
    to itself for a moment, e.g. a burst that vLLM-Omni gathers into one wave only while no request
    comes more than 50 ms after the one before, calls this first."""
    from omni_ext.server_process import ServerStartError

    for proc in list(_AHEAD.values()):
        with contextlib.suppress(ServerStartError):
            proc.wait_ready(timeout)


#: Fixtures whose servers can be started ahead like ``own_servers`` ones: fixture name -> a function of
#: (tiny models, work directory) that starts them (not waiting) and returns an object with ``stop()``.
AHEAD_BUILDERS: dict[str, Any] = {}
_AHEAD_BUILT: dict[str, Any] = {}


def build_ahead(fixture: str, models: dict[str, Path], workdir: Path) -> None:
    """Start the servers of ``fixture`` now (its test is next); :func:`take_ahead` hands them over."""
    if fixture not in _AHEAD_BUILT:
        _AHEAD_BUILT[fixture] = AHEAD_BUILDERS[fixture](models, workdir)


def take_ahead(fixture: str) -> Any:
    """The servers :func:`build_ahead` started for ``fixture``, or None."""
    return _AHEAD_BUILT.pop(fixture, None)


def stop_prestarted() -> None:
    """Stop servers started ahead whose test never asked for them (it was deselected or skipped)."""
    while _AHEAD:
        _AHEAD.popitem()[1].stop()
    while _AHEAD_BUILT:
        _AHEAD_BUILT.popitem()[1].stop()


@contextlib.contextmanager
def own_servers(model: Path, workdir: Path, specs: dict[str, tuple[list[str], dict[str, str]]],
                deploy: dict | None = None, ready: bool = True) -> Iterator[dict[str, ServeProcess]]:
    """``vllm-omni serve`` processes for tests of their own, name -> (args, env), started together (two
    starts overlap on the two cores), or adopted from :func:`prestart`, and stopped afterwards; each has
    its storage and API data directory under ``workdir / name`` (a prestarted one: under the directory
    it was started in) and one thread per process unless its env says otherwise (``deploy``: a deploy
    YAML for each; ``ready=False``: not waited for, a test of a refused start). Their tests are marked
    ``server`` and do not use ``server_pool``, so conftest runs them before the shared pool is up (the
    pool alone holds ~19 GiB of the host's 24). A test that kills or restarts a server takes one of these
    for itself alone: none other shares it, so none depends on running before it."""
    if os.environ.get("OMNI_EXT_NO_SERVERS") == "1":
        pytest.skip("OMNI_EXT_NO_SERVERS=1: this test starts a vllm-omni server of its own")
    procs: dict[str, ServeProcess] = {}
    ahead: set[str] = set()
    try:
        for name, (args, env) in specs.items():
            proc = _AHEAD.pop(_spec_key(model, name, args, env, deploy), None)
            if proc is not None:
                ahead.add(name)
            procs[name] = proc or _launch(model, workdir, name, args, env, deploy)
        for name, proc in procs.items() if ready else ():
            proc.wait_ready(START_TIMEOUT_S)
            how = " (started ahead, during the test before)" if name in ahead else ""
            print(f"\n[servers] own server {name}: ready after {proc.ready_after_s:.1f} s{how} ({proc.log_path})")
        yield procs
    finally:
        stop_servers(procs.values())
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):  # what a server that exited left in its session
                os.killpg(proc.pid, signal.SIGKILL)


#: Seconds a test's server gets to exit after SIGTERM before its process group is SIGKILLed. omni-ext's
#: servers exit in 3-4 s; vLLM-Omni's own executor waits 15 s for its CPU workers, which do not exit on
#: its shutdown signal, before it terminates them: ~15 s at the end of every test that started one, with
#: nothing left to check.
STOP_GRACE_S = 5.0


def stop_servers(procs: Iterable[ServeProcess]) -> None:
    """Stop servers all at once, each with :data:`STOP_GRACE_S` before SIGKILL."""
    from concurrent.futures import ThreadPoolExecutor

    procs = list(procs)
    with ThreadPoolExecutor(max(1, len(procs))) as ex:
        list(ex.map(lambda proc: proc.stop(timeout=STOP_GRACE_S), procs))


def restart_server(server: ServeProcess, *, kill: bool = False) -> int | None:
    """Stop ``server`` (SIGTERM to its process group, or SIGKILL with ``kill``) and start it again in place:
    the same port, arguments, environment and so data directory, a new log beside the old one. Returns
    the old process's exit code."""
    old = server.proc
    assert old is not None, "start() first"
    if kill:
        os.killpg(old.pid, signal.SIGKILL)
        old.wait(timeout=30)
    else:
        server.stop()
    server.log_path = server.log_path.with_suffix(f".{int(server.started_at)}.log")  # type: ignore[union-attr]
    server.start().wait_ready(START_TIMEOUT_S)
    return old.returncode


#: What the processes that tests start for themselves import (torch, vLLM-Omni's diffusion package,
#: omni-ext's executor roles): loaded once by a fork server that forks each of them, instead of ~11 s
#: of imports per spawned process (four processes on two cores: ~25 s before the first collective).
PRELOAD = ("torch", "torch.distributed", "vllm_omni.diffusion.data", "vllm_omni.diffusion.distributed.cfg_parallel",
           "vllm_omni.diffusion.worker.diffusion_model_runner", "vllm_omni.plugins",
           "omni_ext.executor.role", "omni_ext.executor.pipelines", "omni_ext.executor.vae_pipeline",
           "omni_ext.models.tiny")


def process_context():
    """A ``forkserver`` multiprocessing context whose server has :data:`PRELOAD` imported (set before the
    session's fork server starts; the first caller starts it). Forking from it is safe where forking
    the test process is not: the fork server is single-threaded and has run no collective."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def options_for(preset, tiny_models: dict[str, Path] | None = None, role: str | None = None):
    """Render options for a catalog preset (tiny model paths for a cpu preset); a multi-host preset
    renders its head unless ``role`` says otherwise."""
    from omni_ext.presets.render import RenderOptions

    hosts = {"role": role or "head", "master_address": "127.0.0.1"} if preset.multi_host else {}
    if preset.device != "cpu":
        return RenderOptions(**hosts)
    model = {"wan2.1-t2v-tiny": "wan2.1-t2v", "qwen-image-tiny": "qwen-image"}[preset.model]
    return RenderOptions(model=str(tiny_models[model]) if tiny_models else f"/models/{model}", **hosts)


# ---- a model served by its Hugging Face repo id, from a hub cache (tests/test_hub_id.py) -------------
def hf_cache_model(model_dir: Path, cache_root: Path, repo_id: str, *, symlinks: bool = True) -> Path:
    """Lay the model folder ``model_dir`` (a diffusers pipeline: model_index.json and its components)
    into the Hugging Face hub cache under ``cache_root`` (what ``HF_HOME`` names) as ``repo_id``, in the
    layout huggingface_hub reads offline: ``hub/models--{org}--{name}/blobs/<sha256>``,
    ``refs/main`` (the commit) and ``snapshots/<commit>/<path>`` (relative symlinks to the blobs, as
    huggingface_hub writes them; copies with ``symlinks=False``). The commit is a 40-hex id derived
    from the files, so the same folder gives the same snapshot. Returns the snapshot folder (what
    ``snapshot_download(repo_id, local_files_only=True)`` answers)."""
    import hashlib
    import shutil

    org, sep, name = repo_id.partition("/")
    assert sep and org and name and "/" not in name, f"a repo id is 'org/name', not {repo_id!r}"
    repo = Path(cache_root) / "hub" / f"models--{org}--{name}"
    files = sorted(p for p in Path(model_dir).rglob("*") if p.is_file())
    assert any(p.name == "model_index.json" and p.parent == Path(model_dir) for p in files), \
        f"{model_dir} is not a diffusers pipeline folder (no model_index.json)"
    digests = {}
    for path in files:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        digests[path] = h.hexdigest()
    commit = hashlib.sha1("".join(f"{p.relative_to(model_dir)}\0{d}\n" for p, d in digests.items()).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for path, digest in digests.items():
        rel = path.relative_to(model_dir)
        blob, target = repo / "blobs" / digest, snapshot / rel
        if not blob.exists():
            shutil.copyfile(path, blob)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        if symlinks:
            target.symlink_to(os.path.relpath(blob, target.parent))
        else:
            shutil.copyfile(blob, target)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def hosts(fixture: str, tiny_models, tmp_path_factory) -> Iterator:
    """A multi-machine fixture's servers (``AHEAD_BUILDERS[fixture]``): started ahead during the test before
    (tests/conftest.py) or now, waited for, stopped after its test."""
    if os.environ.get("OMNI_EXT_NO_SERVERS") == "1":
        pytest.skip("OMNI_EXT_NO_SERVERS=1: this test starts vllm-omni servers of its own")
    mh = take_ahead(fixture) or AHEAD_BUILDERS[fixture](tiny_models, tmp_path_factory.mktemp(fixture))
    try:
        yield mh.wait_ready(START_TIMEOUT_S)
    finally:
        mh.stop()


@contextlib.contextmanager
def serve_models(workdir: Path, specs: dict[str, tuple[str, list[str], dict[str, str]]]
                 ) -> Iterator[dict[str, ServeProcess]]:
    """``vllm-omni serve MODEL`` processes, name -> (model, args, env), where MODEL is anything vLLM-Omni
    accepts (a folder, or a Hugging Face repo id that the env's ``HF_HOME``/``HF_HUB_OFFLINE`` resolve),
    started together, waited for, and stopped afterwards; each with its storage and API data directory
    under ``workdir / name`` and one thread per process, like :func:`own_servers` (whose servers all
    serve one tiny model folder). Tests that use it are marked ``server``."""
    if os.environ.get("OMNI_EXT_NO_SERVERS") == "1":
        pytest.skip("OMNI_EXT_NO_SERVERS=1: this test starts vllm-omni servers of its own")
    procs: dict[str, ServeProcess] = {}
    try:
        for name, (model, args, env) in specs.items():
            procs[name] = _launch(model, workdir, name, args, env, None)  # type: ignore[arg-type] (str(model))
        for name, proc in procs.items():
            proc.wait_ready(START_TIMEOUT_S)
            print(f"\n[servers] {name} ({proc.model}): ready after {proc.ready_after_s:.1f} s ({proc.log_path})")
        yield procs
    finally:
        stop_servers(procs.values())
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
