"""``omni-ext bench batching``: request batching under ``--max-num-seqs``, TunedExecutor vs vLLM-Omni's executor.

vLLM-Omni batches compatible requests: with ``--max-num-seqs 4`` its scheduler hands up to four
waiting requests to the executor as one wave (``--request-batch-max-wait-ms`` lets a burst gather),
and its executor runs the wave as one batched forward (``execute_model_batch``). The TunedExecutor
keeps such a wave as one batch, or splits it, as :mod:`omni_ext.scheduler.batching` decides from
predicted times, and runs every batch through the same ``execute_model_batch``. The goal (issue 18)
is that omni-ext never loses what vLLM-Omni's batching gains: throughput on a burst at least
stock's. Servers, all the tiny Qwen-Image (``--model-size``, "med" by default) on one worker with
one thread, each started, measured and stopped in turn so that they never share the cores:

- ``stock-b1``: vLLM-Omni's executor and dispatch, ``--max-num-seqs 1``: no batching, the reference;
- ``stock-b4``: vLLM-Omni's executor and dispatch, ``--max-num-seqs 4 --request-batch-max-wait-ms 200``;
- ``tuned-b4``: the same flags with omni-ext's TunedExecutor and its scheduler's ``max_wait_s`` 3600
  (its admission answers no 429 in the burst).

On each server: a warm-up (one request, then one burst of ``--max-num-seqs``: every first call and
every batch shape paid), then ``--rounds`` bursts of ``--requests`` concurrent CFG images
(``POST /v1/images/generations``; prompts cycled, seed ``1000 + i``, the same on every server). A
burst's throughput is its completed requests over its wall time; a server's is the median over its
bursts. The batches that ran are read from the server logs: the TunedExecutor's ``omni-ext: start
batch of N requests`` (and its single requests), vLLM-Omni's waves from ``[RequestBatch] admission
wait done waiting=W max_batch=M`` (a wave of min(W, M)).

The bare host ceiling of the same run: the same requests through one of vLLM-Omni's own
``DiffusionWorker`` in a bare process (no server, no engine, no scheduler, no HTTP), as vLLM-Omni's
executor calls it: one at a time (``execute_model``) and in chunks of ``--max-num-seqs``
(``execute_model_batch``), alternating, with the engine's post-processing of each output. Its ratio
batched / unbatched is what batching can gain on this host at best; each server's throughput is
also given as a share of the bare one of the same batching.

Figures: ``batching.tuned_over_stock_throughput`` (goal >= 1); ``batching.stock_b4_over_b1`` (what
vLLM-Omni's batching gains here) and ``batching.tuned_over_stock_b1``, beside the bare ceiling's
``ceiling.batched_over_unbatched``; the shares of the bare ceiling; per server p50/p99 latency and
the batch-size histogram. What carries over to a card: see :data:`CARRIES_OVER`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from omni_ext.bench import common as c

FAMILY = "qwen-image"
STOCK_B1, STOCK_B4, TUNED_B4 = "stock-b1", "stock-b4", "tuned-b4"
SERVERS = (STOCK_B1, STOCK_B4, TUNED_B4)
GOALS = {"batching.tuned_over_stock_throughput": (">=", 1.0)}
PROMPTS = ("a lighthouse at dusk", "a red bicycle leaning on a wall", "a bowl of ramen", "snow on a pine forest")
NEGATIVE = "blurry, low quality"
TRUE_CFG_SCALE = 4.0
SEED0 = 1000
# 64x64, 8 steps of the "med" tiny Qwen-Image: a CFG image about a second on one thread (20 steps:
# 2-4 s, omni_ext.bench.serving), so a burst of 16 is ~15-20 s unbatched.
DEFAULTS = {"size": "64x64", "steps": 8, "requests": 16, "max_num_seqs": 4, "rounds": 3, "model_size": "med",
            "batch_wait_ms": 200.0, "ceiling_reps": 3}
QUICK = {"size": "32x32", "steps": 2, "requests": 8, "rounds": 1, "model_size": "tiny", "ceiling_reps": 1}
CARRIES_OVER = (
    "What batching gains on a host depends on how far one request is from filling the device: the tiny "
    "models are small enough that a batch of 4 costs much less than 4 requests even on this CPU "
    "(stock_b4_over_b1 and the bare ceiling's batched_over_unbatched say how much), a real model on one "
    "CPU thread would gain nothing, and on a card a batch of small images gains again. That absolute gain "
    "does not carry over. What carries over is tuned_over_stock_throughput: both executors run a wave through "
    "vLLM-Omni's own execute_model_batch, so the figure measures what omni-ext's executor adds or loses around "
    "the same batched forward (dispatch, its batch decision, per-job overhead). The TunedExecutor learns each "
    "batch size's time and keeps a wave as one batch on one group unless a measured batch costs more than its "
    "parts, so wherever vLLM-Omni's batching gains, it keeps the gain."
)

# ---- log parsing (pure) --------------------------------------------------------------------------------
TUNED_BATCH = re.compile(r"omni-ext: start batch of (\d+) requests")
TUNED_SINGLE = re.compile(r"omni-ext: start request \S+ on rank\(s\) \[[^\]]*\] \((?!warm-up\))")
TUNED_PLAN = re.compile(r"omni-ext: a wave of (\d+) compatible requests \([^)]*\) runs as ([\d+]+)")
STOCK_WAVE = re.compile(r"\[RequestBatch\] admission wait done waiting=(\d+) max_batch=(\d+)")


def tuned_batches(log: str) -> list[int]:
    """The size of every job the TunedExecutor started, in order: a batch of N, or 1 for a request
    alone (its start-up warm-up jobs left out)."""
    out = []
    for line in log.splitlines():
        m = TUNED_BATCH.search(line)
        if m:
            out.append(int(m.group(1)))
        elif TUNED_SINGLE.search(line):
            out.append(1)
    return out


def tuned_plans(log: str) -> list[str]:
    """How the TunedExecutor split each wave it was handed (``"4"``, ``"2+2"``, ``"1+1+1+1"``)."""
    return [m.group(2) for m in TUNED_PLAN.finditer(log)]


def engine_waves(log: str) -> list[int]:
    """The size of each wave vLLM-Omni's engine scheduled after an admission wait: min(waiting, max_batch).
    A wave scheduled without a wait (one request per wave, or the engine still busy) logs no line."""
    return [min(int(w), int(m)) for w, m in STOCK_WAVE.findall(log)]


def histogram(sizes: list[int]) -> dict[str, int]:
    """Batch size -> how many batches of that size (sizes as strings, for the JSON), ascending."""
    return {str(k): v for k, v in sorted(Counter(sizes).items())}


def batches_of(name: str, log: str, sent: int, max_num_seqs: int) -> dict[str, Any]:
    """The batches one server ran for ``sent`` requests, from its log since the round began. The
    TunedExecutor's are its own start lines; vLLM-Omni's executor runs each engine wave as one batch,
    and with ``--max-num-seqs 1`` every request alone (no line: by configuration). ``complete``: the
    sizes add up to the requests sent."""
    if name.startswith("tuned"):
        sizes, source = tuned_batches(log), "TunedExecutor start lines"
        extra: dict[str, Any] = {"plans": tuned_plans(log), "engine_waves": engine_waves(log)}
    elif max_num_seqs <= 1:
        sizes, source, extra = [1] * sent, "by configuration (--max-num-seqs 1: one request per wave)", {}
    else:
        sizes, source, extra = engine_waves(log), "vLLM-Omni [RequestBatch] admission-wait lines", {}
    return {"sizes": sizes, "source": source, "complete": sum(sizes) == sent, **extra}


# ---- figures (pure) ----------------------------------------------------------------------------------------
def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), digits)


def burst_stats(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """One burst: completed requests over its wall time, latency percentiles of the completed ones,
    the failed ones by status."""
    lat = [r["latency_s"] for r in records if r["ok"]]
    errors = dict(sorted(Counter(str(r["status"]) for r in records if not r["ok"]).items()))
    return {"sent": len(records), "ok": len(lat), "errors": errors, "wall_s": _r(wall_s, 3),
            "throughput_rps": _r(len(lat) / wall_s) if wall_s > 0 else None,
            "p50_latency_s": _r(c.percentile(lat, 50), 3), "p99_latency_s": _r(c.percentile(lat, 99), 3)}


def server_stats(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A server over its bursts: the median throughput, latency percentiles over every completed
    request of every burst, the batch-size histogram over all bursts."""
    tput = [r["stats"]["throughput_rps"] for r in rounds if r["stats"]["throughput_rps"] is not None]
    lat = [rec["latency_s"] for r in rounds for rec in r["records"] if rec["ok"]]
    sizes = [s for r in rounds for s in r["batches"]["sizes"]]
    errors: Counter[str] = Counter()
    for r in rounds:
        errors.update(r["stats"]["errors"])
    out = {"rounds": len(rounds), "throughput_rps": _r(c.median(tput)) if tput else None,
           "throughput_rps_per_round": tput, "sent": sum(r["stats"]["sent"] for r in rounds),
           "ok": sum(r["stats"]["ok"] for r in rounds), "errors": dict(sorted(errors.items())),
           "p50_latency_s": _r(c.percentile(lat, 50), 3), "p99_latency_s": _r(c.percentile(lat, 99), 3),
           "batch_histogram": histogram(sizes), "batches": len(sizes),
           "batch_source": rounds[0]["batches"]["source"] if rounds else None,
           "histogram_complete": all(r["batches"]["complete"] for r in rounds)}
    plans = [p for r in rounds for p in r["batches"].get("plans", [])]
    if plans:
        out["wave_plans"] = dict(sorted(Counter(plans).items()))
    return out


