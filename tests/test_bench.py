"""The scheduler benchmarks' arithmetic and JSON (``omni_ext.bench``), on plain data: no server, no
timing assertion. The benchmarks themselves run real servers (``omni-ext bench adaptive|mixed|admission``)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from omni_ext.bench import adaptive, admission, mixed
from omni_ext.bench import common as c
from omni_ext.bench import schedule as s
from omni_ext.bench.ceiling import job_pair_result, weighted_slowdown
from omni_ext.bench.client import JobTracker, classify, retry_delay_s
from omni_ext.bench.logwatch import LogEvent, LogWatcher, mode_counts, parse_line, running_at, same_job
from omni_ext.cli import build_parser

HOST = {"cpus": 2, "loadavg_at_start": [0.2, 0.3, 0.4], "uptime": "up", **c.load_check(0.2, 1.0)}
BUSY = {"cpus": 2, "loadavg_at_start": [2.5, 2.0, 1.0], "uptime": "up", **c.load_check(2.5, 1.0)}


def parse(*argv: str):
    return build_parser().parse_args(["bench", *argv])


# ---- schedule ---------------------------------------------------------------------------------------
def test_makespan_bound_is_the_larger_of_average_load_and_longest_job() -> None:
    b = s.makespan_bound([25, 5, 25, 5, 25, 5], 2)
    assert b == {"total_s": 90.0, "longest_s": 25.0, "total_over_groups_s": 45.0, "bound_s": 45.0}
    assert s.makespan_bound([30, 1, 1], 2)["bound_s"] == 30.0  # one long job dominates


def test_list_scheduling_fifo_lpt_and_optimum() -> None:
    jobs = [7.5, 3.3, 7.5, 3.3, 7.5, 3.3]  # 81, 17, 81, 17, 81, 17 frames
    assert s.list_schedule(jobs, 2) == pytest.approx(18.3)  # FIFO: the last 81 starts at 10.8
    assert s.lpt_makespan(jobs, 2) == pytest.approx(17.4)
    assert s.optimal_makespan(jobs, 2) == pytest.approx(17.4)
    # Three equal long jobs cannot split evenly over two groups: the optimum is above the bound.
    assert s.optimal_makespan([25, 25, 25, 5, 5, 5], 2) == 50.0
    assert s.optimal_makespan([1.0] * 20, 2) is None  # too many for exhaustive search
    assert s.optimal_makespan([], 2) == 0.0


@pytest.mark.parametrize(
    "capacity,max_wait,job,admitted",
    [(2, 12.0, 3.3, 8), (2, 12.0, 3.0, 10), (2, 4.0, 5.0, 2), (1, 10.0, 2.5, 5)],
)
def test_expected_admitted_counts_jobs_predicted_to_start_within_max_wait(capacity, max_wait, job, admitted) -> None:
    assert s.expected_admitted(capacity, max_wait, job) == admitted


def test_burst_size_is_a_multiple_of_admitted_capped_and_always_past_it() -> None:
    assert s.burst_size(8, 3.0, 48) == 24
    assert s.burst_size(26, 3.0, 48) == 48
    assert s.burst_size(10, 3.0, 5) == 11  # never a burst admission would take whole
    with pytest.raises(ValueError):
        s.expected_admitted(2, 10, 0)


def test_frames_and_arrival_orders() -> None:
    assert s.parse_frames("81, 17,81") == [81, 17, 81]
    for bad in ("", "81,0", "x"):
        with pytest.raises(ValueError):
            s.parse_frames(bad)
    frames = [81, 17, 81, 17, 81, 17]
    assert s.alternating(frames) == [17, 81, 17, 81, 17, 81]
    assert s.alternating(frames, short_first=False) == frames
    assert s.arrival_orders(frames, False) == {"given": frames}
    orders = s.arrival_orders(frames, True)
    assert orders == {"given": frames, "longest_last": [17, 17, 17, 81, 81, 81],
                      "alternating_short_first": [17, 81, 17, 81, 17, 81]}
    assert list(s.arrival_orders([81, 17], True)) == ["given", "longest_last"]  # duplicates left out
    assert list(s.arrival_orders([17, 81], True)) == ["given"]


# ---- common -----------------------------------------------------------------------------------------
def test_figures_judge_against_their_goal() -> None:
    assert c.judge(1.0, "<=", 1.05) is True and c.judge(1.2, "<=", 1.05) is False
    assert c.judge(1.15, ">=", 1.15) is True and c.judge(None, ">=", 1) is None
    assert c.judge(float("nan"), "<=", 1) is None
    with pytest.raises(ValueError):
        c.judge(1.0, "==", 1.0)
    f = c.figure(1.2, ">=", 1.15, True, note="x")
    assert f == {"value": 1.2, "goal": ">= 1.15", "goal_op": ">=", "goal_value": 1.15, "pass": True,
                 "measurement": True, "note": "x"}
    assert c.verdict(f) == "PASS"
    assert c.verdict(c.figure(0.5, ">=", 1.15, False)) == "FAIL (not a measurement)"
    assert c.verdict(c.figure(None, ">=", 1.15, True)) == "n/a"


def test_ratio_guards() -> None:
    assert c.ratio(3.0, 2.0) == 1.5
    assert c.ratio(None, 2.0) is None and c.ratio(1.0, 0.0) is None and c.ratio(float("nan"), 1.0) is None


def test_host_load_above_the_limit_is_not_a_measurement() -> None:
    assert c.load_check(0.5, 1.0) == {"max_load": 1.0, "measurement": True, "warning": None}
    busy = c.load_check(2.82, 1.0)
    assert busy["measurement"] is False and "2.82 > 1" in busy["warning"]
    assert c.load_check(None, 1.0)["measurement"] is True  # no load average: nothing to hold against the run
    info = c.host_info(max_load=1e9)
    assert info["measurement"] is True and info["cpus"] >= 1 and "loadavg_at_start" in info
    c.finish_host(info)
    assert "loadavg_at_end" in info


def test_table_aligns_columns_and_formats_values() -> None:
    text = c.format_table(["a", "value"], [["x", 1.23456], ["longer", None], ["b", True]])
    lines = text.splitlines()
    assert lines[0].startswith("a       value") and set(lines[1]) <= {"-", " "}
    assert "1.235" in lines[2] and lines[3].endswith("-") and lines[4].endswith("yes")


def test_progress_line_and_bar() -> None:
    assert c.progress_line("x", 0, 4, 0.0) == "x [" + "." * 24 + "] 0/4  0 s"
    line = c.progress_line("x", 1, 4, 10.0, width=4, note="n")
    assert line == "x [#...] 1/4  10 s, ~30 s left  n"
    out = io.StringIO()
    p = c.Progress("jobs", 2, stream=out, min_interval_s=0.0)
    p.advance()
    p.advance()
    p.close()
    assert out.getvalue().splitlines()[-1].startswith("[bench] jobs [" + "#" * 24 + "] 2/2")


def test_profiles_fill_only_what_the_command_line_left_unset() -> None:
    args = parse("mixed", "--quick", "--steps", "7", "--json", "x.json")
    c.apply_profile(args, mixed.DEFAULTS, mixed.QUICK)
    assert args.steps == 7 and args.frames == mixed.QUICK["frames"] and args.skip_ceiling is True
    args = parse("mixed", "--json", "x.json")
    c.apply_profile(args, mixed.DEFAULTS, mixed.QUICK)
    assert args.frames == "81,17,81,17,81,17" and args.skip_ceiling is False and args.order_variants is False
    args = parse("adaptive", "--json", "x.json", "--skip-ceiling")
    c.apply_profile(args, adaptive.DEFAULTS, adaptive.QUICK)
    assert args.skip_ceiling is True and args.concurrency == 8 and args.size == "80x80"


def test_server_commands_are_copy_pasteable() -> None:
    assert c.shell_command(["serve", "a b", "{}"], {"B": "2", "A": "x y"}) == "A='x y' B=2 serve 'a b' '{}'"
    assert c.additional_config() == []
    cfg = c.additional_config(data_parallel_size=2, scheduler={"order": "fifo"})
    assert cfg[0] == "--additional-config"
    assert json.loads(cfg[1]) == {"omni_ext": {"data_parallel_size": 2, "scheduler": {"order": "fifo"}}}
    specs = mixed.server_specs()
    assert {json.loads(a[-1])["omni_ext"]["scheduler"]["order"] for a in specs.values()} == {"slo", "fifo"}
    from omni_ext.scheduler.config import SchedulerConfig

    assert mixed.ORDERS[0] == SchedulerConfig().order  # the burst is judged on omni-ext's default order
    modes = {json.loads(a[-1])["omni_ext"]["scheduler"]["cfg_mode"] for a in adaptive.server_specs().values()}
    assert modes == set(adaptive.MODES)
    assert all("--cfg-parallel-size" in a for a in adaptive.server_specs().values())


# ---- client -----------------------------------------------------------------------------------------
def test_retry_delay_prefers_milliseconds() -> None:
    assert retry_delay_s({"Retry-After": "7", "retry-after-ms": "6250"}) == 6.25
    assert retry_delay_s({"retry-after": "7"}) == 7.0
    assert retry_delay_s({"Retry-After-Ms": "bad", "Retry-After": "3"}) == 3.0
    assert retry_delay_s({}) is None and retry_delay_s({"retry-after": "-1"}) is None


def test_answers_are_jobs_refusals_or_errors() -> None:
    assert classify(200, {"id": "video_1"}, {}) == "job"
    assert classify(429, {"error": {"code": "queue_full"}}, {"Retry-After": "4"}) == "refused"
    assert classify(429, {"error": {"code": "queue_full"}}, {}) == "error"  # a 429 that does not say when
    assert classify(200, {}, {}) == "error"
    assert classify(503, {"error": {}}, {"Retry-After": "4"}) == "error"


# ---- log watcher ------------------------------------------------------------------------------------
START = "INFO 11-29 10:00:01 [omni-ext] omni-ext: start request video_ab-1f2e3d4c on rank(s) [0, 1] (pair), time limit 120 s"
DONE = "INFO 11-29 10:00:04 [omni-ext] omni-ext: done request video_ab-1f2e3d4c on rank(s) [0, 1] in 3.05 s"


def test_log_lines_parse() -> None:
    e = parse_line(START, 5.0)
    assert e == LogEvent("start", "video_ab-1f2e3d4c", 5.0, (0, 1), mode="pair")
    d = parse_line(DONE, 8.0)
    assert d.kind == "done" and d.seconds == 3.05 and d.ranks == (0, 1) and not d.error
    assert parse_line(DONE + " (error)", 8.0).error
    assert parse_line("omni-ext: start request x on rank(s) [1] (single)", 0).mode == "single"
    assert parse_line("omni-ext: start request w on rank(s) [0, 1] (warm-up)", 0).mode == "warm-up"
    done = parse_line("INFO ... omni-ext video video_ab completed in 3.40 s", 9.0)
    assert done.kind == "completed" and done.request_id == "video_ab" and done.seconds == 3.4
    assert parse_line("INFO something else entirely", 1.0) is None


def test_engine_request_ids_match_their_job() -> None:
    assert same_job("video_ab-1f2e3d4c", "video_ab") and same_job("video_ab", "video_ab")
    assert not same_job("video_abc-1f2e3d4c", "video_ab")


def test_running_at_and_mode_counts() -> None:
    ev = [LogEvent("start", "w", 0.0, mode="warm-up"), LogEvent("start", "a", 1.0, mode="single"),
          LogEvent("start", "b", 2.0, mode="single"), LogEvent("done", "a", 4.0), LogEvent("start", "c", 4.1, mode="pair")]
    assert running_at(ev, 3.0) == ["a", "b"]
    assert running_at(ev, 4.05) == ["b"]
    assert running_at(ev, 5.0) == ["b", "c"]
    assert mode_counts(ev) == {"warm-up": 1, "single": 2, "pair": 1}
    assert mode_counts(ev, since=1.5, until=4.5) == {"single": 1, "pair": 1}


def test_log_watcher_reads_lines_as_they_are_written(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    path.write_text("omni-ext: start request old on rank(s) [0] (single)\n")
    w = LogWatcher(path, interval_s=0.01).start()  # only what is written from now on
    try:
        with open(path, "a") as f:
            f.write(START[:40])
            f.flush()
            f.write(START[40:] + "\n" + DONE + "\n")
        assert w.wait("done", "video_ab", timeout=30) is not None
        assert w.first("start", "video_ab").mode == "pair"
        assert w.first("start", "old") is None
    finally:
        w.stop()
    assert [e.kind for e in w.events] == ["start", "done"]


def test_job_tracker_with_nothing_to_wait_for() -> None:
    assert JobTracker("http://127.0.0.1:9").wait([], timeout=1) == {}


# ---- adaptive ---------------------------------------------------------------------------------------
def _adaptive_raw() -> dict:
    def bursts(*rps):
        return [{"requests": 8, "wall_s": 8 / r, "throughput_rps": r, "latencies_s": [], "starts": {"single": 8}}
                for r in rps]

    return {
        "pair": {"low_load_latencies_s": [3.0, 3.1, 2.9, 3.0, 3.2], "high_load": bursts(0.32, 0.33, 0.31)},
        "single": {"low_load_latencies_s": [4.5, 4.6, 4.4, 4.5, 4.5], "high_load": bursts(0.40, 0.41, 0.39)},
        "adaptive": {"low_load_latencies_s": [3.05, 3.1, 3.0, 3.0, 3.1], "high_load": bursts(0.40, 0.39, 0.40)},
    }


FACTS_A = {"model_size": "med", "request": {}, "low_load_requests": 5, "concurrency": 8, "reps": 3, "together": False}


def test_adaptive_summary_ratios_goals_and_ceiling() -> None:
    ceiling = {"cfg_pair": {"speedup": 1.8}, "two_ranks": {"throughput_ratio": 1.9}}
    r = adaptive.summarize(_adaptive_raw(), ceiling, HOST, FACTS_A, {"x": {"shell": "vllm-omni serve ..."}})
    f = r["figures"]
    assert f["adaptive.low_load_latency_ratio"]["value"] == pytest.approx(3.05 / 3.0)
    assert f["adaptive.low_load_latency_ratio"]["pass"] is True
    assert f["adaptive.high_load_throughput_ratio"]["value"] == pytest.approx(0.40 / 0.32)
    assert f["adaptive.high_load_throughput_ratio"]["pass"] is True
    assert f["adaptive.high_load_vs_single_ratio"]["value"] == pytest.approx(0.40 / 0.40)
    assert r["adaptive"]["low_load_latency_ratio"] == f["adaptive.low_load_latency_ratio"]["value"]
    assert r["adaptive"]["goal_high_load_throughput_ratio"] == ">= 1.15"
    assert r["host_ceiling"]["single_ranks_over_pair_throughput"] == pytest.approx(1.9 / 1.8)
    assert r["high_load"]["starts_by_mode"]["adaptive"] == {"single": 24}
    assert r["measurement"] is True and r["server_commands"]
    json.dumps(r)  # JSON-ready
    text = adaptive.table(r)
    assert "adaptive.high_load_throughput_ratio" in text and "cfg_mode=single" in text and "PASS" in text


def test_adaptive_on_a_busy_host_is_recorded_but_not_a_measurement() -> None:
    r = adaptive.summarize(_adaptive_raw(), None, BUSY, FACTS_A, {})
    assert r["measurement"] is False and r["host_ceiling"] is None
    assert all(f["measurement"] is False for f in r["figures"].values())
    assert "NOT A MEASUREMENT" in adaptive.table(r)


# ---- mixed ------------------------------------------------------------------------------------------
def _mixed_raw(orders: dict[str, list[int]], cost_makespans: list[float], fifo_makespans: list[float],
               fifo_single: dict | None = None) -> dict:
    single = {"81": [7.4, 7.6], "17": [3.2, 3.4]}

    def bursts(ms):
        return {v: [{"makespan_s": m} for m in ms] for v in orders}

    return {"slo": {"single": single, "bursts": bursts(cost_makespans)},
            "fifo": {"single": fifo_single or single, "bursts": bursts(fifo_makespans)}}


FACTS_M = {"model_size": "med", "groups": 2, "request": {}, "frames": [81, 17, 81, 17, 81, 17], "single_reps": 2, "reps": 2}


def test_mixed_summary_bound_inputs_and_figures() -> None:
    orders = s.arrival_orders(FACTS_M["frames"], False)
    raw = _mixed_raw(orders, [17.5, 17.9], [18.5, 18.9])
    ceiling = job_pair_result({81: {"one": [7.0], "two": [7.0 * 2 / 1.9]}, 17: {"one": [3.0], "two": [3.0 * 2 / 1.9]}},
                              20, [64, 64])
    r = mixed.summarize(raw, orders, ceiling, HOST, FACTS_M, {})
    inputs = r["mixed"]["bound_inputs"]
    assert inputs["single_job_s"] == {"81": 7.5, "17": 3.3}
    assert inputs["total_s"] == pytest.approx(32.4) and inputs["longest_s"] == 7.5
    assert inputs["bound_s"] == pytest.approx(16.2)
    assert r["mixed"]["makespan_over_bound"] == pytest.approx(17.7 / 16.2)
    assert r["mixed"]["fifo"]["makespan_over_bound"] == pytest.approx(18.7 / 16.2)
    fig = r["figures"]["mixed.makespan_over_bound"]
    assert fig["pass"] is True and fig["fifo_value"] == pytest.approx(18.7 / 16.2)
    assert fig["optimal_over_bound"] == pytest.approx(17.4 / 16.2)
    assert fig["over_host_adjusted_bound"] == pytest.approx((17.7 / 16.2) / (2 / 1.9))
    given = r["by_server"]["slo"]["orders"]["given"]
    assert given["predicted_fifo_makespan_s"] == pytest.approx(18.3)
    assert given["predicted_lpt_makespan_s"] == pytest.approx(17.4)
    assert "mixed.worst_makespan_over_bound" not in r["figures"]
    json.dumps(r)
    assert "order=fifo" in mixed.table(r)


def test_mixed_has_one_bound_for_both_servers_and_a_goal_scaled_by_the_hosts_contention() -> None:
    """Each length's time in the bound is the faster server's; the goal is 1.10 x how much slower two
    concurrent bare jobs run than one alone, weighted by the burst's job times (issue 19)."""
    orders = s.arrival_orders(FACTS_M["frames"], False)
    raw = _mixed_raw(orders, [17.5, 17.9], [18.5, 18.9], fifo_single={"81": [7.0, 7.2], "17": [3.6, 3.8]})
    # two 81-frame jobs at once each 1.3x slower than alone, two 17-frame ones 1.1x
    ceiling = job_pair_result({81: {"one": [5.0, 5.2, 5.1], "two": [6.5, 6.76, 6.63]},
                               17: {"one": [2.0, 2.1], "two": [2.2, 2.31]}}, 20, [64, 64])
    assert ceiling["by_length"]["81"]["slowdown"] == pytest.approx(1.3)
    r = mixed.summarize(raw, orders, ceiling, HOST, FACTS_M, {})
    common = {"81": 7.1, "17": 3.3}
    assert r["mixed"]["bound_inputs"]["single_job_s"] == common == r["mixed"]["fifo"]["bound_inputs"]["single_job_s"]
    bound = (3 * 7.1 + 3 * 3.3) / 2
    assert r["mixed"]["bound_inputs"]["bound_s"] == pytest.approx(bound)
    fig = r["figures"]["mixed.makespan_over_bound"]
    assert fig["value"] == pytest.approx(17.7 / bound) and fig["fifo_value"] == pytest.approx(18.7 / bound)
    slowdown = (3 * 7.1 * 1.3 + 3 * 3.3 * 1.1) / (3 * 7.1 + 3 * 3.3)  # weighted by the burst's job times
    assert fig["two_jobs_at_once_slowdown"] == pytest.approx(slowdown)
    assert fig["goal_value"] == pytest.approx(1.10 * slowdown, abs=1e-4)
    assert "two at once each 1.237x slower" in mixed.table(r)
    assert r["by_server"]["fifo"]["single_job_s"] == {"81": pytest.approx(7.1), "17": pytest.approx(3.7)}
    # without the ceiling the goal is the plain 1.10
    assert mixed.summarize(raw, orders, None, HOST, FACTS_M, {})["figures"]["mixed.makespan_over_bound"]["goal_value"] == 1.10


