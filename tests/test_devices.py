"""Device counting on the way to the accelerator: omni-ext's data parallelism is part of the world
that vLLM-Omni's start-up checks against the visible devices (patch dp-world), and a layout that needs
more devices than are visible is refused at start-up with both numbers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from omni_ext.patches import dp_world
from omni_ext.platform.devices import visible_devices

TUNED = "omni_ext.executor.TunedExecutor"


def _dp(n: int) -> dict:
    return {"omni_ext": {"data_parallel_size": n}}


def test_requested_dp_rules() -> None:
    assert dp_world.requested_dp(None, None) is None
    assert dp_world.requested_dp({"omni_ext": {"scheduler": {}}}, None) is None
    assert dp_world.requested_dp(_dp(2), None) == 2
    assert dp_world.requested_dp(_dp(2), 1) == 2
    assert dp_world.requested_dp(_dp(2), 2) is None  # already the stage's own
    assert dp_world.requested_dp('{"omni_ext": {"data_parallel_size": 3}}', None) == 3  # the CLI's JSON string
    with pytest.raises(ValueError, match="data_parallel_size=2 conflicts with the stage's data_parallel_size=4"):
        dp_world.requested_dp(_dp(2), 4)
    for bad in (0, -1, "2", True, 1.5):
        with pytest.raises(ValueError, match="positive integer"):
            dp_world.requested_dp(_dp(bad), None)


def test_visible_devices_counts_like_vllm_omni() -> None:
    platform = SimpleNamespace(device_control_env_var="CUDA_VISIBLE_DEVICES", device_type="cuda",
                               get_device_count=lambda: 8)
    assert visible_devices(platform, {}) == (8, "cuda device count")
    assert visible_devices(platform, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == (4, "CUDA_VISIBLE_DEVICES=4,5,6,7")
    uuids = "GPU-0c5d-aa,GPU-19fe-bb"  # UUIDs count as devices too
    assert visible_devices(platform, {"CUDA_VISIBLE_DEVICES": uuids})[0] == 2
    assert visible_devices(platform, {"CUDA_VISIBLE_DEVICES": " "}) == (8, "cuda device count")


def _resolve(model: Path, cli: dict) -> tuple:
    """What vLLM-Omni's serve resolves for ``cli``, and the diffusion config its stage start-up builds."""
    from vllm_omni.config.resolver import resolve_omni_config
    from vllm_omni.engine import stage_init_utils as u

    stage = resolve_omni_config(str(model), trust_remote_code=False, deploy_config_path=None, cli_overrides=cli,
                                stage_overrides=None, strategy_config_path=None).stage_configs[0]
    od = u.build_diffusion_config(str(model), stage, u.extract_stage_metadata_from_omni_stage_config(stage))
    return stage, od


