"""``scripts/device_check.sh``: run for real on this CPU host (its own servers, one at a time), and the
pure parts (device tools' output, process lists, verdicts) that only a card would otherwise exercise."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_ext import device_check as dc

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.server
def test_device_check_script_runs_green_on_cpu(tmp_path: Path) -> None:
    """The whole script as CI runs it: every check named, none failed, the device-only ones skipped
    with the reason; the CPU host runs CFG 2 and data parallel 2 on its two worker processes."""
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHON": sys.executable}
    t0 = time.monotonic()
    res = subprocess.run([str(ROOT / "scripts" / "device_check.sh"), "--json", str(out), "--workdir", str(tmp_path / "work")],
                         capture_output=True, text=True, env=env, timeout=900)
    took = time.monotonic() - t0
    assert out.exists(), res.stdout[-3000:] + res.stderr[-5000:]
    report = json.loads(out.read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert [c["name"] for c in report["checks"]] == list(dc.CHECKS)
    assert all(set(c) >= {"name", "status", "detail"} and c["detail"] for c in report["checks"])
    failed = {n: c["detail"] for n, c in checks.items() if c["status"] == "fail"}
    assert not failed, failed
    assert res.returncode == 0, res.stderr[-3000:]
    assert report["device"]["kind"] == "cpu"
    for name in dc.DEVICE_ONLY:
        assert checks[name]["status"] == "skipped" and checks[name]["detail"].startswith("skipped: no device")
    # On CPU everything else really ran (the CPU platform's two workers stand in for two devices).
    assert {n for n, c in checks.items() if c["status"] == "pass"} == set(dc.CHECKS) - dc.DEVICE_ONLY
    assert "ranks [(0,), (1,)]" in checks["identical.tuned-dp2"]["detail"]
    # 288x32 is wider than diffusers' 256-pixel tile: the pair splits the tiled decode as at real sizes.
    assert re.search(r"'Wan VAE tiled decode split between CFG ranks: 1 x 2 tiles, rank 0 decodes 1, rank 1 1 and blends'",
                     checks["split-vae-decode"]["detail"]), checks["split-vae-decode"]["detail"]
    for line in ("device-context.api-engine", "identical.tuned-cfg2", "step-time.1rank"):
        assert line in res.stdout  # the table
    print(f"\n[device-check] the script took {took:.0f} s on this host")


# ---- pure parts ---------------------------------------------------------------------------------------
NVIDIA_L = """GPU 0: NVIDIA H200 (UUID: GPU-0b1c2d3e-aaaa-bbbb-cccc-000000000000)
GPU 1: NVIDIA H200 (UUID: GPU-0b1c2d3e-aaaa-bbbb-cccc-000000000001)
"""
NVIDIA_APPS = """4242, vLLM-Omni::DiffusionWorker_CFG0, 1200 MiB
4243, vLLM-Omni::DiffusionWorker_CFG1, 1100 MiB
"""
NPU_INFO = """+------------------------------------------------------------------------------------------------+
| npu-smi 24.1.0                   Version: 24.1.0                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.4        45                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3371 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | OK            | 90.1        44                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          3370 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 0       0                 | 5150          | python3.11               | 2900                    |
+===========================+===============+====================================================+
| 1       0                 | 5151          | python3.11               | 2800                    |
+===========================+===============+====================================================+
"""


def test_device_tool_output_parsers() -> None:
    assert dc.parse_nvidia_list(NVIDIA_L) == ["NVIDIA H200", "NVIDIA H200"]
    assert dc.parse_nvidia_apps(NVIDIA_APPS) == [4242, 4243]
    assert dc.parse_nvidia_apps("") == []
    assert dc.parse_npu_apps(NPU_INFO) == [5150, 5151]
    assert dc.parse_npu_count("  Total Count                    : 8\n") == 8
    assert dc.parse_npu_count(NPU_INFO) == 2
    assert dc.visible_count(None, 8) == 8
    assert dc.visible_count("4,5", 8) == 2
    assert dc.visible_count("GPU-0b1c2d3e-aaaa-bbbb-cccc-000000000001", 2) == 1


def test_detect_device_from_the_tools(monkeypatch) -> None:
    class Res:
        def __init__(self, out: str) -> None:
            self.stdout, self.returncode = out, 0

    monkeypatch.setattr(dc.shutil, "which", lambda tool: "/usr/bin/" + tool if tool == "nvidia-smi" else None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    dev = dc.detect_device(run=lambda *a, **k: Res(NVIDIA_L))
    assert (dev.kind, dev.count, dev.tool) == ("cuda", 1, "nvidia-smi")
    monkeypatch.setattr(dc.shutil, "which", lambda tool: None)
    assert dc.detect_device().kind == "cpu"


def test_context_verdict_only_workers_may_hold_a_device() -> None:
    tree = {100: "vllm-omni", 101: "vLLM-Omni::DiffusionWorker_CFG0", 102: "vLLM-Omni::DiffusionWorker_CFG1"}
    assert dc.context_verdict(tree, [101, 102, 999])[0] == "pass"
    status, detail = dc.context_verdict(tree, [100, 101, 102])
    assert status == "fail" and "vllm-omni (pid 100)" in detail
    assert dc.context_verdict(tree, [7, 8])[0] == "skipped"  # another PID namespace: cannot tell
    assert dc.context_verdict(tree, None)[0] == "skipped"


def test_verdicts_and_skips() -> None:
    assert dc.step_verdict(10.0, 10.5, on_device=True)[0] == "pass"
    assert dc.step_verdict(10.0, 12.0, on_device=True)[0] == "fail"
    assert dc.step_verdict(10.0, 30.0, on_device=False)[0] == "pass"  # information on CPU
    assert dc.step_verdict(None, 3.0, on_device=False)[0] == "fail"
    tiled = "x omni-ext: Wan VAE tiled decode split between CFG ranks: 1 x 2 tiles"
    layers = "x omni-ext: Wan VAE decode split between CFG ranks after unit 11 of 14"
    assert dc.split_verdict(tiled, True, "288x32")[0] == "pass"
    status, detail = dc.split_verdict(layers, True, "288x32")
    assert status == "fail" and "only the layers split ran" in detail
    assert dc.split_verdict(layers, True, "48x32")[0] == "pass"
    assert dc.split_verdict("", False, "48x32")[0] == "fail"
    cpu, one, two = dc.Device("cpu", 0), dc.Device("cuda", 1), dc.Device("npu", 8)
    assert dc.skip_reason("device-context.api-engine", cpu).startswith("skipped: no device")
    assert dc.skip_reason("identical.tuned-cfg2", cpu) is None
    assert "need two" in dc.skip_reason("identical.tuned-cfg2", one)
    assert dc.skip_reason("identical.tuned-cfg2", two) is None and dc.skip_reason("device-context.api-engine", two) is None
    assert dc.exit_code([{"status": "pass"}, {"status": "skipped"}]) == 0
    assert dc.exit_code([{"status": "fail"}]) == 1
