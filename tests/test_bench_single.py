"""``omni-ext bench cfg-parallel --single-jobs`` (issue 38 item 1): its grid, row figures, overall verdict and
table, on plain data. No server is started; the benchmark itself runs real servers."""

from __future__ import annotations

import argparse

import pytest

from omni_ext.bench import common as c
from omni_ext.bench import single as s
from omni_ext.cli import build_parser


def parse(*argv: str):
    return build_parser().parse_args(["bench", "cfg-parallel", "--json", "x.json", *argv])


# ---- options and the grid ------------------------------------------------------------------------------
def test_single_jobs_options_default_to_the_issues_grid() -> None:
    args = parse("--single-jobs")
    assert args.single_jobs is True and parse().single_jobs is False  # the one-device benchmark stays the default
    assert (args.single_frames, args.single_steps, args.single_size) == ((9, 17), (1, 2, 4, 8), "64x64")
    assert args.single_models == ("wan2.1-t2v", "fastwan", "qwen-image")
    assert args.reps >= s.MIN_REPS and args.settle == 2.0  # at least 5 alternations, the --model settle gap
    got = parse("--single-jobs", "--single-steps", "3,4", "--single-frames", "9", "--single-models", "qwen-image")
    assert (got.single_steps, got.single_frames, got.single_models) == ((3, 4), (9,), ("qwen-image",))
    for bad in (("--single-steps", "0,1"), ("--single-steps", "x"), ("--single-frames", ""),
                ("--single-models", "wan2.2-i2v"), ("--single-models", "")):
        with pytest.raises(SystemExit):
            parse("--single-jobs", *bad)


def test_single_jobs_does_not_combine_with_model_or_sp() -> None:
    s.check_options(parse("--single-jobs"))
    for extra in (("--model", "wan2.1-t2v"), ("--sp", "2")):
        with pytest.raises(SystemExit):
            s.check_options(parse("--single-jobs", *extra))


def test_grid_is_videos_frames_by_steps_then_images_by_steps() -> None:
    rows = s.single_grid()
    assert len(rows) == 2 * 4 + 2 + 4
    videos = [(r["frames"], r["steps"]) for r in rows if r["model"] == "wan2.1-t2v"]
    assert videos == [(9, 1), (9, 2), (9, 4), (9, 8), (17, 1), (17, 2), (17, 4), (17, 8)]
    images = [r for r in rows if r["model"] == "qwen-image"]
    assert [r["steps"] for r in images] == [1, 2, 4, 8] and all(r["frames"] is None and r["kind"] == "image" for r in images)
    # FastWan's distilled 3 steps whatever --single-steps says, at each frame count
    assert [(r["frames"], r["steps"]) for r in rows if r["model"] == "fastwan"] == [(9, 3), (17, 3)]
    assert [r["model"] for r in rows] == ["wan2.1-t2v"] * 8 + ["fastwan"] * 2 + ["qwen-image"] * 4  # one pair after the other
    assert all(r["size"] == "64x64" for r in rows) and len({r["name"] for r in rows}) == len(rows)
    assert rows[0]["name"] == "wan2.1-t2v 64x64 9 frames x1 steps"
    # the order of --single-models is the order the pairs run; images alone need no legal frame count
    swapped = s.single_grid((5,), (2,), "32x32", ("qwen-image", "wan2.1-t2v"))
    assert [(r["model"], r["frames"]) for r in swapped] == [("qwen-image", None), ("wan2.1-t2v", 5)]
    assert len(s.single_grid((10,), (1,), "64x64", ("qwen-image",))) == 1
    for bad in ({"frames": (10,)}, {"frames": ()}, {"steps": ()}, {"steps": (0,)}, {"models": ("wan2.2-i2v",)},
                {"size": "64"}):
        with pytest.raises(ValueError):
            s.single_grid(**bad)


