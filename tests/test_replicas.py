"""Scale-out on vLLM-Omni's own replicas: late, cost-aware binding at the head (``replica-dispatch``),
no hang when a remote replica dies (``replica-send-nonblocking``), admission over the live replicas.

- vLLM-Omni's real ``StagePool`` with recording replica clients: stock binds every request on
  arrival, round robin; with the patch only as many as there are free slots, longest first, the next
  when one finishes, an aborted queued request never, a failed send once more elsewhere.
- A real ZMQ PUSH socket with no peer: the stock blocking send hangs; the patched one raises.
- Real servers of these tests' own: two replicas in one server (deploy YAML ``num_replicas: 2``), and the
  multi-machine mode on loopback (a head with its own replica and two headless replicas, Wan; a head
  and one headless replica, Qwen-Image), driven with the official ``openai`` SDK: every replica gets
  work, killing a replica mid-burst fails only its job (``replica_lost``) while the others finish,
  ``/health`` stays 200, the head's admission follows the live replicas, a restarted headless
  replica rejoins and gets work again.
"""

from __future__ import annotations

import asyncio
import base64
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from tests.helpers import events_mark, options_for, placements, until
from tests.helpers import AHEAD_BUILDERS, REPLICAS2_DEPLOY, hosts
from tests.media import decode_mp4, decode_png

TUNED = "omni_ext.executor.TunedExecutor"
#: The head's --omni-heartbeat-timeout in the multi-machine test: short, so that a killed replica is
#: detected within the test, but not shorter than a stall of this 2-core host. At 6 s a clean suite run
#: of 12-05 lost every replica, the head's own too, 5 s after its burst: the next test's servers were
#: starting ahead, the head logged nothing for 5 s, and vLLM-Omni detached all three as dead.
HEARTBEAT_S = 15.0


# ---- the real StagePool with recording clients ---------------------------------------------------------
class Client:
    """Stands in for a replica's ``StageDiffusionClient``: records what the pool sends it."""

    stage_type = "diffusion"
    final_output = True

    def __init__(self, index: int) -> None:
        self.request_address = f"tcp://127.0.0.1:{40000 + index}"
        self.sent: list[str] = []
        self.params: dict[str, object] = {}
        self.aborted: list[str] = []
        self.dead = False

    async def add_request_async(self, request_id, prompt, params, **kwargs) -> None:
        if self.dead:
            from vllm.v1.engine.exceptions import EngineDeadError

            raise EngineDeadError()
        self.sent.append(request_id)
        self.params[request_id] = params

    async def abort_requests_async(self, request_ids) -> None:
        self.aborted.extend(request_ids)


def request_state(frames: int):
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    sp = OmniDiffusionSamplingParams(height=64, width=64, num_frames=frames, num_inference_steps=20, guidance_scale=4.0)
    return SimpleNamespace(sampling_params_list=[sp])


@pytest.fixture
def pool_and_clients() -> Iterator[tuple]:
    pytest.importorskip("vllm_omni")
    from omni_ext.dispatch.replicas import DISPATCH, attached
    from omni_ext.patches import replica_dispatch
    from omni_ext.scheduler.config import SchedulerConfig
    from vllm_omni.engine.stage_pool import StagePool

    replica_dispatch.apply()
    saved = (DISPATCH.settings.slots_per_replica, DISPATCH.settings.pipeline, DISPATCH.settings.config)
    # Longest first: under the deadline order a short request that waited past its (tiny, learned
    # from a release 0.1 s after its bind) deadline would go first, which depends on the host's load.
    DISPATCH.configure(1, "WanPipeline", SchedulerConfig(settle_s=0.05, order="cost"))
    clients = [Client(0), Client(1)]
    pool = StagePool(0, list(clients))
    yield pool, clients
    DISPATCH.configure(*saved)
    if attached(pool) is not None:
        attached(pool).close()  # this process's dispatch must not count it after the test
    assert DISPATCH.capacity() is None


