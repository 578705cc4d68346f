"""``omni-ext bench mixed``: a closed burst of mixed lengths on two groups, omni-ext's default order vs FIFO.

Two TunedExecutor servers with two data-parallel groups of one worker
(``{"omni_ext": {"data_parallel_size": 2}}``), run side by side, that differ only in
``omni_ext.scheduler.order``: "slo", the default (longest predicted first unless a deadline is at
risk, step-level preemption on: the order that must serve a burst and a stream, issue 19) and
"fifo" (arrival order: vLLM-Omni's). On each:

1. every distinct length of ``--frames`` alone, ``--single-reps`` times: the job times the bound is
   made of (measured on that server, in this run, before the bursts);
2. ``--reps`` bursts: all of ``--frames`` sent at once, in that arrival order (81, 17, 81, 17, 81, 17
   by default, which hurts FIFO), as asynchronous jobs (``POST /v1/videos`` one after another, so
   the arrival order is the given one); makespan = last job stored - first job sent. With
   ``--order-variants`` also "longest last" (ascending) and short/long alternating.

``mixed.makespan_over_bound`` = makespan / ``max(sum of job times / 2, longest job time)``, one
bound for both servers: each length's time is the faster server's median. Goal <= 1.10 x the same
run's two-job contention factor (the bound assumes two groups run as fast side by side as alone, which
a shared host does not give), 1.10 when the ceiling is skipped; for the default order (the FIFO
server's beside it). The factor is how much slower each of two concurrent bare jobs runs than one
alone: whole jobs without a server (:class:`omni_ext.bench.ceiling.JobPair`), every length of the
burst alone and two at once after each round of bursts, each length's slowdown weighted by its jobs'
time in the burst.

``predicted_start_error_s``: how far each burst job's start (the executor's log line) fell from the
start its ``POST`` answer predicted (``predicted_wait_s`` after the answer; ``predicted_start_at`` is
the same in whole unix seconds): p50/p99/max of actual - predicted over every job of the bursts, per
server (positive: later than told). The JSON also holds what list scheduling predicts from the single
timings (arrival order = FIFO, longest first = LPT) and the optimal makespan of the burst (often
above the bound: three 81-frame jobs cannot split evenly over two groups).

The same workload runs across vLLM-Omni's replicas (issue 11: scale-out), each server side by side
with its stock counterpart, figure ``replicas.makespan_over_bound`` (goal <= 1.10):

- ``--replicas 2``: one server with two replicas (deploy YAML ``num_replicas: 2``, one worker in each),
  omni-ext's dispatch and a TunedExecutor in each replica (the head keeps the queue and binds a job when
  a replica frees) vs stock: vLLM-Omni's executor and its round robin on arrival
  (``OMNI_EXT_DISABLE_PATCHES=replica-dispatch``);
- ``--multi-host``: vLLM-Omni's multi-machine mode on loopback, a head with its own replica plus one
  headless replica, omni-ext's dispatch and executor vs stock: vLLM-Omni's executor and the head's
  ``--omni-lb-policy least-queue-length``.

The stock sides were omni-ext's executor with vLLM-Omni's dispatch until the stock rule
(:func:`omni_ext.bench.common.refuse_omni_ext_in_stock`); figures quoted before it compare dispatch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from omni_ext.bench import common as c
from omni_ext.bench import schedule as s
from omni_ext.bench.ceiling import JobPair, weighted_slowdown
from omni_ext.bench.client import JobTracker, post_video, sync_burst
from omni_ext.bench.logwatch import LogWatcher

ORDERS = ("slo", "fifo")  # omni-ext's default order (SchedulerConfig.order), the baseline
GROUPS = 2
GOAL = ("<=", 1.10)
# 64x64, 20 steps: an 81-frame CFG job ~7-8 s on one thread, a 17-frame one ~3 s: a burst ~20 s.
# Three bursts per order, so that the median is one burst's makespan, not the mean of two: on 12-05 two
# bursts run on the same schedule took 11.88 and 12.94 s (one 81-frame job 6.71 s beside another, 5.70 s
# in the other burst).
DEFAULTS = {"size": "64x64", "frames": "81,17,81,17,81,17", "steps": 20, "single_reps": 2, "reps": 3,
            "skip_ceiling": False, "order_variants": False}
QUICK = {"size": "64x64", "frames": "33,9,33,9", "steps": 4, "single_reps": 1, "reps": 1, "skip_ceiling": True}


@dataclass(frozen=True)
class Layout:
    """Where the two groups are and what omni-ext is compared with. ``ORDERS[0]`` ("slo") is always
    omni-ext's server, ``ORDERS[1]`` ("fifo") the baseline: ``baseline`` names it in the JSON."""

    name: str  # "groups", "replicas" or "multi-host"
    figure: str  # prefix of the figures and key of the summary
    baseline: str  # what the baseline is called in the JSON ("fifo", "stock")
    labels: tuple[str, str]  # how the table names the two servers

    def server(self, order: str) -> str:
        return {"groups": f"tuned_dp2_{order}", "replicas": f"replicas2_{_side(order)}",
                "multi-host": f"multihost2_{_side(order)}"}[self.name]