def test_row_requests_are_cfg_videos_and_cfg_images_of_the_rows_shape() -> None:
    args = parse("--single-jobs")
    video, image = s.single_grid((17,), (4,), "64x64", ("wan2.1-t2v", "qwen-image"))
    f = s.row_fields(args, video)
    assert (f["size"], f["num_frames"], f["num_inference_steps"], f["guidance_scale"]) == ("64x64", 17, 4, 4.0)
    assert f["negative_prompt"] and "input_reference" not in f
    g = s.row_fields(args, image, seed=1)
    assert (g["size"], g["num_inference_steps"], g["seed"]) == ("64x64", 4, 1)
    assert g["true_cfg_scale"] > 1 and g["negative_prompt"] and "num_frames" not in g  # a CFG image
    assert s.row_fields(args, image)["seed"] != 1  # the warm-up's seed differs from the timed one's
    assert args.size == "80x80" and args.model is None  # the rows do not change the parsed options
    [few] = s.single_grid((9,), (4,), "64x64", ("fastwan",))
    h = s.row_fields(args, few)
    assert (h["num_frames"], h["num_inference_steps"], h["guidance_scale"]) == (9, 3, 1.0) and "negative_prompt" not in h


# ---- figures -----------------------------------------------------------------------------------------
def test_row_figures_ratio_overhead_and_pass() -> None:
    r = s.row_summary([0.131, 0.140, 0.128, 0.135, 0.133], [0.136, 0.141, 0.130, 0.150, 0.139], True)
    assert r["median_latency_s"] == {"stock": 0.133, "tuned": 0.139} and r["reps"] == 5
    assert r["figures"]["tuned_vs_stock"]["value"] == pytest.approx(0.133 / 0.139)
    assert r["figures"]["tuned_vs_stock"]["pass"] is False  # 0.957 < 1.00
    assert r["figures"]["overhead_ms"]["value"] == pytest.approx(6.0)
    assert r["figures"]["overhead_ms"]["pass"] is True  # 6 ms <= 10 ms
    assert r["pass"] is False  # both goals must hold
    assert r["paired_overhead_ms"] == pytest.approx(5.0)  # median of 5, 1, 2, 15, 6
    assert r["per_rep_tuned_vs_stock"][0] == pytest.approx(0.131 / 0.136)
    # tuned faster: ratio above 1, overhead negative, both met
    fast = s.row_summary([0.20, 0.21, 0.19], [0.15, 0.16, 0.14], True)
    assert fast["figures"]["overhead_ms"]["value"] == pytest.approx(-50.0) and fast["pass"] is True
    assert fast["figures"]["tuned_vs_stock"]["value"] == pytest.approx(0.20 / 0.15)
    # exactly equal: 1.00 meets >= 1.00, 0 ms meets <= 10
    assert s.row_summary([0.1], [0.1], True)["pass"] is True
    # slower by more than 10 ms fails the overhead goal too
    slow = s.row_summary([1.0], [1.02], True)
    assert slow["figures"]["overhead_ms"]["pass"] is False and slow["pass"] is False


def test_ratio_interval_resolves_a_clear_win_and_calls_a_noisy_even_row_a_tie() -> None:
    # tuned 10 % faster in every alternation, with +-2 % noise: the whole interval lies above 1.00
    noise = [1.00, 1.02, 0.98, 1.01, 0.99, 1.02, 0.98, 1.00, 1.01]
    stock = [0.200 * n for n in noise]
    tuned = [0.180 * n for n in reversed(noise)]
    low, high = s.ratio_interval(stock, tuned)
    assert 1.0 < low <= 0.200 / 0.180 <= high < 1.25
    assert s.ratio_interval(stock, tuned) == (low, high)  # a fixed seed: the same run, the same interval
    # the same work under both, +-20 % per request (the tiny Qwen-Image rows on 2 cores): it holds 1.00
    wide = [1.20, 0.85, 1.05, 0.90, 1.15, 0.80, 1.10, 0.95, 1.00]
    even = s.row_summary([0.14 * n for n in wide], [0.14 * n for n in reversed(wide)], True, expected_reps=9)
    lo, hi = even["figures"]["tuned_vs_stock"]["interval"]
    assert lo < 1.0 < hi and hi - lo > 0.1
    assert s.tie_interval({"name": "x", **even}) == (lo, hi)
    # too few alternations for an interval; constant latencies give a point
    assert s.ratio_interval([0.2, 0.2], [0.1, 0.1]) is None
    assert s.ratio_interval([0.5] * 5, [0.505] * 5) == pytest.approx((0.5 / 0.505, 0.5 / 0.505))


