"""``omni-ext`` CLI reads the same registry the code applies; start-up checks are plain logic."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from omni_ext.cli import build_parser
from omni_ext.patches import PATCHES
from omni_ext.patches.couplings import COUPLINGS
from omni_ext.startup import check_model, serve_model_arg


def run_cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "omni_ext.cli", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_patches_list_json_is_the_registry() -> None:
    out = json.loads(run_cli("patches", "list", "--json"))
    assert out["vllm_omni"] == "0.30.0"
    listed = [{k: v for k, v in row.items() if k != "active_for_installed"} for row in out["patches"]]
    assert listed == [asdict(p) for p in PATCHES]
    assert all(row["active_for_installed"] for row in out["patches"])


def test_patches_list_text_names_every_patch() -> None:
    out = run_cli("patches", "list")
    for p in PATCHES:
        assert p.name in out and p.diff in out
        assert all(target in out for target in p.targets), p.targets
    assert "vllm_omni.entrypoints.openai.api_server:omni_init_app_state" in out  # openai-routes replaces both


@pytest.mark.spawns
def test_patches_couplings_json_is_the_registry_and_holds() -> None:
    out = json.loads(run_cli("patches", "couplings", "--json", "--check"))
    assert out["vllm_omni"] == "0.30.0"
    assert [{k: v for k, v in row.items() if k != "problem"} for row in out["couplings"]] == [
        json.loads(json.dumps(asdict(c))) for c in COUPLINGS
    ]
    assert [row["problem"] for row in out["couplings"]] == [None] * len(COUPLINGS)
    text = run_cli("patches", "couplings")
    assert all(c.name in text for c in COUPLINGS)


#: Every ``omni-ext`` subcommand (a new one is added here and to the README).
SUBCOMMANDS = ("make-tiny-model", "patches", "models", "info", "presets", "plan", "serve", "doctor", "bench",
               "device-check")


def test_help_lists_every_subcommand() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert tuple(sub.choices) == SUBCOMMANDS
    out = run_cli("--help")
    for name in SUBCOMMANDS:
        assert f"\n    {name}" in out, name


@pytest.mark.spawns
def test_models_json_is_clean_and_counts_add_up() -> None:
    """``omni-ext models --json``: vLLM's start-up log goes to stderr; one row per registered class
    (tests/test_registry_sweep.py checks the rows themselves)."""
    out = json.loads(run_cli("models", "--json"))
    assert out["vllm_omni"] == "0.30.0"
    keys = [m["key"] for m in out["models"]]
    assert len(keys) == len(set(keys)) and {"WanPipeline", "QwenImagePipeline"} <= set(keys)
    assert sum(out["counts"].values()) == len(keys)
    paths = ("tuned", "passthrough", "unavailable")
    assert out["counts"] == {p: sum(m["path"] == p for m in out["models"]) for p in paths}


def test_info_shows_entry_points() -> None:
    info = json.loads(run_cli("info"))
    assert info["vllm-omni"] == "0.30.0"
    assert info["cpu_platform"] == "omni_ext.platform.cpu.CpuOmniPlatform"
    assert set(info["entry_points"]) == {
        "vllm_omni.platform_plugins:omni_ext_cpu",
        "vllm_omni.general_plugins:omni_ext",
        "vllm.general_plugins:omni_ext",
    }


@pytest.mark.parametrize(
    "argv,model",
    [(["vllm-omni", "serve", "/m", "--omni"], "/m"), (["vllm-omni", "serve", "--omni", "--model", "x/y"], "x/y"),
     (["vllm-omni", "serve", "/m"], None), (["vllm-omni", "bench", "--omni"], None)],
)
def test_serve_model_arg(argv: list[str], model: str | None) -> None:
    assert serve_model_arg(argv) == model


def test_check_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "does not exist" in check_model(str(tmp_path / "nope"))
    assert "neither model_index.json" in check_model(str(tmp_path))
    (tmp_path / "model_index.json").write_text("{}")
    assert check_model(str(tmp_path)) is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert "Hugging Face cache" in check_model("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")


def test_bad_scheduler_option_fails_before_the_model_loads() -> None:
    from omni_ext.startup import check_serve_options

    base = ["vllm-omni", "serve", "/m", "--omni"]
    assert check_serve_options(base) is None
    assert check_serve_options([*base, "--additional-config", '{"omni_ext": {"scheduler": {"max_wait_s": 9}}}']) is None
    assert check_serve_options(["vllm", "serve", "/m", "--additional-config", "{bad"]) is None  # not an omni serve
    bad = check_serve_options([*base, "--additional-config", '{"omni_ext": {"scheduler": {"max_wait": 9}}}'])
    assert bad is not None and "unknown omni_ext.scheduler option(s) ['max_wait']" in bad
    assert "invalid --additional-config" in check_serve_options([*base, "--additional-config={nope"])  # type: ignore[operator]