def test_mixed_reports_how_far_starts_fell_from_their_predicted_start() -> None:
    orders = s.arrival_orders(FACTS_M["frames"], False)
    raw = _mixed_raw(orders, [17.5, 17.9], [18.5, 18.9])
    errors = [0.1, -0.2, 0.3, 0.0, None, 0.5]  # None: no prediction (no rate known yet) or no start line
    raw["slo"]["bursts"]["given"][0]["jobs"] = [{"start_error_s": e} for e in errors]
    r = mixed.summarize(raw, orders, None, HOST, FACTS_M, {})
    err = r["mixed"]["predicted_start_error_s"]
    assert (err["n"], err["p50"], err["max"]) == (5, pytest.approx(0.1), 0.5)
    assert err["p99"] == pytest.approx(0.3 + 0.96 * 0.2)  # between the two largest (numpy's default)
    assert r["mixed"]["fifo"]["predicted_start_error_s"] == {"n": 0, "p50": None, "p99": None, "max": None}
    assert "p50 0.10 s" in mixed.table(r)


@pytest.mark.parametrize("flag,servers", [(["--replicas", "2"], ("replicas2_omni_ext", "replicas2_stock")),
                                          (["--multi-host"], ("multihost2_omni_ext", "multihost2_stock"))])
def test_mixed_across_replicas_compares_dispatch_with_stock(flag: list[str], servers: tuple[str, str]) -> None:
    layout = mixed.layout_of(parse("mixed", *flag, "--json", "x.json"))
    assert layout.figure == "replicas" and tuple(layout.server(o) for o in mixed.ORDERS) == servers
    # The stock side is vLLM-Omni's own dispatch and nothing else: only replica-dispatch is switched off.
    assert mixed.server_envs(layout) == {servers[1]: {"OMNI_EXT_DISABLE_PATCHES": "replica-dispatch"}}
    orders = s.arrival_orders(FACTS_M["frames"], False)
    r = mixed.summarize(_mixed_raw(orders, [17.5, 17.9], [22.0, 22.4]), orders, None, HOST,
                        {**FACTS_M, "layout": layout.name}, {}, layout=layout)
    fig = r["figures"]["replicas.makespan_over_bound"]
    assert fig["value"] == pytest.approx(17.7 / 16.2) and fig["stock_value"] == pytest.approx(22.2 / 16.2)
    assert r["replicas"]["stock"]["makespan_over_bound"] == pytest.approx(22.2 / 16.2)
    assert r["replicas"]["bound_inputs"]["bound_s"] == pytest.approx(16.2)
    assert layout.labels[1] in mixed.table(r)


