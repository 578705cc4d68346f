"""``omni-ext bench admission``: a burst past ``max_wait_s`` (429 + Retry-After), then priorities.

One TunedExecutor server with two data-parallel groups of one worker (capacity 2) and admission
``{"omni_ext": {"scheduler": {"max_wait_s": W}}}``.

1. Calibration: the time ``job_s`` of one job while the other group is busy too (``capacity`` jobs
   at once, ``--calib-rounds`` times; the server learns its cost rate from them as well).
2. Admission: admission should take ``A = capacity * (floor(W / job_s) + 1)`` jobs of a burst (those
   predicted to start within W); ``--burst-factor`` (3) x A clients send at once. Every answer must
   be a job (200) or a 429 with ``Retry-After`` (anything else is an error); a refused client waits
   exactly what it was told (``retry-after-ms`` when present) and sends again, up to
   ``--max-retries`` times. ``admission.first_retry_admitted`` = refused clients admitted on their
   first retry / refused clients (goal >= 0.90); every accepted job must complete.
3. Priority: the server is filled with batch jobs (priority 0) until one is refused; after
   ``--interactive-delay`` x ``job_s`` one interactive request (priority -1) is sent.
   ``priority.interactive_start_over_min`` = (its start - its send) / (the first end of the jobs
   running at the send - the send), goal <= 1.1: it takes the first rank that frees. Start and end
   times are the TunedExecutor's ``start request`` / ``done request`` log lines as they appear
   (:mod:`omni_ext.bench.logwatch`); without them, ``progress > 1`` from polling and the job's
   stored end.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from omni_ext.bench import common as c
from omni_ext.bench import schedule as s
from omni_ext.bench.client import JobTracker, get_video, list_videos, post_video, sync_burst
from omni_ext.bench.logwatch import LogWatcher, running_at

CAPACITY = 2  # two data-parallel groups of one worker
GOALS = {
    "admission.first_retry_admitted": (">=", 0.90),
    "admission.errors": ("<=", 0),
    "admission.accepted_not_completed": ("<=", 0),
    "priority.interactive_start_over_min": ("<=", 1.1),
}
# 64x64x17, 20 steps: a CFG job ~3-3.5 s on one thread with the other group busy; max_wait_s 12 s
# admits ~8 of a burst of 24.
DEFAULTS = {"size": "64x64", "frames": 17, "steps": 20, "max_wait_s": 12.0, "burst_factor": 3.0, "max_burst": 48,
            "calib_rounds": 2, "max_retries": 8, "interactive_delay": 0.5, "max_fill": 64, "skip_priority": False}
QUICK = {"frames": 9, "steps": 6, "max_wait_s": 3.0, "max_burst": 36, "calib_rounds": 1, "max_fill": 40}
SERVER = "tuned_dp2_admission"


def server_specs(max_wait_s: float) -> dict[str, list[str]]:
    return {SERVER: ["--distributed-executor-backend", c.TUNED,
                     *c.additional_config(data_parallel_size=CAPACITY, scheduler={"max_wait_s": max_wait_s})]}


# ---- measuring ---------------------------------------------------------------------------------------
def _calibrate(url: str, tracker: JobTracker, args) -> list[float]:
    sync_burst(url, c.video_fields(args, seed=1), CAPACITY)  # first calls on both groups; teaches the cost rate
    lat = []
    for r in range(args.calib_rounds):
        answers = [post_video(url, c.video_fields(args, seed=20 + 10 * r + i)) for i in range(CAPACITY)]
        bad = [a.record() for a in answers if a.kind != "job"]
        if bad:
            raise RuntimeError(f"calibration request refused or failed: {bad}")
        ends = tracker.wait([a.job_id for a in answers], 600)
        lat += [ends[a.job_id].ended_at - a.sent_at for a in answers]
    return lat


def _client(url: str, args, seed: int, barrier: threading.Barrier, progress: c.Progress) -> dict[str, Any]:
    """One client of the burst: send, and while refused wait exactly Retry-After and send again."""
    fields = c.video_fields(args, seed=seed)
    barrier.wait()
    attempts = []
    a = post_video(url, fields)
    attempts.append(a.record())
    while a.kind == "refused" and len(attempts) <= args.max_retries:
        time.sleep(max(0.0, a.answered_at + (a.retry_s or 0.0) - time.monotonic()))
        a = post_video(url, fields)
        attempts.append(a.record())
    progress.advance(note=f"last answer {a.status}")
    return {"attempts": attempts, "job_id": a.job_id}


def _burst(url: str, tracker: JobTracker, args, n: int, timeout: float) -> dict[str, Any]:
    progress = c.Progress("admission: clients answered", n)
    barrier = threading.Barrier(n)
    results: list[dict[str, Any] | None] = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = _client(url, args, 1000 + i, barrier, progress)
        except Exception as exc:  # a client that crashed counts as an error
            results[i] = {"attempts": [{"kind": "error", "status": 0, "body": f"{type(exc).__name__}: {exc}"}],
                          "job_id": None}

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    progress.close()
    clients = [r or {"attempts": [], "job_id": None} for r in results]
    ids = [cl["job_id"] for cl in clients if cl["job_id"]]
    done = c.Progress("admission: accepted jobs ended", len(ids))
    ends = tracker.wait(ids, timeout, done)
    done.close()
    return {"clients": clients, "ends": {i: vars(e) for i, e in ends.items()}}


def _priority(url: str, tracker: JobTracker, watcher: LogWatcher, args, job_s: float, timeout: float) -> dict[str, Any]:
    fill, refusal, errors = [], None, []
    for i in range(args.max_fill):
        a = post_video(url, c.video_fields(args, seed=5000 + i), priority=0)
        if a.kind == "job":
            fill.append(a.job_id)
        elif a.kind == "refused":
            refusal = a.record()
            break
        else:
            errors.append(a.record())
            break
    c.log(f"priority: {len(fill)} batch jobs admitted, then {'refused' if refusal else 'no refusal'}")
    time.sleep(args.interactive_delay * job_s)
    before = list_videos(url)  # polling fallback: which batch jobs run now
    a = post_video(url, c.video_fields(args, seed=9999), priority=-1)
    t_send = a.sent_at
    out: dict[str, Any] = {"batch_admitted": len(fill), "refusal": refusal, "fill_errors": errors,
                           "interactive": a.record(), "interactive_delay_s": args.interactive_delay * job_s}
    if a.kind != "job":
        tracker.wait(fill, timeout)
        return {**out, "ratio": None, "why": "the interactive request was not admitted"}
    iid = a.job_id
    out["interactive_snapshot"] = get_video(url, iid)
    # Its start: the executor's start line, else the first poll that shows a denoise step done.
    t_start_poll = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if watcher.first("start", iid) is not None:
            break
        obj = get_video(url, iid)
        if obj and (obj.get("progress", 0) > 1 or obj.get("status") in ("completed", "failed")):
            t_start_poll = time.monotonic()
            break
        time.sleep(0.1)
    ends = tracker.wait([*fill, iid], timeout)
    start = watcher.first("start", iid)
    running = running_at(watcher.events, t_send)
    done_t = [e.t for r in running for e in [_first(watcher, "done", r)] if e is not None]
    if start is not None and done_t:
        source, t_start, t_ends = "server log", start.t, done_t
    else:  # polling fallback
        source = "polling"
        t_start = t_start_poll
        running = [vid for vid, obj in before.items() if vid in fill and obj.get("status") == "in_progress"
                   and obj.get("progress", 0) > 1]
        t_ends = [ends[vid].ended_at for vid in running if vid in ends]
    out.update({
        "source": source,
        "running_at_send": running,
        "start_after_send_s": None if t_start is None else t_start - t_send,
        "running_ends_after_send_s": sorted(t - t_send for t in t_ends),
        "ratio": interactive_ratio(t_send, t_start, t_ends),
        "interactive_end": vars(ends[iid]) | {"ended_at": ends[iid].ended_at - t_send},
        "batch_completed": sum(1 for vid in fill if ends[vid].status == "completed"),
    })
    return out


def _first(watcher: LogWatcher, kind: str, request_id: str):
    return next((e for e in watcher.events if e.kind == kind and e.request_id == request_id), None)


def run(args) -> dict[str, Any]:
    host = c.quiet_host(args)
    model, workdir, base_args, env = c.setup(args)
    servers = c.Servers(model, workdir, base_args, env)
    raw: dict[str, Any] = {}
    watcher = None
    try:
        servers.start(server_specs(args.max_wait_s), args.start_timeout)
        url = servers.url(SERVER)
        watcher = LogWatcher(servers.log_path(SERVER)).start()
        tracker = JobTracker(url, watcher)
        raw["calibration_latencies_s"] = _calibrate(url, tracker, args)
        job_s = c.median(raw["calibration_latencies_s"])
        admitted = s.expected_admitted(CAPACITY, args.max_wait_s, job_s)
        n = s.burst_size(admitted, args.burst_factor, args.max_burst)
        raw.update({"job_s": job_s, "expected_admitted": admitted, "burst": n,
                    "burst_capped": n < args.burst_factor * admitted})
        if raw["burst_capped"]:
            c.log(f"WARNING: --max-burst {args.max_burst} caps the burst below {args.burst_factor:g} x {admitted}; "
                  "lower --max-wait-s for a full-size burst")
        c.log(f"admission: a job takes ~{job_s:.2f} s with both groups busy; max_wait_s {args.max_wait_s:g} on "
              f"{CAPACITY} groups admits ~{admitted}; burst of {n}")
        timeout = 300.0 + 4.0 * n * job_s
        raw["admission"] = _burst(url, tracker, args, n, timeout)
        if not args.skip_priority:
            raw["priority"] = _priority(url, tracker, watcher, args, job_s, timeout)
    finally:
        if watcher is not None:
            watcher.stop()
        servers.stop()
    c.finish_host(host)
    return summarize(raw, host, _facts(args), servers.commands, str(workdir))


def _facts(args) -> dict[str, Any]:
    fields = c.video_fields(args)
    return {"model_size": args.model_size, "capacity": CAPACITY, "max_wait_s": args.max_wait_s,
            "burst_factor": args.burst_factor, "max_retries": args.max_retries,
            "request": {k: fields[k] for k in ("size", "num_frames", "num_inference_steps", "guidance_scale")}}


# ---- summary (pure) --------------------------------------------------------------------------------
def interactive_ratio(t_send: float, t_start: float | None, running_end_times: list[float]) -> float | None:
    """(start - send) / (first end of the jobs running at the send - send)."""
    if t_start is None or not running_end_times:
        return None
    return c.ratio(t_start - t_send, min(running_end_times) - t_send)


def count_clients(clients: list[dict[str, Any]], ends: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The admission counts of a burst: first answers, first retries, later retries, errors, completions."""
    first = {"job": 0, "refused": 0, "error": 0}
    retry1 = {"job": 0, "refused": 0, "error": 0, "not_retried": 0}
    later_admitted = never_admitted = errors = no_code = 0
    retry_after: list[float] = []
    for cl in clients:
        att = cl["attempts"]
        if not att:
            first["error"] += 1
            errors += 1
            continue
        errors += sum(1 for a in att if a.get("kind") == "error")
        no_code += sum(1 for a in att if a.get("kind") == "refused" and a.get("error_code") != "queue_full")
        k0 = att[0].get("kind", "error")
        first[k0] = first.get(k0, 0) + 1
        if k0 != "refused":
            continue
        ra = _retry_after_s(att[0])
        if ra is not None:
            retry_after.append(ra)
        k1 = att[1].get("kind", "error") if len(att) > 1 else "not_retried"
        retry1[k1] = retry1.get(k1, 0) + 1
        if k1 != "job":
            if att[-1].get("kind") == "job":
                later_admitted += 1
            else:
                never_admitted += 1
    accepted = [cl["job_id"] for cl in clients if cl.get("job_id")]
    completed = sum(1 for i in accepted if (ends.get(i) or {}).get("status") == "completed")
    return {
        "clients": len(clients),
        "first_answer": first,
        "first_retry": retry1,
        "admitted_on_later_retry": later_admitted,
        "never_admitted": never_admitted,
        "errors": errors,
        "refused_without_queue_full_code": no_code,
        "accepted": len(accepted),
        "completed": completed,
        "accepted_not_completed": len(accepted) - completed,
        "first_retry_admitted": c.ratio(retry1["job"], first["refused"]) if first["refused"] else None,
        "retry_after_s": {"min": min(retry_after), "median": c.median(retry_after), "max": max(retry_after)}
        if retry_after else None,
    }