def ceiling_stats(unbatched_s: list[float], batched_s: list[float], n: int, k: int) -> dict[str, Any]:
    """The bare pipeline's throughputs (``n`` images over the median seconds) and their ratio."""
    un, ba = c.median(unbatched_s), c.median(batched_s)
    return {"requests": n, "max_num_seqs": k, "unbatched_s": sorted(unbatched_s), "batched_s": sorted(batched_s),
            "unbatched_rps": _r(c.ratio(n, un)), "batched_rps": _r(c.ratio(n, ba)),
            "batched_over_unbatched": _r(c.ratio(un, ba))}


def info(value: float | None, measurement: bool, **extra: Any) -> dict[str, Any]:
    """A figure without a goal (a reference beside the goal's figure)."""
    return {"value": value, "goal": "- (reference)", "goal_op": None, "goal_value": None, "pass": None,
            "measurement": measurement, **extra}


def summarize(servers: dict[str, dict[str, Any]], ceiling: dict[str, Any] | None, host: dict[str, Any],
              facts: dict[str, Any]) -> dict[str, Any]:
    """The figures from each server's stats (:func:`server_stats`) and the bare ceiling's (or None)."""
    measurement = bool(host.get("measurement", True))
    servers = {name: dict(s) for name, s in servers.items()}
    rps = {name: s.get("throughput_rps") for name, s in servers.items()}
    bare_b1 = ceiling.get("unbatched_rps") if ceiling else None
    bare_b4 = ceiling.get("batched_rps") if ceiling else None
    bare_gain = ceiling.get("batched_over_unbatched") if ceiling else None
    tuned_vs_stock = _r(c.ratio(rps.get(TUNED_B4), rps.get(STOCK_B4)))
    fig = c.figure(tuned_vs_stock, *GOALS["batching.tuned_over_stock_throughput"], measurement,
                   tuned_rps=rps.get(TUNED_B4), stock_rps=rps.get(STOCK_B4),
                   per_round={n: servers.get(n, {}).get("throughput_rps_per_round") for n in (STOCK_B4, TUNED_B4)})
    tuned_errors = sum(servers.get(TUNED_B4, {}).get("errors", {}).values())
    stock_errors = sum(servers.get(STOCK_B4, {}).get("errors", {}).values())
    if fig["pass"] is not None and (tuned_errors or stock_errors):
        # a failed request makes a burst faster or slower than the work it was asked for: no pass on it
        fig["pass"] = False if tuned_errors else None
        fig["note"] = f"failed requests: tuned {tuned_errors}, stock {stock_errors}"
    figures = {
        "batching.tuned_over_stock_throughput": fig,
        "batching.stock_b4_over_b1": info(_r(c.ratio(rps.get(STOCK_B4), rps.get(STOCK_B1))), measurement,
                                          ceiling=bare_gain),
        "batching.tuned_over_stock_b1": info(_r(c.ratio(rps.get(TUNED_B4), rps.get(STOCK_B1))), measurement,
                                             ceiling=bare_gain),
        "ceiling.batched_over_unbatched": info(bare_gain, measurement, unbatched_rps=bare_b1, batched_rps=bare_b4),
        "batching.stock_b1_over_ceiling": info(_r(c.ratio(rps.get(STOCK_B1), bare_b1)), measurement),
        "batching.stock_b4_over_ceiling": info(_r(c.ratio(rps.get(STOCK_B4), bare_b4)), measurement),
        "batching.tuned_over_ceiling": info(_r(c.ratio(rps.get(TUNED_B4), bare_b4)), measurement),
    }
    for name, s in servers.items():
        s["share_of_bare"] = _r(c.ratio(s.get("throughput_rps"), bare_b1 if name == STOCK_B1 else bare_b4), 3)
    return {"benchmark": "batching", **facts, "host": host, "measurement": measurement, "servers": servers,
            "ceiling": ceiling, "figures": figures, "carries_over": CARRIES_OVER}