def test_mixed_order_variants_report_the_worst_and_failed_bursts() -> None:
    orders = s.arrival_orders(FACTS_M["frames"], True)
    raw = _mixed_raw(orders, [17.5, 17.9], [18.5, 18.9])
    raw["slo"]["bursts"]["longest_last"] = [{"makespan_s": 18.8}, {"makespan_s": None}]
    r = mixed.summarize(raw, orders, None, HOST, FACTS_M, {})
    ll = r["by_server"]["slo"]["orders"]["longest_last"]
    assert ll["failed_bursts"] == 1 and ll["median_makespan_s"] == 18.8
    worst = r["figures"]["mixed.worst_makespan_over_bound"]
    assert worst["value"] == pytest.approx(18.8 / 16.2) and worst["pass"] is False
    assert set(r["figures"]) == {"mixed.makespan_over_bound", "mixed.makespan_over_bound.longest_last",
                                 "mixed.makespan_over_bound.alternating_short_first", "mixed.worst_makespan_over_bound"}
    assert r["host_ceiling"] is None
    mixed.table(r)


# ---- admission --------------------------------------------------------------------------------------
def _att(kind: str, retry: str | None = "3", code: str | None = "queue_full") -> dict:
    if kind == "job":
        return {"kind": "job", "status": 200, "id": "v"}
    if kind == "refused":
        return {"kind": "refused", "status": 429, "headers": {"Retry-After": retry}, "error_code": code}
    return {"kind": "error", "status": 500, "error_code": None}


