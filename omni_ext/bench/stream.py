"""``omni-ext bench stream``: an open stream of short, few-step and long videos at several loads, SLO attainment.

What users and the field measure on a stream is SLO attainment: the share of requests that finish
within k times their standalone time (k = 3 in vLLM-Omni's RFC #290). Servers, all the tiny Wan
(``--model-size``, "med" by default) on two groups of one worker, started together and measured one
at a time on the same streams:

- ``slo``: omni-ext's TunedExecutor with data_parallel_size 2 and the scheduler's defaults (order
  ``slo``: least slack first by each request's deadline; step-level preemption on);
- ``fifo``: the same with ``order: fifo`` (vLLM-Omni's order);
- ``stock``: vLLM-Omni's executor in two replicas and its round robin (``num_replicas: 2``,
  nothing of omni-ext's in the executor or the dispatch; the API stays omni-ext's ``/v1/videos``);
- ``nopreempt``: ``slo`` with ``preempt: false``, on the highest load only (``preempt.throughput_loss``).

The mix (``--short-share``, ``--few-share``, the long class the rest): half short 9-frame 8-step CFG
videos, a quarter few-step ones (:data:`FEW`: 9 frames, 3 steps, no CFG, FastWan's shape) and a quarter
long 81-frame 20-step ones. Every request of an omni-ext server also records what omni-ext predicted for
it (the ``POST`` answer's ``predicted_wait_s``, the executor's predicted seconds) against what happened;
:func:`prediction_stats` gives the errors per class.

Steps:

1. each class alone on each server, ``--standalone-reps`` times: a request's slowdown is its latency
   over the *fastest* server's median standalone time of its class (one yardstick for all servers);
2. the capacity, measured: two groups over the mix's mean standalone seconds, divided by how much
   slower two long jobs sent together run than one alone (the host's contention: both groups share
   its cores with the API and engine processes): the median of every server's pairs, one capacity
   for all servers (12-03: the least of the servers' medians, 1.07 against 1.24-1.31, made "0.9" an
   overload of 1.1 for every server);
3. per load: Poisson arrivals (``--seed``; :func:`arrivals`: the expected count, the mix's share
   exactly) of the mix at ``load`` x capacity for ``--duration`` seconds, sent open loop (each
   ``POST /v1/videos`` at its time, whatever the server does), then every job waited for.
   A refused request (429) counts as a miss;
4. preemption: both groups busy with a long job, then an interactive (priority -1) short request: its
   start after the send, in units of the long job's step time.

Figures and goals (issue 19): ``stream.slo3_attainment`` at 0.7 >= 0.95 and at 0.9 >= 0.85, each
ahead of fifo and stock (of those the run measured: ``--servers``); ``stream.short_p99_over_standalone`` at 0.9 <= 3;
``preempt.interactive_start_over_step`` <= 1.5; ``preempt.throughput_loss`` <= 0.05 at 0.9. The burst
side (``mixed.makespan_over_bound``) is ``omni-ext bench mixed``. ``--plot`` draws attainment against
load per server.

``--repeat N`` (issue 38: one run met every goal, an earlier one on the same code missed them all)
repeats steps 1-4 N times on the same servers, run i with the arrivals' seed ``--seed`` + i, each
after a wait for a quiet host; a figure passes when the median of the runs meets its goal and at
least two thirds of the runs do (:func:`omni_ext.bench.common.repeat_figures`).
"""

from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omni_ext.bench import common as c
from omni_ext.bench import mixed
from omni_ext.bench.client import JobTracker, post_video, sync_burst
from omni_ext.bench.logwatch import LogWatcher

GROUPS = 2
SERVERS = ("slo", "fifo", "stock")
BASELINES = ("fifo", "stock")
NOPREEMPT = "nopreempt"
FACTORS = (3.0, 5.0)
GOALS = {
    "stream.slo3_attainment@0.7": (">=", 0.95),
    "stream.slo3_attainment@0.9": (">=", 0.85),
    "stream.short_p99_over_standalone@0.9": ("<=", 3.0),
    "preempt.interactive_start_over_step": ("<=", 1.5),
    "preempt.throughput_loss": ("<=", 0.05),
}
# 64x64: a long 81-frame, 20-step CFG job ~8 s on one thread of the "med" model, a short 9-frame,
# 8-step one ~1 s: more than 5x apart in cost, as the issue asks.
#: The few-step class (issue 38): FastWan's shape, a distilled few-step video without CFG (its DMD sampler
#: runs 3 steps, guidance off). One server serves one pipeline, so it is the tiny Wan's own sampler at that
#: step count with guidance 1.0: a job on one unit, as the TunedExecutor runs a CFG-free request.
FEW = "few"
DEFAULTS = {"size": "64x64", "short": "9x8", "few": "9x3", "long": "81x20", "short_share": 0.5, "few_share": 0.25,
            "loads": "0.5,0.7,0.9",
            "duration": 150.0, "standalone_reps": 3, "seed": 0}