# ---- output (pure) -----------------------------------------------------------------------------------------
def table(result: dict[str, Any]) -> str:
    figs = result["figures"]
    out = [c.figures_table(figs, {"bare ceiling": {k: f.get("ceiling") for k, f in figs.items()}})]
    rows = []
    for name, s in result["servers"].items():
        rows.append([name, f"{s['ok']}/{s['sent']}", s["throughput_rps"], s.get("share_of_bare"), s["p50_latency_s"],
                     s["p99_latency_s"], _hist_text(s["batch_histogram"]) + ("" if s["histogram_complete"] else " (?)"),
                     s.get("load1_before")])
    out.append(c.format_table(["server", "ok", "req/s (median)", "of bare", "p50 (s)", "p99 (s)",
                               "batches (size x count)", "load before"], rows))
    ceil = result.get("ceiling")
    if ceil:
        out.append(f"bare ceiling (one DiffusionWorker, no server): {ceil['requests']} images one at a time "
                   f"{c.fmt(ceil['unbatched_rps'])} req/s, in chunks of {ceil['max_num_seqs']} "
                   f"{c.fmt(ceil['batched_rps'])} req/s ({c.fmt(ceil['batched_over_unbatched'])}x)")
    else:
        out.append(f"bare ceiling: not measured ({result.get('ceiling_absent') or 'skipped'}); the reference is "
                   "stock's own batched over unbatched throughput (batching.stock_b4_over_b1)")
    f = figs["batching.tuned_over_stock_throughput"]
    out.append(f"goal: TunedExecutor throughput >= vLLM-Omni's on the same burst: {c.verdict(f)} "
               f"({c.fmt(f['value'])}); (?) marks a histogram whose sizes do not add up to the requests sent")
    out.append("carries over to cards: " + result["carries_over"])
    out += c.not_a_measurement(result)
    return "\n\n".join(out)