def _retry_after_s(attempt: dict[str, Any]) -> float | None:
    from omni_ext.bench.client import retry_delay_s

    return retry_delay_s(attempt.get("headers") or {})


def summarize(raw: dict[str, Any], host: dict[str, Any], facts: dict[str, Any], commands: dict[str, Any],
              workdir: str = "") -> dict[str, Any]:
    measurement = bool(host.get("measurement", True))
    adm = raw.get("admission") or {"clients": [], "ends": {}}
    counts = count_clients(adm["clients"], adm["ends"])
    prio = raw.get("priority")
    values = {
        "admission.first_retry_admitted": counts["first_retry_admitted"],
        "admission.errors": float(counts["errors"]),
        "admission.accepted_not_completed": float(counts["accepted_not_completed"]),
        "priority.interactive_start_over_min": prio.get("ratio") if prio else None,
    }
    figures = {k: c.figure(values[k], *GOALS[k], measurement) for k in GOALS if k in values}
    if not prio:
        figures.pop("priority.interactive_start_over_min")
    notes = []
    if raw.get("burst_capped"):
        notes.append(f"the burst ({raw.get('burst')}) was capped by --max-burst below burst_factor x expected admitted "
                     f"({facts.get('burst_factor')} x {raw.get('expected_admitted')})")
    if counts["first_answer"]["refused"] == 0:
        notes.append("nothing was refused: the burst did not exceed max_wait_s (raise --burst-factor or lower --max-wait-s)")
    return {
        "benchmark": "admission",
        "model": f"tiny Wan2.1-T2V '{facts.get('model_size')}' (random weights, float32)",
        **{k: v for k, v in facts.items() if k != "model_size"},
        "threads_per_worker": 1,
        "host": host,
        "measurement": measurement,
        "workdir": workdir,
        "server_commands": commands,
        "job_s": raw.get("job_s"),
        "calibration_latencies_s": raw.get("calibration_latencies_s"),
        "expected_admitted": raw.get("expected_admitted"),
        "burst": raw.get("burst"),
        "burst_capped": raw.get("burst_capped"),
        "admission": {**counts, "goal_first_retry_admitted": ">= 0.9",
                      "pass_first_retry_admitted": figures["admission.first_retry_admitted"]["pass"]},
        "priority": ({k: v for k, v in prio.items() if k != "ratio"} | {
            "interactive_start_over_min": prio.get("ratio"), "goal_interactive_start_over_min": "<= 1.1",
            "pass_interactive_start_over_min": figures["priority.interactive_start_over_min"]["pass"]}) if prio else None,
        "runs": {"clients": adm["clients"], "ends": adm["ends"]},
        "notes": notes,
        "figures": figures,
    }


