"""The topology planner: the user-reported cases, its rules, and the honesty of its estimates."""

from __future__ import annotations

import json

import pytest

from omni_ext.presets import load_catalog, load_cost_table
from omni_ext.presets.costs import Topology, parse_cost_table
from omni_ext.presets.planner import estimate, plan
from omni_ext.presets.shared import requests_use_cfg

COSTS = load_cost_table()


# ----------------------------------------------------------------------------------------------
# the user-reported cases


def test_wan_1_3b_on_two_910b_for_latency_is_cfg_2_at_the_reported_180_s() -> None:
    p = plan("wan2.1-t2v-1.3b", "910b3", 2, "latency")
    assert p.topology == Topology(cfg=2)
    assert p.estimate.latency_s == pytest.approx(180.0) and p.estimate.measured
    assert "user report" in p.estimate.basis[0]
    assert p.reasons[0].startswith("CFG 2: the requests run CFG")


def test_qwen_image_on_eight_910b_for_throughput_is_replicas_not_tp() -> None:
    p = plan("qwen-image", "910b3", 8, "throughput")
    assert p.topology == Topology(replicas=8)
    tp_line = next(r for r in p.reasons if r.startswith("TP 1"))
    assert "fit one device" in tp_line and "all-reduce" in tp_line
    assert any(r.startswith("Replicas 8") and "never --data-parallel-size" in r for r in p.reasons)
    assert any(r.startswith("CFG 1") and "negative_prompt" in r for r in p.reasons)


@pytest.mark.parametrize(("model", "device", "count", "cfg", "latency"), [
    ("wan2.1-t2v-1.3b", "910b3", 1, 1, 360.0),
    ("wan2.1-t2v-1.3b", "4090", 1, 1, 172.0),
    ("wan2.1-t2v-1.3b", "4090", 2, 2, 89.0),
    ("qwen-image-2512", "910b3", 1, 1, 26.0),
])
def test_measured_user_reports_come_back_unchanged(model: str, device: str, count: int, cfg: int, latency: float) -> None:
    p = plan(model, device, count, "latency")
    assert p.topology.cfg == cfg
    assert p.estimate.latency_s == pytest.approx(latency) and p.estimate.measured


# ----------------------------------------------------------------------------------------------
# rules


def test_cfg_2_only_when_the_requests_run_cfg() -> None:
    assert plan("qwen-image", "910b3", 2, "latency").topology == Topology(ulysses=2)
    assert plan("qwen-image", "910b3", 2, "latency", requests_use_cfg=True).topology == Topology(cfg=2)
    assert plan("wan2.1-t2v-1.3b", "910b3", 2, "latency", requests_use_cfg=False).topology.cfg == 1


def test_tp_only_to_fit_memory() -> None:
    wan22 = plan("wan2.2-t2v-a14b", "910b3", 2, "latency")
    assert wan22.topology == Topology(tp=2)
    assert any(r.startswith("TP 2: required to fit") for r in wan22.reasons)
    for model in ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "qwen-image"):
        for count in (2, 4, 8):
            for objective in ("latency", "throughput", "auto"):
                assert plan(model, "910b3", count, objective).topology.tp == 1, (model, count, objective)
    assert all(t["tp"] == 2 for t in (a["topology"] for a in plan("wan2.2-t2v-a14b", "910b3", 8, "latency").alternatives))


def test_a_model_that_cannot_fit_gets_no_topology_and_a_fix() -> None:
    p = plan("wan2.2-t2v-a14b", "910b3", 1, "latency")
    assert not p.feasible
    assert "does not fit" in p.reasons[0] and "--enable-layerwise-offload" in p.reasons[0]


def test_ulysses_degree_must_divide_the_attention_heads() -> None:
    # Wan2.1-1.3B has 12 heads: Ulysses 8 is never a candidate.
    p = plan("wan2.1-t2v-1.3b", "910b3", 8, "latency")
    assert all(a["topology"]["ulysses"] != 8 for a in p.alternatives) and p.topology.ulysses != 8
    assert plan("qwen-image", "910b3", 8, "latency").topology == Topology(ulysses=8)  # 24 heads


def test_auto_is_balanced_and_throughput_prefers_replicas_when_cfg_is_less_efficient() -> None:
    assert plan("wan2.1-t2v-1.3b", "h100", 8, "auto").topology == plan("wan2.1-t2v-1.3b", "h100", 8, "balanced").topology
    assert plan("wan2.1-t2v-1.3b", "h100", 8, "throughput").topology == Topology(replicas=8)
    # On 910B3 CFG 2 measured a full 2.0x, as good as a replica, and halves the latency.
    assert plan("wan2.1-t2v-1.3b", "910b3", 8, "throughput").topology == Topology(replicas=4, cfg=2)