QUICK = {"size": "32x32", "short": "5x2", "few": "5x1", "long": "17x6", "loads": "0.7", "duration": 20.0, "standalone_reps": 1}


# ---- the workload (pure) ---------------------------------------------------------------------------------
def parse_class(text: str) -> tuple[int, int]:
    """``FRAMESxSTEPS`` -> (frames, steps)."""
    try:
        frames, steps = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a request class is FRAMESxSTEPS (e.g. 9x8), got {text!r}") from None
    if frames < 1 or steps < 1:
        raise ValueError(f"frames and steps must be positive, got {text!r}")
    return frames, steps


def parse_loads(text: str) -> list[float]:
    loads = [float(x) for x in str(text).split(",") if x.strip()]
    if not loads or any(not 0 < x < 2 for x in loads):
        raise ValueError(f"loads are fractions of capacity in (0, 2), got {text!r}")
    return loads


def parse_servers(text: str) -> list[str]:
    """``--servers``: a comma-separated subset of the servers, in the benchmark's order."""
    known = [*SERVERS, NOPREEMPT]
    got = [x.strip() for x in str(text).split(",") if x.strip()]
    bad = [x for x in got if x not in known]
    if bad or not got:
        raise ValueError(f"--servers takes a comma-separated subset of {','.join(known)}, got {text!r}")
    return [n for n in known if n in got]


def mix_shares(short_share: float, few_share: float = 0.0) -> dict[str, float]:
    """Each class's share of the stream: short, few-step (when its share is above 0), long the rest."""
    if not (0 < short_share < 1 and 0 <= few_share < 1 and short_share + few_share < 1):
        raise ValueError(f"the short ({short_share:g}) and few-step ({few_share:g}) shares must leave the long class "
                         "a share above 0")
    return {"short": short_share, **({FEW: few_share} if few_share > 0 else {}), "long": 1 - short_share - few_share}


def _shares(shares: float | dict[str, float]) -> dict[str, float]:
    return mix_shares(shares) if isinstance(shares, (int, float)) else shares


def capacity_rps(standalone_s: dict[str, float], shares: float | dict[str, float], groups: int = GROUPS) -> float:
    """Requests per second the groups finish at full use: ``groups`` over the mix's mean seconds
    (``shares``: each class's, or the short share of a short/long mix)."""
    mean_s = sum(share * standalone_s[cls] for cls, share in _shares(shares).items())
    return groups / mean_s


def arrivals(load: float, rate_at_capacity: float, duration_s: float, shares: float | dict[str, float],
             seed: int) -> list[tuple[float, str]]:
    """Poisson arrivals at ``load`` x capacity for ``duration_s``: (time, class), the same for every
    server (seeded by ``seed`` and the load).

    The count is the expected one, ``round(load x rate x duration)``, and the times are a Poisson
    process given that count (uniform order statistics: the same clumps and gaps); each class is its
    share of them exactly (the long class the rest), in a random order. A free count made the loads' labels wrong on
    a slow host: 90 s at 0.56 req/s drew 36 requests at load 0.5 and 27 at 0.7 (12-03), so "0.7"
    was lighter than "0.5"."""
    rng = random.Random(f"{seed}:{load:g}")
    n = max(1, round(load * rate_at_capacity * duration_s))
    classes: list[str] = []
    for cls, share in _shares(shares).items():
        classes += [cls] * (round(share * n) if cls != "long" else 0)
    classes += ["long"] * (n - len(classes))
    rng.shuffle(classes)
    times = sorted(rng.uniform(0.0, duration_s) for _ in range(n))
    return list(zip(times, classes))