def test_admission_counts() -> None:
    clients = [
        {"attempts": [_att("job")], "job_id": "a"},
        {"attempts": [_att("job")], "job_id": "b"},
        {"attempts": [_att("refused", "2"), _att("job")], "job_id": "c"},
        {"attempts": [_att("refused", "4"), _att("job")], "job_id": "d"},
        {"attempts": [_att("refused", "6"), _att("refused"), _att("job")], "job_id": "e"},
        {"attempts": [_att("refused", "8", code="other"), _att("refused")], "job_id": None},
        {"attempts": [_att("error")], "job_id": None},
    ]
    ends = {k: {"status": "completed"} for k in "abcd"} | {"e": {"status": "failed"}}
    n = admission.count_clients(clients, ends)
    assert n["first_answer"] == {"job": 2, "refused": 4, "error": 1}
    assert n["first_retry"] == {"job": 2, "refused": 2, "error": 0, "not_retried": 0}
    assert n["first_retry_admitted"] == 0.5
    assert n["admitted_on_later_retry"] == 1 and n["never_admitted"] == 1
    assert n["errors"] == 1 and n["refused_without_queue_full_code"] == 1
    assert n["accepted"] == 5 and n["completed"] == 4 and n["accepted_not_completed"] == 1
    assert n["retry_after_s"] == {"min": 2.0, "median": 5.0, "max": 8.0}


def test_interactive_ratio() -> None:
    assert admission.interactive_ratio(10.0, 12.1, [12.0, 13.0]) == pytest.approx(2.1 / 2.0)
    assert admission.interactive_ratio(10.0, None, [12.0]) is None
    assert admission.interactive_ratio(10.0, 11.0, []) is None


def test_admission_summary_and_table() -> None:
    raw = {
        "job_s": 3.3, "calibration_latencies_s": [3.2, 3.4], "expected_admitted": 8, "burst": 24,
        "admission": {"clients": [{"attempts": [_att("refused"), _att("job")], "job_id": "x"},
                                  {"attempts": [_att("job")], "job_id": "y"}],
                      "ends": {"x": {"status": "completed"}, "y": {"status": "completed"}}},
        "priority": {"batch_admitted": 9, "ratio": 1.02, "source": "server log", "start_after_send_s": 1.53,
                     "running_ends_after_send_s": [1.5, 1.6]},
    }
    facts = {"model_size": "med", "capacity": 2, "max_wait_s": 12.0, "burst_factor": 3.0, "max_retries": 8, "request": {}}
    r = admission.summarize(raw, HOST, facts, {})
    f = r["figures"]
    assert f["admission.first_retry_admitted"]["value"] == 1.0 and f["admission.first_retry_admitted"]["pass"]
    assert f["admission.errors"]["pass"] and f["admission.accepted_not_completed"]["pass"]
    assert f["priority.interactive_start_over_min"]["value"] == 1.02 and f["priority.interactive_start_over_min"]["pass"]
    assert r["priority"]["interactive_start_over_min"] == 1.02 and r["admission"]["pass_first_retry_admitted"]
    json.dumps(r)
    assert "admitted on first retry" in admission.table(r)
    capped = admission.summarize({**raw, "burst_capped": True}, HOST, facts, {})
    assert capped["burst_capped"] is True and any("capped" in n for n in capped["notes"])
    # Nothing refused: no figure, and a note that says how to fix the run.
    raw2 = {**raw, "admission": {"clients": [{"attempts": [_att("job")], "job_id": "y"}], "ends": {"y": {"status": "completed"}}}}
    raw2.pop("priority")
    r2 = admission.summarize(raw2, HOST, facts, {})
    assert r2["figures"]["admission.first_retry_admitted"]["pass"] is None and r2["notes"]
    assert "priority.interactive_start_over_min" not in r2["figures"] and r2["priority"] is None