def submit_burst(pool, frames: list[int], submit) -> None:
    async def burst() -> None:
        for i, f in enumerate(frames):
            await submit(pool, f"r{i}-{f}", request_state(f), {"prompt": "fox"})

    asyncio.run(burst())


def test_stock_round_robin_binds_on_arrival(pool_and_clients) -> None:
    """The bug: vLLM-Omni binds every request at once, in turn, whatever it costs."""
    from vllm_omni.engine.stage_pool import StagePool

    pool, (c0, c1) = pool_and_clients
    stock = StagePool.submit_initial.__wrapped__
    submit_burst(pool, [81, 17, 81, 17, 81, 17], submit=stock)
    assert c0.sent == ["r0-81", "r2-81", "r4-81"] and c1.sent == ["r1-17", "r3-17", "r5-17"]


def test_dispatch_binds_when_a_slot_frees_longest_first(pool_and_clients) -> None:
    pool, (c0, c1) = pool_and_clients

    async def scenario() -> None:
        submitted: dict[str, float] = {}
        for i, f in enumerate([17, 81, 17, 81, 17, 81]):
            submitted[f"r{i}-{f}"] = time.monotonic()
            await pool.submit_initial(f"r{i}-{f}", request_state(f), {"prompt": "fox"})
        assert c0.sent == c1.sent == []  # an idle pool lets the burst arrive whole (settle_s)
        await asyncio.sleep(0.1)
        await asyncio.sleep(0)  # the send tasks
        assert sorted(c0.sent + c1.sent) == ["r1-81", "r3-81"]  # one per replica, the longest first
        from omni_ext.scheduler.priority import request_waited_s

        # The replica's executor is told how long the request waited here (aging, no second settle):
        # the settle (0.05 s) from the burst's first arrival, less how much later this one arrived
        # (on a busy host the six submits took 9 ms), in whole ms as sent (a18: 0.049).
        sent = c0.sent[0]
        late = submitted[sent] - submitted["r0-17"]
        assert request_waited_s(c0.params[sent]) >= 0.045 - late
        await pool.abort_requests(["r4-17"])  # queued: leaves the queue, never sent
        pool.release_binding("r4-17")
        first = c0.sent[0]
        pool.release_binding(first)  # replica 0's job finished: its slot takes the next longest
        await asyncio.sleep(0.01)
        assert c0.sent == [first, "r5-81"] and len(c1.sent) == 1
        assert pool.get_bound_replica_id("r5-81") == 0  # vLLM-Omni's own binding table, for aborts
        pool.release_binding(c1.sent[0])
        await asyncio.sleep(0.01)
        assert len(c1.sent) == 2 and c1.sent[1] in ("r0-17", "r2-17")

    asyncio.run(scenario())


def test_a_failed_send_goes_once_to_another_replica(pool_and_clients) -> None:
    pool, (c0, c1) = pool_and_clients
    c0.dead = True

    async def scenario() -> None:
        await pool.submit_initial("r0-81", request_state(81), {"prompt": "fox"})
        await asyncio.sleep(0.1)
        for _ in range(3):
            await asyncio.sleep(0)
        assert c1.sent == ["r0-81"] and pool.get_bound_replica_id("r0-81") == 1

    asyncio.run(scenario())