def stream_stats(requests: list[dict[str, Any]], standalone_s: dict[str, float]) -> dict[str, Any]:
    """SLO attainment (a refused or failed request is a miss), p50/p99 latency and slowdown per class,
    throughput (completed requests over the time from the first send to the last end)."""
    def slowdown(r: dict[str, Any]) -> float:
        return r["latency_s"] / standalone_s[r["cls"]] if r["status"] == "completed" else float("inf")

    out: dict[str, Any] = {"n": len(requests), "completed": sum(r["status"] == "completed" for r in requests),
                           "refused": sum(r["status"] == "refused" for r in requests)}
    for f in FACTORS:
        out[f"slo{f:g}_attainment"] = round(sum(slowdown(r) <= f for r in requests) / len(requests), 4) if requests else None
    for cls in [*dict.fromkeys(["short", "long", *(r["cls"] for r in requests)]), "all"]:
        mine = [r for r in requests if cls in ("all", r["cls"])]
        lat = [r["latency_s"] for r in mine if r["status"] == "completed"]
        slow = [slowdown(r) for r in mine]
        out[cls] = {"n": len(mine), "p50_latency_s": _r(c.percentile(lat, 50)), "p99_latency_s": _r(c.percentile(lat, 99)),
                    "p50_slowdown": _r(_pct_inf(slow, 50)), "p99_slowdown": _r(_pct_inf(slow, 99))}
    ends = [r["end_s"] for r in requests if r["status"] == "completed"]
    out["throughput_rps"] = _r(len(ends) / max(ends)) if ends else None
    predictions = prediction_stats(requests, standalone_s)
    if predictions:
        out["predictions"] = predictions
    return out


def _pct_inf(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile as :func:`omni_ext.bench.common.percentile` takes it, where a miss is
    infinitely slow: None when it falls on or next to one (the percentile is unbounded)."""
    vals = sorted(xs)
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    if vals[lo] == float("inf") or (pos > lo and vals[hi] == float("inf")):
        return None
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)


def summarize(raw: dict[str, Any], standalone: dict[str, dict[str, float]], loads: list[float],
              preempt: dict[str, Any] | None, host: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
    """Figures from the raw per-server, per-load requests; one standalone yardstick per class, the
    fastest server's."""
    measurement = bool(host.get("measurement", True))
    yardstick = {cls: min(s[cls] for s in standalone.values()) for cls in next(iter(standalone.values()))}
    by_load: dict[str, dict[str, Any]] = {}
    for load in loads:
        key = f"{load:g}"
        by_load[key] = {name: stream_stats(runs[key], yardstick) for name, runs in raw.items() if key in runs}
    figures: dict[str, dict[str, Any]] = {}
    for load in loads:
        key = f"{load:g}"
        name = f"stream.slo3_attainment@{key}"
        per = by_load[key]
        value = per.get("slo", {}).get("slo3_attainment")
        extra = {f"{b}_value": per.get(b, {}).get("slo3_attainment") for b in BASELINES}
        # ahead of the baselines this run measured; with none (``--servers slo``) the goal alone
        ran = [extra[f"{b}_value"] for b in BASELINES if b in per]
        ahead = None if not ran else value is not None and all(v is not None and value > v for v in ran)
        if name in GOALS:  # the loads the issue sets goals at (the others are in the table)
            fig = c.figure(value, *GOALS[name], measurement, **extra, ahead_of_baselines=ahead)
            if fig["pass"] is not None and ahead is not None:
                fig["pass"] = fig["pass"] and ahead
            figures[name] = fig
        short = per.get("slo", {}).get("short", {}).get("p99_slowdown")
        name = f"stream.short_p99_over_standalone@{key}"
        if name in GOALS:
            figures[name] = c.figure(short, *GOALS[name], measurement,
                                     **{f"{b}_value": per.get(b, {}).get("short", {}).get("p99_slowdown") for b in BASELINES})
    if preempt is not None:
        figures["preempt.interactive_start_over_step"] = c.figure(
            preempt.get("interactive_start_over_step"), *GOALS["preempt.interactive_start_over_step"], measurement,
            **{k: v for k, v in preempt.items() if k != "interactive_start_over_step"})
    top = f"{max(loads):g}"
    with_p, without = by_load[top].get("slo", {}).get("throughput_rps"), by_load[top].get(NOPREEMPT, {}).get("throughput_rps")
    if without is not None:
        loss = None if with_p is None else round(1 - with_p / without, 4)
        figures["preempt.throughput_loss"] = c.figure(loss, *GOALS["preempt.throughput_loss"], measurement,
                                                      load=float(top), with_preemption_rps=with_p, without_rps=without)
    return {"benchmark": "stream", **facts, "host": host, "measurement": measurement,
            "standalone_s": standalone, "yardstick_s": yardstick,
            "cost_ratio_long_over_short": _r(yardstick["long"] / yardstick["short"], 2),
            "by_load": by_load, "preempt": preempt, "runs": raw, "figures": figures}


# ---- measuring --------------------------------------------------------------------------------------------
def _fields(args, cls: str, seed: int) -> dict[str, Any]:
    frames, steps = args.classes[cls]
    return c.video_fields(SimpleNamespace(size=args.size, frames=frames, steps=steps), seed=seed,
                          **({"guidance_scale": 1.0} if cls == FEW else {}))


def play(url: str, tracker: JobTracker, args, schedule: list[tuple[float, str]], seed: int,
         progress: c.Progress | None) -> list[dict[str, Any]]:
    """Send ``schedule`` open loop (each at its time, from a pool so a slow answer delays no other),
    then wait for every admitted job; one record per request. ``progress`` advances twice per request:
    at its send and at its end (or refusal), so that it moves during the arrivals too."""
    answers: list[Any] = [None] * len(schedule)
    t0 = time.monotonic() + 0.5

    def send(i: int) -> None:
        at, cls = schedule[i]
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        answers[i] = post_video(url, _fields(args, cls, seed + i))
        if progress is not None:
            progress.advance()

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(send, range(len(schedule))))
    ids = [a.job_id for a in answers if a.kind == "job"]
    longest = max(args.classes[k][0] * args.classes[k][1] for k in args.classes)
    ends = tracker.wait(ids, timeout=600.0 + 0.05 * longest * len(ids), progress=progress)
    out = []
    for (_at, cls), a in zip(schedule, answers):
        rec: dict[str, Any] = {"cls": cls, "sent_s": round(a.sent_at - t0, 3)}
        if a.kind != "job":
            rec.update(status="refused", http=a.status, latency_s=None)
            if progress is not None:
                progress.advance()
        else:
            end = ends[a.job_id]
            rec.update(id=a.job_id, status=end.status, latency_s=round(end.ended_at - a.sent_at, 3),
                       end_s=round(end.ended_at - t0, 3), end_source=end.source,
                       **_predictions(a, tracker.watcher))
        out.append(rec)
    return out