# ---- command line -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bench", ["adaptive", "mixed", "admission"])
@pytest.mark.parametrize("quick", [False, True])
def test_dry_run_prints_the_plan_and_starts_nothing(bench: str, quick: bool, capsys, tmp_path: Path) -> None:
    argv = [bench, "--dry-run", "--models-dir", str(tmp_path)] + (["--quick"] if quick else [])
    args = parse(*argv)
    assert args.func(args) == 0
    out = capsys.readouterr().out
    plan = json.loads(out[: out.rindex("}") + 1])
    assert plan["benchmark"] == bench and "vllm-omni" in json.dumps(plan)
    assert not any(tmp_path.iterdir())  # not even the model was built


def test_json_is_required_without_dry_run() -> None:
    args = parse("adaptive")
    with pytest.raises(SystemExit):
        args.func(args)


# ---- cfg-parallel --sp ---------------------------------------------------------------------------
def test_cfg_parallel_sp_options() -> None:
    args = parse("cfg-parallel", "--json", "x.json", "--sp", "2", "--reps", "3")
    assert (args.sp, args.reps, args.ceiling_reps, args.max_load, args.quiet_wait) == (2, 3, 3, 1.0, 600.0)
    assert parse("cfg-parallel", "--json", "x.json").sp == 1  # the one-device benchmark stays the default
    for bad in ("0", "-2", "x"):
        with pytest.raises(SystemExit):
            parse("cfg-parallel", "--json", "x.json", "--sp", bad)


def test_cfg_parallel_model_rows_send_a_reference_image_to_image_to_video_models() -> None:
    args = parse("cfg-parallel", "--json", "x.json", "--model", "wan2.2-i2v")
    assert (args.model, args.sp) == ("wan2.2-i2v", 1)  # --model: the side-by-side rows, sp 1 allowed
    assert parse("cfg-parallel", "--json", "x.json").model is None  # the one-device benchmark stays the default
    fields = c.video_fields(args)
    assert fields["input_reference"].startswith(b"\x89PNG") and fields["input_reference"] == c.video_fields(args)["input_reference"]
    assert "input_reference" not in c.video_fields(parse("cfg-parallel", "--json", "x.json", "--model", "wan2.1-t2v"))
    from omni_ext.bench.client import _form

    form = _form(fields)
    assert form["input_reference"][0] == "input_reference.png" and form["prompt"] == (None, fields["prompt"])


def test_model_rows_stock_server_is_vllm_omni_as_it_ships_and_requests_settle() -> None:
    """The --model rows' stock server switches off omni-ext's routes, validation, step cancellation and
    dispatch (each a registered patch name); requests wait --settle seconds between the two servers."""
    from omni_ext.patches import PATCHES

    off = c.STOCK_ENV["OMNI_EXT_DISABLE_PATCHES"].split(",")
    assert set(off) <= {p.name for p in PATCHES} and "cancel-at-step" in off and "openai-routes" in off
    assert parse("cfg-parallel", "--json", "x.json", "--model", "wan2.2-i2v").settle == 2.0


def test_ceiling_latent_shape_follows_the_models_channels_and_vae(tmp_path: Path) -> None:
    from omni_ext.bench.ceiling import latent_shape

    def model(name: str, in_channels: int, vae: dict) -> Path:
        (tmp_path / name / "transformer").mkdir(parents=True)
        (tmp_path / name / "vae").mkdir()
        (tmp_path / name / "transformer" / "config.json").write_text(json.dumps({"in_channels": in_channels}))
        (tmp_path / name / "vae" / "config.json").write_text(json.dumps(vae))
        return tmp_path / name

    assert latent_shape(model("t2v", 16, {}), 80, 80, 17) == [1, 16, 5, 10, 10]
    assert latent_shape(model("i2v", 36, {"scale_factor_spatial": 8}), 80, 80, 17) == [1, 36, 5, 10, 10]
    assert latent_shape(model("ti2v", 48, {"scale_factor_spatial": 16, "scale_factor_temporal": 4}), 160, 160, 17) == [1, 48, 5, 10, 10]


