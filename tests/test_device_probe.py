"""``omni_ext.device_probe`` (the preemption resume that ``device_check`` runs on the device itself),
here on the CPU: the real job thread, step boundary, pause token and suspend module around the tiny
Wan transformer and UniPC, with a control that shows the comparison can fail."""

from __future__ import annotations

import json

import pytest

from omni_ext import device_check as dc
from omni_ext import device_probe as probe
from omni_ext.executor import suspend
from omni_ext.executor.role import ROLE


def test_a_job_paused_twice_while_two_others_run_resumes_byte_identical() -> None:
    r = probe.probe_dtype("cpu", "float32", "tiny")
    assert r["identical"] is True and r["others_identical"] == {"B": True, "C": True}
    assert len(r["paused_at_steps"]) == 2 and 0 < r["paused_at_steps"][0] < r["paused_at_steps"][1] < probe.JOBS["A"][4]
    assert r["step_ms"] > 0 and r["save_restore_ms"] >= 0


def test_without_the_scheduler_and_pipeline_state_put_back_the_resumed_job_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: restoring only the job role (so that the pauses still happen) leaves the UniPC
    state the other jobs wrote: the paused job's bytes change, or (the scheduler's step index past
    the other job's last step) it fails."""

    def role_only(snap, pipeline, device=None):
        for name, value in snap.role.items():
            setattr(ROLE, name, value)

    monkeypatch.setattr(suspend, "restore", role_only)
    try:
        r = probe.probe_dtype("cpu", "float32", "tiny")
    except RuntimeError as exc:
        assert str(exc).startswith("job A"), exc
    else:
        assert r["identical"] is False


def test_main_prints_one_json_report_and_exits_by_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert probe.main(["--kind", "cpu", "--dtypes", "bfloat16"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["kind"] == "cpu" and report["runs"][0]["dtype"] == "bfloat16"
    status, detail = dc.probe_verdict(report)
    assert status == "pass" and detail.startswith("on cpu, torch ") and "bfloat16: byte-identical after pauses" in detail


def test_probe_verdicts() -> None:
    ok = {"dtype": "float32", "identical": True, "others_identical": {"B": True}, "paused_at_steps": [3, 6],
          "step_ms": 1.0, "save_restore_ms": 0.1}
    name = {"torch": "2.11.0+cu130", "kind": "cuda", "device_name": "NVIDIA H200"}
    assert dc.probe_verdict({**name, "runs": [ok]}) == (
        "pass", "on NVIDIA H200, torch 2.11.0+cu130: float32: byte-identical after pauses at steps [3, 6] "
                "(step 1.00 ms, save+restore 0.10 ms)")
    assert dc.probe_verdict({**name, "runs": [ok, {**ok, "dtype": "bfloat16", "identical": False}]})[0] == "fail"
    assert dc.probe_verdict({**name, "runs": [{**ok, "others_identical": {"B": False}}]})[0] == "fail"
    assert dc.probe_verdict({**name, "runs": [{"dtype": "float32", "error": "ModuleNotFoundError: diffusers"}]}) == (
        "fail", "on NVIDIA H200, torch 2.11.0+cu130: float32: ModuleNotFoundError: diffusers")
    assert dc.probe_verdict(None, "Traceback ... boom") == ("fail", "the probe gave no report: Traceback ... boom")