def _predictions(answer: Any, watcher: LogWatcher | None) -> dict[str, Any]:
    """What omni-ext predicted for one job and what happened: the wait its ``POST`` answer predicted
    (``predicted_wait_s``; None when the answer gave none), its wait until the
    executor started it, and the seconds the executor predicted for it and reported at its end. Empty
    where the server logs no starts (vLLM-Omni's executor)."""
    if watcher is None:
        return {}
    start, done = watcher.first("start", answer.job_id), watcher.first("done", answer.job_id)
    if start is None:
        return {}
    body = answer.body if isinstance(answer.body, dict) else {}
    return {"predicted_wait_s": body.get("predicted_wait_s"), "waited_s": round(start.t - answer.sent_at, 3),
            "predicted_s": start.predicted_s, "run_s": done.seconds if done is not None and not done.error else None}


def prediction_stats(requests: list[dict[str, Any]], standalone_s: dict[str, float]) -> dict[str, Any]:
    """How well omni-ext's predictions held, per class (issue 38: 1-4-step jobs within 20 %):

    - ``duration_error``: |predicted seconds / reported seconds - 1| of each job the executor predicted
      (p50, p90);
    - ``start_error_s``: |waited - predicted wait| of each job whose answer predicted a wait, in
      seconds (p50, p90) and, p50, over the class's standalone seconds.

    Empty for a server without predictions (vLLM-Omni's executor)."""
    out: dict[str, Any] = {}
    for cls in dict.fromkeys(r["cls"] for r in requests):
        mine = [r for r in requests if r["cls"] == cls and r.get("status") == "completed"]
        dur = [abs(r["predicted_s"] / r["run_s"] - 1) for r in mine if r.get("predicted_s") and r.get("run_s")]
        start = [abs(r["waited_s"] - r["predicted_wait_s"]) for r in mine
                 if r.get("predicted_wait_s") is not None and r.get("waited_s") is not None]
        if not dur and not start:
            continue
        p50 = c.percentile(start, 50)
        out[cls] = {"n_duration": len(dur), "duration_error_p50": _r(c.percentile(dur, 50)),
                    "duration_error_p90": _r(c.percentile(dur, 90)), "n_start": len(start),
                    "start_error_p50_s": _r(p50), "start_error_p90_s": _r(c.percentile(start, 90)),
                    "start_error_p50_over_standalone": _r(c.ratio(p50, standalone_s.get(cls)))}
    return out


