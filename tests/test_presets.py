"""Launch presets: the catalog, rendering, validation against the installed vLLM-Omni, launch scripts,
``omni-ext serve --preset``, ``omni-ext presets validate``, and real servers started from the cpu-tiny presets.

The expensive parts are shared: one :class:`OmniValidator` (imports vLLM, ~20 s) for the module, and
the two preset servers run one after the other (module fixtures), never together.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import stat
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import yaml

from omni_ext.models.families import FAMILIES, cost_units, family_of
from omni_ext.presets import PresetError, load_catalog, load_cost_table
from omni_ext.presets.catalog import ROLES, Preset
from omni_ext.presets.cli import script_text
from omni_ext.presets.costs import Topology
from omni_ext.presets.planner import estimate
from omni_ext.presets.installed import registry_problems
from omni_ext.presets.pipelines import OMNI_EXT_PIPELINES, QWEN_IMAGE_PIPELINE_KEY
from omni_ext.presets.render import (
    REGISTERED_PIPELINE_CLASSES,
    RenderOptions,
    cli_flags,
    format_rendered,
    render,
    request_hint,
    scheduler_seed,
)
from omni_ext.presets.shared import parse_size, tuned_executor_refusal
from omni_ext.presets.validate import CHECK_RULES, TUNED_EXECUTOR, check_preset, check_qualname
from omni_ext.scheduler.config import scheduler_config
from tests.helpers import options_for
from tests.media import decode_mp4, decode_png

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts" / "launch"
CATALOG = load_catalog()
COSTS = load_cost_table()


def errors(preset: Preset) -> list[str]:
    return [i.message for i in check_preset(preset) if i.level == "error"]


def warnings(preset: Preset) -> list[str]:
    return [i.message for i in check_preset(preset) if i.level == "warning"]


#: Every launch of the catalog: (preset name, role), one per host role for a multi-host preset.
LAUNCHES = [(name, role) for name, p in sorted(CATALOG.items()) for role in (ROLES if p.multi_host else (None,))]


# ----------------------------------------------------------------------------------------------
# catalog


def test_catalog_covers_the_models_devices_and_counts_of_the_issue() -> None:
    models = {p.model for p in CATALOG.values()}
    assert {"wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-t2v-a14b", "qwen-image", "qwen-image-2512"} <= models
    for family in ("910b", "cuda"):
        counts = {p.count for p in CATALOG.values() if p.device == family}
        assert counts == {1, 2, 4, 8}, (family, counts)
    tiny = {(p.model, p.topology.cfg, p.topology.replicas) for p in CATALOG.values() if p.device == "cpu"}
    assert ("wan2.1-t2v-tiny", 2, 1) in tiny and ("qwen-image-tiny", 1, 1) in tiny
    assert {p.objective for p in CATALOG.values()} == {"latency", "throughput", "balanced"}


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_preset_passes_the_static_rules(name: str) -> None:
    assert errors(CATALOG[name]) == []
    assert warnings(CATALOG[name]) == []


def test_user_reported_deployments_have_the_reported_topology() -> None:
    assert CATALOG["wan2.1-t2v-1.3b.910b.x1.balanced"].topology == Topology()
    assert CATALOG["wan2.1-t2v-1.3b.910b.x2.latency"].topology == Topology(cfg=2)
    assert CATALOG["wan2.1-t2v-1.3b.cuda.x2.latency"].topology == Topology(cfg=2)
    assert CATALOG["qwen-image-2512.910b.x1.balanced"].topology == Topology()
    eight = CATALOG["wan2.1-t2v-1.3b.910b.x8.throughput"].topology
    assert eight.devices == 8 and eight.tp == 1 and eight.replicas > 1


def test_every_cost_model_is_a_family_of_the_same_kind() -> None:
    # costs.yaml names the pipeline class of each model; the family table is what omni-ext knows about it.
    for key, spec in COSTS.models.items():
        family = family_of(spec.pipeline_class)
        assert family is not None, f"costs.yaml model {key}: {spec.pipeline_class} is not in omni_ext/models/families.py"
        assert spec.kind == family.kind, f"costs.yaml model {key} is a {spec.kind}, its family {family.name} a {family.kind}"
        assert spec.family is family


def test_pipeline_channels_come_from_the_family_table() -> None:
    assert "WanPipeline" in REGISTERED_PIPELINE_CLASSES and "QwenImagePipeline" not in REGISTERED_PIPELINE_CLASSES
    assert OMNI_EXT_PIPELINES == {"QwenImagePipeline": "omni_ext_qwen_image"} == {"QwenImagePipeline": QWEN_IMAGE_PIPELINE_KEY}
    for family in FAMILIES:
        assert (family.topology == "registered") == (set(family.pipelines) <= REGISTERED_PIPELINE_CLASSES), family.name
        assert (family.topology == "omni-ext") == (family.pipelines[0] in OMNI_EXT_PIPELINES), family.name


def test_registry_disagreements_are_named() -> None:
    assert registry_problems({"WanPipeline", "WanDMDPipeline"}) == []
    gone = registry_problems(set())
    assert any("WanPipeline is no longer registered" in p for p in gone)
    assert any("family wan2.x-t2v" in p and "deploy YAML would be ignored" in p for p in gone)
    upstream = registry_problems({"WanPipeline", "QwenImagePipeline"})
    assert upstream == [p for p in upstream if "family qwen-image:" in p] and "now registered upstream" in upstream[0]


def test_no_npu_preset_uses_tp_unless_the_weights_need_it() -> None:
    usable = COSTS.usable_memory_gb(COSTS.reference_device("910b"))
    for p in CATALOG.values():
        if p.device == "910b" and p.topology.tp > 1:
            assert COSTS.model(p.model).rank_memory_gb(p.topology.tp // 2) > usable, p.name


# ----------------------------------------------------------------------------------------------
# static rules catch the launch mistakes of the issue


BASE = CATALOG["wan2.1-t2v-1.3b.910b.x2.latency"]


def test_cfg_above_two_is_refused() -> None:
    bad = BASE.replace(topology=Topology(cfg=3), count=3, name="wan2.1-t2v-1.3b.910b.x3.latency")
    assert any("cfg 3 > 2" in e for e in errors(bad))


def test_more_parallel_ranks_than_devices_is_refused() -> None:
    bad = BASE.replace(topology=Topology(cfg=2, ulysses=2))
    assert any("more parallel ranks than devices" in e for e in errors(bad))


def test_data_parallel_size_and_num_gpus_flags_are_refused() -> None:
    msgs = errors(BASE.replace(flags=("--data-parallel-size", "2", "--num-gpus", "4")))
    assert any("--data-parallel-size: rejected under --omni" in m for m in msgs)
    assert any("--num-gpus" in m and "same request" in m for m in msgs)


def test_tp_for_a_dit_on_npu_without_memory_need_warns() -> None:
    tp = BASE.replace(topology=Topology(tp=2))
    assert not any("TP 2 for a DiT" in e for e in errors(tp))  # a warning, not an error
    assert any("TP 2 for a DiT without memory need" in w and "NPU" in w for w in warnings(tp))
    needed = CATALOG["wan2.2-t2v-a14b.910b.x2.latency"]
    assert needed.topology.tp == 2 and warnings(needed) == []


def test_qwen_image_cfg_parallel_needs_a_negative_prompt() -> None:
    with_neg = CATALOG["qwen-image.910b.x2.latency.cfg"]
    assert errors(with_neg) == []
    without = with_neg.replace(request_defaults={k: v for k, v in with_neg.request_defaults.items() if k != "negative_prompt"})
    assert any("negative_prompt" in e for e in errors(without))


def test_long_video_without_raised_timeouts_is_refused() -> None:
    p = CATALOG["wan2.1-t2v-14b.910b.x1.balanced"]
    assert int(p.env["VLLM_OMNI_DLO_DP_WAVE_TIMEOUT"]) > 600
    bare = p.replace(env={k: v for k, v in p.env.items() if not k.startswith("VLLM_OMNI_")})
    assert any("VLLM_OMNI_DLO_DP_WAVE_TIMEOUT" in e and "worker group" in e for e in errors(bare))


def test_seconds_and_bad_frame_counts_are_refused() -> None:
    msgs = errors(BASE.replace(request_defaults={**BASE.request_defaults, "seconds": 5, "num_frames": 80}))
    assert any("seconds x 24" in m for m in msgs)
    assert any("4k+1" in m for m in msgs)


def test_each_finding_names_its_rule_and_a_gate_ends_the_check() -> None:
    found = check_preset(BASE.replace(topology=Topology(cfg=3), request_defaults={**BASE.request_defaults, "seconds": 5}))
    assert {("cfg_branches", "error"), ("no_seconds", "error")} <= {(i.rule, i.level) for i in found}
    assert all(i.rule in {r.name for r in CHECK_RULES} for i in found)
    unknown = check_preset(BASE.replace(model="nope", topology=Topology(cfg=0)))
    assert [(i.rule, i.level) for i in unknown] == [("known_model", "error")]


def test_a_preset_size_parses_as_a_request_size() -> None:
    assert parse_size(" 832 X 480 ") == (832, 480)
    for bad in ("832", "-832x480", "832x480x2", "8_32x480", None):
        with pytest.raises(PresetError, match="size must look like 832x480"):
            parse_size(bad)
    msgs = errors(BASE.replace(request_defaults={**BASE.request_defaults, "size": "-832x480"}))
    assert any("size must look like 832x480" in m for m in msgs)


def test_executor_and_scheduler_must_import_and_subclass() -> None:
    assert any("does not import" in e for e in errors(BASE.replace(executor="omni_ext.nope.Executor")))
    assert any("not a subclass" in e for e in errors(BASE.replace(scheduler="omni_ext.presets.catalog.Preset")))
    ok = BASE.replace(executor="vllm_omni.diffusion.executor.multiproc_executor.MultiprocDiffusionExecutor")
    assert errors(ok) == []


# ----------------------------------------------------------------------------------------------
# rendering


def test_wan_renders_a_deploy_yaml_and_qwen_renders_flags_or_its_registered_pipeline() -> None:
    wan = render(CATALOG["wan2.1-t2v-1.3b.910b.x8.throughput"], RenderOptions(devices=list(range(8, 16))))
    stage = wan.deploy["stages"][0]
    assert (stage["num_replicas"], stage["cfg_parallel_size"], stage["devices"]) == (4, 2, "0,1,2,3,4,5,6,7")
    assert wan.env["ASCEND_RT_VISIBLE_DEVICES"] == "8,9,10,11,12,13,14,15"
    assert "--deploy-config" in wan.flags and "--data-parallel-size" not in wan.flags

    one = render(CATALOG["qwen-image.910b.x1.balanced"])
    assert one.deploy is None and "--deploy-config" not in one.flags
    assert json.loads(one.flags[one.flags.index("--default-sampling-params") + 1]) == {
        "0": {"width": 1024, "height": 1024, "num_inference_steps": 50, "true_cfg_scale": 4.0}}

    many = render(CATALOG["qwen-image.910b.x8.throughput"])
    assert many.deploy["pipeline"] == "omni_ext_qwen_image" and many.deploy["stages"][0]["num_replicas"] == 8


def test_the_tuned_executor_is_selected_wherever_it_applies_and_nowhere_else() -> None:
    for preset in CATALOG.values():
        refusal = tuned_executor_refusal(preset)
        assert (preset.executor == TUNED_EXECUTOR) == (refusal is None), preset.name
        if refusal is not None:  # the preset says why vLLM-Omni's own executor runs it
            assert preset.executor is None and preset.notes[0] == f"No TunedExecutor: {refusal}.", preset.name
    assert CATALOG["wan2.1-t2v-1.3b.910b.x8.throughput"].executor == TUNED_EXECUTOR
    # the static rules only look for its module (no vLLM import); here the class itself imports and is an executor
    assert check_qualname(TUNED_EXECUTOR, "vllm_omni.diffusion.executor.abstract.DiffusionExecutor") is None
    assert CATALOG["qwen-image-2512.910b.x1.balanced"].executor == TUNED_EXECUTOR
    assert CATALOG["qwen-image.910b.x8.latency"].executor == TUNED_EXECUTOR  # Ulysses 8: one unit of 8 processes
    assert CATALOG["wan2.1-t2v-1.3b.910b.x4.latency"].executor == TUNED_EXECUTOR  # CFG 2 x Ulysses 2
    # Every preset runs it: the Wan2.2-A14B presets' TP 2 (there to fit the weights) runs inside a unit
    # (issue 18 items 1 and 2: no exception left).
    assert CATALOG["wan2.2-t2v-a14b.910b.x8.latency"].executor == TUNED_EXECUTOR  # CFG 2 x Ulysses 2 x TP 2
    assert all(p.executor == TUNED_EXECUTOR for p in CATALOG.values())
    assert not any(n.startswith("No TunedExecutor") for p in CATALOG.values() for n in p.notes)


def test_the_tuned_executor_where_it_would_refuse_to_start_is_an_error() -> None:
    pp = CATALOG["wan2.2-t2v-a14b.910b.x8.throughput"].replace(
        topology=dataclasses.replace(CATALOG["wan2.2-t2v-a14b.910b.x8.throughput"].topology, vae_patch=2))
    assert any("would refuse to start: its worker groups are CFG and data-parallel groups only" in e for e in errors(pp))
    stepped = CATALOG["wan2.1-t2v-1.3b.910b.x1.balanced"].replace(engine={"step_execution": True})
    assert any("refuses step execution" in e for e in errors(stepped))
    unselected = CATALOG["wan2.1-t2v-1.3b.910b.x1.balanced"].replace(executor=None)
    assert any("TunedExecutor applies to this preset" in w for w in warnings(unselected))


def test_the_tuned_executor_reaches_both_channels(capsys) -> None:
    from omni_ext.cli import main

    wan = render(CATALOG["wan2.1-t2v-1.3b.910b.x8.throughput"])  # deploy YAML, pipeline-wide key in 0.30
    assert wan.deploy["distributed_executor_backend"] == TUNED_EXECUTOR and wan.deploy["stages"][0]["num_replicas"] == 4
    qwen = render(CATALOG["qwen-image.910b.x1.balanced"])  # generic fallback: CLI flags only
    assert qwen.flags[qwen.flags.index("--distributed-executor-backend") + 1] == TUNED_EXECUTOR
    ulysses = render(CATALOG["qwen-image.910b.x8.latency"])  # sequence parallel: the TunedExecutor too
    assert ulysses.flags[ulysses.flags.index("--distributed-executor-backend") + 1] == TUNED_EXECUTOR
    assert main(["serve", "--preset", "wan2.1-t2v-1.3b.910b.x8.throughput", "--dry-run"]) == 0
    assert f"#   distributed_executor_backend: {TUNED_EXECUTOR}" in capsys.readouterr().out


TWO_HOSTS = CATALOG["wan2.1-t2v-1.3b.910b.2x8.throughput"]


def test_two_host_presets_render_one_exact_command_per_role() -> None:
    assert TWO_HOSTS.hosts == 2 and TWO_HOSTS.count == 8 and TWO_HOSTS.topology == Topology(replicas=4, cfg=2)
    assert TWO_HOSTS.total_topology.replicas == 8
    opts = {"model": "/models/wan", "master_address": "127.0.0.1", "master_port": 29600, "deploy_path": "d.yaml"}
    head = render(TWO_HOSTS, RenderOptions(role="head", port=8100, **opts))
    replica = render(TWO_HOSTS, RenderOptions(role="replica", devices=list(range(8, 16)), **opts))
    assert head.argv == ["vllm-omni", "serve", "/models/wan", "--omni", "--host", "0.0.0.0", "--port", "8100",
                         "--deploy-config", "d.yaml", "--stage-id", "0", "--omni-master-address", "127.0.0.1",
                         "--omni-master-port", "29600", "--omni-dp-size-local", "4"]
    assert replica.argv == ["vllm-omni", "serve", "/models/wan", "--omni", "--headless", "--deploy-config", "d.yaml",
                            "--stage-id", "0", "--omni-master-address", "127.0.0.1", "--omni-master-port", "29600",
                            "--omni-dp-size-local", "4", "--worker-backend", "multi_process"]
    # The same deploy YAML on both hosts: 4 replicas of CFG 2 over this host's 8 cards, the TunedExecutor in each.
    assert head.deploy == replica.deploy
    stage = head.deploy["stages"][0]
    assert (stage["num_replicas"], stage["cfg_parallel_size"], stage["devices"]) == (4, 2, "0,1,2,3,4,5,6,7")
    assert head.deploy["distributed_executor_backend"] == TUNED_EXECUTOR
    assert "ASCEND_RT_VISIBLE_DEVICES" not in head.env and replica.env["ASCEND_RT_VISIBLE_DEVICES"] == "8,9,10,11,12,13,14,15"
    assert any("attached remote replica" in n for n in head.notes) and any("after the head" in n for n in replica.notes)
    cmd = format_rendered(replica, "cmd")
    assert "vllm-omni serve /models/wan --omni \\\n  --headless \\\n  --deploy-config d.yaml" in cmd and "--port" not in cmd


def test_two_host_presets_need_a_role_and_the_head_address(capsys) -> None:
    from omni_ext.cli import main

    with pytest.raises(PresetError, match="spans 2 hosts: render one command per host with --role head"):
        render(TWO_HOSTS)
    with pytest.raises(PresetError, match="pass --master-address"):
        render(TWO_HOSTS, RenderOptions(role="replica"))
    with pytest.raises(PresetError, match="runs on one host; --role is for multi-host presets"):
        render(CATALOG["wan2.1-t2v-1.3b.910b.x8.throughput"], RenderOptions(role="head", master_address="127.0.0.1"))
    assert main(["presets", "render", TWO_HOSTS.name, "--format", "cmd"]) == 2
    assert "--role head" in capsys.readouterr().err
    assert main(["presets", "render", TWO_HOSTS.name, "--role", "replica", "--master-address", "127.0.0.1",
                 "--master-port", "29601"]) == 0
    out = capsys.readouterr().out
    assert "--headless" in out and "--omni-master-port 29601" in out and "--worker-backend multi_process" in out
    assert main(["presets", "render", TWO_HOSTS.name, "--role", "head", "--master-address", "127.0.0.1",
                 "--format", "script"]) == 0
    assert capsys.readouterr().out == script_text(TWO_HOSTS, "head")
    assert "2x8" in next(line for line in _listed(main, capsys) if line.startswith(TWO_HOSTS.name))


def _listed(main, capsys) -> list[str]:
    assert main(["presets", "list", "--model", "wan2.1-t2v-1.3b", "--device", "910b"]) == 0
    return capsys.readouterr().out.splitlines()


def test_request_hint_asks_qwen_image_cfg_clients_for_a_negative_prompt() -> None:
    assert any("negative_prompt" in line for line in request_hint(CATALOG["qwen-image.910b.x2.latency.cfg"]))
    assert not any("negative_prompt" in line for line in request_hint(CATALOG["qwen-image.910b.x2.throughput"]))
    wan = request_hint(CATALOG["wan2.1-t2v-1.3b.910b.x2.latency"])
    assert not any("negative_prompt" in line for line in wan) and any("832x480x81" in line for line in wan)


def test_render_refuses_fewer_devices_than_ranks() -> None:
    with pytest.raises(PresetError, match="runs 8 parallel ranks"):
        render(CATALOG["wan2.1-t2v-1.3b.910b.x8.latency"], RenderOptions(devices=[0, 1, 2, 3]))


def test_cmd_format_is_the_exact_command() -> None:
    text = format_rendered(render(BASE, RenderOptions(model="/m", port=9001)), "cmd")
    assert "TASK_QUEUE_ENABLE=2 \\\n" in text
    assert "vllm-omni serve /m --omni \\\n  --host 0.0.0.0 \\\n  --port 9001 \\\n  --deploy-config " in text


def rendered_additional_config(preset: Preset) -> dict | str | None:
    """What the server receives as additional_config: the deploy YAML stage's (after a YAML round
    trip, as vLLM-Omni reads the file) or the ``--additional-config`` JSON string."""
    rendered = render(preset, options_for(preset))
    if rendered.deploy is not None:
        return yaml.safe_load(format_rendered(rendered, "yaml"))["stages"][0].get("additional_config")
    flags = rendered.flags
    return flags[flags.index("--additional-config") + 1] if "--additional-config" in flags else None


def test_scheduler_seed_is_the_cost_table_latency_per_cost_unit() -> None:
    preset = CATALOG["wan2.1-t2v-1.3b.910b.x1.balanced"]
    latency = estimate(COSTS.model(preset.model), COSTS.reference_device("910b"), preset.topology,
                       request={"width": 832, "height": 480, "num_frames": 81, "steps": 50}).latency_s
    assert latency == 360.0  # the user-reported one-card figure
    units = cost_units("WanPipeline", SimpleNamespace(width=832, height=480, num_frames=81, num_inference_steps=50), cfg=True)
    assert scheduler_seed(preset) == float(f"{latency / units:.3g}") == 0.000106
    assert rendered_additional_config(preset) == {"omni_ext": {"scheduler": {"seconds_per_unit": 0.000106}}}
    # CFG 2 halves one request's time; the units of the request do not change
    assert scheduler_seed(CATALOG["wan2.1-t2v-1.3b.910b.x2.latency"]) == float(f"{180.0 / units:.3g}")
    # Qwen-Image runs CFG only with a negative prompt: its units (and so the seed) follow
    plain, cfg = CATALOG["qwen-image.910b.x1.balanced"], CATALOG["qwen-image.910b.x2.latency.cfg"]
    req = SimpleNamespace(width=1024, height=1024, num_inference_steps=50)
    assert scheduler_seed(plain) == float(f"{26.0 / cost_units('QwenImagePipeline', req, cfg=False):.3g}")
    assert scheduler_seed(cfg) == float(f"{26.0 / cost_units('QwenImagePipeline', req, cfg=True):.3g}")


@pytest.mark.parametrize("name", ["wan2.1-t2v-1.3b.910b.x2.latency", "qwen-image.910b.x1.balanced"])
def test_scheduler_seed_never_overrides_the_presets_own_options(name: str) -> None:
    own = {"omni_ext": {"scheduler": {"max_wait_s": 60, "order": "fifo"}, "api": {"ttl_s": 60}}, "other": 1}
    preset = CATALOG[name].replace(additional_config=own)
    got = rendered_additional_config(preset)
    got = json.loads(got) if isinstance(got, str) else got
    seed = scheduler_seed(preset)
    assert got == {"omni_ext": {"scheduler": {"max_wait_s": 60, "order": "fifo", "seconds_per_unit": seed},
                                "api": {"ttl_s": 60}}, "other": 1}
    assert "seconds_per_unit" not in own["omni_ext"]["scheduler"]  # the preset itself is not changed
    pinned = CATALOG[name].replace(additional_config={"omni_ext": {"scheduler": {"seconds_per_unit": 0.5}}})
    assert scheduler_config(rendered_additional_config(pinned)).seconds_per_unit == 0.5
    opted_out = CATALOG[name].replace(additional_config={"omni_ext": {"scheduler": {"seconds_per_unit": None}}})
    assert scheduler_config(rendered_additional_config(opted_out)).seconds_per_unit is None


def test_cpu_presets_get_no_scheduler_seed() -> None:
    cpu = [p for p in CATALOG.values() if p.device == "cpu"]
    assert cpu
    for preset in cpu:
        assert scheduler_seed(preset) is None, preset.name
        assert rendered_additional_config(preset) is None, preset.name


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_rendered_additional_config_parses_as_scheduler_options(name: str) -> None:
    preset = CATALOG[name]
    rendered = rendered_additional_config(preset)
    seed = scheduler_seed(preset)
    assert scheduler_config(rendered).seconds_per_unit == seed
    assert (seed is None) == (preset.device == "cpu")


def test_unknown_scheduler_option_in_a_preset_is_an_error() -> None:
    preset = BASE.replace(additional_config={"omni_ext": {"scheduler": {"max_wait": 60}}})
    assert any("unknown omni_ext.scheduler option(s) ['max_wait']" in e for e in errors(preset))


# ----------------------------------------------------------------------------------------------
# against the installed vLLM-Omni (its own parser and config loader)


@pytest.fixture(scope="module")
def omni():
    from omni_ext.presets.installed import OmniValidator

    validator = OmniValidator()
    yield validator
    validator.close()


@pytest.mark.parametrize(("name", "role"), LAUNCHES)
def test_preset_is_accepted_by_the_installed_vllm_omni(omni, name: str, role: str | None) -> None:
    preset = CATALOG[name]
    summary = omni.validate(render(preset, options_for(preset, role=role)))
    assert summary["resolved"] == preset.topology.as_dict()  # per host: this host's replicas


def test_the_pipeline_assumptions_match_the_installed_registry(omni) -> None:
    assert omni.registry_problems() == []


def test_plugin_hook_registers_the_qwen_image_pipeline(omni) -> None:
    # Multi-replica Qwen-Image presets select pipeline omni_ext_qwen_image in their deploy YAML. It
    # exists in `vllm-omni serve` only if omni-ext's vllm.general_plugins hook registers it (the
    # validator's parser build ran that hook, as the real CLI does).
    assert omni.hook_registered, (
        "omni_ext.plugin._activate must call omni_ext.presets.pipelines.register_preset_pipelines()")


def test_presets_validate_command_uses_the_installed_vllm_omni(omni, monkeypatch, capsys) -> None:
    from omni_ext.cli import main
    from omni_ext.presets import installed

    monkeypatch.setattr(installed, "OmniValidator", lambda: omni)  # the module's validator: no second vLLM import
    monkeypatch.setattr(omni, "close", lambda: None)
    assert main(["presets", "validate", "qwen-image.910b.x8.throughput", "wan2.1-t2v-tiny.cpu.x2.latency",
                 TWO_HOSTS.name]) == 0
    out = capsys.readouterr().out
    assert "[ OK ] qwen-image.910b.x8.throughput: deploy-yaml: 8 replicas" in out and out.rstrip().endswith("ready")
    for role in ROLES:  # one command per host, each parsed and resolved as that host would
        assert f"[ OK ] {TWO_HOSTS.name} --role {role}: deploy-yaml: 4 replicas x CFG 2 x Ulysses 1 x TP 1 per host, 2 hosts" in out
    bad = BASE.replace(flags=("--num-gpus", "4"))
    monkeypatch.setattr("omni_ext.presets.cli.get_preset", lambda name: bad)
    assert main(["presets", "validate", bad.name, "--json"]) == 1
    (row,) = [c for c in json.loads(capsys.readouterr().out) if c["name"] == bad.name]
    assert row["status"] == "fail" and "--num-gpus" in row["detail"]


@pytest.mark.parametrize("flags,match", [
    (["--no-such-flag", "1"], "parser rejected"),  # the installed parser rejects an unknown flag
    (["--data-parallel-size", "2"], "data_parallel_size"),  # rejected under --omni
    (["--num-gpus", "2"], "data_parallel_size=2"),  # GPUs beyond the parallel ranks are caught as redundant DP
])
def test_installed_vllm_omni_refuses_bad_extra_flags(omni, flags: list[str], match: str) -> None:
    rendered = render(CATALOG["qwen-image.910b.x1.balanced"])
    rendered.flags += flags
    with pytest.raises(PresetError, match=match):
        omni.validate(rendered)


def test_installed_vllm_omni_checks_each_hosts_multi_machine_flags(omni) -> None:
    head = render(TWO_HOSTS, RenderOptions(role="head", master_address="127.0.0.1"))
    assert omni.validate(head)["resolved"]["replicas"] == 4
    i = head.flags.index("--omni-dp-size-local")
    head.flags[i + 1] = "2"  # the host would run 2 replicas, not the preset's 4
    with pytest.raises(PresetError, match="omni_dp_size_local: 2, want 4"):
        omni.validate(head)
    one = render(CATALOG["wan2.1-t2v-1.3b.910b.x8.throughput"])
    one.flags += ["--stage-id", "0", "--omni-master-address", "127.0.0.1", "--omni-master-port", "29555"]
    with pytest.raises(PresetError, match="one-host launch in multi-machine mode"):
        omni.validate(one)


def test_qwen_image_replicas_are_lost_without_the_registered_pipeline(omni) -> None:
    preset = CATALOG["qwen-image.910b.x2.throughput"]
    rendered = render(preset)
    # The same YAML without `pipeline:` is ignored by vLLM-Omni's generic fallback ...
    rendered.deploy = {k: v for k, v in rendered.deploy.items() if k != "pipeline"}
    with pytest.raises(PresetError, match="replicas: preset 2, vLLM-Omni resolved 1"):
        omni.validate(rendered)
    # ... and --stage-overrides cannot carry num_replicas either.
    flags = cli_flags(preset) + ["--stage-overrides", json.dumps({"0": {"num_replicas": 2}})]
    via_cli = render(preset)
    via_cli.deploy, via_cli.flags = None, flags
    with pytest.raises(PresetError, match="replicas: preset 2, vLLM-Omni resolved 1"):
        omni.validate(via_cli)



@pytest.mark.parametrize("name", ["wan2.1-t2v-1.3b.910b.x2.latency", "qwen-image-2512.910b.x1.balanced"])
def test_the_scheduler_seed_reaches_the_resolved_stage(omni, name: str) -> None:
    rendered = render(CATALOG[name])
    assert omni.validate(rendered)  # the deploy YAML stage / --additional-config arrive as the stage's additional_config
    if rendered.deploy is not None:
        del rendered.deploy["stages"][0]["additional_config"]
    else:
        i = rendered.flags.index("--additional-config")
        del rendered.flags[i:i + 2]
    with pytest.raises(PresetError, match="additional_config"):
        omni.validate(rendered)


# ----------------------------------------------------------------------------------------------
# launch scripts


def test_launch_scripts_match_the_presets() -> None:
    named = {name: (p, role) for p in CATALOG.values() for role, name in p.launch_scripts().items()}
    assert set(named) == {f.name for f in SCRIPTS.glob("*.sh")}, "regenerate: omni-ext presets write-scripts"
    for file_name, (preset, role) in named.items():
        path = SCRIPTS / file_name
        assert path.read_text() == script_text(preset, role), f"{path} is stale: omni-ext presets write-scripts"
        assert path.stat().st_mode & stat.S_IXUSR
    two = CATALOG["wan2.1-t2v-1.3b.910b.2x8.throughput"].launch_scripts()
    assert two == {"head": "wan2.1-t2v-1.3b_910b_2hosts_8cards_head.sh",
                   "replica": "wan2.1-t2v-1.3b_910b_2hosts_8cards_replica.sh"}


def test_launch_scripts_cover_the_user_reported_deployments() -> None:
    covered = {(p.model, p.device, p.count, p.topology.cfg) for p in CATALOG.values() if p.launch_script}
    assert ("wan2.1-t2v-1.3b", "910b", 1, 1) in covered
    assert ("wan2.1-t2v-1.3b", "910b", 2, 2) in covered
    assert any(m == "wan2.1-t2v-1.3b" and d == "910b" and n == 8 for m, d, n, _ in covered)
    assert ("qwen-image-2512", "910b", 1, 1) in covered


def test_write_scripts_check_reports_a_stale_script(tmp_path: Path) -> None:
    from omni_ext.cli import main

    assert main(["presets", "write-scripts", str(tmp_path)]) == 0
    assert main(["presets", "write-scripts", str(tmp_path), "--check"]) == 0
    victim = next(tmp_path.glob("*.sh"))
    victim.write_text(victim.read_text().replace("TASK_QUEUE_ENABLE=2", "TASK_QUEUE_ENABLE=0"))
    assert main(["presets", "write-scripts", str(tmp_path), "--check"]) == 1


@pytest.mark.parametrize(("preset_name", "role"), [
    ("wan2.1-t2v-1.3b.910b.x8.throughput", None), ("qwen-image-2512.910b.x1.balanced", None),
    ("wan2.1-t2v-1.3b.910b.2x8.throughput", "head"), ("wan2.1-t2v-1.3b.910b.2x8.throughput", "replica"),
])
def test_launch_script_execs_vllm_omni_with_the_rendered_launch(tmp_path: Path, preset_name: str, role: str | None) -> None:
    preset = CATALOG[preset_name]
    fake = tmp_path / "bin" / "vllm-omni"
    fake.parent.mkdir()
    fake.write_text('#!/usr/bin/env bash\n'
                    'python3 -c \'import json,os,sys; json.dump({"argv": sys.argv[1:], "env": dict(os.environ)}, '
                    'open(os.environ["OUT"], "w"))\' "$@"\n'
                    'for a in "$@"; do [ -f "$a" ] && cp "$a" "$OUT.yaml"; done; exit 0\n')
    fake.chmod(0o755)
    out = tmp_path / "out.json"
    env = {"PATH": f"{fake.parent}:{os.environ['PATH']}", "OUT": str(out), "ASCEND_TOOLKIT_HOME": "/fake/cann",
           "MODEL": "/models/m", "PORT": "9123", "TMPDIR": str(tmp_path)}
    script = str(SCRIPTS / preset.launch_scripts()[role])
    if role is not None:  # a host of a multi-host preset must be told where the head is
        proc = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and "set MASTER_ADDR" in proc.stderr and not out.exists()
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
    proc = subprocess.run(["bash", script, "--log-level", "debug"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(out.read_text())
    rendered = render(preset, RenderOptions(model="/models/m", port=9123, role=role,
                                            master_address="127.0.0.1" if role else None, master_port=29611))
    want = rendered.argv[1:] + ["--log-level", "debug"]
    if rendered.deploy is not None:
        i = want.index("--deploy-config") + 1
        want[i] = seen["argv"][i]
        assert yaml.safe_load(Path(str(out) + ".yaml").read_text()) == rendered.deploy
    assert seen["argv"] == want
    for key, value in rendered.env.items():
        assert seen["env"][key] == value
    assert seen["env"]["ASCEND_RT_VISIBLE_DEVICES"] == ",".join(str(i) for i in range(preset.topology.devices))


def test_npu_launch_script_stops_without_cann(tmp_path: Path) -> None:
    if Path("/usr/local/Ascend/ascend-toolkit/set_env.sh").exists():
        pytest.skip("this host has CANN installed")
    script = SCRIPTS / CATALOG["wan2.1-t2v-1.3b.910b.x2.latency"].launch_script
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in proc.stderr


# ----------------------------------------------------------------------------------------------
# CLI


def test_serve_prints_the_command_then_execs_vllm_omni(monkeypatch, tmp_path: Path, capsys) -> None:
    from omni_ext.cli import main

    calls = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: calls.append((file, argv, env)))
    assert main(["serve", "--preset", BASE.name, "--model", "/models/wan", "--port", "9200", "--devices", "4,5",
                 "--", "--log-level", "debug"]) == 0
    printed = capsys.readouterr().out
    (file, argv, env), = calls
    deploy = tmp_path / "omni-ext" / "deploy" / f"{BASE.name}.yaml"
    assert argv[1:] == ["serve", "/models/wan", "--omni", "--host", "0.0.0.0", "--port", "9200",
                        "--deploy-config", str(deploy), "--log-level", "debug"]
    assert file == argv[0] and Path(argv[0]).name == "vllm-omni"
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "4,5" and env["TASK_QUEUE_ENABLE"] == "2"
    assert yaml.safe_load(deploy.read_text())["stages"][0]["cfg_parallel_size"] == 2
    assert printed.index("ASCEND_RT_VISIBLE_DEVICES=4,5") < printed.index(f"--deploy-config {deploy}")


def test_serve_refuses_an_impossible_launch(capsys) -> None:
    from omni_ext.cli import main

    assert main(["serve", "--preset", "wan2.1-t2v-1.3b.910b.x8.latency", "--devices", "0-3", "--dry-run"]) == 2
    assert "runs 8 parallel ranks" in capsys.readouterr().err


def test_rendering_an_impossible_preset_file_fails_with_the_reasons(tmp_path: Path, capsys) -> None:
    from omni_ext.cli import main

    data = yaml.safe_load(BASE.path.read_text())
    data["topology"]["cfg"] = 3
    path = tmp_path / f"{BASE.name}.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["presets", "render", str(path), "--format", "cmd"]) == 2
    err = capsys.readouterr().err
    assert "cfg 3 > 2" in err and "more parallel ranks than devices" in err


def test_presets_list_show_and_render_env(capsys) -> None:
    from omni_ext.cli import main

    assert main(["presets", "list", "--model", "qwen-image", "--device", "910b"]) == 0
    listed = capsys.readouterr().out
    assert "qwen-image.910b.x8.throughput" in listed and "wan2.1" not in listed
    assert main(["presets", "show", "wan2.1-t2v-1.3b.910b.x2.latency"]) == 0
    shown = capsys.readouterr().out
    assert "estimate on Ascend 910B3 (64 GB): 180 s per request" in shown and "[measured]" in shown and "not seconds" in shown
    assert main(["presets", "render", "wan2.1-t2v-14b.910b.x1.balanced", "--format", "env"]) == 0
    assert "export VLLM_OMNI_DLO_DP_WAVE_TIMEOUT=2700" in capsys.readouterr().out
    assert main(["presets", "show", "no-such-preset"]) == 2


# ----------------------------------------------------------------------------------------------
# real servers from the cpu-tiny presets (one at a time)


def _rendered(name: str):
    """An ``own_servers`` declaration (tests/conftest.py) of a cpu preset as rendered for its tiny model:
    the preset's model, flags and environment (its deploy YAML written to the server's directory)."""
    def declare(tiny_models: dict[str, Path]) -> tuple[Path, dict, dict | None]:
        rendered = render(CATALOG[name], options_for(CATALOG[name], tiny_models))
        flags = list(rendered.flags)
        if rendered.deploy is not None:
            at = flags.index("--deploy-config")
            del flags[at:at + 2]
        return Path(rendered.model), {name: (flags, dict(rendered.env))}, rendered.deploy

    return declare


@pytest.mark.server
@pytest.mark.own_servers.with_args(_rendered("wan2.1-t2v-tiny.cpu.x2.latency"))
def test_cpu_tiny_cfg2_preset_serves_a_video(own) -> None:
    proc = own["wan2.1-t2v-tiny.cpu.x2.latency"]
    # The request carries the preset's request defaults, as render.request_hint tells clients to: a
    # front end (omni-ext's own /v1/videos) fills missing fields with Wan's native 832x480x81.
    preset = CATALOG["wan2.1-t2v-tiny.cpu.x2.latency"]
    fields = {"prompt": "a red fox in snow", "seed": "7", **{k: str(v) for k, v in preset.request_defaults.items()}}
    resp = requests.post(proc.url + "/v1/videos/sync", files={k: (None, v) for k, v in fields.items()}, timeout=600)
    assert resp.status_code == 200, resp.text[:500]
    assert decode_mp4(resp.content) == (5, 32, 32)
    log = proc.log_text()
    assert "Worker 1: Initialization complete" in log and "Worker 2:" not in log  # CFG 2 = two ranks


@pytest.mark.server
@pytest.mark.own_servers.with_args(_rendered("qwen-image-tiny.cpu.x1.balanced"))
def test_cpu_tiny_qwen_preset_serves_an_image(own) -> None:
    proc = own["qwen-image-tiny.cpu.x1.balanced"]
    # vLLM-Omni 0.30's /v1/images/generations ignores server-side default sampling params, so the
    # client sends the preset's request defaults itself (render.request_hint says so).
    body = {"prompt": "a lighthouse at dusk", "seed": 3, **CATALOG["qwen-image-tiny.cpu.x1.balanced"].request_defaults}
    resp = requests.post(proc.url + "/v1/images/generations", json=body, timeout=600)
    assert resp.status_code == 200, resp.text[:500]
    assert decode_png(base64.b64decode(resp.json()["data"][0]["b64_json"])).shape[:2] == (32, 32)


# The cpu two-host preset's head and replica commands, as rendered, serve through the head in
# tests/test_replicas.py::test_multihost_burst_then_replica_loss_fails_only_its_job_then_it_rejoins
# (its multi-machine servers are that preset's).
