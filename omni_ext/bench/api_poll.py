"""``omni-ext bench api-poll``: status-poll latency while videos finish, vLLM-Omni's routes vs omni-ext's.

Stock vLLM-Omni encodes each MP4 on the API event loop, so while videos complete, every other
request (including the cheap ``GET /v1/videos/{id}`` that clients poll) waits behind the encoder.
omni-ext encodes in a thread pool. This starts the tiny Wan model twice, one after the other (stock
routes: ``OMNI_EXT_DISABLE_PATCHES=openai-routes``; then omni-ext's), submits ``--videos`` at once
in each, polls ``GET /v1/videos/{id}`` at ``--rate`` from a separate thread until all are done, and
writes the percentiles side by side. Goal: ``api_poll.p99_ms_omni_ext < 100``.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from omni_ext.bench import common as c

GOAL = ("<", 100.0)
#: (server name, its environment): vLLM-Omni's own video routes first, then omni-ext's.
PHASES: tuple[tuple[str, dict[str, str]], ...] = (("stock", {"OMNI_EXT_DISABLE_PATCHES": "openai-routes"}),
                                                  ("omni_ext", {}))
# 832x480 frames make the MP4 encoding heavy next to 2 denoise steps of the tiny model: the encoder is
# what a poll waits behind.
DEFAULTS = {"videos": 4, "size": "832x480", "frames": 33, "steps": 2, "rate": 20.0}
QUICK = {"videos": 2, "size": "256x256", "frames": 9, "steps": 2, "rate": 20.0}
TERMINAL = ("completed", "failed")


def server_args(args: argparse.Namespace) -> list[str]:
    """One request at a time, plus ``--serve-args`` (default: the worker in its own process, as in any
    multi-worker deployment, so the API process only serves HTTP)."""
    return ["--max-num-seqs", "1", *args.serve_args.split()]


def video_fields(args: argparse.Namespace, seed: int = 1) -> dict[str, Any]:
    return {"prompt": "a city street at night, rain", "size": args.size, "num_frames": args.frames,
            "num_inference_steps": args.steps, "seed": seed, "fps": 16}


# ---- measuring -------------------------------------------------------------------------------------
def poll_while(url: str, ids: list[str], rate: float, done: threading.Event) -> list[float]:
    """Poll ``GET /v1/videos/{id}`` (round robin over ``ids``) at ``rate`` per second until ``done``;
    each poll's latency in ms."""
    import requests

    latencies: list[float] = []
    i = 0
    while not done.is_set():
        t0 = time.perf_counter()
        try:
            requests.get(f"{url}/v1/videos/{ids[i % len(ids)]}", timeout=60)
        except requests.RequestException:
            pass  # a poll that timed out still took its time
        latencies.append((time.perf_counter() - t0) * 1000)
        i += 1
        time.sleep(1 / rate)
    return latencies


def wait_all(url: str, ids: list[str], timeout: float, progress: c.Progress) -> dict[str, str]:
    """Each video's final status (``timeout`` for one still running after ``timeout`` seconds)."""
    from omni_ext.bench.client import get_video

    statuses: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(statuses) < len(ids) and time.monotonic() < deadline:
        for vid in ids:
            body = get_video(url, vid) if vid not in statuses else None
            if body and body.get("status") in TERMINAL:
                statuses[vid] = body["status"]
                progress.advance()
        time.sleep(0.2)
    return {vid: statuses.get(vid, "timeout") for vid in ids}