GROUPS_LAYOUT = Layout("groups", "mixed", "fifo", ("order=slo (default)", "order=fifo"))
LAYOUTS = {
    "groups": GROUPS_LAYOUT,
    "replicas": Layout("replicas", "replicas", "stock", ("omni-ext dispatch", "stock round robin")),
    "multi-host": Layout("multi-host", "replicas", "stock", ("omni-ext dispatch", "stock least-queue-length")),
}
#: The replica layouts' stock side: vLLM-Omni's own executor and dispatch (the API stays omni-ext's).
STOCK_DISPATCH_ENV = c.STOCK_DISPATCH_ENV


def _side(order: str) -> str:
    return "omni_ext" if order == ORDERS[0] else "stock"


def layout_of(args) -> Layout:
    if getattr(args, "multi_host", False):
        return LAYOUTS["multi-host"]
    if getattr(args, "replicas", None):
        if args.replicas != GROUPS:
            raise SystemExit(f"omni-ext bench mixed --replicas: only {GROUPS} (the bound is for two groups)")
        return LAYOUTS["replicas"]
    return GROUPS_LAYOUT


def server_name(order: str, layout: Layout = GROUPS_LAYOUT) -> str:
    return layout.server(order)


def server_specs(layout: Layout = GROUPS_LAYOUT, deploy: str = "DEPLOY_YAML") -> dict[str, list[str]]:
    """Serve args of the two servers (for ``multi-host``: of every process of each, head and headless)."""
    if layout.name == "groups":
        return {layout.server(o): ["--distributed-executor-backend", c.TUNED,
                                   *c.additional_config(data_parallel_size=GROUPS, scheduler={"order": o})] for o in ORDERS}
    if layout.name == "replicas":
        return {layout.server(o): ["--deploy-config", deploy if _side(o) == "omni_ext" else _stock_path(deploy)]
                for o in ORDERS}
    return {layout.server(o): ["--distributed-executor-backend", c.TUNED] if _side(o) == "omni_ext" else []
            for o in ORDERS}


def _stock_path(deploy: str) -> str:
    return deploy[: -len(".yaml")] + "-stock.yaml" if deploy.endswith(".yaml") else deploy + "-stock"


def server_envs(layout: Layout) -> dict[str, dict[str, str]]:
    return {} if layout.name == "groups" else {layout.server(ORDERS[1]): dict(STOCK_DISPATCH_ENV)}


def replicas_deploy(workdir: Path) -> str:
    """The deploy YAML of ``--replicas 2``: two replicas of the tiny Wan, a TunedExecutor of one worker each
    (and beside it, for the stock side, the same with vLLM-Omni's executor)."""
    path = workdir / "replicas2.yaml"
    deploy = {"async_chunk": False, "stages": [{
        "stage_id": 0, "num_replicas": GROUPS, "devices": "0,1", "distributed_executor_backend": c.TUNED,
        "flow_shift": 5.0, "boundary_ratio": 0.875}]}
    path.write_text(yaml.safe_dump(deploy, sort_keys=False))
    Path(_stock_path(str(path))).write_text(yaml.safe_dump(c.stock_deploy(deploy), sort_keys=False))
    return str(path)