def _hist_text(hist: dict[str, int]) -> str:
    return ", ".join(f"{size}x{count}" for size, count in hist.items()) or "-"


# ---- the workload and servers ------------------------------------------------------------------------------
def request_fields(args, i: int) -> dict[str, Any]:
    """Request ``i`` of a burst, as ``POST /v1/images/generations`` takes it (a CFG image: a negative
    prompt and ``true_cfg_scale``); the same on every server and in the bare ceiling."""
    return {"prompt": PROMPTS[i % len(PROMPTS)], "negative_prompt": NEGATIVE, "true_cfg_scale": TRUE_CFG_SCALE,
            "size": args.size, "num_inference_steps": args.steps, "seed": SEED0 + i}


def server_specs(max_num_seqs: int, batch_wait_ms: float) -> tuple[dict[str, list[str]], dict[str, dict[str, str]]]:
    """(serve args, extra env) of each server: the stock ones run vLLM-Omni's executor and dispatch."""
    batched = ["--max-num-seqs", str(max_num_seqs), "--request-batch-max-wait-ms", f"{batch_wait_ms:g}"]
    specs = {STOCK_B1: ["--max-num-seqs", "1"],
             STOCK_B4: list(batched),
             TUNED_B4: [*batched, "--distributed-executor-backend", c.TUNED,
                        *c.additional_config(scheduler={"max_wait_s": 3600})]}
    return specs, {STOCK_B1: dict(c.STOCK_DISPATCH_ENV), STOCK_B4: dict(c.STOCK_DISPATCH_ENV)}


