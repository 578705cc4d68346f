"""``omni-ext bench serving`` and ``omni-ext bench api-poll``: the pure parts (percentiles, summary,
table, JSON layout, argument profiles, configuration parsing) on plain data, and one run of the
serving command against a shared tiny server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_ext.bench import api_poll, serving
from omni_ext.bench import common as c
from omni_ext.cli import build_parser

HOST = {"cpus": 2, "loadavg_at_start": [0.2, 0.3, 0.4], "loadavg_at_end": [0.5, 0.4, 0.4], "uptime": "up",
        **c.load_check(0.2, 1.0)}
BUSY = {"cpus": 2, "loadavg_at_start": [2.5, 2.0, 1.0], "uptime": "up", **c.load_check(2.5, 1.0)}


def parse(*argv: str):
    return build_parser().parse_args(["bench", *argv])


def rec(i: int, latency: float, status: str = "200") -> dict:
    return {"i": i, "seed": 1000 + i, "sent_s": float(i), "ok": status == "200", "status": status, "latency_s": latency}


# ---- percentiles ------------------------------------------------------------------------------------
def test_percentiles_interpolate_between_closest_ranks() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert c.percentile(xs, 50) == 2.5
    assert c.percentile(xs, 0) == 1.0 and c.percentile(xs, 100) == 4.0
    assert c.percentile(xs, 90) == pytest.approx(3.7)
    assert c.percentile(xs, 99) == pytest.approx(3.97)  # below the slowest: 4 values cannot show a p99
    assert c.percentile([7.0], 99) == 7.0 and c.percentile([], 50) is None
    assert c.percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    with pytest.raises(ValueError):
        c.percentile(xs, 101)


def test_strict_goals_for_api_poll() -> None:
    assert c.judge(99.9, "<", 100) is True and c.judge(100.0, "<", 100) is False
    assert c.judge(2.0, ">", 1) is True and c.judge(1.0, ">", 1) is False
    assert c.figure(80.0, "<", 100, True)["goal"] == "< 100"


# ---- summary ----------------------------------------------------------------------------------------
def test_summary_counts_errors_by_status_and_times_only_successes() -> None:
    records = [rec(0, 2.0), rec(1, 4.0), rec(2, 0.01, "429"), rec(3, 3.0), rec(4, 0.02, "429"), rec(5, 9.0, "connection")]
    s = serving.summarize_config(records, wall_s=6.0)
    assert s["sent"] == 6 and s["ok"] == 3 and s["error_count"] == 3
    assert s["errors"] == {"429": 2, "connection": 1}
    assert s["p50_s"] == 3.0 and s["p90_s"] == pytest.approx(3.8) and s["p99_s"] == pytest.approx(3.98)
    assert s["requests_per_s"] == 0.5 and s["mean_s"] == 3.0 and s["min_s"] == 2.0 and s["max_s"] == 4.0
    none = serving.summarize_config([rec(0, 0.1, "500")], wall_s=1.0)
    assert none["p50_s"] is None and none["requests_per_s"] == 0.0 and none["errors"] == {"500": 1}
    assert serving.summarize_config([], wall_s=0.0)["requests_per_s"] is None


def _runs() -> list[dict]:
    return [
        {"label": "stock-1dev", "source": "serve", "url": "http://x:1", "preset": None, "wall_s": 8.0,
         "records": [rec(i, 4.0 + i) for i in range(4)], "warmup": []},
        {"label": "tuned-dp2", "source": "url", "url": "http://x:2", "preset": None, "wall_s": 4.0,
         "records": [rec(0, 2.0), rec(1, 2.5), rec(2, 3.0), rec(3, 0.1, "429")], "warmup": []},
    ]


WORKLOAD = {"kind": "video", "mode": "async", "concurrency": 2, "requests": 4, "duration_s": None,
            "request": {"prompt": "p", "size": "32x32", "num_frames": 5}}


def test_result_layout_per_configuration_and_against_the_baseline() -> None:
    r = serving.summarize(_runs(), WORKLOAD, HOST, None, "not measured: pass --ceiling")
    assert r["benchmark"] == "serving" and r["order"] == ["stock-1dev", "tuned-dp2"] and r["baseline"] == "stock-1dev"
    for entry in r["configurations"].values():
        assert {"p50_s", "p90_s", "p99_s", "requests_per_s", "errors", "requests"} <= set(entry)
    dp = r["configurations"]["tuned-dp2"]
    assert dp["requests_per_s"] == 0.75 and dp["errors"] == {"429": 1} and len(dp["requests"]) == 4
    assert dp["requests_per_s_vs_baseline"] == pytest.approx(0.75 / 0.5)
    assert dp["p50_vs_baseline"] == pytest.approx(2.5 / 5.5)
    assert r["host_ceiling"] is None and r["host_ceiling_absent"].startswith("not measured")
    assert r["measurement"] is True
    json.dumps(r)
    other = serving.summarize(_runs(), WORKLOAD, BUSY, None, "x", baseline="tuned-dp2")
    assert other["configurations"]["stock-1dev"]["requests_per_s_vs_baseline"] == pytest.approx(0.5 / 0.75)
    assert other["measurement"] is False


def test_table_compares_configurations_and_states_the_ceiling() -> None:
    text = serving.table(serving.summarize(_runs(), WORKLOAD, HOST, None, "only for video with a local model"))
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["configuration", "ok/sent", "errors"]
    dp = next(line for line in lines if line.startswith("tuned-dp2"))
    assert "3/4" in dp and "429: 1" in dp and "1.500" in dp
    assert "bare host ceiling: absent (only for video with a local model)" in text
    assert "NOT A MEASUREMENT" not in text
    ceiling = {"data_parallel": {"throughput_ratio": 1.91}, "cfg_pair": {"speedup": 1.8}}
    busy = serving.table(serving.summarize(_runs(), WORKLOAD, BUSY, ceiling, None))
    assert "two independent processes 1.910x one" in busy and "NOT A MEASUREMENT" in busy


def test_cdf_and_plot(tmp_path: Path) -> None:
    assert serving.cdf_points([3.0, 1.0, 2.0]) == ([1.0, 2.0, 3.0], [1 / 3, 2 / 3, 1.0])
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.png"
    serving.plot(serving.summarize(_runs(), WORKLOAD, HOST, None, "x"), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_error_kinds() -> None:
    from omni_ext.bench.client import RequestFailed

    class APITimeoutError(Exception):
        pass

    class APIConnectionError(Exception):
        pass

    class Status(Exception):
        status_code = 503

    assert serving.error_kind(RequestFailed(429, "full")) == "429"
    assert serving.error_kind(Status()) == "503"
    assert serving.error_kind(APITimeoutError()) == "timeout"
    assert serving.error_kind(APIConnectionError()) == "connection"
    assert serving.error_kind(serving.JobFailed("x")) == "failed"
    assert serving.error_kind(ValueError("x")) == "ValueError"


# ---- the closed loop (a local send function: the loop's own rules, no server) -----------------------------
def _loop_args(**over):
    args = parse("serving", "--url", "http://h:1", "--concurrency", "3", "--requests", "10", "--steps", "2")
    serving.prepare(args)
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_closed_loop_keeps_concurrency_and_sends_each_request_once() -> None:
    import threading
    import time

    from omni_ext.bench.client import RequestFailed

    lock, state = threading.Lock(), {"now": 0, "max": 0}

    def send(fields: dict) -> int:
        with lock:
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
        time.sleep(0.02)
        with lock:
            state["now"] -= 1
        if fields["seed"] == 1004:
            raise RequestFailed(429, "queue full")
        return 10

    records, wall = serving.closed_loop(send, _loop_args())
    assert [r["i"] for r in records] == list(range(10)) and [r["seed"] for r in records] == list(range(1000, 1010))
    assert state["max"] == 3  # never more in flight than clients
    assert [r["status"] for r in records if not r["ok"]] == ["429"]
    assert all(r["latency_s"] >= 0.02 for r in records) and wall >= 4 * 0.02  # 10 requests / 3 clients: 4 rounds
    timed_out, _ = serving.closed_loop(lambda f: time.sleep(0.05) or 1, _loop_args(requests=None, duration=0.2))
    assert 3 <= len(timed_out) <= 3 * (0.2 / 0.05 + 1)  # stops sending after --duration


# ---- configurations and arguments -------------------------------------------------------------------
def test_configurations_keep_command_line_order_and_labels() -> None:
    args = parse("serving", "--url", "http://127.0.0.1:1", "--label", "first", "--config",
                 "stock=OMNI_EXT_DISABLE_PATCHES=all X_Y=1 --cfg-parallel-size 2", "--url", "b=http://h:2/",
                 "--preset", "wan2.1-t2v-tiny.cpu.x2.latency")
    configs = serving.configurations(args)
    assert [cfg.label for cfg in configs] == ["first", "stock", "b", "wan2.1-t2v-tiny.cpu.x2.latency"]
    assert configs[0].url == "http://127.0.0.1:1" and configs[2].url == "http://h:2"
    assert configs[1].env == {"OMNI_EXT_DISABLE_PATCHES": "all", "X_Y": "1"}
    assert configs[1].args == ["--cfg-parallel-size", "2"]
    preset = configs[3]
    assert preset.source == "preset" and preset.deploy["stages"][0]["cfg_parallel_size"] == 2
    assert preset.args[0] == "--deploy-config"
    assert serving.parse_url("http://h:3", None).label == "h:3"
    for bad in ("nolabel", "two words=--x"):
        with pytest.raises(ValueError):
            serving.parse_config(bad)
    with pytest.raises(ValueError):
        serving.parse_url("h:3", None)
    dup = parse("serving", "--url", "a=http://h:1", "--url", "a=http://h:2")
    with pytest.raises(ValueError, match="unique"):
        serving.configurations(dup)


def test_topologies_suite_is_the_readme_comparison() -> None:
    args = parse("serving", "--suite", "topologies", "--kind", "video")
    configs = {cfg.label: cfg for cfg in serving.configurations(args)}
    assert list(configs) == ["stock-1dev", "stock-cfg2", "stock-dp2", "stock-replicas2", "replicas2", "tuned-cfg2",
                             "tuned-dp2", "adaptive"]
    assert c.TUNED not in " ".join(configs["stock-cfg2"].args + configs["stock-dp2"].args)
    assert json.loads(configs["stock-dp2"].args[-1]) == {"0": {"data_parallel_size": 2}}  # intra-executor DP
    for name, executor in (("stock-replicas2", None), ("replicas2", c.TUNED)):
        stage = configs[name].deploy["stages"][0]
        assert stage["num_replicas"] == 2 and stage.get("distributed_executor_backend") == executor
    # stock replicas: vLLM-Omni's round robin on arrival; omni-ext's: its dispatch (the default)
    assert configs["stock-replicas2"].env["OMNI_EXT_DISABLE_PATCHES"] == "replica-dispatch"
    assert "OMNI_EXT_DISABLE_PATCHES" not in configs["replicas2"].env
    cfg_modes = {k: json.loads(configs[k].args[-1])["omni_ext"]["scheduler"]["cfg_mode"] for k in ("tuned-cfg2", "adaptive")}
    assert cfg_modes == {"tuned-cfg2": "pair", "adaptive": "adaptive"}
    assert json.loads(configs["tuned-dp2"].args[-1]) == {"omni_ext": {"data_parallel_size": 2}}
    image = {cfg.label: cfg for cfg in serving.resolve_suite("topologies", "image")}
    assert image["replicas2"].deploy["pipeline"] == "omni_ext_qwen_image"


def test_started_servers_get_the_deploy_yaml_written_and_the_api_key(tmp_path: Path) -> None:
    import yaml

    args = parse("serving", "--preset", "wan2.1-t2v-tiny.cpu.x2.throughput", "--api-key", "sk-1")
    cfg = serving.configurations(args)[0]
    flags = serving.serve_args(cfg, args, tmp_path)
    path = Path(flags[flags.index("--deploy-config") + 1])
    assert path.parent == tmp_path and yaml.safe_load(path.read_text())["stages"][0]["num_replicas"] == 2
    assert flags[-2:] == ["--api-key", "sk-1"] and cfg.args[1] != str(path)  # the rendered config is left as it was
    assert serving.safe_name("a b/c") == "a_b_c"


def test_profiles_fill_the_kind_defaults_and_the_command_line_wins() -> None:
    args = parse("serving", "--url", "http://h:1")
    serving.prepare(args)
    assert (args.kind, args.size, args.frames, args.steps, args.concurrency, args.requests) == ("video", "64x64", 17, 20, 4, 16)
    args = parse("serving", "--url", "http://h:1", "--quick", "--steps", "3")
    serving.prepare(args)
    assert (args.size, args.frames, args.steps, args.requests, args.model_size) == ("32x32", 5, 3, 4, "tiny")
    args = parse("serving", "--preset", "qwen-image-tiny.cpu.x1.balanced", "--duration", "30")
    serving.prepare(args)
    assert args.kind == "image" and args.requests is None and args.duration == 30
    fields = serving.request_fields(args, 7)
    assert fields["true_cfg_scale"] == 4.0 and "num_frames" not in fields and fields["seed"] == 7
    args = parse("serving", "--url", "http://h:1", "--kind", "image", "--negative-prompt", "")
    serving.prepare(args)
    assert "negative_prompt" not in serving.request_fields(args, 1)
    for argv in ([], ["--url", "http://h:1", "--concurrency", "0"],
                 ["--preset", "qwen-image-tiny.cpu.x1.balanced", "--preset", "wan2.1-t2v-tiny.cpu.x1.balanced"]):
        with pytest.raises(SystemExit):
            serving.prepare(parse("serving", *argv))


def test_serving_dry_run_starts_nothing(capsys, tmp_path: Path) -> None:
    args = parse("serving", "--suite", "topologies", "--dry-run", "--models-dir", str(tmp_path))
    assert args.func(args) == 0
    out = capsys.readouterr().out
    plan = json.loads(out[: out.rindex("}") + 1])
    assert len(plan["configurations"]) == 8 and plan["workload"]["request"]["num_frames"] == 17
    assert "--num-gpus 2" in plan["configurations"]["stock-dp2"]["runs"]
    assert not any(tmp_path.iterdir())


# ---- api-poll -----------------------------------------------------------------------------------------
def test_api_poll_goal_and_layout() -> None:
    phases = [{"routes": "stock", "statuses": ["completed"] * 2, "wall_s": 3.0, "latencies_ms": [5.0, 300.0, 8.0, 6.0]},
              {"routes": "omni_ext", "statuses": ["completed"] * 2, "wall_s": 3.1, "latencies_ms": [4.0, 6.0, 5.0, 7.0]}]
    r = api_poll.summarize(phases, HOST, {"videos": 2})
    a = r["api_poll"]
    assert a["p99_ms_stock"] == pytest.approx(300.0 - 0.03 * 292.0)
    assert a["p99_ms_omni_ext"] == pytest.approx(6.97)
    assert a["goal_p99_ms_omni_ext"] == "< 100" and a["pass_p99_ms_omni_ext"] is True
    assert a["videos_not_completed"] == 0
    fig = r["figures"]["api_poll.p99_ms_omni_ext"]
    assert fig["goal"] == "< 100" and fig["stock_value"] == a["p99_ms_stock"]
    slow = api_poll.summarize([phases[0], {**phases[1], "latencies_ms": [50.0, 150.0]}], BUSY, {})
    assert slow["api_poll"]["pass_p99_ms_omni_ext"] is False and slow["measurement"] is False
    text = api_poll.table(slow)
    assert "FAIL (not a measurement)" in text and "NOT A MEASUREMENT" in text
    json.dumps(r)


def test_api_poll_dry_run_and_profile(capsys, tmp_path: Path) -> None:
    args = parse("api-poll", "--dry-run", "--quick", "--models-dir", str(tmp_path))
    assert args.func(args) == 0
    plan = json.loads(capsys.readouterr().out.split("\n[bench]")[0])
    assert plan["videos"] == 2 and plan["server env"]["stock"] == {"OMNI_EXT_DISABLE_PATCHES": "openai-routes"}
    assert "--max-num-seqs 1" in plan["servers (one after the other)"]["omni_ext"]
    assert not any(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        args = parse("api-poll")
        args.func(args)


# ---- against a real server ------------------------------------------------------------------------------
@pytest.mark.server
def test_serving_bench_against_a_shared_server(server_pool, tmp_path: Path) -> None:
    """The command end to end on the shared tiny Wan server: 4 requests, 2 clients, async (SDK create +
    poll + download); every request completes and its figures are consistent with its requests."""
    server = server_pool.get("wan")
    out = tmp_path / "serving.json"
    args = parse("serving", "--url", f"wan={server.url}", "--quick", "--requests", "4", "--concurrency", "2",
                 "--json", str(out), "--quiet-wait", "0")  # the suite keeps the host busy: no wait, no measurement
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    entry = result["configurations"]["wan"]
    assert entry["sent"] == 4 and entry["ok"] == 4, entry["requests"]
    assert entry["errors"] == {} and sorted(r["seed"] for r in entry["requests"]) == [1000, 1001, 1002, 1003]
    assert all(r["bytes"] > 1000 for r in entry["requests"])  # an mp4 came back for each
    lat = sorted(r["latency_s"] for r in entry["requests"])
    assert lat[0] <= entry["p50_s"] <= entry["p90_s"] <= entry["p99_s"] <= lat[-1]
    assert 0 < entry["requests_per_s"] <= 4 / lat[0] * 2  # 2 clients cannot beat 2 / fastest
    assert result["host_ceiling"] is None and result["host_ceiling_absent"]


def test_every_configuration_called_stock_runs_vllm_omni_s_own_executor(tmp_path: Path) -> None:
    """A row called stock runs vLLM-Omni's executor and dispatch: rendered as the benchmarks start
    them (flags, and the deploy YAML they write), no omni-ext executor appears anywhere. The topologies
    suite's "stock-replicas2" once kept the preset's top-level ``distributed_executor_backend``, which
    vLLM-Omni applies to every stage: that row ran omni-ext's executor."""
    import yaml

    from omni_ext.bench import mixed

    checked = []
    for kind in ("video", "image"):
        for cfg in serving.resolve_suite("topologies", kind):
            if "stock" not in cfg.label:
                continue
            flags = serving.serve_args(cfg, parse("serving", "--suite", "topologies"), tmp_path)
            deploy = yaml.safe_load(Path(flags[flags.index("--deploy-config") + 1]).read_text()) if cfg.deploy else None
            assert c.omni_ext_executor_in(flags, deploy) == [], (kind, cfg.label, flags, deploy)
            assert cfg.deploy is None or cfg.env.get("OMNI_EXT_DISABLE_PATCHES") == "replica-dispatch"
            c.refuse_omni_ext_in_stock(cfg.label, flags)
            checked.append(f"{kind}:{cfg.label}")
    for flag in (["--replicas", "2"], ["--multi-host"]):
        layout = mixed.layout_of(parse("mixed", *flag, "--json", "x.json"))
        specs = mixed.server_specs(layout, mixed.replicas_deploy(tmp_path))
        for name, flags in specs.items():
            deploy = yaml.safe_load(Path(flags[flags.index("--deploy-config") + 1]).read_text()) \
                if "--deploy-config" in flags else None
            uses_ours = c.omni_ext_executor_in(flags, deploy)
            assert (uses_ours == []) == name.endswith("stock"), (name, uses_ours)
            if name.endswith("stock"):
                checked.append(name)
    assert len(checked) == 8 + 2
    # and the guard every benchmark server passes through refuses a mislabelled one, top-level key included
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"distributed_executor_backend": c.TUNED, "stages": [{"stage_id": 0}]}))
    with pytest.raises(ValueError, match="called stock but selects omni-ext's executor: deploy YAML"):
        c.refuse_omni_ext_in_stock("stock-replicas2", ["--deploy-config", str(bad)])
    c.refuse_omni_ext_in_stock("replicas2", ["--deploy-config", str(bad)])