def test_long_requests_raise_the_forward_timeouts() -> None:
    p = plan("wan2.1-t2v-14b", "910b3", 1, "latency")
    assert p.estimate.latency_s > 600
    assert p.env["VLLM_OMNI_DLO_DP_WAVE_TIMEOUT"] == p.env["VLLM_OMNI_VIDEO_SYNC_TIMEOUT"] == "2700"
    assert plan("wan2.1-t2v-1.3b", "910b3", 2, "latency").env == {}


# ----------------------------------------------------------------------------------------------
# estimates say where they are extrapolated


def test_other_topology_is_flagged_with_the_speedup_source() -> None:
    est = plan("wan2.1-t2v-1.3b", "910b3", 8, "latency").estimate
    assert not est.measured
    assert any("cfg2.u4" in e and "MindIE-SD" in e for e in est.extrapolated)


def test_other_device_model_and_request_are_flagged() -> None:
    a100 = plan("wan2.1-t2v-1.3b", "a100", 1, "latency").estimate
    assert any("speed assumed equal to h100" in e for e in a100.extrapolated)
    wan22 = plan("wan2.2-t2v-a14b", "910b3", 2, "latency").estimate
    assert any("costed like wan2.1-t2v-14b" in e for e in wan22.extrapolated)
    bigger = plan("wan2.1-t2v-1.3b", "910b3", 1, "latency", request={"width": 1280, "height": 720}).estimate
    assert bigger.latency_s > 2.25 * 360  # more tokens, and attention grows quadratically
    assert any(e.startswith("request:") for e in bigger.extrapolated)
    steps = plan("wan2.1-t2v-1.3b", "910b3", 1, "latency", request={"steps": 25}).estimate
    assert steps.latency_s == pytest.approx(180.0)


def test_cross_device_estimate_names_the_ratio_it_used() -> None:
    table = parse_cost_table({**_raw(), "anchors": [a for a in _raw()["anchors"] if a["model"] != "qwen-image-2512"]})
    est = estimate(table.model("qwen-image"), table.device("910b3"), Topology(), costs=table)
    assert any("scaled from h100" in e and "wan2.1-t2v-1.3b" in e for e in est.extrapolated)


def test_no_anchor_means_no_number() -> None:
    est = plan("qwen-image-tiny", "cpu", 1, "latency").estimate
    assert est.latency_s is None and est.extrapolated


def test_every_cost_figure_names_its_source() -> None:
    assert all(a.source.strip() for a in COSTS.anchors)
    assert all(f.source.strip() for table in COSTS.speedups.values() for f in table.values())
    assert all(f.source.strip() for table in COSTS.replica_efficiency.values() for f in table.values())
    assert COSTS.one_host_layout.source.strip() and COSTS.one_host_layout.reason.strip()


# ----------------------------------------------------------------------------------------------
# catalog agreement and CLI


def test_every_catalog_preset_is_what_the_planner_recommends() -> None:
    for preset in load_catalog().values():
        device = COSTS.families[preset.device]["reference_device"]
        p = plan(preset.model, device, preset.count, preset.objective, requests_use_cfg=requests_use_cfg(preset, COSTS),
                 hosts=preset.hosts)
        assert p.topology == preset.topology, preset.name