def post_image(url: str, fields: dict[str, Any], t0: float, timeout: float = 1800.0) -> dict[str, Any]:
    """One image request to its answer: status, latency, its send and end times after ``t0``."""
    import requests

    sent = time.monotonic()
    rec: dict[str, Any] = {"seed": fields["seed"], "sent_s": round(sent - t0, 3)}
    try:
        r = requests.post(url + "/v1/images/generations", json=fields, timeout=timeout)
        ok = r.status_code == 200 and bool(r.json().get("data"))
        rec.update(ok=ok, status=r.status_code)
        if not ok:
            rec["error"] = r.text[:300]
    except Exception as exc:  # counted by kind; the burst goes on
        rec.update(ok=False, status=type(exc).__name__, error=str(exc)[:300])
    end = time.monotonic()
    rec.update(latency_s=round(end - sent, 3), end_s=round(end - t0, 3))
    return rec


def burst(url: str, fields: list[dict[str, Any]], progress: c.Progress | None = None) -> tuple[list[dict[str, Any]], float]:
    """All ``fields`` at once from a pool of as many threads; the records in order and the wall time
    from the first send to the last answer."""
    t0 = time.monotonic()

    def one(f: dict[str, Any]) -> dict[str, Any]:
        rec = post_image(url, f, t0)
        if progress is not None:
            progress.advance(note="" if rec["ok"] else f"seed {rec['seed']}: {rec['status']}")
        return rec

    with ThreadPoolExecutor(len(fields)) as pool:
        records = list(pool.map(one, fields))
    return records, max(r["end_s"] for r in records)


def measure_server(name: str, proc, args) -> dict[str, Any]:
    """Warm up one ready server, then ``--rounds`` bursts; each burst's records, stats and batches."""
    warm = [*burst(proc.url, [request_fields(args, 900)])[0],
            *burst(proc.url, [request_fields(args, 900 + i) for i in range(1, args.max_num_seqs + 1)])[0]]
    bad = [w for w in warm if not w["ok"]]
    if bad:
        raise RuntimeError(f"{name}: {len(bad)} of {len(warm)} warm-up requests failed: {bad[0].get('error')}; "
                           f"log {proc.log_path}")
    load1 = _load1()
    max_seqs = 1 if name == STOCK_B1 else args.max_num_seqs
    fields = [request_fields(args, i) for i in range(args.requests)]
    progress = c.Progress(f"{name}: requests", args.requests * args.rounds)
    rounds = []
    try:
        for _ in range(args.rounds):
            mark = len(proc.log_text())
            records, wall = burst(proc.url, fields, progress)
            time.sleep(0.2)  # the last start lines reach the log file
            batches = batches_of(name, proc.log_text()[mark:], len(records), max_seqs)
            rounds.append({"records": records, "wall_s": wall, "stats": burst_stats(records, wall), "batches": batches})
    finally:
        progress.close()
    stats = server_stats(rounds)
    c.log(f"{name}: {c.fmt(stats['throughput_rps'])} req/s (median of {args.rounds}), p50 "
          f"{c.fmt(stats['p50_latency_s'], 2)} s, batches {_hist_text(stats['batch_histogram'])}, "
          f"{sum(stats['errors'].values())} failed")
    return {**stats, "load1_before": _r(load1, 2), "warmup": warm, "runs": rounds}


def _load1() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