def test_a_request_waits_for_the_replica_that_meets_its_deadline(pool_and_clients) -> None:
    """Issue 19 item 4: replica 1 is free but three times slower; replica 0 runs a 1 s job. A 1 s
    request due in 2.5 s would end at 3 s on replica 1: it waits for replica 0, while a request with
    time to spare behind it takes replica 1 at once."""
    from omni_ext.dispatch.replicas import DISPATCH
    from omni_ext.scheduler.config import SchedulerConfig
    from omni_ext.scheduler.priority import DEADLINE_ARG

    pool, (c0, c1) = pool_and_clients
    DISPATCH.configure(1, "WanPipeline", SchedulerConfig(settle_s=0.0, seconds_per_unit=1 / 3520))  # "slo"; 1 s a job
    d = DISPATCH.dispatcher_of(pool)
    d.speed[1] = 3.0

    def state(deadline_s: float | None):
        st = request_state(17)
        st.sampling_params_list[0].extra_args = {DEADLINE_ARG: deadline_s} if deadline_s else {}
        return st

    async def scenario() -> None:
        await pool.submit_initial("running", state(None), {"prompt": "fox"})
        await asyncio.sleep(0)  # the send task
        assert c0.sent == ["running"]  # earliest finish: the fast replica
        await pool.submit_initial("due", state(2.5), {"prompt": "fox"})
        await pool.submit_initial("spare", state(60.0), {"prompt": "fox"})
        await asyncio.sleep(0.05)
        assert c1.sent == ["spare"] and c0.sent == ["running"]  # "due" waits on the head
        pool.release_binding("running")
        await asyncio.sleep(0.01)
        assert c0.sent == ["running", "due"]

    asyncio.run(scenario())


# ---- the blocking send ---------------------------------------------------------------------------------
def test_send_to_a_replica_that_is_gone_blocks_stock_and_raises_patched() -> None:
    zmq = pytest.importorskip("zmq")
    from vllm.v1.engine.exceptions import EngineDeadError

    from omni_ext.patches.replica_send import SEND_WAIT_MS, NonBlockingSocket, _unreachable_error

    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    try:
        done = threading.Event()
        threading.Thread(target=lambda: (push.send(b"stock"), done.set()), daemon=True).start()
        assert not done.wait(1.5), "a blocking PUSH send with no peer should wait (the stock hang)"
        pull = ctx.socket(zmq.PULL)
        pull.connect(f"tcp://127.0.0.1:{port}")  # a peer appears: the stuck send goes through
        assert done.wait(5) and pull.recv() == b"stock"
        pull.close(linger=0)
        time.sleep(0.5)  # ZMQ notices the peer is gone
        sock = NonBlockingSocket(push, "replica 1 (test)", _unreachable_error())
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="no connected replica"):
            sock.send(b"patched")
        assert time.monotonic() - t0 < SEND_WAIT_MS / 1000 + 1.0
        pull = ctx.socket(zmq.PULL)
        pull.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)
        sock.send(b"ok")  # with a peer it sends as before
        assert pull.recv() == b"ok"
        pull.close(linger=0)
    finally:
        push.close(linger=0)
        ctx.term()