@pytest.mark.parametrize("name", ["wan2.1-t2v", "qwen-image"])  # a registered pipeline; the generic fallback
def test_stage_world_counts_omni_ext_dp(name: str, tiny_models, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_omni.config import omni_config
    from vllm_omni.config.config_factory import StageConfigFactory

    dp_world.apply()
    cli = {"distributed_executor_backend": TUNED, "cfg_parallel_size": 2, "additional_config": _dp(2)}
    monkeypatch.setenv("OMNI_EXT_CPU_VISIBLE_DEVICES", "0,1,2,3")  # the CPU platform's CUDA_VISIBLE_DEVICES
    stage, od = _resolve(tiny_models[name], cli)
    assert (stage.parallel_config.world_size, stage.runtime_config.num_gpus) == (4, 4)
    assert stage.runtime_config.devices in (None, "0,1,2,3")  # never a CFG-only "0,1"
    assert (od.num_gpus, od.parallel_config.data_parallel_size) == (4, 2)

    monkeypatch.setenv("OMNI_EXT_CPU_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match=r"requires 4 device\(s\).*but 2 device\(s\) are available"):
        _resolve(tiny_models[name], cli)

    # Stock (the bug): the world counts CFG alone, so the same 2 devices pass the check.
    monkeypatch.setattr(omni_config, "_stage_engine_values", omni_config._stage_engine_values.__wrapped__)
    monkeypatch.setattr(StageConfigFactory, "_normalize_default_diffusion",
                        classmethod(StageConfigFactory.__dict__["_normalize_default_diffusion"].__func__.__wrapped__))
    stage, od = _resolve(tiny_models[name], cli)
    assert (stage.parallel_config.world_size, od.num_gpus) == (2, 2)


@pytest.mark.server
@pytest.mark.own_servers("wan2.1-t2v", {"dp2-one-device": (
    ["--distributed-executor-backend", TUNED, "--additional-config", '{"omni_ext": {"data_parallel_size": 2}}'],
    {"OMNI_EXT_CPU_VISIBLE_DEVICES": "0"})}, ready=False)
def test_dp_beyond_visible_devices_refused_at_start(own) -> None:
    """A real ``vllm-omni serve`` with 2 data-parallel groups and one visible (CPU) device stops at
    start-up naming both numbers, instead of losing a rank in set_device."""
    proc = own["dp2-one-device"]
    proc.proc.wait(timeout=300)
    log = proc.log_text()
    assert proc.proc.returncode != 0
    assert "Stage 0 requires 2 device(s) based on parallel_config, but 1 device(s) are available" in log, \
        proc.log_tail()
    assert "exited during start-up" not in log


@pytest.mark.server
@pytest.mark.own_servers("wan2.1-t2v", {"vae-patch-parallel": (
    ["--distributed-executor-backend", TUNED, "--cfg-parallel-size", "2", "--vae-patch-parallel-size", "2"], {})},
    ready=False)
def test_vae_patch_parallel_refused_at_start_with_the_alternative(own) -> None:
    """vLLM-Omni's VAE patch parallel runs world-group collectives that ranks running different
    requests would never all enter: the TunedExecutor stops at start-up naming the flag and what to
    do instead (it splits the VAE decode itself), not a hang at the first decode."""
    proc = own["vae-patch-parallel"]
    proc.proc.wait(timeout=300)
    assert proc.proc.returncode != 0
    assert "omni-ext TunedExecutor: drop --vae-patch-parallel-size 2" in proc.log_text(), proc.log_tail()


# ---- CPU_AFFINITY_CONF per replica (omni_ext.executor.ascend) ---------------------------------------
def _torch_npu_default_cores(local: int, visible_count: int, cores: int) -> list[int]:
    """torch_npu 2.10.0.post4's own slice (NPUAffinityController.cpp getNPUDefaultCores): by the local
    device index among the devices this process sees."""
    block = cores // visible_count
    return list(range(local * block, (local + 1) * block))


def _conf_cores(conf: str) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for part in conf.split(",")[1:]:
        key, _, rng = part.partition(":")
        a, _, b = rng.partition("-")
        out.setdefault(int(key[3:]), []).extend(range(int(a), int(b or a) + 1))
    return out


def test_replicas_with_their_own_cards_collide_under_torch_npu_default() -> None:
    # 8 cards, 4 replicas x 2 cards, 192 cores: every replica's rank 0 gets cores 0-95 (the bug).
    slices = [_torch_npu_default_cores(0, 2, 192) for _replica in range(4)]
    assert all(s == slices[0] for s in slices)


def test_replica_affinity_gives_each_card_its_own_cores() -> None:
    from omni_ext.executor.ascend import ascend_worker_env, replica_affinity_conf

    replicas = ["0,1", "2,3", "4,5", "6,7"]
    confs = [replica_affinity_conf("1", vis, 8, range(192)) for vis in replicas]
    assert confs[1] == "1,npu0:48-71,npu1:72-95"
    seen: list[int] = []
    for conf in confs:
        for cores in _conf_cores(conf).values():
            assert len(cores) == 24
            seen += cores
    assert sorted(seen) == list(range(192))  # disjoint, and together the whole host
    # One card per replica (torch_npu would bind every process to all cores): each its own 24 cores.
    assert replica_affinity_conf("2", "5", 8, range(192)) == "2,npu0:120-143"
    # A cpuset container: the slices come from the allowed cores, non-contiguous runs repeated.
    assert replica_affinity_conf("1", "1", 2, [0, 1, 2, 3, 8, 9, 10, 11]) == "1,npu0:8-11"
    assert replica_affinity_conf("1", "1", 2, [0, 1, 2, 8, 9, 10]) == "1,npu0:8-10"
    assert replica_affinity_conf("1", "0", 2, [0, 2, 4, 6]) == "1,npu0:0,npu0:2"
    # Left alone: sees every card, no cards named, an explicit user range, mode 0, too few cores.
    for conf, vis, cards, cores in [("1", "0,1,2,3", 4, range(64)), ("1", None, 8, range(64)),
                                    ("1,npu0:0-3", "1", 8, range(64)), ("0", "1", 8, range(64)),
                                    ("1", "1", 8, range(4)), ("1", "9", 8, range(64))]:
        assert replica_affinity_conf(conf, vis, cards, cores) is None
    # Through the executor's worker env: the default mode and a user's mode-only value are refined.
    env = ascend_worker_env({"ASCEND_RT_VISIBLE_DEVICES": "2,3"}, num_groups=1, group_size=2,
                            total_cards=8, allowed_cores=range(192))
    assert env["CPU_AFFINITY_CONF"] == "1,npu0:48-71,npu1:72-95"
    env = ascend_worker_env({"ASCEND_RT_VISIBLE_DEVICES": "3", "CPU_AFFINITY_CONF": "2"}, num_groups=1,
                            group_size=1, total_cards=4, allowed_cores=range(16))
    assert env["CPU_AFFINITY_CONF"] == "2,npu0:12-15"
    user = {"ASCEND_RT_VISIBLE_DEVICES": "3", "CPU_AFFINITY_CONF": "1,npu0:0-1"}
    assert "CPU_AFFINITY_CONF" not in ascend_worker_env(user, num_groups=1, group_size=1, total_cards=4,
                                                        allowed_cores=range(16))


@pytest.mark.server
@pytest.mark.own_servers("qwen-image", {"step-execution": (["--distributed-executor-backend", TUNED, "--step-execution"], {})},
                         ready=False)
def test_step_execution_refused_at_start_with_the_alternative(own) -> None:
    """vLLM-Omni's step execution hands the executor one denoise step of many requests at a time; the
    TunedExecutor runs whole requests (and pauses them at a step itself), so it stops at start-up naming
    the flag and the alternative rather than failing the first request."""
    proc = own["step-execution"]
    proc.proc.wait(timeout=300)
    assert proc.proc.returncode != 0
    log = proc.log_text()
    assert "omni-ext TunedExecutor: drop --step-execution" in log, proc.log_tail()
    assert "serve with vLLM-Omni's own executor" in log


def test_a_worker_group_sees_only_its_own_devices() -> None:
    """Each CFG group of the TunedExecutor is a world of its own: its rank i must be the executor's rank
    base+i, so the group sees only its devices (cut from what is visible now); on CPU nothing is set."""
    from omni_ext.platform.devices import group_devices_env

    npu = SimpleNamespace(device_type="npu", device_control_env_var="ASCEND_RT_VISIBLE_DEVICES")
    cuda = SimpleNamespace(device_type="cuda", device_control_env_var="CUDA_VISIBLE_DEVICES")
    cpu = SimpleNamespace(device_type="cpu", device_control_env_var="OMNI_EXT_CPU_VISIBLE_DEVICES")
    assert group_devices_env(npu, (2, 3), {}) == {"ASCEND_RT_VISIBLE_DEVICES": "2,3"}
    assert group_devices_env(npu, (2, 3), {"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}) == {"ASCEND_RT_VISIBLE_DEVICES": "6,7"}
    assert group_devices_env(cuda, (0,), {"CUDA_VISIBLE_DEVICES": "3, 1"}) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert group_devices_env(cpu, (2, 3), {"OMNI_EXT_CPU_VISIBLE_DEVICES": "0,1,2,3"}) == {}


def test_cpu_workers_share_the_cores_of_the_whole_server_not_of_their_group() -> None:
    from omni_ext.platform.threads import HOST_WORKERS_ENV, threads_per_worker, workers_on_host

    assert workers_on_host({HOST_WORKERS_ENV: "4", "WORLD_SIZE": "2"}) == 4
    assert workers_on_host({"WORLD_SIZE": "2"}) == 2 and workers_on_host({}) == 1
    assert threads_per_worker(workers_on_host({HOST_WORKERS_ENV: "2", "WORLD_SIZE": "1"}), cores=2, environ={}) == 1


def test_each_worker_group_of_an_ascend_server_gets_its_cards_and_their_cores() -> None:
    """An 8-card 910B host, 4 groups of CFG 2: group 1 (ranks 2, 3) sees cards 2,3 as its npu0/npu1, and
    the mode-only affinity is worked out for those cards (not npu0/npu1's cores again, which every group
    would then share); the server's worker count goes with it."""
    from omni_ext.executor.tuned import group_env
    from omni_ext.platform.threads import HOST_WORKERS_ENV

    npu = SimpleNamespace(device_type="npu", device_control_env_var="ASCEND_RT_VISIBLE_DEVICES")
    args = dict(num_groups=4, group_size=2, total_cards=8, allowed_cores=range(192))
    env = group_env({"HCCL_OP_EXPANSION_MODE": "AIV"}, npu, (2, 3), 8, args, environ={})
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "2,3" and env["CPU_AFFINITY_CONF"] == "1,npu0:48-71,npu1:72-95"
    assert env[HOST_WORKERS_ENV] == "8" and env["HCCL_OP_EXPANSION_MODE"] == "AIV"
    env = group_env({}, npu, (0, 1), 4, args, environ={"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"})
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "4,5" and env["CPU_AFFINITY_CONF"] == "1,npu0:96-119,npu1:120-143"
    cpu = SimpleNamespace(device_type="cpu", device_control_env_var="OMNI_EXT_CPU_VISIBLE_DEVICES")
    assert group_env({}, cpu, (1,), 2, None, environ={}) == {HOST_WORKERS_ENV: "2"}
