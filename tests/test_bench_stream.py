"""``omni-ext bench stream``'s pure parts: the workload, the per-request statistics, the figures and
their goals, the stock server's command, the table and the plot. The measurement itself runs real
servers (``omni-ext bench stream --json OUT``); its figures are the README's, not asserted here."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from omni_ext.bench import common as c
from omni_ext.bench import mixed
from omni_ext.bench import stream as st


def test_classes_and_loads_are_parsed_and_bad_ones_named() -> None:
    assert st.parse_class("81x20") == (81, 20)
    assert st.parse_loads("0.5, 0.7,0.9") == [0.5, 0.7, 0.9]
    with pytest.raises(ValueError, match="FRAMESxSTEPS"):
        st.parse_class("81")
    with pytest.raises(ValueError, match="positive"):
        st.parse_class("0x4")
    with pytest.raises(ValueError, match="fractions of capacity"):
        st.parse_loads("0.5,3")


def test_servers_are_a_subset_in_the_benchmarks_order() -> None:
    assert st.parse_servers("stock,slo") == ["slo", "stock"]
    assert st.parse_servers("slo,fifo,stock,nopreempt") == ["slo", "fifo", "stock", "nopreempt"]
    for bad in ("", "slo,vllm", " , "):
        with pytest.raises(ValueError, match="--servers"):
            st.parse_servers(bad)


def test_arrivals_are_seeded_poisson_at_the_asked_share_of_capacity() -> None:
    cap = st.capacity_rps({"short": 1.0, "long": 8.0}, 0.75)
    assert cap == pytest.approx(2 / (0.75 * 1.0 + 0.25 * 8.0))
    a = st.arrivals(0.7, cap, 20_000.0, 0.75, seed=3)
    assert a == st.arrivals(0.7, cap, 20_000.0, 0.75, seed=3)  # the same stream for every server
    assert a != st.arrivals(0.9, cap, 20_000.0, 0.75, seed=3)
    assert len(a) / 20_000.0 == pytest.approx(0.7 * cap, rel=0.05)
    assert sum(cls == "short" for _, cls in a) / len(a) == pytest.approx(0.75, abs=0.02)
    assert all(0 < t <= 20_000.0 for t, _ in a) and [t for t, _ in a] == sorted(t for t, _ in a)


def test_each_load_gets_its_expected_count_and_the_exact_mix() -> None:
    """A short run's free Poisson count can invert the loads (12-03: 36 requests at "0.5", 27 at
    "0.7"); the count is the expected one and the share exact, the times still Poisson-like."""
    cap = 0.559
    counts = {load: st.arrivals(load, cap, 90.0, 0.75, seed=0) for load in (0.5, 0.7, 0.9)}
    assert [len(a) for a in counts.values()] == [round(load * cap * 90.0) for load in (0.5, 0.7, 0.9)]
    for a in counts.values():
        assert sum(cls == "short" for _, cls in a) == round(0.75 * len(a))
    long_run = st.arrivals(0.9, cap, 20_000.0, 0.75, seed=0)
    gaps = [b - a for (a, _), (b, _) in zip(long_run, long_run[1:])]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert cv == pytest.approx(1.0, abs=0.1)  # exponential gaps (a Poisson process), not a metronome


def _req(cls: str, latency: float | None, end: float | None = None, status: str = "completed") -> dict:
    return {"cls": cls, "status": status, "latency_s": latency, "end_s": end if end is not None else latency}


def test_a_refused_request_is_a_miss_and_an_unbounded_tail_has_no_p99() -> None:
    alone = {"short": 1.0, "long": 5.0}
    reqs = [_req("short", 1.5, 2.0), _req("short", 2.9, 4.0), _req("long", 10.0, 12.0), _req("long", 30.0, 40.0),
            _req("short", None, status="refused")]
    s = st.stream_stats(reqs, alone)
    assert s["n"] == 5 and s["completed"] == 4 and s["refused"] == 1
    assert s["slo3_attainment"] == pytest.approx(3 / 5)  # 1.5x, 2.9x, 2x in; 6x and the refused one out
    assert s["slo5_attainment"] == pytest.approx(3 / 5)
    assert s["long"]["p50_slowdown"] == pytest.approx(4.0) and s["long"]["p99_slowdown"] == pytest.approx(5.96)
    assert s["short"]["p99_slowdown"] is None  # the refused one is the tail: unbounded
    assert s["short"]["p50_latency_s"] == pytest.approx(2.2)
    assert s["throughput_rps"] == pytest.approx(4 / 40.0)


def _raw(att: dict[str, float], n: int = 20) -> list[dict]:
    """``n`` short requests of which a share ``att`` is within 3x (the rest at 4x)."""
    k = round(att * n)
    return [_req("short", 2.0 if i < k else 4.0, 10.0 + i) for i in range(n)]


def test_figures_pass_only_ahead_of_fifo_and_stock_and_preemption_costs_little() -> None:
    standalone = {"slo": {"short": 1.1, "long": 8.0}, "fifo": {"short": 1.0, "long": 8.4}, "stock": {"short": 1.2, "long": 7.9}}
    raw = {"slo": {"0.7": _raw(1.0), "0.9": _raw(0.9)}, "fifo": {"0.7": _raw(0.8), "0.9": _raw(0.9)},
           "stock": {"0.7": _raw(0.5), "0.9": _raw(0.4)}, "nopreempt": {"0.9": _raw(0.85)}}
    out = st.summarize(raw, standalone, [0.7, 0.9], {"interactive_start_over_step": 1.2, "long_step_s": 0.4},
                       {"measurement": True}, {"seed": 0})
    assert out["yardstick_s"] == {"short": 1.0, "long": 7.9}  # the fastest server's: one bound for all
    f = out["figures"]
    assert f["stream.slo3_attainment@0.7"]["pass"] is True and f["stream.slo3_attainment@0.7"]["stock_value"] == 0.5
    # 0.9 reached, but not ahead of fifo's equal 0.9: not a pass
    assert f["stream.slo3_attainment@0.9"]["value"] == 0.9 and f["stream.slo3_attainment@0.9"]["pass"] is False
    assert f["preempt.interactive_start_over_step"]["pass"] is True
    loss = f["preempt.throughput_loss"]
    assert loss["value"] == pytest.approx(1 - (20 / 29.0) / (20 / 29.0)) and loss["pass"] is True
    text = st.table(out)
    assert "stream.slo3_attainment@0.9" in text and "stock (vLLM-Omni)" in text and "fastest server's median" in text
    # the capacity is measured: standalone speed over how much slower two jobs at once run
    out = st.summarize(raw, standalone, [0.7, 0.9], None, {"measurement": True},
                       {"capacity_rps": 0.19, "capacity_rps_alone": 0.209, "two_jobs_over_alone": {"slo": 1.12, "stock": 1.1},
                        "contention": 1.11, "groups": 2})
    assert "0.209 req/s at standalone speed, over two long jobs at once each 1.110x slower" in st.table(out)
    # ``--servers slo``: ahead of the baselines it ran (none), the goal alone; with fifo alone, ahead of fifo
    alone = st.summarize({"slo": raw["slo"]}, {"slo": standalone["slo"]}, [0.7, 0.9], None, {"measurement": True}, {})
    fig = alone["figures"]["stream.slo3_attainment@0.9"]
    assert fig["pass"] is True and fig["ahead_of_baselines"] is None
    pair = st.summarize({k: raw[k] for k in ("slo", "fifo")}, {k: standalone[k] for k in ("slo", "fifo")}, [0.7, 0.9],
                        None, {"measurement": True}, {})
    assert pair["figures"]["stream.slo3_attainment@0.7"]["pass"] is True  # 1.0 against fifo's 0.8
    assert pair["figures"]["stream.slo3_attainment@0.9"]["pass"] is False  # 0.9 against fifo's equal 0.9


def test_the_stock_server_runs_vllm_omnis_executor_and_dispatch(tmp_path: Path) -> None:
    specs, envs = st.server_specs(mixed.replicas_deploy(tmp_path))
    assert set(specs) == {"slo", "fifo", "stock", "nopreempt"}
    for name, flags in specs.items():
        deploy = yaml.safe_load(Path(flags[flags.index("--deploy-config") + 1]).read_text()) if "--deploy-config" in flags else None
        assert (c.omni_ext_executor_in(flags, deploy) == []) == (name == "stock"), name
    c.refuse_omni_ext_in_stock("stock", specs["stock"])
    assert envs == {"stock": {"OMNI_EXT_DISABLE_PATCHES": "replica-dispatch"}}
    assert json.loads(specs["fifo"][-1])["omni_ext"]["scheduler"] == {"order": "fifo"}
    assert json.loads(specs["nopreempt"][-1])["omni_ext"]["scheduler"] == {"preempt": False}


def test_dry_run_names_the_servers_and_the_goals(capsys) -> None:
    from omni_ext.cli import main

    assert main(["bench", "stream", "--dry-run", "--quick"]) == 0
    plan = json.loads(capsys.readouterr().out.split("\n[bench]")[0])
    assert set(plan["servers (started together, measured one at a time)"]) == {"slo", "fifo", "stock", "nopreempt"}
    assert plan["classes"]["long"]["request"]["num_frames"] == 17 and plan["loads"] == [0.7]
    assert plan["goals"]["stream.slo3_attainment@0.9"] == ">= 0.85"


def test_the_plot_draws_attainment_against_load(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    by_load = {k: {n: {"slo3_attainment": v} for n, v in zip(("slo", "fifo", "stock"), vals)}
               for k, vals in {"0.5": (1.0, 0.9, 0.7), "0.9": (0.9, 0.6, 0.4)}.items()}
    st.plot({"by_load": by_load}, tmp_path / "stream.png")
    assert (tmp_path / "stream.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_request_class_becomes_the_fields_of_a_video() -> None:
    args = SimpleNamespace(size="64x64", classes={"short": (9, 8), "long": (81, 20)})
    f = st._fields(args, "long", 5)
    assert (f["num_frames"], f["num_inference_steps"], f["seed"], f["size"]) == (81, 20, 5, "64x64")


def test_predictions_per_class_report_duration_and_start_errors() -> None:
    """Per class: |predicted / reported - 1| of each predicted job, |waited - predicted wait| of each job
    whose POST answer predicted a wait; a server without predictions (vLLM-Omni's) reports none."""
    alone = {"short": 1.0, "long": 5.0, "few": 0.5}
    reqs = [
        {**_req("short", 2.0, 3.0), "predicted_s": 1.1, "run_s": 1.0, "predicted_wait_s": 1.0, "waited_s": 1.5},
        {**_req("short", 2.0, 4.0), "predicted_s": 0.9, "run_s": 1.0, "predicted_wait_s": None, "waited_s": 0.1},
        {**_req("short", 2.0, 5.0), "predicted_s": 1.0, "run_s": 1.0, "predicted_wait_s": 2.0, "waited_s": 1.0},
        {**_req("long", 9.0, 14.0), "predicted_s": 4.0, "run_s": 5.0, "predicted_wait_s": 0.0, "waited_s": 0.2},
        {**_req("few", 1.0, 15.0), "predicted_s": None, "run_s": 0.5},  # no rate known yet: not counted
        {**_req("few", 1.0, 16.0), "predicted_s": 0.6, "run_s": 0.5},
        {**_req("short", None, status="refused"), "predicted_s": 5.0},
    ]
    p = st.prediction_stats(reqs, alone)
    assert p["short"]["n_duration"] == 3 and p["short"]["duration_error_p50"] == pytest.approx(0.1)
    assert p["short"]["n_start"] == 2 and p["short"]["start_error_p50_s"] == pytest.approx(0.75)
    assert p["short"]["start_error_p90_s"] == pytest.approx(0.95)
    assert p["short"]["start_error_p50_over_standalone"] == pytest.approx(0.75)
    assert p["long"]["duration_error_p50"] == pytest.approx(0.2) and p["long"]["start_error_p50_s"] == pytest.approx(0.2)
    assert p["few"]["n_duration"] == 1 and p["few"]["duration_error_p50"] == pytest.approx(0.2)
    assert p["few"]["n_start"] == 0 and p["few"]["start_error_p50_s"] is None
    assert st.stream_stats(reqs, alone)["predictions"] == p
    assert "predictions" not in st.stream_stats([_req("short", 2.0, 3.0)], alone)  # vLLM-Omni's executor


def test_the_table_shows_the_predictions_of_the_servers_that_make_them() -> None:
    standalone = {"slo": {"short": 1.0, "long": 5.0}, "stock": {"short": 1.1, "long": 5.2}}
    pred = {"predicted_s": 1.2, "run_s": 1.0, "predicted_wait_s": 1.0, "waited_s": 1.4}
    raw = {"slo": {"0.7": [{**_req("short", 2.0, 3.0), **pred}, _req("long", 6.0, 9.0)]},
           "stock": {"0.7": [_req("short", 2.5, 3.0), _req("long", 7.0, 9.0)]}}
    result = st.summarize(raw, standalone, [0.7], None, {"measurement": True}, {"seed": 0})
    assert result["by_load"]["0.7"]["slo"]["predictions"]["short"]["duration_error_p50"] == pytest.approx(0.2)
    assert "predictions" not in result["by_load"]["0.7"]["stock"]
    text = st.table(result)
    assert "omni-ext's predictions per class" in text
    rows = [line for line in text.splitlines() if line.lstrip("| ").startswith("0.7") and "short" in line and "0.2" in line]
    assert rows and "stock" not in rows[0]


def test_a_job_record_takes_its_predictions_from_the_answer_and_the_log() -> None:
    from omni_ext.bench.client import Answer
    from omni_ext.bench.logwatch import LogEvent

    class Watcher:
        events = [LogEvent("start", "video_1-0", 12.5, (0,), mode="single", predicted_s=0.8),
                  LogEvent("done", "video_1-0", 13.4, (0,), seconds=0.9)]

        def first(self, kind, job_id):
            return next((e for e in self.events if e.kind == kind and e.request_id.startswith(job_id)), None)

    a = Answer(200, {"id": "video_1", "predicted_wait_s": 2.0}, {}, 10.0, 10.1, "job")
    assert st._predictions(a, Watcher()) == {"predicted_wait_s": 2.0, "waited_s": 2.5, "predicted_s": 0.8, "run_s": 0.9}
    assert st._predictions(a, None) == {}
    assert st._predictions(Answer(200, {"id": "video_2"}, {}, 10.0, 10.1, "job"), Watcher()) == {}


def test_the_mix_has_a_few_step_class_at_its_exact_share() -> None:
    """The default mix: half short, a quarter few-step (FastWan's shape, no CFG), the long class the
    rest; each exactly its share of a load's count, and the capacity over the mix's mean seconds."""
    shares = st.mix_shares(0.5, 0.25)
    assert shares == {"short": 0.5, "few": 0.25, "long": 0.25} and st.mix_shares(0.75) == {"short": 0.75, "long": 0.25}
    for bad in ((0.8, 0.2), (0.0, 0.2), (0.5, -0.1)):
        with pytest.raises(ValueError, match="long class"):
            st.mix_shares(*bad)
    alone = {"short": 1.0, "few": 0.4, "long": 8.0}
    assert st.capacity_rps(alone, shares) == pytest.approx(2 / (0.5 * 1.0 + 0.25 * 0.4 + 0.25 * 8.0))
    assert st.capacity_rps(alone, 0.75) == pytest.approx(2 / (0.75 + 2.0))  # a short/long mix as before
    a = st.arrivals(0.7, 1.3, 200.0, shares, seed=1)
    n = len(a)
    assert n == round(0.7 * 1.3 * 200.0) and a == st.arrivals(0.7, 1.3, 200.0, shares, seed=1)
    counts = {cls: sum(x == cls for _, x in a) for cls in shares}
    assert counts["short"] == round(0.5 * n) and counts["few"] == round(0.25 * n) and sum(counts.values()) == n
    assert st.arrivals(0.7, 1.3, 200.0, 0.75, seed=1) == st.arrivals(0.7, 1.3, 200.0, {"short": 0.75, "long": 0.25}, seed=1)


def test_a_few_step_request_has_no_cfg_and_its_class_is_reported() -> None:
    args = SimpleNamespace(size="64x64", classes={"short": (9, 8), "few": (9, 3), "long": (81, 20)})
    few, short = st._fields(args, "few", 3), st._fields(args, "short", 3)
    assert (few["num_frames"], few["num_inference_steps"], few["guidance_scale"]) == (9, 3, 1.0)
    assert short["guidance_scale"] > 1.0
    standalone = {"slo": {"short": 1.0, "few": 0.4, "long": 8.0}, "stock": {"short": 1.1, "few": 0.5, "long": 8.2}}
    raw = {name: {"0.9": [_req("short", 2.0, 3.0), _req("few", 1.0, 4.0), _req("few", 2.0, 5.0), _req("long", 9.0, 9.0)]}
           for name in standalone}
    result = st.summarize(raw, standalone, [0.9], None, {"measurement": True}, {"seed": 0})
    assert result["yardstick_s"] == {"short": 1.0, "few": 0.4, "long": 8.0}
    few_stats = result["by_load"]["0.9"]["slo"]["few"]
    assert few_stats["n"] == 2 and few_stats["p99_slowdown"] == pytest.approx(4.975)  # 2.5x and 5x
    text = st.table(result)
    assert any(line.lstrip("| ").startswith("0.9") and "few" in line for line in text.splitlines())


def test_the_dry_run_plans_the_three_classes(capsys) -> None:
    from omni_ext.cli import main

    assert main(["bench", "stream", "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out.split("\n[bench]")[0])
    assert list(plan["classes"]) == ["short", "few", "long"] and plan["shares"]["few"] == 0.25
    assert plan["classes"]["few"]["request"]["guidance_scale"] == 1.0
    assert main(["bench", "stream", "--dry-run", "--few-share", "0", "--short-share", "0.75"]) == 0
    assert list(json.loads(capsys.readouterr().out.split("\n[bench]")[0])["classes"]) == ["short", "long"]
    with pytest.raises(SystemExit, match="long class"):
        main(["bench", "stream", "--dry-run", "--short-share", "0.8"])