def test_cfg_parallel_sp_servers_share_one_layout_and_differ_only_in_the_executor() -> None:
    from omni_ext.bench.runner import TUNED, sp_layout, sp_server_specs

    flags, env = sp_layout(2)
    assert env == {"OMNI_EXT_CPU_VISIBLE_DEVICES": "0,1,2,3", "OMP_NUM_THREADS": "1"}
    assert flags[:4] == ["--cfg-parallel-size", "2", "--ulysses-degree", "2"]
    specs = sp_server_specs(2)
    assert specs["tuned_sp"] == [*specs["stock_sp"], "--distributed-executor-backend", TUNED]
    c.refuse_omni_ext_in_stock("stock_sp", specs["stock_sp"])  # really vLLM-Omni's executor
    assert sp_layout(4)[1]["OMNI_EXT_CPU_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"


def _sp_runs(stock: list[float], tuned: list[float], stock_loop: float | None, tuned_loop: float | None) -> dict:
    def run(lat: float, loop: float | None) -> dict:
        return {"latency_s": lat, "stages": {"Wan22Pipeline.diffuse": loop} if loop else {"x.vae.decode": 0.1}}

    return {"stock_sp": [run(x, stock_loop) for x in stock], "tuned_sp": [run(x, tuned_loop) for x in tuned]}


def test_cfg_parallel_sp_ratios_and_goals() -> None:
    from omni_ext.bench.ceiling import sp_ceiling_result
    from omni_ext.bench.runner import diffuse_s, sp_summary, sp_table

    ceiling = sp_ceiling_result([8.0, 7.0, 9.0], [4.2, 3.8, 4.0], 2, 25, [1, 16, 5, 10, 10])
    assert ceiling["speedup"] == 2.0 and ceiling["layout"] == {"cfg": 2, "ulysses": 2, "processes": 4}
    assert "predict_noise_maybe_with_cfg" in ceiling["what"] and "4 bare processes" in ceiling["what"]
    s = sp_summary(_sp_runs([6.0, 6.6, 6.3], [6.0, 5.7, 5.8], 4.4, 4.1), ceiling, True)
    assert s["median_latency_s"] == {"stock_sp": 6.3, "tuned_sp": 5.8}
    assert s["figures"]["tuned_vs_stock"]["value"] == pytest.approx(6.3 / 5.8)
    assert s["figures"]["tuned_vs_stock"]["pass"] is True
    assert s["figures"]["tuned_vs_ceiling"]["value"] == pytest.approx(4.0 / 4.1)  # 0.976 >= 0.95
    assert s["figures"]["tuned_vs_ceiling"]["pass"] is True
    assert s["stock_vs_ceiling"] == pytest.approx(4.0 / 4.4)
    assert s["sp_speedup_over_one_process_loop"]["tuned"] == pytest.approx(8.0 / 4.1)
    assert s["per_rep_tuned_vs_stock"] == pytest.approx([1.0, 6.6 / 5.7, 6.3 / 5.8])
    slow = sp_summary(_sp_runs([6.0], [6.5], 4.4, 4.5), ceiling, True)["figures"]
    assert slow["tuned_vs_stock"]["pass"] is False and slow["tuned_vs_ceiling"]["pass"] is False  # 0.889
    # no profiler stages / no ceiling: the figure has no value, so no verdict
    none = sp_summary(_sp_runs([6.0], [6.0], None, None), None, False)["figures"]
    assert none["tuned_vs_ceiling"]["value"] is None and none["tuned_vs_ceiling"]["pass"] is None
    assert none["tuned_vs_stock"]["measurement"] is False
    assert diffuse_s({"WanPipeline.diffuse": 2.5, "WanPipeline.vae.decode": 0.3}) == 2.5 and diffuse_s({}) is None
    table = sp_table({"figures": s["figures"], "median_latency_s": s["median_latency_s"], "median_diffuse_s": s["median_diffuse_s"],
                      "stock_vs_ceiling": s["stock_vs_ceiling"], "host_ceiling": ceiling, "measurement": False,
                      "host": BUSY})
    assert "tuned_vs_ceiling" in table and "PASS" in table and "NOT A MEASUREMENT" in table


@pytest.mark.parametrize("expand", [False, True], ids=["one-timestep", "ti2v-per-token"])
def test_the_bare_wan_step_gives_the_transformer_the_timesteps_the_pipeline_gives(expand: bool) -> None:
    """The ceiling's step feeds the pipeline's own CFG step; a pipeline that expands its timesteps
    (Wan2.2 TI2V-5B's image mode) gets one per patch token, 0 on the reference's first latent frame, as
    its ``diffuse`` makes them (the transformer then embeds one per token)."""
    from types import SimpleNamespace

    import torch

    from omni_ext.bench.ceiling import _wan_step

    seen = {}

    class Pipe:
        expand_timesteps = expand
        transformer = SimpleNamespace(config=SimpleNamespace(text_dim=8, patch_size=[1, 2, 2]))

        def predict_noise_maybe_with_cfg(self, **kw):
            seen.update(kw)
            return kw["positive_kwargs"]["hidden_states"]

    lat = [1, 48, 3, 6, 10]
    _wan_step(Pipe(), lat)()
    ts = seen["positive_kwargs"]["timestep"]
    assert torch.equal(ts, seen["negative_kwargs"]["timestep"]) and seen["positive_kwargs"]["hidden_states"].shape == tuple(lat)
    if not expand:
        assert ts.tolist() == [500.0]
        return
    assert ts.shape == (1, 3 * 3 * 5)  # frames x (height / 2) x (width / 2) patch tokens
    assert ts[0, :15].tolist() == [0.0] * 15 and ts[0, 15:].tolist() == [500.0] * 30


def test_every_benchmark_waits_for_a_quiet_host_before_it_starts(monkeypatch) -> None:
    """Each ``omni-ext bench`` command takes ``--max-load`` and ``--quiet-wait``, and its run starts with
    :func:`omni_ext.bench.common.quiet_host` (a benchmark that needs a quiet host waits for one)."""
    import inspect

    from omni_ext.bench import adaptive, admission, api_poll, batching, mixed, runner, serving, stream

    for bench in ("cfg-parallel", "data-parallel", "adaptive", "mixed", "admission", "serving", "stream", "batching",
                  "api-poll"):
        args = parse(bench, "--json", "x.json", "--max-load", "0.7", "--quiet-wait", "30")
        assert (args.max_load, args.quiet_wait) == (0.7, 30.0), bench
    for run in (runner.run_cfg_parallel, runner.run_cfg_parallel_sp, runner.run_data_parallel, adaptive.run,
                admission.run, mixed.run, api_poll.run, serving.run, stream.run, batching.run):
        assert "quiet_host(args)" in inspect.getsource(run), run.__qualname__
    waits = []
    monkeypatch.setattr(c, "wait_for_quiet", lambda max_load, timeout: waits.append((max_load, timeout)) or {"quiet": True})
    host = c.quiet_host(parse("mixed", "--json", "x.json", "--max-load", "1e9", "--quiet-wait", "5"))
    assert waits == [(1e9, 5.0)] and host["quiet_wait"] == {"quiet": True} and host["measurement"] is True


def test_wait_for_quiet_polls_until_the_load_falls_or_the_time_is_up() -> None:
    loads, now, slept = [3.0, 2.0, 0.8], [0.0], []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    got = c.wait_for_quiet(1.0, 100.0, poll_s=10.0, load=lambda: loads.pop(0), clock=lambda: now[0], sleep=sleep)
    assert got == {"quiet": True, "waited_s": 20.0, "load1": 0.8, "max_load": 1.0} and slept == [10.0, 10.0]
    got = c.wait_for_quiet(1.0, 25.0, poll_s=10.0, load=lambda: 5.0, clock=lambda: now[0], sleep=sleep)
    assert got["quiet"] is False and got["waited_s"] == 30.0  # gave up at the first poll past 25 s
    assert c.wait_for_quiet(1.0, 0.0, load=lambda: 0.1)["quiet"] is True


def test_the_burst_yardstick_weights_each_lengths_slowdown_by_its_jobs_time() -> None:
    ceiling = job_pair_result({81: {"one": [5.0], "two": [6.0]}, 17: {"one": [2.0], "two": [2.0]}}, 20, [64, 64])
    assert weighted_slowdown(ceiling, [("81", 5.0), ("17", 2.0)]) == pytest.approx((5.0 * 1.2 + 2.0) / 7.0)
    assert weighted_slowdown(ceiling, [("81", 5.0)]) == pytest.approx(1.2)
    # a length it never timed, or nothing timed two at once: no factor (the goal falls back to 1.10)
    assert weighted_slowdown(ceiling, [("33", 3.0)]) is None
    assert weighted_slowdown(job_pair_result({81: {"one": [5.0], "two": []}}, 20, [64, 64]), [("81", 5.0)]) is None


# ---- --repeat: N runs, the median and two thirds of the runs ----------------------------------------------
def _runs(name: str, op: str, goal: float, values: list, passes: list | None = None, measurement: bool = True) -> list:
    """One figure's value in each run, as each run's ``figures`` (a run's ``pass`` overridable, as the
    stream's "ahead of the baselines" does)."""
    runs = []
    for i, v in enumerate(values):
        fig = c.figure(v, op, goal, measurement)
        if passes is not None:
            fig["pass"] = passes[i]
        runs.append({name: fig})
    return runs


def test_repeat_takes_the_median_range_and_runs_meeting_of_each_figure() -> None:
    f = c.repeat_figures(_runs("slo3", ">=", 0.95, [0.981, 0.798, 0.96]))["slo3"]
    assert f["runs"] == [0.981, 0.798, 0.96] and f["median"] == f["value"] == 0.96
    assert f["range"] == [0.798, 0.981] and f["runs_meeting"] == 2 and f["runs_needed"] == 2 and f["n"] == 3
    assert f["pass"] is True and f["verdict"] == "PASS" and f["goal"] == ">= 0.95"
    # the median misses: one good run (or two of three at most) is not a result
    f = c.repeat_figures(_runs("slo3", ">=", 0.95, [0.981, 0.798, 0.90]))["slo3"]
    assert f["median"] == 0.90 and f["runs_meeting"] == 1 and f["pass"] is False and f["verdict"] == "FAIL"


def test_repeat_a_le_goal_and_a_ge_goal_side_by_side() -> None:
    runs = [{**a, **b} for a, b in zip(_runs("p99", "<=", 3.0, [2.43, 18.2, 2.9]), _runs("slo3", ">=", 0.85, [0.873, 0.754, 0.86]))]
    figs = c.repeat_figures(runs)
    assert list(figs) == ["p99", "slo3"]
    assert figs["p99"]["median"] == 2.9 and figs["p99"]["range"] == [2.43, 18.2] and figs["p99"]["pass"] is True
    assert figs["slo3"]["median"] == 0.86 and figs["slo3"]["runs_meeting"] == 2 and figs["slo3"]["pass"] is True
    figs = c.repeat_figures(_runs("p99", "<=", 3.0, [2.43, 18.2, 3.1]))
    assert figs["p99"]["median"] == 3.1 and figs["p99"]["pass"] is False


def test_repeat_passes_only_when_two_thirds_of_the_runs_also_meet_the_goal() -> None:
    # every value meets 0.95, but two runs failed a condition beyond the goal (behind a baseline)
    f = c.repeat_figures(_runs("slo3", ">=", 0.95, [0.96, 0.97, 0.98], passes=[True, False, False]))["slo3"]
    assert f["median"] == 0.97 and f["runs_meeting"] == 1 and f["pass"] is False
    f = c.repeat_figures(_runs("slo3", ">=", 0.95, [0.96, 0.97, 0.98], passes=[True, False, True]))["slo3"]
    assert f["runs_meeting"] == 2 and f["pass"] is True
    # two runs: the median (their mean) meets 0.95, but only 1 of the 2 needed runs does
    f = c.repeat_figures(_runs("slo3", ">=", 0.95, [0.96, 0.94]))["slo3"]
    assert f["median"] == pytest.approx(0.95) and f["runs_needed"] == 2 and f["pass"] is False
    assert [c.runs_needed(n) for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 2, 3, 4, 4]


def test_repeat_a_run_without_a_value_misses_and_ranks_worst_in_the_median() -> None:
    # a p99 that fell on a refused request has no value (unbounded): the worst of "<="
    f = c.repeat_figures(_runs("p99", "<=", 3.0, [2.5, None, 2.8]))["p99"]
    assert f["runs"] == [2.5, None, 2.8] and f["median"] == 2.8 and f["range"] == [2.5, 2.8]
    assert f["runs_meeting"] == 2 and f["pass"] is True
    f = c.repeat_figures(_runs("p99", "<=", 3.0, [2.5, None, 3.5]))["p99"]
    assert f["median"] == 3.5 and f["pass"] is False  # not 3.0, the mean of the two with a value
    f = c.repeat_figures(_runs("slo3", ">=", 0.95, [None, 0.96, 0.97]))["slo3"]
    assert f["median"] == 0.96 and f["pass"] is True
    # the median falls on a run without a value: no median, and a FAIL (some runs had one)
    f = c.repeat_figures(_runs("slo3", ">=", 0.95, [None, 0.99, None]))["slo3"]
    assert f["median"] is None and f["range"] == [0.99, 0.99] and f["pass"] is False and f["verdict"] == "FAIL"
    # no run has a value: no verdict, as for one run
    f = c.repeat_figures(_runs("slo3", ">=", 0.95, [None, None, None]))["slo3"]
    assert f["median"] is None and f["range"] is None and f["pass"] is None and f["verdict"] == "n/a"
    # a figure missing from a run (its server did not run then) counts as a run without a value
    runs = _runs("loss", "<=", 0.05, [0.01, 0.02, 0.03])
    del runs[1]["loss"]
    f = c.repeat_figures(runs)["loss"]
    assert f["runs"] == [0.01, None, 0.03] and f["median"] == 0.03 and f["runs_meeting"] == 2 and f["pass"] is True


@pytest.mark.parametrize("value,op,goal,run_pass,measurement", [
    (0.96, ">=", 0.95, None, True), (0.90, ">=", 0.95, None, True), (0.96, ">=", 0.95, False, True),
    (2.9, "<=", 3.0, None, True), (3.1, "<=", 3.0, None, False), (None, "<=", 3.0, None, True)])
def test_repeat_of_one_run_is_that_runs_verdict(value, op, goal, run_pass, measurement) -> None:
    run = _runs("x", op, goal, [value], None if run_pass is None else [run_pass], measurement)[0]["x"]
    f = c.repeat_figures([{"x": run}])["x"]
    assert (f["value"], f["pass"], f["measurement"], f["goal"]) == (run["value"], run["pass"], run["measurement"], run["goal"])
    assert f["verdict"] == c.verdict(run) and f["runs_needed"] == 1


def test_repeat_table_shows_each_run_the_median_the_range_and_the_verdict() -> None:
    figs = c.repeat_figures(_runs("stream.short_p99_over_standalone@0.9", "<=", 3.0, [2.43, None, 2.9]))
    text = c.repeat_table(figs, ["run 1", "run 2", "run 3"])
    header, _, row = text.splitlines()
    assert header.split() == ["figure", "run", "1", "run", "2", "run", "3", "median", "range", "goal", "runs", "meeting", "verdict"]
    assert row.split() == ["stream.short_p99_over_standalone@0.9", "2.430", "-", "2.900", "2.900", "2.430-2.900", "<=", "3",
                           "2/3", "(need", "2)", "PASS"]


def test_stream_repeat_option_keeps_every_run_and_adds_the_repeat_section(capsys) -> None:
    from omni_ext.bench import stream as st
    from omni_ext.cli import main

    assert parse("stream", "--json", "x.json").repeat == 1
    assert parse("stream", "--json", "x.json", "--repeat", "3").repeat == 3
    assert main(["bench", "stream", "--dry-run", "--quick", "--repeat", "3", "--seed", "5"]) == 0
    plan = json.loads(capsys.readouterr().out.split("\n[bench]")[0])
    assert plan["repeat"]["seeds"] == [5, 6, 7] and "at least 2 of 3" in plan["repeat"]["pass"]
    assert main(["bench", "stream", "--dry-run", "--quick"]) == 0
    assert "repeat" not in json.loads(capsys.readouterr().out.split("\n[bench]")[0])  # --repeat 1: as before
    with pytest.raises(SystemExit, match="--repeat"):
        main(["bench", "stream", "--dry-run", "--repeat", "0"])

    def reqs(within: int) -> list:
        """10 short requests, ``within`` of them inside 3x standalone."""
        return [{"cls": "short", "status": "completed", "latency_s": 2.0 if i < within else 4.0, "end_s": 10.0 + i}
                for i in range(10)]

    def one(seed: int, within: int, host: dict) -> dict:
        raw = {"slo": {"0.7": reqs(within)}, "fifo": {"0.7": reqs(5)}, "stock": {"0.7": reqs(4)}}
        alone = {n: {"short": 1.0, "long": 8.0} for n in raw}
        return st.summarize(raw, alone, [0.7], None, host, {"seed": seed})

    results = [one(0, 10, HOST), one(1, 8, HOST), one(2, 10, BUSY)]
    out = st.repeated(results)
    assert out["results"] == results and out["repeat"]["seeds"] == [0, 1, 2] and out["repeat"]["runs_needed"] == 2
    f = out["repeat"]["figures"]["stream.slo3_attainment@0.7"]
    assert f is out["figures"]["stream.slo3_attainment@0.7"]
    assert f["runs"] == [1.0, 0.8, 1.0] and f["median"] == 1.0 and f["range"] == [0.8, 1.0] and f["runs_meeting"] == 2
    assert f["pass"] is True and f["measurement"] is False  # run 3 started on a busy host
    assert out["measurement"] is False and out["busy_runs"] == [3]
    text = st.table(out)
    assert "== run 2/3 (seed 1) ==" in text and "at least 2 of 3 runs" in text and "PASS (not a measurement)" in text
    assert "NOT A MEASUREMENT: run(s) 3 started on a busy host" in text
    assert st.median_by_load(results)["0.7"] == {"slo": {"slo3_attainment": 1.0}, "fifo": {"slo3_attainment": 0.5},
                                                 "stock": {"slo3_attainment": 0.4}}
    json.dumps(out, default=str)


def test_the_full_size_wan_runs_one_server_at_a_time_and_reports_per_step_overhead_and_memory(monkeypatch) -> None:
    """``cfg-parallel --model-size 1.3b``: Wan2.1-T2V-1.3B's transformer per worker does not leave room for
    two servers, so stock (vLLM-Omni as it ships) is started, warmed up, measured and stopped before the
    tuned server starts; the result gains the per-step overhead of tuned's loop and each server's memory."""
    from omni_ext.bench import runner
    from omni_ext.bench.common import STOCK_ENV

    events: list = []

    class FakeServers:
        def __init__(self, *a, **k):
            self.procs, self.commands = {}, {}

        def start(self, specs, timeout, envs=None):
            events.append(("start", tuple(specs), all((envs or {}).get(n) == STOCK_ENV for n in specs)))
            self.procs.update({n: SimpleNamespace(processes=list) for n in specs})

        def stop(self, *names):
            events.append(("stop", names))
            for n in names or list(self.procs):
                self.procs.pop(n, None)

        def url(self, name):
            return name

    def send(url, fields):
        events.append(("request", url, fields.get("seed")))
        return {"latency_s": 2.0 if url == "stock_sp" else 1.9,
                "stages": {"WanPipeline.diffuse": 1.2 if url == "stock_sp" else 1.1}}

    monkeypatch.setattr(runner, "setup", lambda args: ("/m", Path("/tmp"), [], {}))
    monkeypatch.setattr(runner, "quiet_host", lambda args: {"measurement": True})
    monkeypatch.setattr(runner, "finish_host", lambda host: None)
    monkeypatch.setattr(runner, "Servers", FakeServers)
    monkeypatch.setattr(runner, "_request", lambda args: (send, lambda a, seed=7: {"seed": seed}))
    monkeypatch.setattr(runner.time, "sleep", lambda s: None)

    class Peak:  # the memory sampler's switches, in the order the benchmark throws them
        def __init__(self, server):
            pass

        def __enter__(self):
            events.append(("sampling", True))
            return self

        def __exit__(self, *exc):
            events.append(("sampling", False))

        def sample_now(self):
            events.append(("sample",))

        def result(self):
            return {"peak_server_pss_mb": 1, "peak_host_used_mb": 2}

    monkeypatch.setattr(runner, "MemoryPeak", Peak)
    args = parse("cfg-parallel", "--json", "x.json", "--model-size", "1.3b", "--size", "64x64", "--frames", "9",
                 "--steps", "4", "--reps", "2", "--skip-ceiling")
    result = runner.run_cfg_parallel_sp(args)
    # a sample walks a 6 GiB worker's page tables: the timed requests (seed 7) run with the sampler off
    sampling = False
    for e in events:
        if e[0] == "sampling":
            sampling = e[1]
        elif e[0] == "request":
            assert sampling == (e[2] == 1), e  # on for the warm-up (seed 1) only
    assert events.count(("sample",)) == 2  # one sample per server after its timed requests
    starts = [e for e in events if e[0] == "start"]
    assert starts == [("start", ("stock_sp",), True), ("start", ("tuned_sp",), False)]
    first_tuned = events.index(("start", ("tuned_sp",), False))
    assert ("stop", ("stock_sp",)) in events[:first_tuned]  # stock is gone before tuned starts
    assert [e[1:] for e in events if e[0] == "request"] == [("stock_sp", 1), ("stock_sp", 7), ("stock_sp", 7),
                                                            ("tuned_sp", 1), ("tuned_sp", 7), ("tuned_sp", 7)]
    assert result["servers_one_at_a_time"] is True and set(result["memory"]) == {"stock_sp", "tuned_sp"}
    assert result["per_step_overhead_ms"]["over_stock"] == pytest.approx(-25.0)  # (1.1 - 1.2) s / 4 steps
    assert result["per_step_overhead_ms"]["over_ceiling"] is None  # no ceiling was run
    assert runner.per_step_ms(1.3, 1.1, 4) == pytest.approx(50.0) and runner.per_step_ms(None, 1.0, 4) is None


def test_memory_peak_counts_shared_pages_once_and_keeps_the_peak() -> None:
    from omni_ext.bench.runner import MemoryPeak

    class Proc:
        def __init__(self, pss):
            self.pss = pss

        def memory_full_info(self):
            if self.pss is None:
                raise FakePsutil.Error("gone")
            return SimpleNamespace(pss=self.pss, rss=10 * self.pss)

    class FakePsutil:
        class Error(Exception):
            pass

        used = [4 * 2**30]

        @staticmethod
        def virtual_memory():
            return SimpleNamespace(total=24 * 2**30, available=24 * 2**30 - FakePsutil.used[0])

    tree = [[Proc(2**30), Proc(2**29), Proc(None)], [Proc(2**28)]]
    peak = MemoryPeak(SimpleNamespace(processes=lambda: tree[0]))
    peak.sample(FakePsutil)
    peak.server = SimpleNamespace(processes=lambda: tree[1])
    FakePsutil.used[0] = 2 * 2**30
    peak.sample(FakePsutil)
    assert peak.result() == {"peak_server_pss_mb": 1536, "peak_host_used_mb": 4096}


def test_the_1_3b_size_is_wan2_1_t2v_1_3b_s_transformer_and_only_for_it(tmp_path: Path) -> None:
    """Wan2.1-T2V-1.3B's transformer config (30 layers, dim 1536 = 12 heads x 128, FFN 8960), built on the
    meta device to count it; other models refuse the size."""
    import torch

    from omni_ext.models import tiny

    with torch.device("meta"):
        tf = tiny.wan_transformer("1.3b")
    cfg = tf.config
    assert (cfg.num_layers, cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim) == (30, 1536, 8960)
    params = sum(p.numel() for p in tf.parameters())
    assert 1.3e9 < params < 1.5e9, params
    with pytest.raises(ValueError, match="wan2.1-t2v only"):
        tiny.build_tiny_model("qwen-image", tmp_path / "q", size="1.3b")
