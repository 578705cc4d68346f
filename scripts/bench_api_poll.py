#!/usr/bin/env python
"""Status-poll latency while several videos finish: stock vLLM-Omni routes vs omni-ext's, one run.

Stock vLLM-Omni encodes each MP4 on the API event loop, so while videos complete, every other
request — including the cheap ``GET /v1/videos/{id}`` that clients poll — waits behind the
encoder. omni-ext encodes in a thread pool. This script starts the tiny Wan model twice, one after
the other on this machine (stock routes: ``OMNI_EXT_DISABLE_PATCHES=openai-routes``; then omni-ext),
submits N videos at once in each, polls ``GET /v1/videos/{id}`` at a fixed rate from a separate
thread until all are done, and prints latency percentiles side by side (and writes --json).

    .venv/bin/python scripts/bench_api_poll.py --json out/api_poll.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import requests

from omni_ext.models.tiny import build_tiny_model
from omni_ext.server_process import ServeProcess


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def run_phase(name: str, model: Path, env: dict[str, str], args: argparse.Namespace, tmp: Path) -> dict:
    server = ServeProcess(model=str(model), args=["--max-num-seqs", "1", *args.serve_args.split()], env={
        **env, "OMNI_EXT_API_DATA_DIR": str(tmp / f"api-{name}"), "VLLM_OMNI_SERVER_STORAGE__PATH": str(tmp / f"st-{name}"),
    }, log_path=tmp / f"{name}.log")
    with server:
        form = {"prompt": (None, "a city street at night, rain"), "size": (None, args.size),
                "num_frames": (None, str(args.frames)), "num_inference_steps": (None, str(args.steps)),
                "seed": (None, "1"), "fps": (None, "16")}
        requests.post(server.url + "/v1/videos/sync", files=form, timeout=600)  # warm-up
        ids = [requests.post(server.url + "/v1/videos", files=form, timeout=60).json()["id"] for _ in range(args.videos)]
        latencies: list[float] = []
        done = threading.Event()

        def poll() -> None:
            i = 0
            while not done.is_set():
                t0 = time.perf_counter()
                requests.get(f"{server.url}/v1/videos/{ids[i % len(ids)]}", timeout=60)
                latencies.append((time.perf_counter() - t0) * 1000)
                i += 1
                time.sleep(1 / args.rate)

        poller = threading.Thread(target=poll, daemon=True)
        t_start = time.perf_counter()
        poller.start()
        statuses = {}
        while len(statuses) < len(ids):
            for vid in ids:
                body = requests.get(f"{server.url}/v1/videos/{vid}", timeout=60).json()
                if body.get("status") in ("completed", "failed"):
                    statuses[vid] = body["status"]
            time.sleep(0.2)
        done.set()
        poller.join()
        wall = time.perf_counter() - t_start
    return {
        "routes": name, "videos": args.videos, "statuses": sorted(statuses.values()), "polls": len(latencies),
        "wall_s": round(wall, 2), "p50_ms": round(statistics.median(latencies), 1), "p99_ms": round(pct(latencies, 99), 1),
        "max_ms": round(max(latencies), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--videos", type=int, default=4)
    ap.add_argument("--size", default="832x480", help="WxH; large frames make MP4 encoding heavy")
    ap.add_argument("--frames", type=int, default=33)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rate", type=float, default=20.0, help="status polls per second")
    ap.add_argument("--serve-args", default="--distributed-executor-backend mp",
                    help="extra vllm-omni serve flags for both servers (default: the worker in its own process, "
                         "as in any multi-worker deployment, so the API process only serves HTTP)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = build_tiny_model("wan2.1-t2v", tmp / "wan")
        results = [
            run_phase("stock", model, {"OMNI_EXT_DISABLE_PATCHES": "openai-routes"}, args, tmp),
            run_phase("omni-ext", model, {}, args, tmp),
        ]
    report = {"workload": vars(args) | {"json": None}, "results": results,
              "p99_ratio_stock_over_omni_ext": round(results[0]["p99_ms"] / max(results[1]["p99_ms"], 1e-3), 2)}
    for r in results:
        print(f"{r['routes']:>9}: {r['polls']} polls during {r['wall_s']} s while {r['videos']} videos finished: "
              f"p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, max {r['max_ms']} ms")
    print(f"p99 stock / omni-ext: {report['p99_ratio_stock_over_omni_ext']}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
