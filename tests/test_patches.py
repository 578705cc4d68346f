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

ROOT = Path(__file__).resolve().parents[1]


def _omni_src() -> Path:
    import vllm_omni

    return Path(vllm_omni.__file__).resolve().parents[1]


@pytest.mark.parametrize("patch", reg.PATCHES, ids=lambda p: p.name)
def test_registry_entry_is_complete(patch: reg.Patch) -> None:
    for field in ("name", "target", "why", "versions", "where", "diff", "test", "removal", "upstream", "apply"):
        assert getattr(patch, field), f"{patch.name}: empty {field}"
    assert patch.where in ("worker", "api")
    assert (ROOT / patch.diff).is_file()
    test_file, _, test_name = patch.test.partition("::")
    assert f"def {test_name}(" in (ROOT / test_file).read_text(), patch.test
    module, _, qual = patch.target.partition(":")
    obj = __import__(module, fromlist=["x"])
    for part in qual.split("."):
        obj = getattr(obj, part)  # the target exists in the installed vLLM-Omni
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

    monkeypatch.setattr(mod, "_resolve", lambda q: (lambda: hits.append(1)))
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