def contention(url: str, tracker: JobTracker, args, alone_s: float) -> list[float]:
    """How much slower each of two long requests sent together runs than one alone on this server:
    their mean latency over ``alone_s``, once per ``--standalone-reps``."""
    ratios = []
    for rep in range(args.standalone_reps):
        runs = play(url, tracker, args, [(0.0, "long"), (0.0, "long")], 800 + 2 * rep, None)
        if any(r["status"] != "completed" for r in runs):
            raise RuntimeError(f"{url}: a pair of long requests did not complete: {runs}")
        ratios.append(round(sum(r["latency_s"] for r in runs) / len(runs) / alone_s, 3))
    return ratios


def standalone_times(url: str, tracker: JobTracker, args) -> dict[str, float]:
    """Median seconds of each class alone on this server, timed as the stream's requests are (an
    asynchronous job, from its send to its stored video)."""
    out = {}
    for cls in args.classes:
        runs = [play(url, tracker, args, [(0.0, cls)], 900 + rep, None)[0] for rep in range(args.standalone_reps)]
        if any(r["status"] != "completed" for r in runs):
            raise RuntimeError(f"{url}: a standalone {cls} request did not complete: {runs}")
        out[cls] = round(c.median([r["latency_s"] for r in runs]), 3)
    return out


def interactive_start(url: str, watcher: LogWatcher, args, long_s: float) -> dict[str, Any]:
    """Both groups busy with a long job, then an interactive short request: its start after the send,
    over the long job's step time (its standalone seconds / steps)."""
    longs = [post_video(url, _fields(args, "long", 700 + i)) for i in range(GROUPS)]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(watcher.first("start", a.job_id) for a in longs if a.kind == "job"):
        time.sleep(0.1)
    time.sleep(min(2.0, 0.2 * long_s))  # into the long jobs' denoise loops
    sent = post_video(url, _fields(args, "short", 777), priority=-1)
    started = watcher.wait("start", sent.job_id, 300) if sent.kind == "job" else None
    step_s = long_s / args.classes["long"][1]
    waited = started.t - sent.sent_at if started else None
    JobTracker(url, watcher).wait([a.job_id for a in [*longs, sent] if a.kind == "job"], 600)
    return {"interactive_start_over_step": _r(c.ratio(waited, step_s), 3), "interactive_start_s": _r(waited, 3),
            "long_step_s": _r(step_s, 4)}


def server_specs(deploy: str) -> tuple[dict[str, list[str]], dict[str, dict[str, str]]]:
    """(serve args, extra env) of every server; ``deploy`` is the two-replica deploy YAML whose stock
    twin (:func:`omni_ext.bench.mixed.replicas_deploy`) the stock server runs."""
    dp2 = {"data_parallel_size": GROUPS}
    specs = {"slo": ["--distributed-executor-backend", c.TUNED, *c.additional_config(**dp2)],
             "fifo": ["--distributed-executor-backend", c.TUNED, *c.additional_config(**dp2, scheduler={"order": "fifo"})],
             "stock": ["--deploy-config", mixed._stock_path(deploy)],
             NOPREEMPT: ["--distributed-executor-backend", c.TUNED, *c.additional_config(**dp2, scheduler={"preempt": False})]}
    return specs, {"stock": dict(c.STOCK_DISPATCH_ENV)}


def measure(servers: c.Servers, watchers: dict[str, LogWatcher], names: list[str], args, loads: list[float],
            seed: int, label: str = "") -> tuple[dict, dict, dict | None, dict[str, Any]]:
    """One run on servers already up and warm: the standalone times, the capacity, the streams seeded
    by ``seed`` at every load, and the preemption; (raw, standalone, preempt, the run's facts)."""
    measured = [n for n in SERVERS if n in names] or [names[0]]
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {n: {} for n in names}
    standalone: dict[str, dict[str, float]] = {}
    for name in measured:
        standalone[name] = standalone_times(servers.url(name), JobTracker(servers.url(name), watchers[name]), args)
        c.log(f"{label}{name}: standalone {standalone[name]}")
    yard = {cls: min(s[cls] for s in standalone.values()) for cls in args.classes}
    pairs = {name: contention(servers.url(name), JobTracker(servers.url(name), watchers[name]), args,
                              standalone[name]["long"]) for name in measured}
    together = {name: round(c.median(v), 3) for name, v in pairs.items()}
    host_contention = round(max(1.0, c.median([x for v in pairs.values() for x in v])), 3)
    c.log(f"{label}two long jobs at once, each over alone: {pairs}; the host's: {host_contention}")
    shares = mix_shares(args.short_share, args.few_share)
    rate = capacity_rps(yard, shares) / host_contention
    schedules = {f"{load:g}": arrivals(load, rate, args.duration, shares, seed) for load in loads}
    top = f"{max(loads):g}"
    plays = {f"{load:g}": [n for n in names if n != NOPREEMPT or f"{load:g}" == top] for load in loads}
    total = 2 * sum(len(schedules[k]) * len(v) for k, v in plays.items())
    progress = c.Progress(f"{label}stream: requests sent + ended", total)
    for load in loads:
        key = f"{load:g}"
        for name in plays[key]:
            tracker = JobTracker(servers.url(name), watchers[name])
            raw[name][key] = play(servers.url(name), tracker, args, schedules[key], 10_000 * (1 + loads.index(load)), progress)
            stats = stream_stats(raw[name][key], yard)
            c.log(f"{label}load {key} {name}: slo3 {stats['slo3_attainment']}, short p99 slowdown "
                  f"{stats['short']['p99_slowdown']}, {stats['refused']} refused")
    progress.close()
    preempt = interactive_start(servers.url("slo"), watchers["slo"], args, yard["long"]) if "slo" in names else None
    facts = {"seed": seed, "capacity_rps": _r(rate), "capacity_rps_alone": _r(capacity_rps(yard, shares)),
             "two_jobs_over_alone": together, "two_jobs_over_alone_pairs": pairs, "contention": host_contention,
             "arrivals": {k: len(v) for k, v in schedules.items()}}
    return raw, standalone, preempt, facts


