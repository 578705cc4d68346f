"""``omni-ext bench adaptive``: one CFG-2 group, placing CFG requests as a pair, on single ranks, or adaptively.

Three TunedExecutor servers with ``--cfg-parallel-size 2`` that differ only in
``omni_ext.scheduler.cfg_mode`` ("pair", "single", "adaptive"), one after another (``--together``:
all three at once, requests alternating between them). On each:

- low load: ``--low-load-requests`` CFG requests one at a time -> p50 latency;
- high load: ``--reps`` closed bursts of ``--concurrency`` CFG requests -> median throughput, and
  how many of them started as a pair or on single ranks (from the server log).

Figures: ``adaptive.low_load_latency_ratio`` = adaptive / pair p50 latency (goal <= 1.05: adaptive
keeps pairs when nothing waits), ``adaptive.high_load_throughput_ratio`` = adaptive / pair
throughput (>= 1.15: single ranks under load), ``adaptive.high_load_vs_single_ratio`` = adaptive /
single throughput (>= 0.95). Beside them the bare host ceilings of
:mod:`omni_ext.bench.ceiling`: a pair (cfg split + all-gather) vs one process, two independent
processes vs one, and their quotient, the best "single ranks / pair" throughput this host allows.
"""

from __future__ import annotations

import time
from typing import Any

from omni_ext.bench import common as c
from omni_ext.bench.client import sync_burst, sync_request
from omni_ext.bench.logwatch import LogWatcher, mode_counts
from omni_ext.scheduler.config import CfgMode

MODES = (CfgMode.PAIR, CfgMode.SINGLE, CfgMode.ADAPTIVE)
GOALS = {
    "adaptive.low_load_latency_ratio": ("<=", 1.05),
    "adaptive.high_load_throughput_ratio": (">=", 1.15),
    "adaptive.high_load_vs_single_ratio": (">=", 0.95),
}
# 80x80x17, 25 steps on the "med" tiny Wan: the cfg-parallel benchmark's request (a CFG step
# ~180 ms on one thread): a pair ~3 s, one rank ~4.5 s.
DEFAULTS = {"size": "80x80", "frames": 17, "steps": 25, "low_load_requests": 5, "concurrency": 8, "reps": 3,
            "skip_ceiling": False}
QUICK = {"size": "64x64", "frames": 9, "steps": 6, "low_load_requests": 2, "concurrency": 4, "reps": 1,
         "skip_ceiling": True}


def server_name(mode: CfgMode) -> str:
    return f"tuned_cfg2_{mode}"


def server_specs() -> dict[str, list[str]]:
    return {server_name(m): ["--cfg-parallel-size", "2", "--distributed-executor-backend", c.TUNED,
                             *c.additional_config(scheduler={"cfg_mode": m})] for m in MODES}


def total_requests(args) -> int:
    return len(MODES) * (args.low_load_requests + args.reps * args.concurrency)


# ---- measuring ---------------------------------------------------------------------------------------
def _warm_up(url: str, args) -> None:
    sync_burst(url, c.video_fields(args, seed=1), 2)  # both ranks (single mode) pay their first calls
    sync_request(url, c.video_fields(args, seed=2))


def _low_load(url: str, watcher: LogWatcher, args, n: int, progress: c.Progress, into: dict[str, Any]) -> None:
    """``n`` requests one at a time; their latencies and how they started (pair or single) go ``into`` the raw record."""
    t0 = time.monotonic()
    for i in range(n):
        into["low_load_latencies_s"].append(sync_request(url, c.video_fields(args, seed=10 + i))["latency_s"])
        progress.advance()
    time.sleep(0.2)
    for k, v in mode_counts(watcher.events, t0, time.monotonic()).items():
        into["low_load_starts"][k] = into["low_load_starts"].get(k, 0) + v


def _high_load(url: str, watcher: LogWatcher, args, progress: c.Progress) -> dict[str, Any]:
    t0 = time.monotonic()
    burst = sync_burst(url, c.video_fields(args), args.concurrency, progress)
    time.sleep(0.2)  # the last "start" lines are long written; let the watcher read them
    burst["starts"] = mode_counts(watcher.events, t0, time.monotonic())
    return burst


def run(args) -> dict[str, Any]:
    host = c.quiet_host(args)
    model, workdir, base_args, env = c.setup(args)
    specs = server_specs()
    servers = c.Servers(model, workdir, base_args, env)
    raw: dict[str, dict[str, Any]] = {m: {"low_load_latencies_s": [], "low_load_starts": {}, "high_load": []}
                                      for m in MODES}
    progress = c.Progress("adaptive: requests", total_requests(args))
    watchers: dict[str, LogWatcher] = {}
    try:
        if args.together:
            servers.start(specs, args.start_timeout)
            for m in MODES:
                watchers[m] = LogWatcher(servers.log_path(server_name(m))).start()
                _warm_up(servers.url(server_name(m)), args)
            for i in range(args.low_load_requests):  # request by request, rotating the order
                for m in MODES[i % 3:] + MODES[: i % 3]:
                    _low_load(servers.url(server_name(m)), watchers[m], args, 1, progress, raw[m])
            for rep in range(args.reps):
                for m in MODES[rep % 3:] + MODES[: rep % 3]:
                    raw[m]["high_load"].append(_high_load(servers.url(server_name(m)), watchers[m], args, progress))
        else:
            for m in MODES:
                name = server_name(m)
                servers.start({name: specs[name]}, args.start_timeout)
                watchers[m] = LogWatcher(servers.log_path(name)).start()
                _warm_up(servers.url(name), args)
                _low_load(servers.url(name), watchers[m], args, args.low_load_requests, progress, raw[m])
                for _ in range(args.reps):
                    raw[m]["high_load"].append(_high_load(servers.url(name), watchers[m], args, progress))
                watchers[m].stop()
                servers.stop(name)
    finally:
        for w in watchers.values():
            w.stop()
        servers.stop()
        progress.close()
    ceiling = None
    if not args.skip_ceiling:
        from omni_ext.bench.ceiling import measure

        c.log("bare host ceilings (no server): a pair vs one process, two independent processes vs one (~2 min)")
        h, w = c.size_hw(args.size)
        ceiling = {"cfg_pair": measure(model, h, w, args.frames, args.steps),
                   "two_ranks": measure(model, h, w, args.frames, args.steps, independent=True)}
    c.finish_host(host)
    return summarize(raw, ceiling, host, args=_facts(args), commands=servers.commands, workdir=str(workdir))


