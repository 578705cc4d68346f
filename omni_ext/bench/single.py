"""``omni-ext bench cfg-parallel --single-jobs``: what one short job costs under omni-ext (issue 38, item 1).

A grid of single requests, each sent alone on an idle server pair: the tiny Wan2.1 (``wan2.1-t2v``)
at ``--single-frames`` (9, 17) x ``--single-steps`` (1, 2, 4, 8), the same Wan served as FastWan's few-step
``WanDMDPipeline`` (``fastwan``: its 3 distilled steps, CFG-free, at ``--single-frames``) and the tiny
Qwen-Image (``qwen-image``) at ``--single-steps``, all at ``--single-size`` (64x64), with CFG except
FastWan. Each model gets ONE
pair of servers, started as ``cfg-parallel --model M`` starts them (:func:`runner.sp_server_specs`
with ``--sp 1``: ``--cfg-parallel-size 2``, 2 worker processes of one thread each, vLLM-Omni's pipeline
profiler on both): ``stock_sp`` is vLLM-Omni as it ships (its executor and routes, ``common.STOCK_ENV``),
``tuned_sp`` omni-ext's TunedExecutor on the same layout. The pairs run one after the other, never at
once, each after its own quiet-host wait.

Per row: one warm-up request per server (the shape's first-call costs; kept in the JSON, not counted),
then ``--reps`` alternations, stock first on even ones, every request preceded by the ``--settle``
gap. Figures per row (:func:`row_summary`): ``tuned_vs_stock`` = stock's median latency / tuned's (goal
>= 1.00) and ``overhead_ms`` = tuned's median - stock's in ms (goal <= 10 ms; a negative value, tuned
faster, meets it). The overall verdict (:func:`overall_verdict`) is PASS only when every row of the
grid was measured and met both goals. All rows are measured side by side within one run; none is
compared with a figure from another run.

The arithmetic (grid, row figures, verdict, table) is pure and unit-tested in
``tests/test_bench_single.py``; :func:`run` is the only part that starts servers.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from omni_ext.bench import common as c

VIDEO_MODEL, IMAGE_MODEL = "wan2.1-t2v", "qwen-image"
#: The few-step class (issue 38 item 2): the tiny Wan2.1 served as FastWan's ``WanDMDPipeline``, which runs
#: the 3 timesteps its checkpoint was distilled for whatever the request asks, and no CFG (guidance 1.0).
FEW_STEP_MODEL, FEW_STEP_CLASS, FEW_STEPS = "fastwan", "WanDMDPipeline", 3
MODELS = (VIDEO_MODEL, FEW_STEP_MODEL, IMAGE_MODEL)
DEFAULT_SIZE = "64x64"
DEFAULT_FRAMES = (9, 17)
DEFAULT_STEPS = (1, 2, 4, 8)
#: The issue's rule: a row's figures are medians of at least this many alternations.
MIN_REPS = 5
#: Goals of every row (issue 38 item 1): tuned at least as fast as stock; and at most 10 ms per job
#: over stock where it is slower.
GOALS = {"tuned_vs_stock": (">=", 1.0), "overhead_ms": ("<=", 10.0)}
STOCK, TUNED = "stock_sp", "tuned_sp"


# ---- pure: options and the grid ----------------------------------------------------------------------
def int_list(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> (1, 2, 4, 8): positive integers, comma-separated (an argparse ``type``)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def model_list(text: str) -> tuple[str, ...]:
    """``"wan2.1-t2v,qwen-image"``: a subset of :data:`MODELS` (an argparse ``type``)."""
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in values if v not in MODELS]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(MODELS)}, got {text!r}")
    return values


def single_grid(frames: tuple[int, ...] = DEFAULT_FRAMES, steps: tuple[int, ...] = DEFAULT_STEPS,
                size: str = DEFAULT_SIZE, models: tuple[str, ...] = MODELS) -> list[dict[str, Any]]:
    """The rows, in the order they run: per model in the order of ``models``, the video rows frames x
    steps, the image rows steps (``frames`` None). Wan's frame counts must be 4k + 1 (its VAE's temporal grid)."""
    c.size_hw(size)  # a WxH
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise ValueError(f"models must be a subset of {', '.join(MODELS)}, got {list(models)}")
    bad = [f for f in frames if f < 1 or (f - 1) % 4]
    if {VIDEO_MODEL, FEW_STEP_MODEL} & set(models) and (bad or not frames):
        raise ValueError(f"Wan frame counts must be 4k + 1 (1, 5, 9, 17, ...), got {list(frames)}")
    if not steps or any(s < 1 for s in steps):
        raise ValueError(f"steps must be positive, got {list(steps)}")
    rows = []
    for model in dict.fromkeys(models):
        if model == VIDEO_MODEL:
            cells = [(f, s) for f in frames for s in steps]
        elif model == FEW_STEP_MODEL:
            cells = [(f, FEW_STEPS) for f in frames]
        else:
            cells = [(None, s) for s in steps]
        for f, s in cells:
            shape = f"{size} {f} frames" if f is not None else f"{size} image"
            rows.append({"name": f"{model} {shape} x{s} steps", "model": model, "kind": "video" if f else "image",
                         "size": size, "frames": f, "steps": s})
    return rows


def row_args(args, row: dict[str, Any]) -> argparse.Namespace:
    """The benchmark's options with the row's model, size, frames and steps (for the request builders)."""
    return argparse.Namespace(**{**vars(args), "model": row["model"], "size": row["size"],
                                 "frames": row["frames"] or 1, "steps": row["steps"]})


def row_fields(args, row: dict[str, Any], **over: Any) -> dict[str, Any]:
    """The request of a row: a CFG video for Wan (:func:`common.video_fields`), a CFG image for Qwen-Image
    (``omni-ext bench batching``'s request 0: a negative prompt and ``true_cfg_scale``)."""
    ns = row_args(args, row)
    if row["model"] == FEW_STEP_MODEL:  # CFG-free, as FastWan runs (its default guidance is 1.0)
        fields = c.video_fields(ns, guidance_scale=1.0, **over)
        fields.pop("negative_prompt", None)
        return fields
    if row["kind"] == "video":
        return c.video_fields(ns, **over)
    from omni_ext.bench.batching import request_fields

    return {**request_fields(ns, 0), **over}


# ---- pure: figures ----------------------------------------------------------------------------------------
#: Resamples of :func:`ratio_interval` (fixed seed: the same latencies give the same interval).
RESAMPLES, INTERVAL_SEED = 2000, 0


def ratio_interval(stock_s: list[float], tuned_s: list[float], level: float = 0.95,
                   resamples: int = RESAMPLES) -> tuple[float, float] | None:
    """The ``level`` bootstrap interval of stock's median latency / tuned's, resampling whole
    alternations (a stock request and the tuned one sent beside it stay together, as they were measured).

    Why: on this 2-core host one request of a 0.14 s row moves by +-20 %, so a median of 21 alternations
    still moves by a few per cent from run to run, and a row where both executors do the same work reads
    0.94 in one grid and 1.06 in the next. The interval says which rows the run resolved: a row whose
    interval holds 1.00 is a tie this host cannot call either way (its verdict stays what its median
    says). None with fewer than 3 alternations."""
    pairs = [(s, t) for s, t in zip(stock_s, tuned_s) if s > 0 and t > 0]
    if len(pairs) < 3:
        return None
    rng = random.Random(INTERVAL_SEED)
    ratios = []
    for _ in range(resamples):
        draw = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        ratios.append(c.median([s for s, _ in draw]) / c.median([t for _, t in draw]))
    tail = 100.0 * (1.0 - level) / 2.0
    return c.percentile(ratios, tail), c.percentile(ratios, 100.0 - tail)


def row_summary(stock_s: list[float], tuned_s: list[float], measurement: bool,
                stock_diffuse_s: list[float | None] | None = None, tuned_diffuse_s: list[float | None] | None = None,
                expected_reps: int | None = None) -> dict[str, Any]:
    """A row's medians, figures and pass from its latencies (seconds, in alternation order).

    ``tuned_vs_stock``: stock's median / tuned's (goal >= 1.00). ``overhead_ms``: tuned's median -
    stock's, in ms (goal <= 10; negative when tuned is faster). ``paired_overhead_ms``: the median of
    each alternation's tuned - stock (the two requests sent back to back), reported beside it.
    ``pass``: both goals met; None while either figure has no value, or when the row has fewer than
    ``expected_reps`` alternations (a request failed part-way: its figures are kept, not judged).
    ``tuned_vs_stock`` carries its 95 % bootstrap interval (``interval``, :func:`ratio_interval`)."""
    med_stock = c.median(stock_s) if stock_s else None
    med_tuned = c.median(tuned_s) if tuned_s else None
    over = None if med_stock is None or med_tuned is None else 1000.0 * (med_tuned - med_stock)
    figures = {
        "tuned_vs_stock": c.figure(c.ratio(med_stock, med_tuned), *GOALS["tuned_vs_stock"], measurement,
                                   note="stock median latency / tuned median latency",
                                   interval=ratio_interval(stock_s, tuned_s)),
        "overhead_ms": c.figure(over, *GOALS["overhead_ms"], measurement,
                                note="tuned median latency - stock median latency, ms (negative: tuned faster)"),
    }
    verdicts = [f["pass"] for f in figures.values()]
    pairs = list(zip(stock_s, tuned_s))
    complete = expected_reps is None or len(pairs) >= expected_reps

    def med_or_none(xs: list[float] | None) -> float | None:
        xs = [x for x in (xs or []) if x is not None]
        return c.median(xs) if xs else None

    return {
        "reps": min(len(stock_s), len(tuned_s)),
        "median_latency_s": {"stock": med_stock, "tuned": med_tuned},
        "median_diffuse_s": {"stock": med_or_none(stock_diffuse_s), "tuned": med_or_none(tuned_diffuse_s)},
        "figures": figures,
        "pass": None if None in verdicts or not complete else all(verdicts),
        "complete": complete,
        "per_rep_tuned_vs_stock": [c.ratio(s, t) for s, t in pairs],
        "paired_overhead_ms": c.median([1000.0 * (t - s) for s, t in pairs]) if pairs else None,
    }


#: The parts of one request's latency (:func:`breakdown`), in the order the breakdown table lists them.
PARTS = ("route", "encode", "engine", "queue", "to_worker", "worker_other", "text", "loop", "decode", "from_worker")
#: What each part is; ``-`` in a stock column: vLLM-Omni's answer does not report it, it lies in
#: ``route`` or ``engine``.
PART_NOTES = {
    "route": "client to the engine and back: HTTP, parsing, admission, the answer (latency - stage_0_gen_ms - encode)",
    "encode": "the route's encoding of the result (mp4, png): omni-ext's routes report it",
    "engine": "the engine and executor outside the parts below (stage_0_gen_ms - the rest)",
    "queue": "the TunedExecutor's queue and placement (arrival to start)",
    "to_worker": "start to the worker beginning it (the pipe, the worker's wake-up)",
    "worker_other": "the worker's run outside the profiled pipeline stages",
    "text": "the pipeline's text encoding",
    "loop": "the denoise loop (<Pipeline>.diffuse)",
    "decode": "the VAE decode (<Pipeline>.vae.decode; the tuned Wan's split decode is not profiled: worker_other)",
    "from_worker": "output computed to the executor holding it (shared memory, the pipe)",
}


def breakdown(run: dict[str, Any]) -> dict[str, float | None]:
    """One request's latency taken apart, in ms, from the client's latency and the stage durations of
    its answer (vLLM-Omni's pipeline profiler, its engine's ``stage_0_gen_ms`` and, under omni-ext, the
    TunedExecutor's hops, :func:`omni_ext.executor.ranks.hops`, and the route's encode). A part the
    answer does not report is None and its time stays in ``route`` or ``engine``; all None without
    ``stage_0_gen_ms``."""
    stages = run.get("stages") or {}
    parts: dict[str, float | None] = dict.fromkeys(PARTS)
    gen_ms = stages.get("stage_0_gen_ms")
    if not isinstance(gen_ms, (int, float)):
        return parts

    def seconds(suffix: str) -> float | None:
        vals = [v for k, v in stages.items() if k.endswith(suffix) and not k.startswith("omni_ext.")
                and isinstance(v, (int, float))]
        return 1000.0 * sum(vals) if vals else None

    def ours(name: str) -> float | None:
        v = stages.get(f"omni_ext.{name}")
        return 1000.0 * v if isinstance(v, (int, float)) else None

    parts.update(text=seconds(".text_encoder.forward"), loop=seconds(".diffuse"), decode=seconds(".vae.decode"),
                 encode=ours("encode"), queue=ours("queue"), to_worker=ours("to_worker"), from_worker=ours("from_worker"))
    pipeline = sum(parts[k] or 0.0 for k in ("text", "loop", "decode"))
    worker = ours("worker")
    if worker is not None:
        parts["worker_other"] = worker - pipeline
        pipeline = worker
    parts["route"] = 1000.0 * run["latency_s"] - gen_ms - (parts["encode"] or 0.0)
    parts["engine"] = gen_ms - pipeline - sum(parts[k] or 0.0 for k in ("queue", "to_worker", "from_worker"))
    return parts


def row_breakdown(stock: list[dict[str, Any]], tuned: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per part (:data:`PARTS`): the median ms over a row's stock runs and over its tuned runs, and
    ``delta`` = tuned - stock where both report it. The medians of parts need not add up to the median
    latency; each part's delta says where tuned and stock differ."""
    def med(runs: list[dict[str, Any]], part: str) -> float | None:
        vals = [v for v in (breakdown(r)[part] for r in runs) if v is not None]
        return c.median(vals) if vals else None

    out = {}
    for part in PARTS:
        s, t = med(stock, part), med(tuned, part)
        out[part] = {"stock": s, "tuned": t, "delta": None if s is None or t is None else t - s}
    return out


def breakdown_table(result: dict[str, Any]) -> str:
    """Per row, per part: stock ms / tuned ms (``-``: not reported; see :data:`PART_NOTES`)."""
    rows = []
    for r in result["rows"]:
        b = r.get("breakdown")
        if not b:
            continue
        rows.append([r["name"], *[f"{c.fmt(b[p]['stock'], 1)}/{c.fmt(b[p]['tuned'], 1)}" for p in PARTS]])
    notes = "\n".join(f"  {p}: {PART_NOTES[p]}" for p in PARTS)
    return ("per-job time taken apart, median ms stock/tuned:\n" + c.format_table(["row", *PARTS], rows)
            + "\n" + notes)


def predictions(lines: list[str]) -> list[dict[str, float]]:
    """The TunedExecutor's predicted seconds against the seconds each job took, from its log lines
    (``start ... predicted X s`` and ``done ... in Y s``), in the order the jobs started; warm-ups and
    jobs started with no prediction are left out. ``error``: (predicted - took) / took."""
    from omni_ext.bench.logwatch import parse_line

    started: dict[str, float] = {}
    out: list[dict[str, float]] = []
    for line in lines:
        e = parse_line(line, 0.0)
        if e is None:
            continue
        if e.kind == "start" and e.mode != "warm-up" and e.predicted_s is not None:
            started[e.request_id] = e.predicted_s
        elif e.kind == "done" and not e.error and e.request_id in started and e.seconds:
            predicted = started.pop(e.request_id)
            out.append({"predicted_s": predicted, "took_s": e.seconds, "error": (predicted - e.seconds) / e.seconds})
    return out


def prediction_summary(jobs: list[dict[str, float]]) -> dict[str, Any]:
    """A row's prediction errors (:func:`predictions` of its tuned jobs: the warm-up first, then the
    alternations). ``first_error``: the row's first job, whose step count its shape class had not run
    before in this grid (the cost model's fixed and per-step split is what predicts it); ``median_abs_error``:
    the median |error| of the rest."""
    rest = [abs(j["error"]) for j in jobs[1:]]
    return {"jobs": len(jobs), "first_error": jobs[0]["error"] if jobs else None,
            "median_abs_error": c.median(rest) if rest else None}


def skip_below(rows: list[dict[str, Any]], min_steps: int) -> None:
    """Mark the rows whose step count the model cannot run (``skipped``, with why): the API refuses fewer
    than its ``min_steps`` (Qwen-Image's FlowMatch scheduler, stretched to a terminal sigma, gives a
    NaN sigma at one step: :func:`omni_ext.api.validation.limits_for_model`). They are not run and
    not counted, where a 400 had counted as a row without figures."""
    for row in rows:
        if row["steps"] < min_steps:
            row["skipped"] = f"{row['steps']} step(s): this model takes {min_steps} or more"


def overall_verdict(rows: list[dict[str, Any]], measurement: bool, reps: int) -> dict[str, Any]:
    """PASS when every row was measured and met both goals; FAIL when any row missed one; INCOMPLETE when
    none missed but some row has no figures (a server or request failed). ``flags`` say what weakens it:
    a busy host at a pair's start (not a measurement) or fewer than :data:`MIN_REPS` alternations. Rows
    the model cannot run (:func:`skip_below`) are listed apart and not counted. ``ties``: the rows, met
    or missed, whose ratio's 95 % interval holds 1.00 (:func:`tie_interval`): their verdicts stand, and
    say less than the resolved rows'."""
    skipped = [f"{r['name']} ({r['skipped']})" for r in rows if r.get("skipped")]
    rows = [r for r in rows if not r.get("skipped")]
    failed = [r["name"] for r in rows if r.get("pass") is False]
    ties = {r["name"]: interval for r in rows if (interval := tie_interval(r)) is not None}
    missing = [r["name"] for r in rows if r.get("pass") is None]
    ratios = [r["figures"]["tuned_vs_stock"]["value"] for r in rows if r.get("figures")]
    overheads = [r["figures"]["overhead_ms"]["value"] for r in rows if r.get("figures")]
    ratios = [v for v in ratios if v is not None]
    overheads = [v for v in overheads if v is not None]
    if failed:
        word, ok = "FAIL", False
    elif missing or not rows:
        word, ok = "INCOMPLETE", None
    else:
        word, ok = "PASS", True
    flags = []
    if not measurement:
        flags.append("not a measurement (busy host at a pair's start)")
    if reps < MIN_REPS:
        flags.append(f"{reps} alternations per row, fewer than the {MIN_REPS} the goal asks for")
    return {"verdict": word, "pass": ok, "measurement": measurement, "rows": len(rows),
            "rows_met": sum(1 for r in rows if r.get("pass") is True), "failed": failed, "missing": missing,
            "worst_tuned_vs_stock": min(ratios) if ratios else None,
            "max_overhead_ms": max(overheads) if overheads else None, "flags": flags, "skipped": skipped,
            "ties": ties}


def tie_interval(row: dict[str, Any]) -> tuple[float, float] | None:
    """A row's ratio interval when the row met the overhead goal and its interval holds the ratio's goal
    (1.00): a miss or a pass the run cannot tell apart. None otherwise."""
    figs = row.get("figures") or {}
    ratio, over = figs.get("tuned_vs_stock") or {}, figs.get("overhead_ms") or {}
    interval = ratio.get("interval")
    if not interval or over.get("pass") is False:
        return None
    low, high = interval
    return (low, high) if low < ratio.get("goal_value", GOALS["tuned_vs_stock"][1]) <= high else None


def verdict_line(overall: dict[str, Any]) -> str:
    head = (f"overall: {overall['verdict']} ({overall['rows_met']}/{overall['rows']} rows met tuned_vs_stock >= 1.00 "
            f"and overhead <= 10 ms; worst tuned_vs_stock {c.fmt(overall['worst_tuned_vs_stock'])}, "
            f"max overhead {c.fmt(overall['max_overhead_ms'], 1)} ms)")
    parts = [head]
    if overall["failed"]:
        ties = overall.get("ties") or {}
        parts.append("missed: " + "; ".join(
            name + (f" (a tie: its 95 % interval {c.fmt(ties[name][0])}-{c.fmt(ties[name][1])} holds 1.00)"
                    if name in ties else "") for name in overall["failed"]))
    if overall["missing"]:
        parts.append("no figures: " + "; ".join(overall["missing"]))
    if overall.get("skipped"):
        parts.append("not run: " + "; ".join(overall["skipped"]))
    if overall.get("ties"):
        parts.append("ties, met or missed (the 95 % interval of tuned_vs_stock holds 1.00): "
                     + "; ".join(f"{name} {c.fmt(lo)}-{c.fmt(hi)}" for name, (lo, hi) in overall["ties"].items()))
    parts += [f"FLAG: {f}" for f in overall["flags"]]
    return "\n".join(parts)


def single_table(result: dict[str, Any]) -> str:
    """One line per row (median ms stock / tuned, tuned_vs_stock and its interval, overhead ms, the paired overhead, the
    executor's prediction error of the row's first job and its median over the rest in %, reps, verdict
    with the goals a failed row missed: ``ratio``, ``overhead``), then the overall verdict and any pair's
    error or busy-host warning."""
    rows = []
    for r in result["rows"]:
        med = r.get("median_latency_s") or {}
        figs = r.get("figures") or {}
        ms = {k: None if med.get(k) is None else 1000.0 * med[k] for k in ("stock", "tuned")}
        word = "skipped" if r.get("skipped") else "n/a" if r.get("pass") is None else c.verdict({"pass": r["pass"],
                                                               "measurement": (figs.get("tuned_vs_stock") or {}).get("measurement", True)})
        missed = [short for key, short in (("tuned_vs_stock", "ratio"), ("overhead_ms", "overhead"))
                  if (figs.get(key) or {}).get("pass") is False]
        if r.get("pass") is False:
            word = word.replace("FAIL", "FAIL " + "+".join(missed), 1)
        if tie_interval(r):
            word += " (tie)"
        pred = r.get("prediction") or {}
        pct = {k: None if pred.get(k) is None else 100.0 * pred[k] for k in ("first_error", "median_abs_error")}
        interval = (figs.get("tuned_vs_stock") or {}).get("interval")
        rows.append([r["name"], c.fmt(ms["stock"], 1), c.fmt(ms["tuned"], 1),
                     (figs.get("tuned_vs_stock") or {}).get("value"),
                     f"{c.fmt(interval[0])}-{c.fmt(interval[1])}" if interval else "-",
                     c.fmt((figs.get("overhead_ms") or {}).get("value"), 1), c.fmt(r.get("paired_overhead_ms"), 1),
                     c.fmt(pct["first_error"], 0), c.fmt(pct["median_abs_error"], 0), r.get("reps", 0), word])
    lines = [c.format_table(["row", "stock ms", "tuned ms", "tuned_vs_stock", "95 % interval", "overhead ms", "paired ms",
                             "pred 1st %", "pred |err| %", "reps", "verdict"], rows),
             verdict_line(result["overall"])]
    if any(r.get("breakdown") for r in result["rows"]):
        lines.append(breakdown_table(result))
    for r in result["rows"]:
        if r.get("error"):
            lines.append(f"{r['name']} failed: {r['error'][:300]}")
    for model, pair in (result.get("pairs") or {}).items():
        if pair.get("error"):
            lines.append(f"{model} pair failed: {pair['error'][:300]}")
        host = pair.get("host") or {}
        if host.get("warning"):
            lines.append(f"{model}: NOT A MEASUREMENT: {host['warning']}")
    return "\n".join(lines)


def check_options(args) -> None:
    """``--single-jobs`` runs its own grid on CFG 2 alone: ``--model`` and ``--sp`` > 1 do not combine."""
    if getattr(args, "model", None) or getattr(args, "sp", 1) > 1:
        raise SystemExit("omni-ext bench cfg-parallel --single-jobs: use --single-models (and no --sp); it runs CFG 2 alone")


# ---- the measurement -----------------------------------------------------------------------------------
def _send(row: dict[str, Any]):
    from omni_ext.bench.client import sync_image_request, sync_request

    return sync_request if row["kind"] == "video" else sync_image_request


def _measure_pair(args, model: str, rows: list[dict[str, Any]], root: Path, progress: c.Progress,
                  pair: dict[str, Any]) -> None:
    """Start ``model``'s stock/tuned pair, run its rows (records into each row's ``runs``), stop it."""
    from omni_ext.api.validation import limits_for_model
    from omni_ext.bench.common import STOCK_ENV
    from omni_ext.bench.runner import sp_layout, sp_server_specs

    built = VIDEO_MODEL if model == FEW_STEP_MODEL else model
    ns = argparse.Namespace(**{**vars(args), "model": built, "workdir": str(root / model)})
    tiny, workdir, base_args, env = c.setup(ns)
    if model == FEW_STEP_MODEL:
        from omni_ext.models.tiny import relabel

        tiny = relabel(tiny, Path(workdir) / "model", FEW_STEP_CLASS)
    _, layout_env = sp_layout(1)
    servers = c.Servers(tiny, workdir, base_args, {**env, **layout_env})
    pair["model_path"] = str(tiny)
    skip_below(rows, limits_for_model(str(tiny)).min_steps)
    try:
        servers.start(sp_server_specs(1), args.start_timeout, envs={STOCK: STOCK_ENV})
        pair["servers"] = servers.commands
        for row in rows:
            if row.get("skipped"):
                progress.advance(2 * args.reps + 2, note=f"{row['name']}: skipped")
                continue
            try:
                _measure_row(args, servers, row, progress)
            except Exception as exc:  # a request the server refused or a failure: the next rows run
                row["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
                c.log(f"{row['name']} failed: {row['error'][:300]}")
    finally:
        pair.setdefault("servers", servers.commands)
        servers.stop()


def _measure_row(args, servers: c.Servers, row: dict[str, Any], progress: c.Progress) -> None:
    from omni_ext.bench.runner import diffuse_s

    send = _send(row)
    fields = row_fields(args, row)
    log = servers.log_path(TUNED)
    offset = log.stat().st_size if log.exists() else 0
    for name in (STOCK, TUNED):  # warm-up: the shape's first-call costs, not counted
        time.sleep(args.settle)
        row["warmup"][name] = send(servers.url(name), row_fields(args, row, seed=1))
        progress.advance(note=f"{row['name']}: warm-up {name}")
    for i in range(args.reps):
        for name in ((STOCK, TUNED) if i % 2 == 0 else (TUNED, STOCK)):
            time.sleep(args.settle)  # the other server's workers poll busily for a while after a request
            r = send(servers.url(name), fields)
            row["runs"][name].append(r)
            d = diffuse_s(r.get("stages") or {})
            progress.advance(note=f"{row['name']} rep {i}: {name} {1000 * r['latency_s']:.0f} ms"
                                  + (f" (diffuse {1000 * d:.0f} ms)" if d else ""))
    time.sleep(0.2)  # the executor's last "done" line reaches the log
    if log.exists():
        with open(log, "rb") as f:
            f.seek(offset)
            row["predictions"] = predictions(f.read().decode("utf-8", "replace").splitlines())


def run(args) -> dict[str, Any]:
    from omni_ext.bench.runner import diffuse_s

    check_options(args)
    grid = single_grid(args.single_frames, args.single_steps, args.single_size, args.single_models)
    rows = [{**r, "warmup": {}, "runs": {STOCK: [], TUNED: []}} for r in grid]
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="omni-ext-bench-single-"))
    root.mkdir(parents=True, exist_ok=True)
    progress = c.Progress("cfg-parallel --single-jobs", len(rows) * (2 * args.reps + 2), min_interval_s=0.0)
    pairs: dict[str, dict[str, Any]] = {}
    for model in dict.fromkeys(args.single_models):
        pair: dict[str, Any] = {"error": None}
        pairs[model] = pair
        pair["host"] = host = c.quiet_host(args)  # before each pair: the one before it has stopped
        try:
            _measure_pair(args, model, [r for r in rows if r["model"] == model], root, progress, pair)
        except Exception as exc:  # recorded: the other pair's rows still stand
            pair["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
            c.log(f"{model} pair failed: {pair['error'][:300]}")
        c.finish_host(host)
    progress.close()
    measurement = all(p["host"]["measurement"] for p in pairs.values())
    for r in rows:
        runs = r["runs"]
        r.update(row_summary([x["latency_s"] for x in runs[STOCK]], [x["latency_s"] for x in runs[TUNED]],
                             pairs[r["model"]]["host"]["measurement"],
                             [diffuse_s(x.get("stages") or {}) for x in runs[STOCK]],
                             [diffuse_s(x.get("stages") or {}) for x in runs[TUNED]], expected_reps=args.reps))
        r["prediction"] = prediction_summary(r.get("predictions") or [])
        r["breakdown"] = row_breakdown(runs[STOCK], runs[TUNED])
    return {
        "benchmark": "cfg-parallel --single-jobs",
        "models": {m: f"tiny {m} '{args.model_size}' (random weights, float32)" for m in pairs},
        "layout": {"cfg": 2, "ulysses": 1, "processes_per_server": 2, "threads_per_process": 1},
        "stock": "vLLM-Omni's executor and routes (OMNI_EXT_DISABLE_PATCHES=" + c.STOCK_ENV["OMNI_EXT_DISABLE_PATCHES"] + ")",
        "tuned": "omni-ext's TunedExecutor, the same layout",
        "reps": args.reps,
        "settle_s": args.settle,
        "goals": {k: f"{op} {v:g}" for k, (op, v) in GOALS.items()},
        "measurement": measurement,
        "workdir": str(root),
        "pairs": pairs,
        "rows": rows,
        "overall": overall_verdict(rows, measurement, args.reps),
    }


def main(args) -> int:
    result = run(args)
    return c.write_result(args.json, result, single_table(result))