def table(result: dict[str, Any]) -> str:
    a = result["admission"]
    out = [c.figures_table(result["figures"])]
    rows = [["clients in the burst", a["clients"]], ["expected admitted at once", result.get("expected_admitted")],
            ["admitted at once", a["first_answer"]["job"]], ["refused (429 + Retry-After)", a["first_answer"]["refused"]],
            ["admitted on first retry", a["first_retry"]["job"]], ["refused again on first retry", a["first_retry"]["refused"]],
            ["admitted on a later retry", a["admitted_on_later_retry"]], ["never admitted", a["never_admitted"]],
            ["errors (not 200, not 429 + Retry-After)", a["errors"]], ["accepted", a["accepted"]],
            ["completed", a["completed"]], ["job time with both groups busy (s)", result.get("job_s")]]
    p = result.get("priority")
    if p:
        rows += [["priority: batch jobs admitted before a 429", p.get("batch_admitted")],
                 ["priority: interactive start after send (s)", p.get("start_after_send_s")],
                 ["priority: first running job end after send (s)", (p.get("running_ends_after_send_s") or [None])[0]],
                 ["priority: timing source", p.get("source")]]
    out.append(c.format_table(["count", "value"], rows))
    out += result.get("notes") or []
    out += c.not_a_measurement(result)
    return "\n\n".join(out)


def dry_run(args) -> dict[str, Any]:
    example = {job: s.expected_admitted(CAPACITY, args.max_wait_s, job) for job in (1.0, 3.0, 5.0)}
    return {"benchmark": "admission", "server": c.planned_commands(c.model_path(args), server_specs(args.max_wait_s)),
            "request": c.video_fields(args), **_facts(args),
            "burst": f"min({args.max_burst}, {args.burst_factor:g} x {CAPACITY} x (floor({args.max_wait_s:g} / job_s) + 1)),"
                     " job_s measured first",
            "expected_admitted_for_job_s": example, "priority_phase": not args.skip_priority,
            "goals": {k: f"{op} {v:g}" for k, (op, v) in GOALS.items()}}


def main(args) -> int:
    return c.run_command(args, DEFAULTS, QUICK, dry_run, run, table)