# ---- real servers ----------------------------------------------------------------------------------------
def post_video(url: str, frames: int, steps: int, seed: int) -> str:
    form = {"prompt": "a red fox running through fresh snow", "negative_prompt": "blurry", "size": "64x64",
            "num_frames": str(frames), "num_inference_steps": str(steps), "guidance_scale": "4.0", "seed": str(seed),
            "fps": "8"}
    resp = requests.post(url + "/v1/videos", files={k: (None, v) for k, v in form.items()}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


def wait_jobs(url: str, ids: list[str], timeout: float = 240.0) -> dict[str, dict]:
    out: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(ids) and time.monotonic() < deadline:
        for vid in ids:
            if vid not in out:
                body = requests.get(f"{url}/v1/videos/{vid}", timeout=30).json()
                if body["status"] in ("completed", "failed"):
                    out[vid] = {**body, "_t": time.monotonic()}
        time.sleep(0.2)
    assert len(out) == len(ids), f"jobs not finished after {timeout:.0f} s: {set(ids) - set(out)}"
    return out


def dispatches(server, after: float = 0.0) -> list[tuple[str, int]]:
    """(engine request id, stage-0 replica) the head's dispatcher bound, in order, from the server's
    placement journal (``GET /v1/omni_ext/placements``), after the cursor ``after`` (:func:`events_mark`)."""
    return [(e["request_id"], e["replica"]) for e in placements(server, after, kind="bind") if e["stage"] == 0]


def bound_jobs(server, job_ids: list[str]) -> dict[str, int]:
    """Which of ``job_ids`` the head has bound so far, and to which replica (the latest binding)."""
    out = {}
    for rid, r in dispatches(server):
        for j in job_ids:
            if rid.startswith(j + "-"):
                out[j] = r
    return out


def replica_of(server, job_id: str) -> int:
    return next(r for rid, r in dispatches(server) if rid.startswith(job_id + "-"))


def sdk(url: str):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.server
@pytest.mark.own_servers("wan2.1-t2v", {"rep2": ([], {})}, deploy=REPLICAS2_DEPLOY)  # two replicas of one worker each
def test_two_replicas_in_one_server_share_a_burst_and_survive_losing_one(own) -> None:
    """One scenario on a server of this test's own (it ends by killing a replica, so nothing shares it):
    admission counts both replicas' slots, a burst reaches both, then SIGKILL of one replica process
    while both run a long job fails only that job and the server keeps serving."""
    import psutil

    server = own["rep2"]
    assert "omni-ext scheduler (API): 2 slot(s)" in server.log_text()
    # A burst through the official SDK: every replica gets work.
    before = events_mark(server)
    client = sdk(server.url)
    extra = {"num_inference_steps": 8, "negative_prompt": "blurry", "fps": 8}
    jobs = [client.videos.create(prompt=f"a fox {i}", size="64x64", seconds="1",
                                 extra_body={**extra, "num_frames": f, "seed": i}) for i, f in enumerate([33, 9, 33, 9])]
    ends = wait_jobs(server.url, [j.id for j in jobs])
    assert all(e["status"] == "completed" for e in ends.values()), ends
    for j in jobs[:2]:
        assert decode_mp4(client.videos.download_content(j.id).read())[1:] == (64, 64)
    sent = dispatches(server, before)
    assert {r for _, r in sent} == {0, 1}, sent
    # A replica dies mid-job.
    ids = [post_video(server.url, 33, 8, i) for i in range(3)]  # ~15 s each in bfloat16
    until(lambda: len(bound_jobs(server, ids)) >= 2, 60, "two jobs bound")
    log = server.log_text()
    victim_replica = replica_of(server, ids[0])  # replicas 0 and 1 were started in that order
    pids = [int(p) for p in re.findall(r"loaded in StageDiffusionProc \(pid (\d+)", log)]
    procs = sorted((psutil.Process(p) for p in pids if psutil.pid_exists(p)), key=lambda p: p.create_time())
    assert len(procs) == 2, pids
    victim = procs[victim_replica]
    for p in [*victim.children(recursive=True), victim]:
        p.kill()
    ends = wait_jobs(server.url, ids, timeout=180)
    lost = ends[ids[0]]
    assert lost["status"] == "failed" and lost["error"]["code"] == "replica_lost", lost
    assert all(ends[i]["status"] == "completed" for i in ids[1:]), ends
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    after = wait_jobs(server.url, [post_video(server.url, 9, 2, 99)], timeout=120)
    assert next(iter(after.values()))["status"] == "completed"


# ---- multi-machine mode on loopback --------------------------------------------------------------------
def _image_hosts(models: dict[str, Path], tmp: Path):
    """Tiny Qwen-Image in multi-machine mode: a head and one headless replica (started, not waited for)."""
    from omni_ext.server_process import MultiHostServer

    return MultiHostServer(str(models["qwen-image"]), replicas=1,
                           args=["--enforce-eager", "--distributed-executor-backend", TUNED], env={"OMP_NUM_THREADS": "1"},
                           head_env={"OMNI_EXT_API_DATA_DIR": str(tmp / "api"),
                                     "VLLM_OMNI_SERVER_STORAGE__PATH": str(tmp / "storage")}, log_dir=tmp).start()


AHEAD_BUILDERS["image_hosts"] = _image_hosts


@pytest.fixture
def image_hosts(tiny_models, tmp_path_factory) -> Iterator:
    yield from hosts("image_hosts", tiny_models, tmp_path_factory)


@pytest.mark.server
def test_multihost_images_through_the_head(image_hosts) -> None:
    mh = image_hosts
    client = sdk(mh.url)

    def one(i: int) -> bytes:
        out = client.images.generate(prompt=f"a lighthouse {i}", size="64x64",
                                     extra_body={"num_inference_steps": 4, "seed": i})
        return base64.b64decode(out.data[0].b64_json)

    with ThreadPoolExecutor(4) as ex:
        pngs = list(ex.map(one, range(4)))
    assert all(decode_png(p).shape[:2] == (64, 64) for p in pngs)
    assert {r for _, r in dispatches(mh.head)} == {0, 1}


#: The cpu two-host preset whose rendered commands the multi-machine Wan servers run.
TWO_HOST_PRESET = "wan2.1-t2v-tiny.cpu.2x1.throughput"
_MASTER_FLAGS = ("--stage-id", "--omni-master-address", "--omni-master-port")


def _two_hosts(tiny_models: dict[str, Path], tmp: Path):
    """The cpu two-host preset's commands as ``omni-ext presets render`` gives them (tiny Wan, the
    TunedExecutor through its deploy YAML): the head, with its own replica, and the replica command
    run twice, as on two replica hosts, for one test: it kills and restarts one. Plus ``--dtype
    float32`` (the test's job sizes assume it) and the head's short heartbeat time-out. Started, not
    waited for."""
    from dataclasses import replace

    from omni_ext.presets import load_catalog
    from omni_ext.presets.render import format_rendered, render
    from omni_ext.server_process import MultiHostServer

    preset = load_catalog()[TWO_HOST_PRESET]
    head, replica = (render(preset, replace(options_for(preset, tiny_models, role), master_port=1))
                     for role in ("head", "replica"))
    assert format_rendered(head, "yaml") == format_rendered(replica, "yaml") and head.env == replica.env
    deploy = tmp / "deploy.yaml"
    deploy.write_text(format_rendered(head, "yaml"))
    flags = list(head.flags)
    flags[flags.index("--deploy-config") + 1] = str(deploy)
    for flag in _MASTER_FLAGS:  # MultiHostServer gives every process these, with a free master port
        at = flags.index(flag)
        del flags[at:at + 2]
    # The replica command is the head's with --headless and multi-process workers, as MultiHostServer runs it.
    assert replica.headless and not head.headless
    assert [f for f in replica.flags if f not in flags and f not in head.flags] == ["--worker-backend", "multi_process"]
    mh = MultiHostServer(str(tiny_models["wan2.1-t2v"]), replicas=2, args=[*flags, "--dtype", "float32"],
                         env={**head.env, "OMP_NUM_THREADS": "1"}, head_args=["--omni-heartbeat-timeout", str(HEARTBEAT_S)],
                         head_env={"OMNI_EXT_API_DATA_DIR": str(tmp / "api"),
                                   "VLLM_OMNI_SERVER_STORAGE__PATH": str(tmp / "storage")}, log_dir=tmp)
    return mh.start()


AHEAD_BUILDERS["multihost"] = _two_hosts


@pytest.fixture
def multihost(tiny_models, tmp_path_factory) -> Iterator:
    yield from hosts("multihost", tiny_models, tmp_path_factory)


@pytest.mark.server
def test_multihost_burst_then_replica_loss_fails_only_its_job_then_it_rejoins(multihost) -> None:
    """One scenario on the multi-machine servers of the cpu two-host preset (it kills and restarts a
    headless replica, so no other test shares them and none depends on running before it): the
    preset's request defaults give its video through the head, a burst reaches every replica, then one
    headless replica is SIGKILLed mid-job, and restarted."""
    from omni_ext.presets import load_catalog

    url = multihost.url
    client = sdk(url)
    defaults = load_catalog()[TWO_HOST_PRESET].request_defaults
    fields = {"prompt": "a red fox in snow", "seed": "7", **{k: str(v) for k, v in defaults.items()}}
    resp = requests.post(url + "/v1/videos/sync", files={k: (None, v) for k, v in fields.items()}, timeout=300)
    assert resp.status_code == 200, resp.text[:500]
    assert decode_mp4(resp.content) == (5, 32, 32)
    for replica in multihost.headless:
        assert "--headless" in replica.log_text().splitlines()[0]
        assert "omni-ext TunedExecutor: 1 worker(s)" in replica.log_text()
    before = events_mark(multihost.head)
    extra = {"num_inference_steps": 8, "negative_prompt": "blurry", "fps": 8}
    jobs = [client.videos.create(prompt=f"a fox {i}", size="64x64", seconds="1",
                                 extra_body={**extra, "num_frames": f, "seed": i})
            for i, f in enumerate([33, 9, 33, 9, 33, 9])]
    ends = wait_jobs(multihost.url, [j.id for j in jobs])
    assert all(e["status"] == "completed" for e in ends.values()), ends
    assert decode_mp4(client.videos.download_content(jobs[0].id).read()) == (33, 64, 64)
    assert {r for _, r in dispatches(multihost.head, before)} == {0, 1, 2}
    assert "omni-ext scheduler (API): a replica joined; admission now counts 3 slot(s)" in multihost.head.log_text()
    # A headless replica dies while every replica runs a long job.
    ids = [post_video(url, 33, 200, 10 + i) for i in range(3)]  # long jobs: one per replica
    until(lambda: len(bound_jobs(multihost.head, ids)) >= 3, 60, "three jobs bound")
    on = {i: replica_of(multihost.head, i) for i in ids}
    victim_index = 0
    dead = multihost.replica_id(victim_index)
    victim_job = next(i for i, r in on.items() if r == dead)  # the job running on that headless replica
    healthy = []
    stop = threading.Event()

    def watch_health() -> None:
        while not stop.is_set():
            healthy.append(requests.get(url + "/health", timeout=10).status_code)
            time.sleep(0.5)

    watcher = threading.Thread(target=watch_health, daemon=True)
    watcher.start()
    killed_at = time.monotonic()
    multihost.kill_replica(victim_index)
    more = [post_video(url, 9, 4, 20 + i) for i in range(3)]  # new work while the loss is detected
    lost = wait_jobs(url, [victim_job], timeout=HEARTBEAT_S + 60)[victim_job]
    assert lost["status"] == "failed" and lost["error"]["code"] == "replica_lost", lost
    assert lost["_t"] - killed_at <= HEARTBEAT_S + 20, "lost job not failed within the heartbeat timeout"
    # The other replicas' long jobs run on through the loss (not waited for to their end, 200 steps of
    # 33 frames on two cores: deleted once seen unharmed), and the new work completes beside them.
    survivors = [i for i in ids if i != victim_job]
    states = {i: requests.get(f"{url}/v1/videos/{i}", timeout=30).json() for i in survivors}
    assert all(b["status"] in ("in_progress", "completed") for b in states.values()), states
    for i in survivors:
        assert requests.delete(f"{url}/v1/videos/{i}", timeout=60).status_code == 200
    ends = wait_jobs(url, more, timeout=240)
    stop.set()
    watcher.join(timeout=15)
    assert all(ends[i]["status"] == "completed" for i in more), ends
    assert set(healthy) == {200}, healthy
    head_log = multihost.head.log_text()
    assert all(r != dead for rid, r in dispatches(multihost.head) if any(rid.startswith(i + "-") for i in more))
    assert "admission now counts 2 slot(s)" in head_log
    # The replica's host comes back: it registers again and gets work.
    multihost.restart_replica(victim_index, timeout=300)
    before = events_mark(multihost.head)
    ids = [post_video(url, 9, 8, 40 + i) for i in range(6)]  # short: only where they run matters here
    ends = wait_jobs(url, ids)
    assert all(e["status"] == "completed" for e in ends.values()), ends
    replicas = {r for _, r in dispatches(multihost.head, before)}
    rejoined = multihost.replica_id(victim_index)
    assert len(replicas) == 3 and rejoined in replicas, (replicas, rejoined)
    assert "admission now counts 3 slot(s)" in multihost.head.log_text().split("attached remote replica")[-1]