def test_a_tie_is_reported_beside_the_verdict_never_instead_of_it() -> None:
    wide = [1.20, 0.85, 1.05, 0.90, 1.15, 0.80, 1.10, 0.95, 1.00]
    tie_missed = _row("q2", [0.140 * n for n in wide], [0.1402 * n for n in reversed(wide)])  # 0.999: missed, a tie
    won = _row("w", [0.2] * 9, [0.18] * 9)
    slow = _row("s", [0.14 * n for n in wide], [0.16 * n for n in reversed(wide)])  # +20 ms: overhead missed
    v = s.overall_verdict([tie_missed, won, slow], True, 9)
    assert v["verdict"] == "FAIL" and v["failed"] == ["q2", "s"]  # a tie still fails
    assert list(v["ties"]) == ["q2"]  # a row over the overhead goal is a miss, not a tie
    line = s.verdict_line(v)
    assert "missed: q2 (a tie: its 95 % interval" in line and "; s" in line and "ties, met or missed" in line
    table = s.single_table({"rows": [{**s.single_grid((9,), (1,), "64x64", ("wan2.1-t2v",))[0], **tie_missed}],
                            "overall": v, "pairs": {}})
    assert table.splitlines()[2].rstrip().endswith("FAIL ratio (tie)") and "95 % interval" in table.splitlines()[0]


def test_row_without_runs_or_short_of_its_reps_is_not_judged() -> None:
    empty = s.row_summary([], [], True, expected_reps=5)
    assert empty["pass"] is None and empty["figures"]["tuned_vs_stock"]["value"] is None
    assert empty["figures"]["overhead_ms"]["value"] is None and empty["paired_overhead_ms"] is None
    assert empty["median_latency_s"] == {"stock": None, "tuned": None}
    short = s.row_summary([0.2, 0.2], [0.1, 0.1], True, expected_reps=5)  # a request failed part-way
    assert short["pass"] is None and short["complete"] is False and short["figures"]["tuned_vs_stock"]["pass"] is True
    assert s.row_summary([0.2] * 5, [0.1] * 5, True, expected_reps=5)["pass"] is True
    busy = s.row_summary([0.2], [0.1], False)
    assert busy["figures"]["tuned_vs_stock"]["measurement"] is False and busy["pass"] is True


def test_row_diffuse_medians_skip_missing_stages() -> None:
    r = s.row_summary([0.2, 0.2, 0.2], [0.2, 0.2, 0.2], True, [0.1, 0.12, 0.11], [None, None, None])
    assert r["median_diffuse_s"] == {"stock": pytest.approx(0.11), "tuned": None}


def _row(name: str, stock: list[float], tuned: list[float], measurement: bool = True) -> dict:
    return {"name": name, **s.row_summary(stock, tuned, measurement, expected_reps=len(stock) or 5)}


def test_overall_verdict_pass_fail_incomplete_and_flags() -> None:
    ok = [_row("a", [0.2] * 5, [0.19] * 5), _row("b", [0.5] * 5, [0.5] * 5)]
    v = s.overall_verdict(ok, True, 5)
    assert (v["verdict"], v["pass"], v["rows_met"], v["rows"], v["flags"]) == ("PASS", True, 2, 2, [])
    assert v["worst_tuned_vs_stock"] == pytest.approx(1.0) and v["max_overhead_ms"] == pytest.approx(0.0)
    bad = [*ok, _row("c", [0.13] * 5, [0.194] * 5), _row("d", [], [])]
    v = s.overall_verdict(bad, True, 5)
    assert (v["verdict"], v["pass"], v["failed"], v["missing"]) == ("FAIL", False, ["c"], ["d"])
    assert v["max_overhead_ms"] == pytest.approx(64.0) and v["worst_tuned_vs_stock"] == pytest.approx(0.13 / 0.194)
    v = s.overall_verdict([*ok, _row("d", [], [])], True, 5)
    assert (v["verdict"], v["pass"], v["missing"]) == ("INCOMPLETE", None, ["d"])
    assert s.overall_verdict([], True, 5)["verdict"] == "INCOMPLETE"
    flagged = s.overall_verdict(ok, False, 3)
    assert flagged["verdict"] == "PASS" and len(flagged["flags"]) == 2
    assert "not a measurement" in flagged["flags"][0] and "fewer than the 5" in flagged["flags"][1]