def start_servers(layout: Layout, servers: c.Servers, workdir: Path, timeout: float) -> None:
    if layout.name != "multi-host":
        servers.start(server_specs(layout, replicas_deploy(workdir)), timeout, envs=server_envs(layout))
        return
    for o in ORDERS:
        stock = o == ORDERS[1]
        servers.start_multihost(layout.server(o), server_specs(layout)[layout.server(o)], headless=GROUPS - 1,
                                head_args=["--omni-lb-policy", "least-queue-length"] if stock else [],
                                head_env=dict(STOCK_DISPATCH_ENV) if stock else {})
    servers.wait_all(timeout)


# ---- measuring ---------------------------------------------------------------------------------------
def run_jobs(url: str, tracker: JobTracker, watcher: LogWatcher, args, frames: list[int], seed: int,
             timeout: float, progress: c.Progress | None = None) -> dict[str, Any]:
    """Send one asynchronous job per entry of ``frames`` (in that order, back to back) and wait for all.
    Times are relative to the first send."""
    answers = [post_video(url, c.video_fields(args, num_frames=f, seed=seed + i)) for i, f in enumerate(frames)]
    t0 = answers[0].sent_at
    errors = [a.record() for a in answers if a.kind != "job"]
    ids = [a.job_id for a in answers if a.kind == "job"]
    ends = tracker.wait(ids, timeout, progress)
    jobs = []
    for f, a in zip(frames, answers):
        if a.kind != "job":
            continue
        end = ends[a.job_id]
        start = watcher.first("start", a.job_id) or watcher.first("dispatch", a.job_id)
        wait = a.body.get("predicted_wait_s") if isinstance(a.body, dict) else None
        predicted = a.answered_at - t0 + wait if wait is not None else None
        started = start.t - t0 if start else None
        jobs.append({"id": a.job_id, "frames": f, "sent_s": a.sent_at - t0,
                     "started_s": started, "ranks": list(start.ranks) if start else None,
                     "predicted_start_s": predicted,
                     "start_error_s": started - predicted if started is not None and predicted is not None else None,
                     "ended_s": end.ended_at - t0, "end_source": end.source, "status": end.status,
                     "latency_s": end.ended_at - a.sent_at})
    ok = not errors and all(j["status"] == "completed" for j in jobs)
    return {"frames": frames, "ok": ok, "errors": errors, "jobs": jobs,
            "makespan_s": max((j["ended_s"] for j in jobs), default=None) if ok else None}


def _job_timeout(args, frames: list[int]) -> float:
    return 120.0 + 10.0 * sum(frames) * args.steps / 20.0