# ---- the bare ceiling ------------------------------------------------------------------------------------
def _ceiling_worker(model: str, fields: list[dict[str, Any]], k: int, reps: int, port: int) -> None:
    """In a bare process: one vLLM-Omni ``DiffusionWorker`` (one thread, omni-ext's plugin and patches as
    in a server's worker), the requests built as vLLM-Omni's image route builds them, run one at a
    time and in chunks of ``k`` through the calls vLLM-Omni's executor makes (``execute_model``,
    ``execute_model_batch``), each output post-processed as the engine does; ``reps`` alternating
    timed passes of each. Prints the seconds of every pass after :data:`omni_ext.bench.ceiling.MARK`."""
    import inspect

    import torch
    from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
    from vllm_omni.diffusion.postprocess.media import finalize_diffusion_media
    from vllm_omni.diffusion.registry import get_diffusion_post_process_func, get_diffusion_pre_process_func
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.sched.interface import CachedRequestData, DiffusionSchedulerOutput, NewRequestData
    from vllm_omni.diffusion.worker.diffusion_worker import DiffusionWorker
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams, OmniTextPrompt
    from vllm_omni.plugins import load_omni_general_plugins

    from omni_ext.bench.ceiling import MARK

    load_omni_general_plugins()  # as vLLM-Omni's worker_main does
    torch.set_num_threads(1)
    od = OmniDiffusionConfig.from_kwargs(model=model, dtype=torch.float32, enforce_eager=True, num_gpus=1,
                                         max_num_seqs=k, parallel_config=DiffusionParallelConfig())
    od.enrich_config()
    od.master_port = port
    worker = DiffusionWorker(local_rank=0, rank=0, od_config=od)
    pre, post = get_diffusion_pre_process_func(od), get_diffusion_post_process_func(od)
    post_takes_sp = post is not None and "sampling_params" in inspect.signature(post).parameters

    def make(f: dict[str, Any], rid: str) -> Any:  # vllm_omni/entrypoints/openai/api_server.py, generate_images
        width, height = (int(v) for v in f["size"].lower().split("x"))
        prompt = OmniTextPrompt(prompt=f["prompt"], modalities=["image"])
        prompt["negative_prompt"] = f["negative_prompt"]
        prompt["mm_processor_kwargs"] = {"target_h": height, "target_w": width}
        prompt["height"], prompt["width"] = height, width
        sp = OmniDiffusionSamplingParams(num_outputs_per_prompt=1)
        sp.width, sp.height = width, height
        sp.num_inference_steps, sp.true_cfg_scale, sp.seed = f["num_inference_steps"], f["true_cfg_scale"], f["seed"]
        req = OmniDiffusionRequest(prompt=prompt, sampling_params=sp, request_id=rid)
        return pre(req) if pre is not None else req

    def finish(req: Any, out: Any) -> None:  # DiffusionEngine.postprocess_output
        if out.error:
            raise RuntimeError(f"request {req.request_id}: {out.error}")
        if getattr(out, "media", None) is not None:
            finalize_diffusion_media(out.media, sampling_params=req.sampling_params)
        elif out.output is not None and post is not None:
            post(out.output, **({"sampling_params": req.sampling_params} if post_takes_sp else {}))

    def one_at_a_time(tag: str, todo: list[dict[str, Any]]) -> None:
        for i, f in enumerate(todo):
            req = make(f, f"{tag}-{i}")
            finish(req, worker.execute_model(req, od))

    def in_chunks(tag: str, todo: list[dict[str, Any]]) -> None:
        for lo in range(0, len(todo), k):
            reqs = [make(f, f"{tag}-{lo + j}") for j, f in enumerate(todo[lo:lo + k])]
            if len(reqs) == 1:  # vLLM-Omni's executor runs a wave of one as a single request
                finish(reqs[0], worker.execute_model(reqs[0], od))
                continue
            wave = DiffusionSchedulerOutput(
                step_id=0, scheduled_new_reqs=[NewRequestData(request_id=r.request_id, req=r) for r in reqs],
                scheduled_cached_reqs=CachedRequestData.make_empty(), finished_req_ids=set(),
                num_running_reqs=len(reqs), num_waiting_reqs=0)
            outs = [ro.result for ro in worker.execute_model_batch(wave, od).runner_outputs]
            if len(outs) != len(reqs):
                raise RuntimeError(f"a batch of {len(reqs)} requests returned {len(outs)} outputs")
            for req, out in zip(reqs, outs):
                finish(req, out)

    one_at_a_time("warm-1", fields[:1])  # first-call costs, and every batch shape once
    in_chunks("warm-k", fields[:k])
    times: dict[str, list[float]] = {"unbatched": [], "batched": []}
    for rep in range(reps):
        for mode in (("unbatched", "batched") if rep % 2 == 0 else ("batched", "unbatched")):
            t0 = time.perf_counter()
            (one_at_a_time if mode == "unbatched" else in_chunks)(f"{mode}-{rep}", fields)
            times[mode].append(time.perf_counter() - t0)
            print(f"[ceiling] rep {rep}: {mode} {times[mode][-1]:.2f} s", file=sys.stderr, flush=True)
    print(MARK + json.dumps({"unbatched_s": times["unbatched"], "batched_s": times["batched"]}), flush=True)
    worker.shutdown()