def run(args) -> dict[str, Any]:
    """``--repeat N`` runs on the same servers (started and warmed once), run i with the arrivals'
    seed ``--seed`` + i, each after a wait for a quiet host; one run's result, or :func:`repeated`."""
    host = c.quiet_host(args)
    loads = parse_loads(args.loads)
    model, workdir, base_args, env = c.setup(args)
    servers = c.Servers(model, workdir, base_args, env)
    specs, envs = server_specs(mixed.replicas_deploy(workdir))
    names = parse_servers(args.servers)
    specs = {n: specs[n] for n in names}
    watchers: dict[str, LogWatcher] = {}
    done: list[tuple[dict[str, Any], tuple]] = []
    n = args.repeat
    try:
        servers.start(specs, args.start_timeout, envs=envs)
        for name in names:
            watchers[name] = LogWatcher(servers.log_path(name)).start()
            for cls in args.classes:  # both groups pay their first calls
                sync_burst(servers.url(name), _fields(args, cls, 1), GROUPS)
        for i in range(n):
            if i:  # the last run left the host busy
                c.finish_host(host)
                host = c.quiet_host(args)
            label = f"run {i + 1}/{n} (seed {args.seed + i}): " if n > 1 else ""
            done.append((host, measure(servers, watchers, names, args, loads, args.seed + i, label)))
    finally:
        for w in watchers.values():
            w.stop()
        servers.stop()
    c.finish_host(host)
    facts = {"model": f"tiny Wan2.1-T2V '{args.model_size}' (random weights, float32)", "groups": GROUPS,
             "size": args.size, "classes": {k: {"frames": f, "steps": s} for k, (f, s) in args.classes.items()},
             "shares": mix_shares(args.short_share, args.few_share), "loads": loads, "duration_s": args.duration,
             "server_commands": servers.commands, "workdir": str(workdir)}
    results = [summarize(raw, standalone, loads, preempt, h, {**facts, **mine})
               for h, (raw, standalone, preempt, mine) in done]
    return results[0] if n == 1 else repeated(results)


def repeated(results: list[dict[str, Any]]) -> dict[str, Any]:
    """N runs' results as one: every run's full result (``results``) and the ``repeat`` section, whose
    figures (:func:`omni_ext.bench.common.repeat_figures`: median, range, runs meeting the goal,
    verdict) are also the top-level ``figures``."""
    figures = c.repeat_figures([r["figures"] for r in results])
    busy = [i + 1 for i, r in enumerate(results) if not r["measurement"]]
    return {"benchmark": "stream", "measurement": not busy, "busy_runs": busy, "figures": figures,
            "repeat": {"n": len(results), "seeds": [r["seed"] for r in results], "runs_needed": c.runs_needed(len(results)),
                       "figures": figures},
            "results": results}