def run(args) -> dict[str, Any]:
    layout = layout_of(args)
    host = c.quiet_host(args)
    frames = s.parse_frames(args.frames)
    orders = s.arrival_orders(frames, args.order_variants)
    lengths = sorted(set(frames))
    model, workdir, base_args, env = c.setup(args)
    servers = c.Servers(model, workdir, base_args, env)
    raw: dict[str, dict[str, Any]] = {o: {"single": {str(f): [] for f in lengths}, "bursts": {v: [] for v in orders}}
                                      for o in ORDERS}
    total = len(ORDERS) * (len(lengths) * args.single_reps + args.reps * sum(len(v) for v in orders.values()))
    watchers: dict[str, LogWatcher] = {}
    progress = None
    # The bare yardstick's processes start with the servers (their first calls are paid before anything
    # is timed); one repetition of it follows each round of bursts, so both meet the same phases of the host.
    pair = None if args.skip_ceiling else JobPair(model, *c.size_hw(args.size), args.steps, lengths, workdir)
    try:
        start_servers(layout, servers, workdir, args.start_timeout)
        if pair is not None:
            pair.ready()
        trackers = {}
        for o in ORDERS:
            name = layout.server(o)
            watchers[o] = LogWatcher(servers.log_path(name)).start()
            trackers[o] = JobTracker(servers.url(name), watchers[o])
            for f in lengths:  # both groups pay their first calls at every length
                sync_burst(servers.url(name), c.video_fields(args, num_frames=f, seed=1), GROUPS)
        progress = c.Progress("mixed: jobs", total)
        for o in ORDERS:  # single-job timings, each length alone
            for rep in range(args.single_reps):
                for f in lengths:
                    r = run_jobs(servers.url(layout.server(o)), trackers[o], watchers[o], args, [f], 500 + rep,
                                 _job_timeout(args, [f]), progress)
                    if not r["ok"]:
                        raise RuntimeError(f"single {f}-frame job on {layout.server(o)} failed: {r}")
                    raw[o]["single"][str(f)].append(r["jobs"][0]["latency_s"])
        for rep in range(args.reps):
            for variant, order in orders.items():
                pair_of_orders = ORDERS if rep % 2 == 0 else ORDERS[::-1]
                for o in pair_of_orders:
                    r = run_jobs(servers.url(layout.server(o)), trackers[o], watchers[o], args, order, 1000 + 10 * rep,
                                 _job_timeout(args, order), progress)
                    raw[o]["bursts"][variant].append(r)
                    c.log(f"rep {rep} {variant} order={o}: makespan {c.fmt(r['makespan_s'], 2)} s")
            if pair is not None:
                pair.rep(rep)
                c.log(f"rep {rep} bare jobs (no server), alone / two at once: " + ", ".join(
                    f"{f} frames {t['one'][-1]:.2f} / {max(t['two'][-2:]):.2f} s" for f, t in pair.times.items()))
    finally:
        for w in watchers.values():
            w.stop()
        servers.stop()
        if pair is not None:
            pair.close()
        if progress is not None:
            progress.close()
    ceiling = pair.result() if pair is not None else None
    c.finish_host(host)
    return summarize(raw, orders, ceiling, host, _facts(args, frames), servers.commands, str(workdir), layout)


def _facts(args, frames: list[int]) -> dict[str, Any]:
    fields = c.video_fields(args, num_frames=frames[0])
    return {"model_size": args.model_size, "groups": GROUPS, "layout": layout_of(args).name,
            "request": {k: fields[k] for k in ("size", "num_inference_steps", "guidance_scale")},
            "frames": frames, "single_reps": args.single_reps, "reps": args.reps}


# ---- summary (pure) --------------------------------------------------------------------------------
def burst_figures(single_s: dict[str, float], order: list[int], makespans: list[float | None]) -> dict[str, Any]:
    """Bound, predicted and measured makespans of one arrival order on one server."""
    job_s = [single_s[str(f)] for f in order]
    bound = s.makespan_bound(job_s, GROUPS)
    done = [m for m in makespans if m is not None]
    med = c.median(done) if done else None
    opt = s.optimal_makespan(job_s, GROUPS)
    return {
        "order": order, "job_s": job_s, **bound,
        "makespans_s": makespans, "median_makespan_s": med,
        "makespan_over_bound": c.ratio(med, bound["bound_s"]),
        "predicted_fifo_makespan_s": s.list_schedule(job_s, GROUPS),
        "predicted_lpt_makespan_s": s.lpt_makespan(job_s, GROUPS),
        "optimal_makespan_s": opt,
        "optimal_over_bound": c.ratio(opt, bound["bound_s"]),
        "failed_bursts": len(makespans) - len(done),
    }