def measure_ceiling(model: Path, args, workdir: Path) -> dict[str, Any]:
    """The bare ceiling in a child process (:func:`_ceiling_worker`); its log in ``workdir``."""
    from omni_ext.bench.ceiling import MARK, sp_env
    from omni_ext.server_process import free_port

    fields = [request_fields(args, i) for i in range(args.requests)]
    arg = json.dumps([str(model), fields, args.max_num_seqs, args.ceiling_reps, free_port()])
    log_path = workdir / "ceiling.log"
    env = {**os.environ, **c.BASE_ENV, **sp_env(1)}
    c.log(f"bare ceiling (one DiffusionWorker, no server): {args.ceiling_reps} x ({args.requests} one at a time, "
          f"in chunks of {args.max_num_seqs}); log {log_path}")
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-m", "omni_ext.bench.batching", "--ceiling-worker", arg],
                              stdout=subprocess.PIPE, stderr=log, env=env, text=True,
                              timeout=args.start_timeout + 3600)
    answer = next((line[line.find(MARK) + len(MARK):] for line in proc.stdout.splitlines() if MARK in line), None)
    if proc.returncode != 0 or answer is None:
        raise RuntimeError(f"the bare ceiling exited {proc.returncode} without an answer; log {log_path}")
    times = json.loads(answer)
    out = ceiling_stats(times["unbatched_s"], times["batched_s"], args.requests, args.max_num_seqs)
    out.update(log=str(log_path), what=(
        "the same requests through one vLLM-Omni DiffusionWorker in a bare process (one thread; omni-ext's "
        "plugin and patches as in a server's worker): the image route's request, the model's pre-processing, "
        f"execute_model one at a time vs execute_model_batch in chunks of {args.max_num_seqs} (the calls "
        "vLLM-Omni's executor makes), the engine's post-processing; no server, engine loop, scheduler, IPC, "
        "PNG encoding or HTTP. Median of alternating passes."))
    c.log(f"bare ceiling: {c.fmt(out['unbatched_rps'])} req/s one at a time, {c.fmt(out['batched_rps'])} req/s "
          f"in chunks ({c.fmt(out['batched_over_unbatched'])}x)")
    return out


# ---- the run ------------------------------------------------------------------------------------------
def run(args) -> dict[str, Any]:
    host = c.quiet_host(args)
    model = c.tiny_model(args, FAMILY)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="omni-ext-bench-batching-"))
    workdir.mkdir(parents=True, exist_ok=True)
    servers = c.Servers(model, workdir, list(c.BASE_ARGS), dict(c.BASE_ENV))
    specs, envs = server_specs(args.max_num_seqs, args.batch_wait_ms)
    measured: dict[str, dict[str, Any]] = {}
    try:
        for name in SERVERS:  # one at a time: started, measured, stopped
            servers.start({name: specs[name]}, args.start_timeout, envs=envs)
            try:
                measured[name] = measure_server(name, servers.procs[name], args)
            finally:
                servers.stop(name)
    finally:
        servers.stop()
    ceiling, absent = None, None
    if args.skip_ceiling:
        absent = "--skip-ceiling"
    else:
        try:
            ceiling = measure_ceiling(model, args, workdir)
        except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as exc:
            absent = f"failed: {exc}"
            c.log(f"WARNING: bare ceiling {absent}")
    c.finish_host(host)
    facts = {"model": f"tiny Qwen-Image '{args.model_size}' (random weights, float32)", "workers": 1,
             "threads_per_worker": int(c.BASE_ENV["OMP_NUM_THREADS"]), "size": args.size, "steps": args.steps,
             "requests": args.requests, "max_num_seqs": args.max_num_seqs, "batch_wait_ms": args.batch_wait_ms,
             "rounds": args.rounds, "request": request_fields(args, 0), "prompts": list(PROMPTS),
             "server_commands": servers.commands, "workdir": str(workdir), "ceiling_absent": absent}
    return summarize(measured, ceiling, host, facts)