def run_phase(url: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, submit ``--videos`` at once, poll until all ended."""
    from omni_ext.bench.client import post_video, sync_request

    sync_request(url, video_fields(args), timeout=600)  # warm-up: first-call costs
    answers = [post_video(url, video_fields(args, seed=2 + i), timeout=60) for i in range(args.videos)]
    bad = [a.record() for a in answers if a.kind != "job"]
    if bad:
        raise RuntimeError(f"{name}: video not accepted: {bad[0]}")
    ids = [a.job_id for a in answers]
    done = threading.Event()
    latencies: list[float] = []
    poller = threading.Thread(target=lambda: latencies.extend(poll_while(url, ids, args.rate, done)), daemon=True)
    progress = c.Progress(f"{name}: videos ended", len(ids))
    t0 = time.perf_counter()
    poller.start()
    try:
        statuses = wait_all(url, ids, args.job_timeout, progress)
    finally:
        done.set()
        poller.join()
        progress.close()
    return {"routes": name, "statuses": sorted(statuses.values()), "wall_s": time.perf_counter() - t0,
            "latencies_ms": latencies}


def run(args: argparse.Namespace) -> dict[str, Any]:
    host = c.quiet_host(args)
    model, workdir, base_args, env = c.setup(args)
    servers = c.Servers(model, workdir, base_args, env)
    phases = []
    try:
        for name, phase_env in PHASES:
            servers.start({name: server_args(args)}, args.start_timeout, {name: phase_env})
            try:
                phases.append(run_phase(servers.url(name), name, args))
            finally:
                servers.stop(name)
    finally:
        servers.stop()
    c.finish_host(host)
    result = summarize(phases, host, facts(args))
    result.update(server_commands=servers.commands, workdir=str(workdir))
    return result


# ---- summary (pure) --------------------------------------------------------------------------------
def phase_summary(phase: dict[str, Any]) -> dict[str, Any]:
    lat = phase["latencies_ms"]
    return {"routes": phase["routes"], "statuses": phase["statuses"], "polls": len(lat), "wall_s": phase["wall_s"],
            "p50_ms": c.percentile(lat, 50), "p99_ms": c.percentile(lat, 99), "max_ms": max(lat, default=None)}


def summarize(phases: list[dict[str, Any]], host: dict[str, Any], workload: dict[str, Any]) -> dict[str, Any]:
    """``api_poll.p99_ms_omni_ext`` against its goal, ``api_poll.p99_ms_stock`` beside it."""
    measurement = bool(host.get("measurement", True))
    by = {p["routes"]: phase_summary(p) for p in phases}
    ours, stock = by.get("omni_ext", {}).get("p99_ms"), by.get("stock", {}).get("p99_ms")
    not_completed = sum(s != "completed" for p in phases for s in p["statuses"])
    fig = c.figure(ours, *GOAL, measurement, stock_value=stock, stock_over_omni_ext=c.ratio(stock, ours))
    return {
        "benchmark": "api-poll", "workload": workload, "host": host, "measurement": measurement,
        "phases": by, "polls_ms": {p["routes"]: p["latencies_ms"] for p in phases},
        "api_poll": {"p99_ms_omni_ext": ours, "p99_ms_stock": stock, "p50_ms_omni_ext": by.get("omni_ext", {}).get("p50_ms"),
                     "p50_ms_stock": by.get("stock", {}).get("p50_ms"), "p99_ratio_stock_over_omni_ext": c.ratio(stock, ours),
                     "goal_p99_ms_omni_ext": f"{GOAL[0]} {GOAL[1]:g}", "pass_p99_ms_omni_ext": fig["pass"],
                     "videos_not_completed": not_completed},
        "figures": {"api_poll.p99_ms_omni_ext": fig},
    }


def table(result: dict[str, Any]) -> str:
    out = [c.figures_table(result["figures"], {"vLLM-Omni routes": {"api_poll.p99_ms_omni_ext": result["api_poll"]["p99_ms_stock"]}})]
    rows = [[p["routes"], p["polls"], p["wall_s"], p["p50_ms"], p["p99_ms"], p["max_ms"], ",".join(p["statuses"])]
            for p in result["phases"].values()]
    out.append(c.format_table(["routes", "polls", "wall (s)", "p50 (ms)", "p99 (ms)", "max (ms)", "videos"], rows))
    out += c.not_a_measurement(result)
    return "\n\n".join(out)


def facts(args: argparse.Namespace) -> dict[str, Any]:
    return {"model_size": args.model_size, "videos": args.videos, "rate_per_s": args.rate,
            "request": video_fields(args), "serve_args": server_args(args), "threads_per_worker": 1}


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    specs = {name: server_args(args) for name, _ in PHASES}
    return {"benchmark": "api-poll", "servers (one after the other)": c.planned_commands(c.model_path(args), specs),
            "server env": dict(PHASES), **facts(args), "goal": f"api_poll.p99_ms_omni_ext {GOAL[0]} {GOAL[1]:g}"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="write the percentiles, the goal, pass/fail and every poll here")
    p.add_argument("--quick", action="store_true", help="a small, fast version (smoke test)")
    p.add_argument("--dry-run", action="store_true", help="print the servers and requests; start nothing")
    p.add_argument("--videos", type=int, default=None, help="videos submitted at once")
    p.add_argument("--size", default=None, help="WxH; large frames make MP4 encoding heavy")
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--rate", type=float, default=None, help="status polls per second")
    p.add_argument("--serve-args", default="--distributed-executor-backend mp",
                   help="extra vllm-omni serve flags for both servers")
    p.add_argument("--model-size", choices=["tiny", "small", "med"], default="tiny", help="tiny Wan2.1 preset")
    p.add_argument("--models-dir", default=None, help="where the tiny model is built/cached")
    p.add_argument("--workdir", default=None, help="server logs and storage (default: a new temp dir)")
    p.add_argument("--start-timeout", type=float, default=1200.0)
    p.add_argument("--job-timeout", type=float, default=600.0, help="give up on the videos after this many seconds")
    c.add_quiet_options(p)


def main(args: argparse.Namespace) -> int:
    if not args.dry_run and not args.json:
        raise SystemExit("omni-ext bench api-poll: --json OUT is required (or --dry-run)")
    return c.run_command(args, DEFAULTS, QUICK, dry_run, run, table)
