"""The patch registry: data that matches the code, diffs that still apply, guards that work."""

from __future__ import annotations

import logging
import queue
import subprocess
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from omni_ext import patches as reg
from tests.helpers import process_context

ROOT = Path(__file__).resolve().parents[1]


def _omni_src() -> Path:
    import vllm_omni

    return Path(vllm_omni.__file__).resolve().parents[1]


@pytest.mark.parametrize("patch", reg.PATCHES, ids=lambda p: p.name)
def test_registry_entry_is_complete(patch: reg.Patch) -> None:
    for field in ("name", "target", "why", "versions", "where", "diff", "test", "removal", "upstream", "apply"):
        assert getattr(patch, field), f"{patch.name}: empty {field}"
    assert patch.where in ("worker", "api", "tuned-worker")
    assert (ROOT / patch.diff).is_file()
    test_file, _, test_name = patch.test.partition("::")
    assert f"def {test_name}(" in (ROOT / test_file).read_text(), patch.test
    for target in patch.targets:
        reg.resolve(target)  # the target exists in the installed vLLM-Omni
    assert reg.omni_version() and patch.applies_to(reg.omni_version())


def test_names_are_unique() -> None:
    names = [p.name for p in reg.PATCHES]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("patch", reg.PATCHES, ids=lambda p: p.name)