def start_errors(bursts: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Actual - predicted start (seconds) of every job of ``bursts`` (arrival order -> runs) that has both:
    how well admission's ``predicted_start_at`` held; p50, p99 and max, and how many jobs."""
    errs = [j["start_error_s"] for runs in bursts.values() for r in runs for j in r.get("jobs", ())
            if j.get("start_error_s") is not None]
    return {"n": len(errs), "p50": c.percentile(errs, 50), "p99": c.percentile(errs, 99), "max": max(errs, default=None)}


def summarize(raw: dict[str, dict[str, Any]], orders: dict[str, list[int]], ceiling: dict[str, Any] | None,
              host: dict[str, Any], facts: dict[str, Any], commands: dict[str, Any], workdir: str = "",
              layout: Layout = GROUPS_LAYOUT) -> dict[str, Any]:
    measurement = bool(host.get("measurement", True))
    prefix, base = layout.figure, layout.baseline
    ours, theirs = ORDERS
    singles = {o: {f: c.median(v) for f, v in raw[o]["single"].items()} for o in ORDERS}
    # one bound for both servers: a length's time is the faster server's (neither is judged against
    # its own slower single runs)
    common = {f: min(singles[o][f] for o in ORDERS) for f in singles[ours]}
    per: dict[str, dict[str, Any]] = {}
    for o in ORDERS:
        per[o] = {"single_job_s": singles[o], "single_runs_s": raw[o]["single"],
                  "predicted_start_error_s": start_errors(raw[o]["bursts"]),
                  "orders": {v: burst_figures(common, order, [b["makespan_s"] for b in raw[o]["bursts"][v]])
                             for v, order in orders.items()}}
    contention = weighted_slowdown(ceiling, [(str(f), common[str(f)]) for f in orders["given"]]) if ceiling else None
    goal = round(GOAL[1] * max(1.0, contention), 4) if contention else GOAL[1]
    figures: dict[str, dict[str, Any]] = {}
    for v in orders:
        mine, baseline = per[ours]["orders"][v], per[theirs]["orders"][v]
        name = f"{prefix}.makespan_over_bound" if v == "given" else f"{prefix}.makespan_over_bound.{v}"
        extra = {f"{base}_value": baseline["makespan_over_bound"], "order": orders[v],
                 "optimal_over_bound": mine["optimal_over_bound"]}
        if contention:
            extra["over_host_adjusted_bound"] = c.ratio(mine["makespan_over_bound"], contention)
            extra["two_jobs_at_once_slowdown"] = contention
        figures[name] = c.figure(mine["makespan_over_bound"], GOAL[0], goal, measurement, **extra)
    if len(orders) > 1:
        vals = [f["value"] for f in figures.values()]
        worst = None if any(v is None for v in vals) else max(vals)
        figures[f"{prefix}.worst_makespan_over_bound"] = c.figure(
            worst, GOAL[0], goal, measurement, **{f"{base}_value": _worst([f[f"{base}_value"] for f in figures.values()])})
    given_ours, given_base = per[ours]["orders"]["given"], per[theirs]["orders"]["given"]
    return {
        "benchmark": "mixed",
        "model": f"tiny Wan2.1-T2V '{facts.get('model_size')}' (random weights, float32)",
        **{k: v for k, v in facts.items() if k != "model_size"},
        "arrival_orders": orders,
        "threads_per_worker": 1,
        "host": host,
        "measurement": measurement,
        "workdir": workdir,
        "server_commands": commands,
        "servers": {layout.server(o): label for o, label in zip(ORDERS, layout.labels)},
        "runs": raw,
        "by_server": per,
        prefix: {
            "makespan_over_bound": given_ours["makespan_over_bound"],
            "goal_makespan_over_bound": f"{GOAL[0]} {goal:g}",
            "pass_makespan_over_bound": figures[f"{prefix}.makespan_over_bound"]["pass"],
            "bound_inputs": {"single_job_s": common, "total_s": given_ours["total_s"],
                             "longest_s": given_ours["longest_s"], "groups": GROUPS, "bound_s": given_ours["bound_s"]},
            "makespan_s": given_ours["median_makespan_s"],
            "predicted_start_error_s": per[ours]["predicted_start_error_s"],
            base: {"makespan_over_bound": given_base["makespan_over_bound"], "makespan_s": given_base["median_makespan_s"],
                   "predicted_start_error_s": per[theirs]["predicted_start_error_s"],
                   "bound_inputs": {"single_job_s": common, "total_s": given_base["total_s"],
                                    "longest_s": given_base["longest_s"], "bound_s": given_base["bound_s"]}},
            **({"worst_makespan_over_bound": figures[f"{prefix}.worst_makespan_over_bound"]["value"]}
               if len(orders) > 1 else {}),
        },
        "host_ceiling": ({**ceiling, "two_jobs_at_once_slowdown": contention} if ceiling else None),
        "figures": figures,
    }


def _worst(vals: list[float | None]) -> float | None:
    return None if any(v is None for v in vals) else max(vals)


def table(result: dict[str, Any]) -> str:
    figs = result["figures"]
    layout = LAYOUTS.get(result.get("layout", "groups"), GROUPS_LAYOUT)
    base = layout.baseline
    out = [c.figures_table(figs, {f"{layout.labels[1]} (vLLM-Omni)": {k: f.get(f"{base}_value") for k, f in figs.items()},
                                  "optimal/bound": {k: f.get("optimal_over_bound") for k, f in figs.items()}})]
    rows = []
    for v, order in result["arrival_orders"].items():
        for o, label in zip(ORDERS, layout.labels):
            b = result["by_server"][o]["orders"][v]
            rows.append([v, ",".join(map(str, order)), label, b["bound_s"], b["median_makespan_s"],
                         b["makespan_over_bound"], b["predicted_lpt_makespan_s"] if o == ORDERS[0] else b["predicted_fifo_makespan_s"],
                         b["optimal_makespan_s"]])
    out.append(c.format_table(["arrival", "frames", "server", "bound (s)", "makespan (s)", "makespan/bound",
                               "list-scheduling prediction (s)", "optimal (s)"], rows))
    singles = "; ".join(f"{label}: " + ", ".join(f"{f} frames {c.fmt(t, 2)} s" for f, t in
                                                 result["by_server"][o]["single_job_s"].items())
                        for o, label in zip(ORDERS, layout.labels))
    out.append(f"single-job times (alone): {singles}")
    errs = "; ".join(f"{label}: p50 {c.fmt(e['p50'], 2)} s, p99 {c.fmt(e['p99'], 2)} s over {e['n']} jobs"
                     for o, label in zip(ORDERS, layout.labels)
                     for e in [result["by_server"][o].get("predicted_start_error_s") or {"n": 0, "p50": None, "p99": None}])
    out.append(f"start - predicted start (admission's predicted_start_at): {errs}")
    ceil = result.get("host_ceiling")
    if ceil:
        per_length = ", ".join(f"{f} frames {c.fmt(b.get('slowdown'))}x" for f, b in ceil.get("by_length", {}).items())
        out.append(f"bare host, whole jobs without a server: two at once each {c.fmt(ceil.get('two_jobs_at_once_slowdown'))}x "
                   f"slower than alone, weighted by the burst's job times ({per_length})")
    out += c.not_a_measurement(result)
    return "\n\n".join(out)


def dry_run(args) -> dict[str, Any]:
    layout = layout_of(args)
    frames = s.parse_frames(args.frames)
    orders = s.arrival_orders(frames, args.order_variants)
    planned = c.planned_commands(c.model_path(args), server_specs(layout))
    for name, env in server_envs(layout).items():
        planned[name] = c.shell_command([], env).strip() + " " + planned[name]
    if layout.name == "multi-host":
        planned = {name: {"head": f"{cmd} --stage-id 0 --omni-master-address 127.0.0.1 --omni-master-port MASTER_PORT"
                                  + (" --omni-lb-policy least-queue-length" if name.endswith("stock") else ""),
                          "headless (x1)": cmd.replace(" --host 127.0.0.1 --port PORT", " --headless")
                                           + " --stage-id 0 --omni-master-address 127.0.0.1 --omni-master-port MASTER_PORT"
                                           " --worker-backend multi_process"}
                   for name, cmd in planned.items()}
    return {"benchmark": "mixed", "servers (side by side)": planned,
            "request": c.video_fields(args, num_frames=frames[0]), **_facts(args, frames), "arrival_orders": orders,
            "ceiling": not args.skip_ceiling, "goal": f"{layout.figure}.makespan_over_bound {GOAL[0]} {GOAL[1]:g}"}


def main(args) -> int:
    return c.run_command(args, DEFAULTS, QUICK, dry_run, run, table)