def test_table_has_one_line_per_row_and_the_verdict() -> None:
    rows = [{**r, **s.row_summary(st, tu, True, expected_reps=5)} for r, (st, tu) in
            zip(s.single_grid((9,), (1, 4), "64x64", ("wan2.1-t2v", "qwen-image")), ([[0.131] * 5, [0.194] * 5], [[0.3] * 5, [0.29] * 5],
                                                       [[0.5] * 5, [0.505] * 5], [[], []]))]
    result = {"rows": rows, "overall": s.overall_verdict(rows, True, 5),
              "pairs": {"wan2.1-t2v": {"error": None, "host": {}},
                        "qwen-image": {"error": "RuntimeError: no start", "host": {"warning": "1-minute load 2.00 > 1"}}}}
    table = s.single_table(result)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["row", "stock", "ms"] and set(lines[1]) <= {"-", " "}
    body = lines[2:2 + len(rows)]
    assert [ln.split("  ")[0] for ln in body] == [r["name"] for r in rows]
    assert "131.0" in body[0] and "194.0" in body[0] and "63.0" in body[0] and body[0].rstrip().endswith("FAIL ratio+overhead")
    assert body[1].rstrip().endswith("PASS")
    assert body[2].rstrip().endswith("FAIL ratio") and "5.0" in body[2]  # 5 ms over stock meets 10 ms, 0.990 misses 1.00
    assert body[3].rstrip().endswith("n/a")
    assert "overall: FAIL (1/4 rows" in table
    assert "missed: wan2.1-t2v 64x64 9 frames x1 steps; qwen-image 64x64 image x1 steps" in table
    assert "no figures: qwen-image" in table and "qwen-image pair failed: RuntimeError" in table
    assert "NOT A MEASUREMENT" in table


def test_main_dispatches_single_jobs_to_its_module(monkeypatch) -> None:
    from omni_ext.bench import cli

    seen = []
    monkeypatch.setattr(s, "main", lambda args: seen.append(args) or 0)
    args = parse("--single-jobs")
    assert cli._cfg(args) == 0 and seen == [args]
    assert isinstance(s.row_args(args, s.single_grid()[0]), argparse.Namespace)