def _facts(args) -> dict[str, Any]:
    fields = c.video_fields(args)
    return {"model_size": args.model_size, "request": {k: fields[k] for k in ("size", "num_frames", "num_inference_steps",
                                                                              "guidance_scale")},
            "low_load_requests": args.low_load_requests, "concurrency": args.concurrency, "reps": args.reps,
            "together": bool(args.together)}


# ---- summary (pure) --------------------------------------------------------------------------------
def summarize(raw: dict[str, dict[str, Any]], ceiling: dict[str, Any] | None, host: dict[str, Any],
              args: dict[str, Any], commands: dict[str, Any], workdir: str = "") -> dict[str, Any]:
    """The result JSON from the raw measurements: p50 latencies, median throughputs, the three
    ratios with goals and pass/fail, the ceilings."""
    p50 = {m: c.median(raw[m]["low_load_latencies_s"]) for m in MODES}
    thr = {m: c.median([b["throughput_rps"] for b in raw[m]["high_load"]]) for m in MODES}
    starts: dict[str, dict[str, int]] = {}
    for m in MODES:
        for b in raw[m]["high_load"]:
            for k, v in (b.get("starts") or {}).items():
                starts.setdefault(m, {})[k] = starts.get(m, {}).get(k, 0) + v
    values = {
        "adaptive.low_load_latency_ratio": c.ratio(p50["adaptive"], p50["pair"]),
        "adaptive.high_load_throughput_ratio": c.ratio(thr["adaptive"], thr["pair"]),
        "adaptive.high_load_vs_single_ratio": c.ratio(thr["adaptive"], thr["single"]),
    }
    measurement = bool(host.get("measurement", True))
    figures = {name: c.figure(values[name], *GOALS[name], measurement) for name in GOALS}
    ceil_out = None
    if ceiling:
        pair_x = ceiling["cfg_pair"].get("speedup")
        two_x = ceiling["two_ranks"].get("throughput_ratio")
        ceil_out = {**ceiling, "single_ranks_over_pair_throughput": c.ratio(two_x, pair_x)}
    section = {k.split(".", 1)[1]: v for k, v in values.items()}
    for name, (op, target) in GOALS.items():
        key = name.split(".", 1)[1]
        section[f"goal_{key}"] = f"{op} {target:g}"
        section[f"pass_{key}"] = figures[name]["pass"]
    return {
        "benchmark": "adaptive",
        "model": f"tiny Wan2.1-T2V '{args.get('model_size')}' (random weights, float32)",
        **{k: v for k, v in args.items() if k != "model_size"},
        "threads_per_worker": 1,
        "host": host,
        "measurement": measurement,
        "workdir": workdir,
        "server_commands": commands,
        "runs": raw,
        "low_load": {"p50_latency_s": p50, "starts_by_mode": {m: raw[m].get("low_load_starts", {}) for m in MODES}},
        "high_load": {"median_throughput_rps": thr, "starts_by_mode": starts},
        "adaptive": section,
        "host_ceiling": ceil_out,
        "figures": figures,
    }


def table(result: dict[str, Any]) -> str:
    ceil = result.get("host_ceiling") or {}
    ceil_col = {"adaptive.high_load_throughput_ratio": ceil.get("single_ranks_over_pair_throughput")}
    out = [c.figures_table(result["figures"], {"host ceiling (no server)": ceil_col})]
    rows = []
    for m in MODES:
        s = result["high_load"]["starts_by_mode"].get(m, {})
        low = result["low_load"]["starts_by_mode"].get(m, {})
        rows.append([f"cfg_mode={m}", result["low_load"]["p50_latency_s"][m], f"{low.get('pair', 0)}/{low.get('single', 0)}",
                     result["high_load"]["median_throughput_rps"][m], f"{s.get('pair', 0)}/{s.get('single', 0)}"])
    out.append(c.format_table(["server", "p50 latency, 1 at a time (s)", "starts pair/single",
                               f"throughput, {result['concurrency']} concurrent (req/s)", "starts pair/single"], rows))
    if ceil:
        out.append(f"bare host: a pair {c.fmt(ceil['cfg_pair'].get('speedup'))}x one process, two independent "
                   f"processes {c.fmt(ceil['two_ranks'].get('throughput_ratio'))}x")
    out += c.not_a_measurement(result)
    return "\n\n".join(out)


def dry_run(args) -> dict[str, Any]:
    return {"benchmark": "adaptive", "servers (one after another)" if not args.together else "servers (together)":
            c.planned_commands(c.model_path(args), server_specs()),
            "request": c.video_fields(args), **_facts(args), "requests_total": total_requests(args),
            "ceiling": not args.skip_ceiling, "goals": {k: f"{op} {v:g}" for k, (op, v) in GOALS.items()}}


def main(args) -> int:
    return c.run_command(args, DEFAULTS, QUICK, dry_run, run, table)