def dry_run(args) -> dict[str, Any]:
    specs, envs = server_specs(args.max_num_seqs, args.batch_wait_ms)
    planned = c.planned_commands(c.model_path(args, FAMILY), specs)
    for name, env in envs.items():
        planned[name] = c.shell_command([], env).strip() + " " + planned[name]
    return {"benchmark": "batching", "model": str(c.model_path(args, FAMILY)),
            "servers (started, measured and stopped one at a time, in this order)": planned,
            "warm-up per server": f"1 request, then a burst of {args.max_num_seqs}",
            "rounds per server": args.rounds,
            "burst": f"{args.requests} concurrent POST /v1/images/generations (a pool of {args.requests} threads)",
            "requests": [request_fields(args, i) for i in range(args.requests)],
            "bare ceiling": "skipped" if args.skip_ceiling else
            f"one DiffusionWorker, no server: {args.ceiling_reps} x ({args.requests} one at a time, in chunks of "
            f"{args.max_num_seqs})",
            "quiet host": f"waits up to {args.quiet_wait:g} s for a 1-minute load <= {args.max_load:g}",
            "goals": {k: f"{op} {v:g}" for k, (op, v) in GOALS.items()}}


def add_arguments(p: argparse.ArgumentParser) -> None:

    p.add_argument("--json", default=None, help="write the figures, goals, pass/fail and every request here (required unless --dry-run)")
    p.add_argument("--quick", action="store_true", help="a small, fast version (smoke test; figures are not meaningful)")
    p.add_argument("--dry-run", action="store_true", help="print the servers, commands and requests; start nothing")
    p.add_argument("--model-size", choices=["tiny", "small", "med"], default=None, help="tiny Qwen-Image preset (med)")
    p.add_argument("--size", default=None, help="WxH of every image (64x64)")
    p.add_argument("--steps", type=c.positive_int, default=None, help="inference steps per image (8)")
    p.add_argument("--requests", type=c.positive_int, default=None, help="concurrent requests per burst (16)")
    p.add_argument("--max-num-seqs", type=c.positive_int, default=None, help="the batched servers' --max-num-seqs (4)")
    p.add_argument("--batch-wait-ms", type=float, default=None, help="the batched servers' --request-batch-max-wait-ms (200)")
    p.add_argument("--rounds", type=c.positive_int, default=None, help="bursts per server (median throughput; 3)")
    p.add_argument("--ceiling-reps", type=c.positive_int, default=None, help="timed passes of each bare-ceiling mode (3)")
    p.add_argument("--skip-ceiling", action="store_true", help="skip the bare host ceiling")
    c.add_host_options(p)


def main(args) -> int:
    c.apply_profile(args, DEFAULTS, QUICK)
    try:
        c.size_hw(args.size)  # a malformed --size fails here, not after the servers
    except ValueError:
        raise SystemExit(f"omni-ext bench batching: --size is WxH (e.g. 64x64), got {args.size!r}") from None
    if args.dry_run:
        return c.print_plan(dry_run(args))
    if not args.json:
        raise SystemExit("omni-ext bench batching: --json OUT is required (or --dry-run)")
    result = run(args)
    return c.write_result(args.json, result, table(result))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--ceiling-worker":
        _ceiling_worker(*json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit("usage: python -m omni_ext.bench.batching --ceiling-worker JSON (run by omni-ext bench batching)")