# ---- output -----------------------------------------------------------------------------------------------
def table(result: dict[str, Any]) -> str:
    if "repeat" in result:
        return repeat_table(result)
    figs = result["figures"]
    out = [c.figures_table(figs, {f"{b} (vLLM-Omni)" if b == "stock" else b: {k: f.get(f"{b}_value") for k, f in figs.items()}
                                  for b in BASELINES})]
    rows = []
    for load, per in result["by_load"].items():
        for name, s in per.items():
            rows.append([load, name, s["n"], s["refused"], s["slo3_attainment"], s["slo5_attainment"],
                         s["short"]["p50_latency_s"], s["short"]["p99_latency_s"], s["short"]["p99_slowdown"],
                         s["long"]["p50_latency_s"], s["long"]["p99_latency_s"], s["throughput_rps"]])
    out.append(c.format_table(["load", "server", "requests", "refused", "SLO 3x", "SLO 5x", "short p50 (s)",
                               "short p99 (s)", "short p99 / alone", "long p50 (s)", "long p99 (s)", "req/s"], rows))
    extra = [[load, name, cls, s[cls]["n"], s[cls]["p50_latency_s"], s[cls]["p99_latency_s"], s[cls]["p99_slowdown"]]
             for load, per in result["by_load"].items() for name, s in per.items()
             for cls in s if cls not in ("short", "long", "all") and isinstance(s[cls], dict) and "p99_slowdown" in s[cls]]
    if extra:
        out.append(c.format_table(["load", "server", "class", "requests", "p50 (s)", "p99 (s)", "p99 / alone"], extra))
    prows = [[load, name, cls, p["n_duration"], p["duration_error_p50"], p["duration_error_p90"], p["n_start"],
              p["start_error_p50_s"], p["start_error_p90_s"], p["start_error_p50_over_standalone"]]
             for load, per in result["by_load"].items() for name, s in per.items()
             for cls, p in (s.get("predictions") or {}).items()]
    if prows:
        out.append("omni-ext's predictions per class (duration: |predicted / reported - 1|; start: |waited - the "
                   "POST answer's predicted_wait_s|, of the jobs it predicted a wait for)\n\n" + c.format_table(
                       ["load", "server", "class", "jobs", "duration err p50", "p90", "waits predicted",
                        "start err p50 (s)", "p90 (s)", "p50 / alone"], prows))
    y = result["yardstick_s"]
    out.append(f"standalone (fastest server's median, the yardstick of every server): short {c.fmt(y['short'], 2)} s, "
               f"long {c.fmt(y['long'], 2)} s ({c.fmt(result['cost_ratio_long_over_short'], 1)}x); "
               f"capacity {c.fmt(result.get('capacity_rps'))} req/s on {result.get('groups')} groups"
               + (f" (measured: {c.fmt(result['capacity_rps_alone'])} req/s at standalone speed, over two long jobs "
                  f"at once each {c.fmt(result['contention'], 3)}x slower than alone, the median of every "
                  f"server's pairs: {result['two_jobs_over_alone']})"
                  if result.get("two_jobs_over_alone") else ""))
    out += c.not_a_measurement(result)
    return "\n\n".join(out)


def repeat_table(result: dict[str, Any]) -> str:
    """Each run's tables, then every figure's runs, median, range and verdict (median and two thirds of
    the runs meet the goal)."""
    runs = result["results"]
    out = [f"== run {i + 1}/{len(runs)} (seed {r['seed']}) ==\n\n{table(r)}" for i, r in enumerate(runs)]
    rep = result["repeat"]
    out.append(f"== {rep['n']} runs (seeds {', '.join(map(str, rep['seeds']))}): a figure passes when its median "
               f"meets the goal and at least {rep['runs_needed']} of {rep['n']} runs do ==")
    out.append(c.repeat_table(result["figures"], [f"run {i + 1}" for i in range(len(runs))]))
    if result["busy_runs"]:
        out.append(f"NOT A MEASUREMENT: run(s) {', '.join(map(str, result['busy_runs']))} started on a busy host")
    return "\n\n".join(out)


def median_by_load(results: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Each server's median SLO-3x attainment per load over the runs (what :func:`plot` draws for
    ``--repeat``)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for key in results[0]["by_load"]:
        names = dict.fromkeys(n for r in results for n in r["by_load"].get(key, {}))
        out[key] = {}
        for name in names:
            vals = [r["by_load"][key][name]["slo3_attainment"] for r in results if name in r["by_load"].get(key, {})]
            vals = [v for v in vals if v is not None]
            if vals:
                out[key][name] = {"slo3_attainment": c.median(vals)}
    return out