def test_run_alternates_on_one_pair_per_model_one_pair_after_the_other(monkeypatch, tmp_path) -> None:
    """The measuring loop with fake servers and requests (nothing starts): one pair per model, started
    and stopped before the next; per row two warm-ups, then alternations stock first on even ones."""
    events: list[tuple] = []

    class FakeServers:
        def __init__(self, model, workdir, base_args, env) -> None:
            self.model, self.env, self.commands = model, env, {}

        def start(self, specs, timeout, envs=None) -> None:
            events.append(("start", str(self.model), tuple(specs), envs))
            self.commands = {name: {"argv": args} for name, args in specs.items()}

        def url(self, name: str) -> str:
            return name

        def log_path(self, name: str):
            return tmp_path / f"{name}.log"

        def stop(self, *names) -> None:
            events.append(("stop", str(self.model)))

    def setup(ns):
        return tmp_path / ns.model, tmp_path / "w", [], {}

    def send_for(row):
        def send(url, fields):
            events.append(("req", row["name"], url, fields["seed"]))
            if row["model"] == "qwen-image":
                raise RuntimeError("qwen down")
            if url == s.TUNED:  # the executor's lines, as a TunedExecutor server logs them
                n = sum(1 for e in events if e[0] == "req" and e[2] == s.TUNED)
                with open(tmp_path / f"{s.TUNED}.log", "a") as log:
                    log.write(f"INFO omni-ext: start request r{n} on rank(s) [0, 1] (pair), waited 0.00 s, priority 0, "
                              f"predicted {0.2 if n % 3 == 1 else 0.19:.3f} s\n"
                              f"INFO omni-ext: done request r{n} on rank(s) [0, 1] in 0.190 s\n")
            return {"latency_s": 0.2 if url == s.STOCK else 0.19, "stages": {"WanPipeline.diffuse": 0.1}}
        return send

    monkeypatch.setattr(c, "Servers", FakeServers)
    monkeypatch.setattr(c, "setup", setup)
    monkeypatch.setattr(c, "quiet_host", lambda args: {"measurement": True, "warning": None})
    monkeypatch.setattr(s, "_send", send_for)
    monkeypatch.setattr(s.time, "sleep", lambda x: events.append(("sleep", x)))
    args = parse("--single-jobs", "--single-frames", "9", "--single-steps", "1,4", "--reps", "2",
                 "--single-models", "wan2.1-t2v,qwen-image",
                 "--workdir", str(tmp_path), "--settle", "0.5")
    result = s.run(args)
    starts = [e for e in events if e[0] in ("start", "stop")]
    assert [e[:2] for e in starts] == [("start", str(tmp_path / "wan2.1-t2v")), ("stop", str(tmp_path / "wan2.1-t2v")),
                                       ("start", str(tmp_path / "qwen-image")), ("stop", str(tmp_path / "qwen-image"))]
    assert starts[0][2] == (s.STOCK, s.TUNED) and starts[0][3] == {s.STOCK: c.STOCK_ENV}
    wan = [e for e in events if e[0] == "req" and e[1].startswith("wan2.1-t2v 64x64 9 frames x1 ")]
    assert [(e[2], e[3]) for e in wan] == [(s.STOCK, 1), (s.TUNED, 1), (s.STOCK, 1234), (s.TUNED, 1234),
                                          (s.TUNED, 1234), (s.STOCK, 1234)]
    reqs = [i for i, e in enumerate(events) if e[0] == "req"]
    assert all(events[i - 1] == ("sleep", 0.5) for i in reqs)  # the settle gap before every request
    rows = result["rows"]
    assert [r["pass"] for r in rows] == [True, True, None, None]
    assert rows[0]["figures"]["overhead_ms"]["value"] == pytest.approx(-10.0)
    assert rows[0]["median_diffuse_s"] == {"stock": 0.1, "tuned": 0.1} and len(rows[0]["runs"][s.STOCK]) == 2
    # the executor's predictions of the row's tuned jobs: the first (its warm-up) 5 % over, the others exact
    assert [len(r["predictions"]) for r in rows[:2]] == [3, 3]
    assert rows[0]["prediction"] == {"jobs": 3, "first_error": pytest.approx(0.2 / 0.19 - 1), "median_abs_error": 0.0}
    assert rows[2]["prediction"] == {"jobs": 0, "first_error": None, "median_abs_error": None}
    # a row that fails (e.g. a step count the model refuses) is recorded and the pair's next rows still run
    assert [r.get("error", "")[:27] for r in rows[2:]] == ["RuntimeError: qwen down"] * 2
    assert len([e for e in events if e[0] == "req" and e[1].startswith("qwen-image")]) == 2
    assert result["pairs"]["qwen-image"]["error"] is None and result["pairs"]["wan2.1-t2v"]["error"] is None
    assert result["overall"]["verdict"] == "INCOMPLETE" and result["overall"]["flags"] == [
        "2 alternations per row, fewer than the 5 the goal asks for"]
    assert "qwen-image 64x64 image x1 steps failed: RuntimeError: qwen down" in s.single_table(result)