def test_upstream_diff_applies_to_installed_vllm_omni(patch: reg.Patch) -> None:
    proc = subprocess.run(
        ["git", "apply", "--check", "-p1", "--unsafe-paths", str(ROOT / patch.diff)],
        cwd=_omni_src(), capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_version_mismatch_is_skipped_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    calls = []
    probe = replace(reg.PATCHES[0], name="probe", versions=">=99", apply="builtins:print")
    state = reg.PatchState()
    with caplog.at_level(logging.WARNING, logger="omni_ext.patches"):
        first = reg.apply_patches({"worker"}, patches=(probe,), version="0.30.0", state=state)
        second = reg.apply_patches({"worker"}, patches=(probe,), version="0.30.0", state=state)
    assert first["probe"].startswith("skipped: vLLM-Omni 0.30.0 is outside >=99")
    assert second == first
    warnings = [r for r in caplog.records if "probe skipped" in r.getMessage()]
    assert len(warnings) == 1
    assert not calls


def test_matching_version_applies_once_and_role_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    hits: list[int] = []
    import omni_ext.patches as mod

    monkeypatch.setattr(mod, "resolve", lambda q: (lambda: hits.append(1)))
    api_only = replace(reg.PATCHES[0], name="api-probe", where="api", versions="==0.30.0")
    state = reg.PatchState()
    assert reg.apply_patches({"worker"}, patches=(api_only,), version="0.30.0", state=state) == {}
    assert reg.apply_patches({"worker", "api"}, patches=(api_only,), version="0.30.0", state=state) == {"api-probe": "applied"}
    reg.apply_patches({"worker", "api"}, patches=(api_only,), version="0.30.0", state=state)
    assert hits == [1]


def test_disable_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(reg.DISABLE_ENV, "probe")
    probe = replace(reg.PATCHES[0], name="probe", apply="builtins:print")
    out = reg.apply_patches({"worker"}, patches=(probe,), version="0.30.0", state=reg.PatchState())
    assert out["probe"].startswith("skipped: disabled")


def test_process_roles_reads_the_tuned_worker_flag_without_importing_the_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from omni_ext.executor.role import Role

    assert Role().tuned_worker is False  # the field the TunedExecutor worker sets
    monkeypatch.delitem(sys.modules, reg.ROLE_MODULE, raising=False)
    assert "tuned-worker" not in reg.process_roles()
    assert reg.ROLE_MODULE not in sys.modules  # read, never imported
    fake = SimpleNamespace(ROLE=SimpleNamespace(tuned_worker=False))
    monkeypatch.setitem(sys.modules, reg.ROLE_MODULE, fake)
    assert "tuned-worker" not in reg.process_roles()
    fake.ROLE.tuned_worker = True
    assert {"worker", "tuned-worker"} <= reg.process_roles()
    hits: list[str] = []
    monkeypatch.setattr(reg, "resolve", lambda q: (lambda: hits.append(q)))
    tuned = replace(reg.PATCHES[0], name="tuned-probe", where="tuned-worker")
    assert reg.apply_patches(patches=(tuned,), version="0.30.0", state=reg.PatchState()) == {"tuned-probe": "applied"}
    assert hits == [tuned.apply]


def _activation(tuned: bool, results) -> None:
    """In a fresh worker process (forked from the tests' fork server, as the TunedExecutor's CPU
    workers fork from theirs): vLLM-Omni's general-plugin loading, after the flag if ``tuned``."""
    if tuned:
        from omni_ext.executor.role import ROLE

        ROLE.tuned_worker = True
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
    from vllm_omni.plugins import load_omni_general_plugins

    from omni_ext.patches import _STATE, is_patched

    load_omni_general_plugins()  # as the TunedExecutor worker does, after setting the flag
    results.put({"applied": dict(_STATE.applied), "runner_patched": is_patched(DiffusionModelRunner.__init__)})


@pytest.mark.spawns
@pytest.mark.parametrize("tuned", [True, False], ids=["tuned-worker", "other-worker"])
def test_plugin_activation_applies_tuned_worker_patches_only_when_flagged(tuned: bool) -> None:
    """vLLM-Omni's general-plugin entry point (register_omni -> _activate -> apply_patches) applies the
    tuned-worker patches in a process that set ROLE.tuned_worker first, and only there."""
    ctx = process_context()
    results = ctx.Queue()
    proc = ctx.Process(target=_activation, args=(tuned, results))
    proc.start()
    out = results.get(timeout=300)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    tuned_patches = {p.name for p in reg.PATCHES if p.where == "tuned-worker"}
    assert tuned_patches
    if tuned:
        assert all(out["applied"].get(n) == "applied" for n in tuned_patches), out
    else:
        assert not tuned_patches & set(out["applied"]), out
    assert out["runner_patched"] is tuned


def test_patch_attr_replaces_once_and_keeps_the_stock_object() -> None:
    class Owner:
        def f(self) -> str:
            return "stock"

    stock = Owner.f

    def make():
        original = Owner.f

        def f(self) -> str:
            return "patched+" + original(self)

        return f

    assert reg.patch_attr(Owner, "f", make()) is True
    assert reg.patch_attr(Owner, "f", make()) is False  # a second apply does not wrap twice
    assert Owner().f() == "patched+stock"
    assert reg.is_patched(Owner.f) and Owner.f.__wrapped__ is stock and not reg.is_patched(stock)


def test_multi_target_patches_name_every_object_they_replace() -> None:
    by_name = {p.name: p for p in reg.PATCHES}
    assert by_name["openai-routes"].targets == (
        "vllm_omni.entrypoints.openai.api_server:router",
        "vllm_omni.entrypoints.openai.api_server:omni_init_app_state",
    )
    from omni_ext.models.families import cancellable_classes

    assert by_name["cancel-at-step"].targets == cancellable_classes()


def _fake_worker() -> SimpleNamespace:
    results: list = []
    return SimpleNamespace(
        gpu_id=0,
        _async_output_queue=queue.Queue(),
        _enqueue_result=results.append,
        _async_output_done=threading.Condition(),
        _async_output_pending=1,
        results=results,
    )


def test_async_output_loop_bug_and_fix() -> None:
    """Stock loop dies at once on a host without an accelerator; the patched one delivers the output."""
    from vllm_omni.diffusion.data import AsyncOutputKind, DiffusionOutput
    from vllm_omni.diffusion.ipc import unpack_diffusion_output_shm
    from vllm_omni.diffusion.worker.diffusion_worker import WorkerProc

    from omni_ext.patches import async_output

    assert torch.accelerator.current_accelerator() is None  # this test is about CPU-only hosts
    async_output.apply()
    async_output.apply()  # idempotent
    patched = WorkerProc._async_output_loop
    stock = patched.__wrapped__

    w = _fake_worker()
    with pytest.raises(AttributeError):
        stock(w)  # the bug: current_accelerator() is None

    w = _fake_worker()
    out = DiffusionOutput(output=torch.arange(12, dtype=torch.float32).reshape(3, 4))
    w._async_output_queue.put((out, "id-1", None))
    w._async_output_queue.put(None)
    t = threading.Thread(target=patched, args=(w,))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    [msg] = w.results
    assert msg.kind == AsyncOutputKind.OUTPUT_READY and msg.async_output_id == "id-1" and msg.error is None
    assert w._async_output_pending == 0
    received = unpack_diffusion_output_shm(msg.output)  # what the executor does on the other side
    assert torch.equal(received.output, torch.arange(12, dtype=torch.float32).reshape(3, 4))


# --------------------------------------------------------------------------------------------------
# idle-poll-backoff: an idle stock server wakes ~2000 times a second; with the patch a few hundred
# --------------------------------------------------------------------------------------------------
def _wakeups(pid: int) -> int:
    """Context switches so far of the threads of ``pid`` that poll (each idle poll is one sleep/wake).

    gloo's own TCP loop threads (about 120 wake-ups/s each in a one-worker server) are left out:
    they are torch's, not the poll loops this patch is about."""
    return sum(n for name, n in _threads(pid) if name != "gloo_tcp_loop")


def _threads(pid: int) -> list[tuple[str, int]]:
    """(name, context switches so far) of each live thread of ``pid``."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            switches = sum(int(line.split()[1]) for line in (task / "status").read_text().splitlines()
                           if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))
        except OSError:
            continue  # a thread that ended meanwhile
        out.append((name, switches))
    return out


def test_idle_server_cpu_bug_and_fix(server_pool) -> None:
    import time

    patched, stock = server_pool.get("wan", quiet=True), server_pool.get("wan-stock")
    time.sleep(1.5)  # past the 50 ms "hot" window of any earlier request, and the second before deep idle
    pids = {"patched": patched.proc.pid, "stock": stock.proc.pid}
    start = {k: _wakeups(p) for k, p in pids.items()}
    t0 = time.monotonic()
    time.sleep(3.0)
    dt = time.monotonic() - t0
    rate = {k: (_wakeups(p) - start[k]) / dt for k, p in pids.items()}
    # Stock: loops sleeping 1 ms -> ~1000-2000 wake-ups/s (fewer if the host is busy).
    # Patched, nothing in flight for over a second: 100 ms polls -> a few dozen/s with the server's
    # other threads (10 ms polls, the cadence while a request is in flight, gave ~100-250/s).
    assert rate["stock"] > 10 * rate["patched"], rate
    assert rate["patched"] < 80, rate


# --------------------------------------------------------------------------------------------------
# gloo-shared-device: one gloo event-loop thread per worker instead of one per process group
# --------------------------------------------------------------------------------------------------
def _gloo_loops(pid: int) -> dict[int, tuple[int, int]]:
    """``{process id: (gloo_tcp_loop threads, their context switches so far)}`` over the server's
    process tree (API process and worker processes)."""
    import psutil

    out = {}
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        loops = [n for name, n in _threads(proc.pid) if name == "gloo_tcp_loop"]
        if loops:
            out[proc.pid] = (len(loops), sum(loops))
    return out


def _gloo_rank(rank: int, port: int, results) -> None:
    """One rank of test_gloo_shared_device_groups_still_talk (spawned: patches this process only)."""
    import os

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from omni_ext.patches import gloo_device

    gloo_device.apply()
    gloo_device.apply()  # idempotent
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    groups = [dist.new_group([0, 1], backend="gloo") for _ in range(6)]
    sums = []
    for i, g in enumerate(groups):
        out = [torch.zeros(4) for _ in range(2)]
        dist.all_gather(out, torch.full((4,), float(10 * i + rank)), group=g)
        sums.append(float(torch.stack(out).sum()))
    loops = sum(1 for name, _ in _threads(os.getpid()) if name == "gloo_tcp_loop")
    backend = groups[0]._get_backend(torch.device("cpu"))
    results.put((rank, sums, loops, isinstance(backend, c10d.ProcessGroupGloo)))
    dist.destroy_process_group()


@pytest.mark.spawns
def test_gloo_shared_device_groups_still_talk() -> None:
    """Seven gloo groups (WORLD + 6) on the shared device: collectives on each are right, one loop
    thread per process, and torch's isinstance checks still see a ProcessGroupGloo."""
    from omni_ext.server_process import free_port

    ctx = process_context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (results.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in (0, 1):
        sums, loops, is_gloo = got[rank]
        assert sums == [4 * (20 * i + 1) for i in range(6)]  # 4 x (10i + 0) + 4 x (10i + 1)
        assert loops == 1 and is_gloo


def test_gloo_loop_threads_bug_and_fix(server_pool) -> None:
    """Stock: a worker has one gloo loop thread per process group (~19), each waking every 10 ms.
    Patched: one per worker process; the servers still serve (every other test uses them)."""
    import time

    patched, stock = server_pool.get("wan", quiet=True), server_pool.get("wan-stock")
    before = {"patched": _gloo_loops(patched.proc.pid), "stock": _gloo_loops(stock.proc.pid)}
    t0 = time.monotonic()
    time.sleep(2.0)
    dt = time.monotonic() - t0
    after = {"patched": _gloo_loops(patched.proc.pid), "stock": _gloo_loops(stock.proc.pid)}
    assert before["stock"] and before["patched"], before  # each server has a worker with gloo groups
    assert all(n >= 10 for n, _ in before["stock"].values()), before  # the bug: a loop per group
    assert all(n == 1 for n, _ in before["patched"].values()), before  # the fix: one per process
    rate = {k: sum(after[k][p][1] - before[k][p][1] for p in before[k] if p in after[k]) / dt for k in before}
    assert rate["stock"] > 5 * rate["patched"], rate  # ~19 x 100 wake-ups/s vs ~100/s


def test_idle_poll_clock_backs_off_only_when_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_ext.patches import idle_poll

    clock = idle_poll._PollClock()
    now = [100.0]
    monkeypatch.setattr(idle_poll.time, "monotonic", lambda: now[0])
    clock.touch()
    assert clock.idle_delay(0.001) == 0.001  # outputs are flowing: keep the 1 ms cadence
    now[0] += 0.049
    assert clock.idle_delay(0.001) == 0.001
    now[0] += 0.002  # 51 ms without an output
    assert clock.idle_delay(0.001) == pytest.approx(0.010)
    assert clock.idle_delay(0) == 0 and clock.idle_delay(0.5) == 0.5  # other sleeps untouched
    clock.touch()
    assert clock.idle_delay(0.001) == 0.001


def test_idle_poll_goes_deep_only_after_a_second_with_nothing_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_ext.patches import idle_poll

    clock = idle_poll._PollClock()
    now = [100.0]
    monkeypatch.setattr(idle_poll.time, "monotonic", lambda: now[0])
    clock.touch()
    now[0] += 0.5
    assert clock.idle_delay(0.001, idle=True) == pytest.approx(0.010)  # quiet, but not for a second yet
    now[0] += 0.6
    assert clock.idle_delay(0.001, idle=True) == pytest.approx(0.100)
    assert clock.idle_delay(0.001, idle=False) == pytest.approx(0.010)  # a request in flight: its output is due

    class Orch:
        def __init__(self, states) -> None:
            self.request_states = states

    monkeypatch.setattr(idle_poll, "ORCHESTRATORS", [])
    assert idle_poll.nothing_in_flight() is False  # no orchestrator seen: not certain, so not deep
    a, b = Orch({}), Orch({"req-1": object()})
    monkeypatch.setattr(idle_poll, "ORCHESTRATORS", [a])
    assert idle_poll.nothing_in_flight() is True and clock.idle_delay(0.001) == pytest.approx(0.100)
    monkeypatch.setattr(idle_poll, "ORCHESTRATORS", [a, b])
    assert idle_poll.nothing_in_flight() is False and clock.idle_delay(0.001) == pytest.approx(0.010)
    del a.request_states  # a vLLM-Omni without the attribute: never deep
    monkeypatch.setattr(idle_poll, "ORCHESTRATORS", [a])
    assert idle_poll.nothing_in_flight() is False


def test_dmd2_forward_bug_and_fix() -> None:
    """vLLM-Omni's DMD2 mixin passes guidance_scale/num_inference_steps to a base forward that takes the
    batch alone (Wan22Pipeline, QwenImagePipeline): TypeError, the server's warm-up dies. Patched, such a
    base gets the batch alone, and a base that declares the keywords still gets the DMD2 values."""
    from vllm_omni.diffusion.models.dmd2.mixin import DMD2PipelineMixin

    from omni_ext.patches import dmd2_forward

    stock = getattr(DMD2PipelineMixin.forward, "__wrapped__", DMD2PipelineMixin.forward)

    class BatchOnly:  # Wan22Pipeline.forward(self, req)
        def forward(self, req):
            return ["batch", req]

    class Keywords:  # a base forward that declares the DMD2 overrides
        def forward(self, req, guidance_scale=None, num_inference_steps=None):
            return [guidance_scale, num_inference_steps]

    def pipeline(base: type) -> object:
        cls = type(f"DMD2{base.__name__}", (DMD2PipelineMixin, base), {})
        p = cls.__new__(cls)
        p.dmd2_config = SimpleNamespace(guidance_scale=1.0, num_inference_steps=4)
        p._sanitize_dmd2_request = lambda req: None
        return p

    with pytest.raises(TypeError, match="guidance_scale"):
        stock(pipeline(BatchOnly), "req")
    dmd2_forward.apply()
    dmd2_forward.apply()  # idempotent
    assert DMD2PipelineMixin.forward(pipeline(BatchOnly), "req") == ["batch", "req"]
    assert DMD2PipelineMixin.forward(pipeline(Keywords), "req", guidance_scale=7.0) == [1.0, 4]