def plot(result: dict[str, Any], path: str | Path) -> None:
    """SLO attainment at 3x against load, one line per server (with ``--repeat``: the runs' median),
    the goals as points."""
    if "repeat" in result:
        result = {"by_load": median_by_load(result["results"])}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted(result["by_load"], key=float)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in [*SERVERS, NOPREEMPT]:
        pts = [(float(k), result["by_load"][k][name]["slo3_attainment"]) for k in loads if name in result["by_load"][k]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label={"slo": "omni-ext (order slo)", "fifo": "order fifo",
                                                    "stock": "stock, 2 replicas", NOPREEMPT: "slo, no preemption"}[name])
    for name, (_op, target) in GOALS.items():
        if name.startswith("stream.slo3_attainment@"):
            ax.plot([float(name.split("@")[1])], [target], marker="_", markersize=18, color="black")
    ax.set_xlabel("load (share of measured capacity)")
    ax.set_ylabel("requests within 3x standalone")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title("SLO attainment on a Poisson stream (goals: black marks)", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    c.log(f"wrote {path}")


def dry_run(args) -> dict[str, Any]:
    loads = parse_loads(args.loads)
    specs, envs = server_specs(str(Path(args.workdir or "WORKDIR") / "replicas2.yaml"))
    planned = c.planned_commands(c.model_path(args), specs)
    for name, env in envs.items():
        planned[name] = c.shell_command([], env).strip() + " " + planned[name]
    plan = {"benchmark": "stream", "servers (started together, measured one at a time)": planned,
            "classes": {k: {"frames": f, "steps": s, "request": _fields(args, k, 0)} for k, (f, s) in args.classes.items()},
            "shares": mix_shares(args.short_share, args.few_share), "loads": loads, "duration_s": args.duration,
            "seed": args.seed,
            "goals": {k: f"{op} {v:g}" for k, (op, v) in GOALS.items()}}
    if args.repeat > 1:
        plan["repeat"] = {"runs": args.repeat, "seeds": [args.seed + i for i in range(args.repeat)],
                          "pass": f"median meets the goal and at least {c.runs_needed(args.repeat)} of {args.repeat} runs do"}
    return plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="write the figures, goals, pass/fail and every request here (required unless --dry-run)")
    p.add_argument("--plot", default=None, help="also draw SLO attainment against load as this PNG")
    p.add_argument("--quick", action="store_true", help="a small, fast version (smoke test; figures are not meaningful)")
    p.add_argument("--dry-run", action="store_true", help="print the servers, commands and requests; start nothing")
    p.add_argument("--model-size", choices=["tiny", "small", "med"], default="med", help="tiny Wan2.1 preset")
    p.add_argument("--size", default=None, help="WxH of every video")
    p.add_argument("--short", default=None, help="the short class, FRAMESxSTEPS (default 9x8)")
    p.add_argument("--long", default=None, help="the long class, FRAMESxSTEPS (default 81x20)")
    p.add_argument("--few", default=None, help="the few-step class, FRAMESxSTEPS without CFG (default 9x3: FastWan's shape)")
    p.add_argument("--short-share", type=float, default=None, help="share of short requests in the stream (0.5)")
    p.add_argument("--few-share", type=float, default=None,
                   help="share of few-step requests (0.25; 0 leaves them out); the long class takes the rest")
    p.add_argument("--loads", default=None, help="comma-separated loads, fractions of the measured capacity (0.5,0.7,0.9)")
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals per load and server (150)")
    p.add_argument("--standalone-reps", type=int, default=None, help="standalone timings per class and server (median)")
    p.add_argument("--seed", type=int, default=None, help="the arrivals' seed")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="play the whole benchmark N times on the same servers, run i with seed --seed + i, each "
                        "after a wait for a quiet host; a figure passes when the median of the runs meets its goal "
                        "and at least two thirds of the runs (rounded up: 2 of 3) do")
    p.add_argument("--servers", default=",".join([*SERVERS, NOPREEMPT]),
                   help="comma-separated servers to run (of slo,fifo,stock,nopreempt; all by default). The yardstick "
                        "and the capacity come from the ones run; a figure whose servers did not run has no value")
    c.add_host_options(p)


def main(args) -> int:
    c.apply_profile(args, DEFAULTS, QUICK)
    if args.repeat < 1:
        raise SystemExit(f"omni-ext bench stream: --repeat must be at least 1, got {args.repeat}")
    try:
        mix_shares(args.short_share, args.few_share)
    except ValueError as exc:
        raise SystemExit(f"omni-ext bench stream: {exc}") from None
    args.classes = {"short": parse_class(args.short), **({FEW: parse_class(args.few)} if args.few_share > 0 else {}),
                    "long": parse_class(args.long)}
    if args.dry_run:
        return c.print_plan(dry_run(args))
    if not args.json:
        raise SystemExit("omni-ext bench stream: --json OUT is required (or --dry-run)")
    result = run(args)
    code = c.write_result(args.json, result, table(result))
    if args.plot:
        plot(result, args.plot)
    return code
