"""``omni-ext bench batching``'s pure parts: the batches read from server logs, the burst and server
statistics, the figures and their goal, the servers' commands, the table, the dry run, and the burst
client against a fake HTTP server. The measurement itself runs real servers (``omni-ext bench
batching --json OUT``); its figures are not asserted here."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from omni_ext.bench import batching as b
from omni_ext.bench import common as c

TUNED_LOG = """\
(EngineCore pid=1) INFO 12-02 09:00:00 [ranks.py:650] omni-ext: start request warmup-0 on rank(s) [0] (warm-up), waited 0.00 s
INFO 12-02 09:00:01 [diffusion_engine.py:758] [RequestBatch] admission wait done waiting=16 max_batch=4 waited_ms=40.1
INFO 12-02 09:00:01 [ranks.py:245] omni-ext: a wave of 4 compatible requests (qwen-image:64x64x1:cfg) runs as 4 on 1 group(s) free in [0.0] s
INFO 12-02 09:00:01 [ranks.py:650] omni-ext: start batch of 4 requests ['img_gen-a', 'img_gen-b', 'img_gen-c', 'img_gen-d'] on rank(s) [0] (single), waited 0.05 s, priority 0
INFO 12-02 09:00:02 [ranks.py:245] omni-ext: a wave of 4 compatible requests (qwen-image:64x64x1:cfg) runs as 2+2 on 1 group(s) free in [0.0] s
INFO 12-02 09:00:02 [ranks.py:650] omni-ext: start batch of 2 requests ['img_gen-e', 'img_gen-f'] on rank(s) [0] (single), waited 1.00 s, priority 0
INFO 12-02 09:00:03 [ranks.py:650] omni-ext: start batch of 2 requests ['img_gen-g', 'img_gen-h'] on rank(s) [0] (single), waited 2.00 s, priority 0, predicted 1.0 s
INFO 12-02 09:00:04 [ranks.py:650] omni-ext: start request img_gen-i on rank(s) [0] (single), waited 3.00 s, priority 0
"""
STOCK_LOG = """\
INFO 12-02 09:00:00 [diffusion_engine.py:431] [RequestBatch] engine init max_num_seqs=4 max_wait_ms=200.0
INFO 12-02 09:00:01 [diffusion_engine.py:758] [RequestBatch] admission wait done waiting=16 max_batch=4 waited_ms=40.1
INFO 12-02 09:00:02 [diffusion_engine.py:758] [RequestBatch] admission wait done waiting=12 max_batch=4 waited_ms=0.0
INFO 12-02 09:00:03 [diffusion_engine.py:758] [RequestBatch] admission wait done waiting=8 max_batch=4 waited_ms=0.0
INFO 12-02 09:00:04 [diffusion_engine.py:758] [RequestBatch] admission wait done waiting=3 max_batch=4 waited_ms=0.0
"""


# ---- the batches, from the logs ------------------------------------------------------------------------
def test_the_tuned_executors_batches_and_plans_are_read_from_its_log_without_its_warm_up() -> None:
    assert b.tuned_batches(TUNED_LOG) == [4, 2, 2, 1]
    assert b.tuned_plans(TUNED_LOG) == ["4", "2+2"]
    assert b.histogram(b.tuned_batches(TUNED_LOG)) == {"1": 1, "2": 2, "4": 1}
    got = b.batches_of("tuned-b4", TUNED_LOG, sent=9, max_num_seqs=4)
    assert got["complete"] is True and got["plans"] == ["4", "2+2"] and got["engine_waves"] == [4]
    assert b.batches_of("tuned-b4", TUNED_LOG, sent=16, max_num_seqs=4)["complete"] is False


def test_vllm_omnis_waves_are_min_of_waiting_and_max_batch_and_b1_runs_one_at_a_time() -> None:
    assert b.engine_waves(STOCK_LOG) == [4, 4, 4, 3]
    got = b.batches_of("stock-b4", STOCK_LOG, sent=15, max_num_seqs=4)
    assert got["sizes"] == [4, 4, 4, 3] and got["complete"] is True and "RequestBatch" in got["source"]
    one = b.batches_of("stock-b1", "", sent=16, max_num_seqs=1)
    assert one["sizes"] == [1] * 16 and one["complete"] is True and "configuration" in one["source"]
    assert b.engine_waves("nothing here") == [] and b.histogram([]) == {}


# ---- statistics and figures ------------------------------------------------------------------------------
def _rec(lat: float, ok: bool = True, status: int | str = 200) -> dict:
    return {"ok": ok, "status": status, "latency_s": lat, "end_s": lat, "seed": 1000}


def _round(lats: list[float], wall: float, sizes: list[int], bad: int = 0) -> dict:
    records = [_rec(x) for x in lats] + [_rec(0.1, ok=False, status=429) for _ in range(bad)]
    return {"records": records, "wall_s": wall, "stats": b.burst_stats(records, wall),
            "batches": {"sizes": sizes, "source": "test", "complete": sum(sizes) == len(records)}}


def test_a_burst_counts_completed_requests_over_its_wall_time() -> None:
    s = b.burst_stats([_rec(1.0), _rec(2.0), _rec(3.0), _rec(0.2, ok=False, status=500)], 4.0)
    assert s["sent"] == 4 and s["ok"] == 3 and s["errors"] == {"500": 1}
    assert s["throughput_rps"] == pytest.approx(0.75)
    assert s["p50_latency_s"] == pytest.approx(2.0) and s["p99_latency_s"] == pytest.approx(2.98)
    assert b.burst_stats([], 0.0)["throughput_rps"] is None


def test_a_server_is_its_median_burst_with_latencies_and_batches_over_all_bursts() -> None:
    rounds = [_round([1.0] * 4, 4.0, [4]), _round([2.0] * 4, 2.0, [2, 2]), _round([3.0] * 4, 1.0, [4])]
    s = b.server_stats(rounds)
    assert s["throughput_rps"] == pytest.approx(2.0) and s["throughput_rps_per_round"] == [1.0, 2.0, 4.0]
    assert s["batch_histogram"] == {"2": 2, "4": 2} and s["batches"] == 4 and s["histogram_complete"] is True
    assert s["p50_latency_s"] == pytest.approx(2.0) and s["sent"] == 12 and s["errors"] == {}


def _servers(b1: float, b4: float, tuned: float, tuned_bad: int = 0) -> dict:
    def one(rps: float, bad: int = 0) -> dict:
        return b.server_stats([_round([1.0] * 16, 16 / rps, [4, 4, 4, 4], bad=bad)])
    return {"stock-b1": one(b1), "stock-b4": one(b4), "tuned-b4": one(tuned, tuned_bad)}


def test_the_goal_is_tuned_throughput_at_least_stocks_with_the_bare_ceiling_beside() -> None:
    ceiling = b.ceiling_stats([10.0, 9.0, 11.0], [8.0, 8.5, 7.5], n=16, k=4)
    assert ceiling["unbatched_rps"] == pytest.approx(1.6) and ceiling["batched_rps"] == pytest.approx(2.0)
    assert ceiling["batched_over_unbatched"] == pytest.approx(1.25)
    out = b.summarize(_servers(1.0, 1.2, 1.25), ceiling, {"measurement": True}, {"requests": 16})
    f = out["figures"]
    assert f["batching.tuned_over_stock_throughput"]["value"] == pytest.approx(1.25 / 1.2, abs=1e-4)
    assert f["batching.tuned_over_stock_throughput"]["pass"] is True
    assert f["batching.tuned_over_stock_throughput"]["goal"] == ">= 1"
    assert f["batching.stock_b4_over_b1"]["value"] == pytest.approx(1.2) and f["batching.stock_b4_over_b1"]["pass"] is None
    assert f["batching.stock_b4_over_b1"]["ceiling"] == pytest.approx(1.25)
    assert f["batching.tuned_over_stock_b1"]["value"] == pytest.approx(1.25)
    assert f["batching.stock_b4_over_ceiling"]["value"] == pytest.approx(0.6)
    assert f["batching.stock_b1_over_ceiling"]["value"] == pytest.approx(1.0 / 1.6)
    assert out["servers"]["tuned-b4"]["share_of_bare"] == pytest.approx(0.625)
    assert out["servers"]["stock-b1"]["share_of_bare"] == pytest.approx(0.625)
    slower = b.summarize(_servers(1.0, 1.2, 1.1), ceiling, {"measurement": False}, {})
    fig = slower["figures"]["batching.tuned_over_stock_throughput"]
    assert fig["pass"] is False and fig["measurement"] is False and c.verdict(fig) == "FAIL (not a measurement)"


def test_failed_requests_decide_no_pass_and_a_missing_ceiling_leaves_its_ratios_empty() -> None:
    out = b.summarize(_servers(1.0, 1.0, 2.0, tuned_bad=2), None, {"measurement": True}, {})
    fig = out["figures"]["batching.tuned_over_stock_throughput"]
    assert fig["pass"] is False and "tuned 2" in fig["note"]
    assert out["figures"]["ceiling.batched_over_unbatched"]["value"] is None
    assert out["figures"]["batching.tuned_over_ceiling"]["value"] is None
    assert out["servers"]["tuned-b4"]["share_of_bare"] is None
    text = b.table({**out, "ceiling_absent": "--skip-ceiling"})
    assert "not measured (--skip-ceiling)" in text and "batching.stock_b4_over_b1" in text


def test_the_table_names_the_goal_verdict_the_batches_and_what_carries_over() -> None:
    ceiling = b.ceiling_stats([10.0], [8.0], n=16, k=4)
    servers = _servers(1.0, 1.2, 1.3)
    for s in servers.values():
        s["load1_before"] = 0.4
    text = b.table(b.summarize(servers, ceiling, {"measurement": True}, {}))
    assert "goal: TunedExecutor throughput >= vLLM-Omni's on the same burst: PASS" in text
    assert "4x4" in text and "bare ceiling (one DiffusionWorker, no server)" in text
    assert "carries over to cards" in text and "tuned_over_stock_throughput" in text


# ---- servers, requests, dry run ------------------------------------------------------------------------
def test_the_stock_servers_run_vllm_omnis_executor_and_the_tuned_one_never_refuses() -> None:
    specs, envs = b.server_specs(4, 200)
    assert list(specs) == ["stock-b1", "stock-b4", "tuned-b4"]
    for name, flags in specs.items():
        assert (c.omni_ext_executor_in(flags) == []) == name.startswith("stock"), name
        c.refuse_omni_ext_in_stock(name, flags)
    assert specs["stock-b1"] == ["--max-num-seqs", "1"]
    assert specs["stock-b4"] == ["--max-num-seqs", "4", "--request-batch-max-wait-ms", "200"]
    assert specs["tuned-b4"][:4] == specs["stock-b4"]
    assert json.loads(specs["tuned-b4"][-1]) == {"omni_ext": {"scheduler": {"max_wait_s": 3600}}}
    assert envs == {"stock-b1": {"OMNI_EXT_DISABLE_PATCHES": "replica-dispatch"},
                    "stock-b4": {"OMNI_EXT_DISABLE_PATCHES": "replica-dispatch"}}


def test_a_burst_is_cfg_images_with_distinct_seeds() -> None:
    args = SimpleNamespace(size="64x64", steps=8)
    burst = [b.request_fields(args, i) for i in range(16)]
    assert len({f["seed"] for f in burst}) == 16
    assert all(f["negative_prompt"] and f["true_cfg_scale"] > 1 for f in burst)
    assert burst[0]["size"] == "64x64" and burst[0]["num_inference_steps"] == 8


def test_dry_run_names_the_servers_requests_and_goal_and_starts_nothing(capsys) -> None:
    from omni_ext.cli import main

    assert main(["bench", "batching", "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = json.loads(out.split("\n[bench]")[0])
    servers = plan["servers (started, measured and stopped one at a time, in this order)"]
    assert list(servers) == ["stock-b1", "stock-b4", "tuned-b4"]
    assert "TunedExecutor" in servers["tuned-b4"] and "TunedExecutor" not in servers["stock-b4"]
    assert "--max-num-seqs 4" in servers["stock-b4"] and "--max-num-seqs 1" in servers["stock-b1"]
    assert len(plan["requests"]) == 16 and plan["requests"][0]["size"] == "64x64"
    assert plan["goals"] == {"batching.tuned_over_stock_throughput": ">= 1"}
    assert "dry run: nothing was started" in out
    assert main(["bench", "batching", "--dry-run", "--quick", "--requests", "6"]) == 0
    quick = json.loads(capsys.readouterr().out.split("\n[bench]")[0])
    assert len(quick["requests"]) == 6 and quick["requests"][0]["num_inference_steps"] == 2
    assert quick["rounds per server"] == 1 and "qwen-image-tiny" in quick["model"]


def test_a_run_without_json_or_with_a_bad_size_is_refused() -> None:
    from omni_ext.cli import main

    with pytest.raises(SystemExit, match="--json OUT is required"):
        main(["bench", "batching", "--quick"])
    with pytest.raises(SystemExit, match="WxH"):
        main(["bench", "batching", "--dry-run", "--size", "64"])


# ---- the client, against a fake server -----------------------------------------------------------------
class _Fake:
    """A stand-in for ``vllm-omni serve``: answers ``POST /v1/images/generations`` (a 500 for seed
    1003) and logs a TunedExecutor start line per request."""

    def __init__(self) -> None:
        self.lines: list[str] = ["startup noise"]
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.lines.append(f"omni-ext: start request img_gen-{body['seed']} on rank(s) [0] (single), waited 0 s")
                ok = body["seed"] != 1003
                data = json.dumps({"data": [{"b64_json": "AA=="}]} if ok else {"error": "boom"}).encode()
                self.send_response(200 if ok else 500)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.log_path = Path("fake.log")
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def log_text(self) -> str:
        return "\n".join(self.lines)


def test_a_server_is_warmed_up_then_measured_in_bursts_with_its_batches_from_the_log() -> None:
    pytest.importorskip("requests")
    fake = _Fake()
    try:
        args = SimpleNamespace(size="32x32", steps=2, requests=6, rounds=2, max_num_seqs=4)
        got = b.measure_server("tuned-b4", fake, args)
    finally:
        fake.httpd.shutdown()
    assert len(got["warmup"]) == 5 and all(w["ok"] for w in got["warmup"])
    assert got["sent"] == 12 and got["ok"] == 10 and got["errors"] == {"500": 2}
    assert [len(r["records"]) for r in got["runs"]] == [6, 6]
    assert [r["seed"] for r in got["runs"][0]["records"]] == list(range(1000, 1006))
    # only each round's own start lines count: 6 requests alone per round, not the warm-up's 5
    assert got["batch_histogram"] == {"1": 12} and got["histogram_complete"] is True
    assert got["throughput_rps"] is not None and got["p99_latency_s"] is not None