def test_plan_cli_text_and_json(capsys) -> None:
    from omni_ext.cli import main

    assert main(["plan", "--model", "wan2.1-t2v-1.3b", "--device", "910b3", "--count", "2", "--objective", "latency"]) == 0
    text = capsys.readouterr().out
    assert "topology: 1 replica x CFG 2" in text and "[measured]" in text
    assert "preset: wan2.1-t2v-1.3b.910b.x2.latency" in text
    assert main(["plan", "--model", "qwen-image", "--device", "910b", "--count", "8", "--objective", "throughput", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["topology"]["replicas"] == 8 and data["presets"] == ["qwen-image.910b.x8.throughput"]
    assert main(["plan", "--model", "wan2.2-t2v-a14b", "--device", "910b3", "--count", "1"]) == 1
    assert main(["plan", "--model", "nope", "--device", "910b3", "--count", "1"]) == 2


def _raw() -> dict:
    from importlib import resources

    import yaml

    return yaml.safe_load(resources.files("omni_ext.presets").joinpath("costs.yaml").read_text())


# ----------------------------------------------------------------------------------------------
# executor, one-host layout, several hosts


def _layout_table(replicas: float | None, dp: float | None):
    raw = _raw()
    raw["one_host_layout"] = {**raw["one_host_layout"], "replicas_per_hour": replicas, "dp_groups_per_hour": dp}
    return parse_cost_table(raw)


def test_one_host_throughput_is_replicas_of_tuned_executors_and_says_why() -> None:
    p = plan("wan2.1-t2v-1.3b", "910b3", 8, "throughput")
    assert p.topology == Topology(replicas=4, cfg=2) and p.layout == "replicas"
    (line,) = [r for r in p.reasons if r.startswith("Executor:")]
    assert "4 replicas, each its own TunedExecutor, not one TunedExecutor with data_parallel_size 4" in line
    # the measured figures (omni-ext bench serving on this host) are cited, and replicas win the tie
    assert "measured 4511/h as replicas vs 4486/h as data-parallel groups" in line
    assert "omni-ext bench serving --suite topologies, 2-core CPU host" in line
    assert "a lost replica fails only its own jobs" in line and "dispatch already balances them" in line


def test_measured_layout_figures_decide_and_are_cited() -> None:
    dp_wins = plan("wan2.1-t2v-1.3b", "910b3", 8, "throughput", costs=_layout_table(100.0, 130.0))
    assert dp_wins.layout == "dp-groups"
    assert any("one TunedExecutor with data_parallel_size 4, not 4 replicas: measured 100/h as replicas vs 130/h" in r
               for r in dp_wins.reasons)
    tie = plan("wan2.1-t2v-1.3b", "910b3", 8, "throughput", costs=_layout_table(100.0, 101.0))
    assert tie.layout == "replicas"  # within 2 %: replicas, for their failure isolation
    assert any("measured 100/h as replicas vs 101/h" in r for r in tie.reasons)


def test_the_executor_line_says_where_the_tuned_executor_does_not_apply() -> None:
    p = plan("wan2.2-t2v-a14b", "910b3", 2, "latency")  # tensor parallel runs under the TunedExecutor too
    assert p.topology.tp == 2
    assert any(r.startswith("Executor: omni-ext's TunedExecutor (--distributed-executor-backend") for r in p.reasons)
    ulysses = plan("qwen-image", "910b3", 8, "latency")  # sequence parallel runs under the TunedExecutor
    assert ulysses.topology.ulysses == 8
    assert any(r.startswith("Executor: omni-ext's TunedExecutor (--distributed-executor-backend") for r in ulysses.reasons)
    one = plan("wan2.1-t2v-1.3b", "910b3", 1, "balanced")
    assert any(r.startswith("Executor: omni-ext's TunedExecutor (--distributed-executor-backend") for r in one.reasons)


def test_two_hosts_for_throughput_are_the_one_host_layout_on_each_behind_one_head(capsys) -> None:
    from omni_ext.cli import main

    one = plan("wan2.1-t2v-1.3b", "910b3", 8, "throughput")
    two = plan("wan2.1-t2v-1.3b", "910b3", 8, "throughput", hosts=2)
    assert two.topology == one.topology == Topology(replicas=4, cfg=2) and two.hosts == 2
    assert two.estimate.latency_s == one.estimate.latency_s  # a replica never spans hosts
    assert two.estimate.throughput_per_hour == pytest.approx(8 * 0.95 * 3600 / 180)  # 8 replicas in all
    assert any("8 replicas at 0.95 efficiency" in e for e in two.estimate.extrapolated)
    (line,) = [r for r in two.reasons if r.startswith("Hosts 2:")]
    assert "1 headless replica host(s)" in line and "a lost host fails only its own jobs" in line
    assert main(["plan", "--model", "wan2.1-t2v-1.3b", "--device", "910b3", "--count", "8", "--objective", "throughput",
                 "--hosts", "2"]) == 0
    text = capsys.readouterr().out
    assert "topology: 4 replicas x CFG 2 x Ulysses 1 x TP 1 per host" in text
    assert "preset: wan2.1-t2v-1.3b.910b.2x8.throughput  (head: omni-ext serve --preset" in text and "--role replica" in text
    assert main(["plan", "--model", "wan2.1-t2v-tiny", "--device", "cpu", "--count", "1", "--objective", "throughput",
                 "--hosts", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hosts"] == 2 and data["presets"] == ["wan2.1-t2v-tiny.cpu.2x1.throughput"]