def test_breakdown_takes_a_tuned_answer_apart_and_leaves_what_stock_does_not_report_none() -> None:
    """Stock's answer reports the engine's time and the pipeline's stages; a tuned one adds the
    executor's hops and the route's encode. Each part in ms; the parts add up to the latency."""
    stock = {"latency_s": 0.300, "stages": {"WanPipeline.text_encoder.forward": 0.050, "WanPipeline.diffuse": 0.100,
                                            "WanPipeline.vae.decode": 0.080, "queue_wait_ms": 0.3, "stage_0_gen_ms": 260.0}}
    b = s.breakdown(stock)
    assert set(b) == set(s.PARTS)
    assert b["route"] == pytest.approx(40.0) and b["engine"] == pytest.approx(30.0)
    assert (b["text"], b["loop"], b["decode"]) == pytest.approx((50.0, 100.0, 80.0))
    assert b["queue"] is b["to_worker"] is b["from_worker"] is b["worker_other"] is b["encode"] is None
    tuned = {"latency_s": 0.290, "stages": {"WanPipeline.text_encoder.forward": 0.040, "WanPipeline.diffuse": 0.100,
                                            "stage_0_gen_ms": 250.0, "omni_ext.queue": 0.001, "omni_ext.to_worker": 0.002,
                                            "omni_ext.worker": 0.220, "omni_ext.from_worker": 0.004, "omni_ext.encode": 0.010}}
    t = s.breakdown(tuned)
    assert t["worker_other"] == pytest.approx(80.0)  # the split decode, not profiled, is the worker's own
    assert (t["queue"], t["to_worker"], t["from_worker"], t["encode"]) == pytest.approx((1.0, 2.0, 4.0, 10.0))
    assert t["route"] == pytest.approx(30.0) and t["engine"] == pytest.approx(250.0 - 220.0 - 7.0)
    assert sum(v for v in t.values() if v is not None) == pytest.approx(290.0)
    assert sum(v for v in b.values() if v is not None) == pytest.approx(300.0)
    assert set(s.breakdown({"latency_s": 0.1, "stages": {}}).values()) == {None}  # no engine time: nothing to split


def test_row_breakdown_medians_per_part_and_the_delta_where_both_report_it() -> None:
    def run(lat, gen, loop, **ours):
        return {"latency_s": lat, "stages": {"P.diffuse": loop, "stage_0_gen_ms": gen, **{f"omni_ext.{k}": v for k, v in ours.items()}}}

    stock = [run(0.2, 180.0, 0.1), run(0.22, 190.0, 0.11), run(0.21, 185.0, 0.12)]
    tuned = [run(0.19, 175.0, 0.1, queue=0.001), run(0.2, 176.0, 0.1, queue=0.003), run(0.5, 480.0, 0.1, queue=0.002)]
    rb = s.row_breakdown(stock, tuned)
    assert rb["loop"] == {"stock": pytest.approx(110.0), "tuned": pytest.approx(100.0), "delta": pytest.approx(-10.0)}
    assert rb["queue"]["stock"] is None and rb["queue"]["tuned"] == pytest.approx(2.0) and rb["queue"]["delta"] is None
    assert rb["route"]["tuned"] == pytest.approx(20.0)  # the outlier's engine time is not the route's
    table = s.breakdown_table({"rows": [{"name": "wan x1", "breakdown": rb}, {"name": "failed"}]})
    assert "wan x1" in table and "110.0/100.0" in table and "-/2.0" in table and "failed" not in table
    assert all(f"  {p}: " in table for p in s.PARTS)


def test_rows_below_the_models_minimum_steps_are_not_run_and_not_counted() -> None:
    """Qwen-Image takes 2 steps or more (``limits_for_model``'s ``min_steps``: the API refuses 1, a NaN
    sigma); its x1 row was a 400 that counted as a row without figures (2026-12-07 12:21: "12/14 rows")."""
    floor = 2
    rows = [{**r, **s.row_summary([0.2] * 5, [0.19] * 5, True, expected_reps=5)}
            for r in s.single_grid((9,), (1, 2), "64x64", ("qwen-image",))]
    s.skip_below(rows, floor)
    assert [bool(r.get("skipped")) for r in rows] == [True, False]
    v = s.overall_verdict(rows, True, 5)
    assert (v["verdict"], v["rows"], v["rows_met"], v["missing"]) == ("PASS", 1, 1, [])
    assert v["skipped"] == ["qwen-image 64x64 image x1 steps (1 step(s): this model takes 2 or more)"]
    table = s.single_table({"rows": rows, "overall": v, "pairs": {}})
    assert table.splitlines()[2].rstrip().endswith("skipped")
    assert "not run: qwen-image 64x64 image x1 steps (1 step(s): this model takes 2 or more)" in table
