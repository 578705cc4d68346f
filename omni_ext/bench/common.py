"""What every ``omni-ext bench ...`` command shares: the tiny model, the servers, the request fields,
the host's state, goals and pass/fail, the comparison table, the progress bar and the JSON file.

The measuring parts (servers, HTTP) are used by :mod:`omni_ext.bench.runner` (cfg-parallel,
data-parallel) and by the scheduler benchmarks (:mod:`omni_ext.bench.adaptive`,
:mod:`omni_ext.bench.mixed`, :mod:`omni_ext.bench.admission`); the arithmetic parts (figures,
table, progress line, load check, option profiles) are pure and unit-tested in ``tests/test_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TUNED = "omni_ext.executor.TunedExecutor"
#: Serve flags of every benchmark server (float32 tiny model, no graph capture).
BASE_ARGS = ["--dtype", "float32", "--enforce-eager"]
#: Environment of every benchmark server: one thread per worker, offline.
BASE_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMNI_EXT_LOG_LEVEL": "INFO"}
#: Above this 1-minute load average before a run starts, its figures are not called measurements.
DEFAULT_MAX_LOAD = 1.0
PROMPT = "a red fox running through fresh snow"
#: What a configuration called "stock" switches off besides omni-ext's executor: omni-ext's dispatch.
STOCK_DISPATCH_ENV = {"OMNI_EXT_DISABLE_PATCHES": "replica-dispatch"}
#: A "stock" server beside a tuned one: vLLM-Omni's own routes, validation, executor and dispatch, and its
#: denoise loop without omni-ext's per-step cancellation check (``cancel-at-step`` adds a collective per
#: step to vLLM-Omni's Wan and Qwen-Image pipelines). Kept: the two fixes for servers that share a host's
#: cores, ``idle-poll-backoff`` and ``gloo-shared-device`` (an idle server's busy polls and gloo threads
#: would take cores from the server being measured; on a card host each server has its own).
STOCK_ENV = {"OMNI_EXT_DISABLE_PATCHES": "openai-routes,validate-diffusion-requests,cancel-at-step,replica-dispatch"}


def omni_ext_executor_in(args: Sequence[str], deploy: dict[str, Any] | None = None) -> list[str]:
    """Where a server's flags or deploy YAML select omni-ext's executor (empty: vLLM-Omni's own).

    A deploy YAML's top-level ``distributed_executor_backend`` applies to every stage
    (vLLM-Omni's ``config/omni_config.py``), so it counts as much as a stage's own key."""
    found = [f"flag {a}" for a in args if a.startswith("omni_ext.")]
    for where, d in [("deploy YAML", deploy or {}), *((f"stage {st.get('stage_id')}", st) for st in (deploy or {}).get("stages", []))]:
        if str(d.get("distributed_executor_backend", "")).startswith("omni_ext."):
            found.append(f"{where}: distributed_executor_backend {d['distributed_executor_backend']}")
    return found


def refuse_omni_ext_in_stock(name: str, args: Sequence[str]) -> None:
    """A benchmark server whose name says "stock" must run vLLM-Omni's own executor: checked on the
    exact flags (and the deploy YAML they name) before it starts, so no figure is mislabelled."""
    if "stock" not in name:
        return
    deploy = None
    if "--deploy-config" in args:
        path = Path(args[list(args).index("--deploy-config") + 1])
        if path.is_file():
            import yaml

            deploy = yaml.safe_load(path.read_text(encoding="utf-8"))
    found = omni_ext_executor_in(args, deploy)
    if found:
        raise ValueError(f"benchmark server {name!r} is called stock but selects omni-ext's executor: {'; '.join(found)}")


def stock_deploy(deploy: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``deploy`` with vLLM-Omni's own executor at every level (top-level key and stages)."""
    import copy

    out = copy.deepcopy(deploy)
    out.pop("distributed_executor_backend", None)
    for stage in out.get("stages", []):
        stage.pop("distributed_executor_backend", None)
    return out
NEGATIVE = "blurry, low quality"


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


# ---- model and servers ---------------------------------------------------------------------------
def model_path(args, family: str = "wan2.1-t2v") -> Path:
    root = Path(args.models_dir or Path(tempfile.gettempdir()) / "omni-ext-bench-models")
    return root / f"{family}-{args.model_size}-float32"


def tiny_model(args, family: str = "wan2.1-t2v") -> Path:
    """The tiny ``family`` model (``omni_ext.models.tiny.MODELS``; Wan2.1 unless told) of
    ``--model-size`` (float32), built once and cached under ``--models-dir``."""
    from omni_ext.models.tiny import build_tiny_model

    out = model_path(args, family)
    if not (out / "model_index.json").exists():
        build_tiny_model(family, out, size=args.model_size, dtype="float32")
    return out


def setup(args) -> tuple[Path, Path, list[str], dict[str, str]]:
    """(model, workdir, base serve args, base env) of one benchmark run."""
    model = tiny_model(args, getattr(args, "model", None) or "wan2.1-t2v")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="omni-ext-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    return model, workdir, list(BASE_ARGS), dict(BASE_ENV)


def shell_command(argv: Sequence[str], env: dict[str, str]) -> str:
    """One copy-pasteable line: the environment overrides, then the command."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())), shlex.join(list(argv))])


def additional_config(**omni_ext: Any) -> list[str]:
    """``--additional-config`` with an ``omni_ext`` section (empty values left out)."""
    section = {k: v for k, v in omni_ext.items() if v not in (None, {}, [])}
    return ["--additional-config", json.dumps({"omni_ext": section}, sort_keys=True)] if section else []


class Servers:
    """Start/stop ``ServeProcess`` servers of one benchmark; records the exact command of each."""

    def __init__(self, model: Path, workdir: Path, base_args: list[str], env: dict[str, str]) -> None:
        self.model, self.workdir, self.base_args, self.env = model, workdir, base_args, env
        self.procs: dict[str, Any] = {}
        self.commands: dict[str, dict[str, Any]] = {}

    def server_env(self, name: str) -> dict[str, str]:
        return {**self.env, "VLLM_OMNI_SERVER_STORAGE__PATH": str(self.workdir / f"storage-{name}"),
                "OMNI_EXT_API_DATA_DIR": str(self.workdir / f"api-{name}")}

    def start(self, specs: dict[str, list[str]], timeout: float, envs: dict[str, dict[str, str]] | None = None) -> None:
        """Start every server of ``specs`` (name -> serve args) at once, then wait until all are ready.
        ``envs`` adds per-server environment (e.g. ``OMNI_EXT_DISABLE_PATCHES`` for one of them)."""
        from omni_ext.server_process import ServeProcess

        for name, args in specs.items():
            refuse_omni_ext_in_stock(name, args)
        for name, args in specs.items():
            env = {**self.server_env(name), **(envs or {}).get(name, {})}
            proc = ServeProcess(model=str(self.model), args=[*self.base_args, *args], env=env,
                                log_path=self.workdir / f"{name}.log").start()
            self.procs[name] = proc
            self.commands[name] = {"argv": proc.command(), "env": env, "shell": shell_command(proc.command(), env),
                                   "log": str(proc.log_path)}
        for name in specs:
            self.procs[name].wait_ready(timeout)
            log(f"{name}: ready after {self.procs[name].ready_after_s:.0f} s")

    def start_multihost(self, name: str, args: list[str], headless: int, head_args: list[str] | None = None,
                        head_env: dict[str, str] | None = None) -> None:
        """Start ``name`` as vLLM-Omni's multi-machine mode on loopback: a head (the endpoint, with its
        own replica) and ``headless`` headless replicas; :meth:`wait_all` waits until all joined."""
        from omni_ext.server_process import MultiHostServer

        refuse_omni_ext_in_stock(name, [*args, *(head_args or [])])
        mh = MultiHostServer(str(self.model), replicas=headless, args=[*self.base_args, *args], env=dict(self.env),
                             head_args=list(head_args or []), head_env={**self.server_env(name), **(head_env or {})},
                             log_dir=self.workdir / name).start()
        self.procs[name] = mh
        head_env_all = {**self.env, **mh.head_env}
        self.commands[name] = {"head": shell_command(mh.head.command(), head_env_all),
                               "headless": [shell_command(p.command(), self.env) for p in mh.headless],
                               "log": str(mh.log_path)}

    def wait_all(self, timeout: float) -> None:
        for name, proc in self.procs.items():
            proc.wait_ready(timeout)
            log(f"{name}: ready after {proc.ready_after_s:.0f} s")

    def stop(self, *names: str) -> None:
        for name in names or list(self.procs):
            proc = self.procs.pop(name, None)
            if proc is not None:
                proc.stop()

    def url(self, name: str) -> str:
        return self.procs[name].url

    def log_path(self, name: str) -> Path:
        return self.procs[name].log_path


def planned_commands(model: Path, specs: dict[str, list[str]]) -> dict[str, str]:
    """The serve command of each server as a dry run prints it (port chosen at start)."""
    try:
        from omni_ext.server_process import vllm_omni_exe

        exe = vllm_omni_exe()
    except FileNotFoundError:
        exe = "vllm-omni"
    return {name: shell_command([exe, "serve", str(model), "--omni", "--host", "127.0.0.1", "--port", "PORT",
                                 *BASE_ARGS, *args], BASE_ENV) for name, args in specs.items()}


# ---- requests --------------------------------------------------------------------------------------
def reference_png(width: int, height: int) -> bytes:
    """A fixed reference image of the request's size (smooth gradients: it encodes like a photo)."""
    import io

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) * 127 // max(width + height - 2, 1)], -1)
    out = io.BytesIO()
    Image.fromarray(rgb.astype("uint8")).save(out, format="PNG")
    return out.getvalue()


def edit_fields(args, **over) -> dict[str, Any]:
    """The benchmark's image edit: a CFG pair (Qwen-Image's rule: ``true_cfg_scale`` > 1 and a negative
    prompt) on the fixed reference image, at the request's size."""
    w, h = (int(v) for v in args.size.split("x"))
    f = {"prompt": PROMPT, "negative_prompt": NEGATIVE, "size": f"{w}x{h}", "num_inference_steps": args.steps,
         "true_cfg_scale": 4.0, "seed": 1234, "response_format": "b64_json", "image": reference_png(w, h)}
    f.update(over)
    return f


def video_fields(args, **over) -> dict[str, Any]:
    """The benchmark's request; with an image-to-video ``--model``, its reference image too."""
    from omni_ext.models.tiny import TAKES_IMAGE

    w, h = args.size.split("x")
    f = {
        "prompt": PROMPT,
        "negative_prompt": NEGATIVE,
        "size": f"{w}x{h}",
        "num_frames": args.frames,
        "num_inference_steps": args.steps,
        "guidance_scale": 4.0,
        "seed": 1234,
        "fps": 8,
    }
    if getattr(args, "model", None) in TAKES_IMAGE:
        f["input_reference"] = reference_png(int(w), int(h))
    f.update(over)
    return f


def size_hw(size: str) -> tuple[int, int]:
    """(height, width) of ``WxH``."""
    w, h = (int(v) for v in size.lower().split("x"))
    return h, w


# ---- statistics and figures ------------------------------------------------------------------------
def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``xs`` by linear interpolation between closest ranks (numpy's
    default), so p99 of 4 latencies lies between the two slowest instead of being the slowest;
    None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    vals = sorted(float(x) for x in xs)
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None when either is missing, not finite or ``b`` is 0."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return None
    return a / b


_GOAL_OPS = {"<=": float.__le__, ">=": float.__ge__, "<": float.__lt__, ">": float.__gt__}


def judge(value: float | None, op: str, target: float) -> bool | None:
    """Whether ``value`` meets the goal ``op target`` (``<=``, ``>=``, ``<`` or ``>``); None without a value."""
    if op not in _GOAL_OPS:
        raise ValueError(f"unknown goal operator {op!r}")
    if value is None or not math.isfinite(value):
        return None
    return bool(_GOAL_OPS[op](float(value), float(target)))


def figure(value: float | None, op: str, target: float, measurement: bool, **extra: Any) -> dict[str, Any]:
    """One figure of the JSON: value, goal, pass/fail, and whether the run counts as a measurement."""
    return {"value": value, "goal": f"{op} {target:g}", "goal_op": op, "goal_value": target,
            "pass": judge(value, op, target), "measurement": measurement, **extra}


def verdict(fig: dict[str, Any]) -> str:
    if fig.get("pass") is None:
        return "n/a"
    word = "PASS" if fig["pass"] else "FAIL"
    return word if fig.get("measurement", True) else f"{word} (not a measurement)"


def runs_needed(n: int) -> int:
    """How many of ``n`` runs must meet a goal: two thirds, rounded up (2 of 3, 1 of 1)."""
    return math.ceil(2 * n / 3)


def repeat_figures(runs: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The figures of ``n`` runs of one benchmark (each run's ``figures``), one figure each: the median
    of the runs' values, their range, how many runs met the goal, and a verdict that passes only when
    the median meets the goal AND at least :func:`runs_needed` runs passed (one good run is not a
    result, issue 38).

    A run without a value (no figure, or None: e.g. a p99 that fell on a refused request, unbounded)
    does not meet the goal and ranks as the worst value in the median, so a missing run can only lower
    it; the median is None when it falls on one. No value in any run: no verdict (``pass`` None), as
    for one run. A run's own ``pass`` is what counts as meeting, so conditions beyond the goal (the
    stream's "ahead of the baselines") carry over."""
    n = len(runs)
    need = runs_needed(n)
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(k for figs in runs for k in figs):
        figs = [figs.get(name) for figs in runs]
        known = [f for f in figs if f is not None]
        op, target = known[0]["goal_op"], known[0]["goal_value"]
        values = [None if f is None else f.get("value") for f in figs]
        finite = [float(v) for v in values if v is not None and math.isfinite(v)]
        worst = math.inf if op in ("<=", "<") else -math.inf
        mid = statistics.median([float(v) if v is not None and math.isfinite(v) else worst for v in values])
        mid = mid if math.isfinite(mid) else None
        meeting = sum(f is not None and f.get("pass") is True for f in figs)
        ok = None if not finite else bool(judge(mid, op, target)) and meeting >= need
        fig = {"value": mid, "goal": known[0]["goal"], "goal_op": op, "goal_value": target, "pass": ok,
               "measurement": all(f.get("measurement", True) for f in known), "runs": values, "median": mid,
               "range": [min(finite), max(finite)] if finite else None, "runs_meeting": meeting,
               "runs_needed": need, "n": n}
        fig["verdict"] = verdict(fig)
        out[name] = fig
    return out


def repeat_table(figures: dict[str, dict[str, Any]], run_labels: Sequence[str]) -> str:
    """The table of :func:`repeat_figures`: each run's value, the median, the range, the goal, the runs
    that met it and the verdict."""
    def span(r: list[float] | None) -> str:
        return "-" if r is None else f"{fmt(r[0])}-{fmt(r[1])}"

    headers = ["figure", *run_labels, "median", "range", "goal", "runs meeting", "verdict"]
    rows = [[name, *f["runs"], f["median"], span(f["range"]), f["goal"],
             f"{f['runs_meeting']}/{f['n']} (need {f['runs_needed']})", f["verdict"]] for name, f in figures.items()]
    return format_table(headers, rows)


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with left-aligned columns (values through :func:`fmt`)."""
    cells = [[str(h) for h in headers], *[[fmt(v) for v in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def figures_table(figures: dict[str, dict[str, Any]], extra_cols: dict[str, dict[str, Any]] | None = None) -> str:
    """The comparison table of a benchmark's figures: value, goal, verdict, and any extra columns
    (column name -> figure name -> value, e.g. the bare host ceiling)."""
    extra_cols = extra_cols or {}
    headers = ["figure", "value", "goal", "verdict", *extra_cols]
    rows = [[name, f["value"], f["goal"], verdict(f), *(col.get(name) for col in extra_cols.values())]
            for name, f in figures.items()]
    return format_table(headers, rows)


# ---- host --------------------------------------------------------------------------------------------
def host_info(max_load: float = DEFAULT_MAX_LOAD) -> dict[str, Any]:
    """CPUs, ``uptime`` and the load average now, and whether the host is quiet enough for a measurement."""
    try:
        load: list[float] | None = list(os.getloadavg())
    except OSError:
        load = None
    try:
        uptime = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        uptime = None
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "uptime": uptime,
            "loadavg_at_start": load, **load_check(load[0] if load else None, max_load)}


def load_check(load1: float | None, max_load: float) -> dict[str, Any]:
    """``measurement``: False when the 1-minute load was above ``max_load`` before starting (the
    figures are then recorded but not called measurements), with the warning that says so."""
    busy = load1 is not None and load1 > max_load
    warning = (f"1-minute load {load1:.2f} > {max_load:g} before starting: the host is busy, the figures "
               "of this run are recorded but are not measurements") if busy else None
    return {"max_load": max_load, "measurement": not busy, "warning": warning}


def finish_host(host: dict[str, Any]) -> None:
    """Add the load average at the end of the run (after the servers stopped)."""
    try:
        host["loadavg_at_end"] = list(os.getloadavg())
    except OSError:
        host["loadavg_at_end"] = None


def add_host_options(p) -> None:
    """The options every server benchmark module takes for its model, its servers and a quiet host."""
    p.add_argument("--models-dir", default=None, help="where the tiny model is built/cached")
    p.add_argument("--workdir", default=None, help="server logs and storage (default: a new temp dir)")
    p.add_argument("--start-timeout", type=float, default=1200.0)
    add_quiet_options(p)


def add_quiet_options(p) -> None:
    """``--max-load`` and ``--quiet-wait``: every benchmark waits for a quiet host before it starts
    (:func:`quiet_host`)."""
    p.add_argument("--max-load", type=float, default=1.0, help="wait for the 1-minute load to fall to this before starting")
    p.add_argument("--quiet-wait", type=float, default=600.0, help="wait at most this many seconds for it (then: not a measurement)")


def quiet_host(args) -> dict[str, Any]:
    """Wait for a quiet host (``--max-load``, at most ``--quiet-wait`` s: :func:`wait_for_quiet`), then
    the host's facts (:func:`host_info`) with that wait, and a warning in the log if it stayed busy."""
    quiet = wait_for_quiet(args.max_load, args.quiet_wait)
    host = {**host_info(args.max_load), "quiet_wait": quiet}
    warn_if_busy(host)
    return host


def wait_for_quiet(max_load: float, timeout_s: float, poll_s: float = 10.0, load=None, clock=time.monotonic,
                   sleep=time.sleep) -> dict[str, Any]:
    """Wait until the 1-minute load is at most ``max_load`` (a benchmark that needs a quiet host),
    at most ``timeout_s``; a progress line per poll. Returns the wait (``quiet`` False: it timed out,
    and :func:`host_info` will then record the run as not a measurement)."""
    load = load or (lambda: os.getloadavg()[0])
    t0 = clock()
    while True:
        now = load()
        waited = clock() - t0
        if now <= max_load:
            return {"quiet": True, "waited_s": round(waited, 1), "load1": now, "max_load": max_load}
        if waited >= timeout_s:
            log(f"host still busy after {waited:.0f} s (1-minute load {now:.2f} > {max_load:g}): going on")
            return {"quiet": False, "waited_s": round(waited, 1), "load1": now, "max_load": max_load}
        log(f"waiting for a quiet host: 1-minute load {now:.2f} > {max_load:g} ({waited:.0f}/{timeout_s:.0f} s)")
        sleep(poll_s)


def warn_if_busy(host: dict[str, Any]) -> None:
    if host.get("warning"):
        log(f"WARNING: {host['warning']}")


# ---- option profiles (defaults vs --quick) ----------------------------------------------------------
def apply_profile(args, defaults: dict[str, Any], quick: dict[str, Any]) -> None:
    """Fill every option the user left unset (None) from ``quick`` under ``--quick``, else from
    ``defaults``; options given on the command line always win."""
    profile = {**defaults, **(quick if getattr(args, "quick", False) else {})}
    for key, value in profile.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


# ---- progress --------------------------------------------------------------------------------------
def progress_line(label: str, done: int, total: int, elapsed_s: float, width: int = 24, note: str = "") -> str:
    """``label [#####.....] done/total  elapsed, ~left`` (the estimate from the rate so far)."""
    total = max(1, total)
    done = max(0, min(done, total))
    filled = int(round(width * done / total))
    left = f", ~{elapsed_s * (total - done) / done:.0f} s left" if 0 < done < total else ""
    tail = f"  {note}" if note else ""
    return f"{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}  {elapsed_s:.0f} s{left}{tail}"


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, one line per change (at most one a
    ``min_interval_s``) in a log file. Thread-safe."""

    def __init__(self, label: str, total: int, stream=None, min_interval_s: float = 2.0) -> None:
        self.label, self.total, self.done = label, total, 0
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.min_interval_s = min_interval_s
        self.t0 = time.monotonic()
        self._last = 0.0
        self._lock = threading.Lock()
        self._draw("", force=True)

    def advance(self, n: int = 1, note: str = "") -> None:
        with self._lock:
            self.done += n
            self._draw(note, force=self.done >= self.total)

    def _draw(self, note: str, force: bool = False) -> None:
        now = time.monotonic()
        if not self.tty and not force and now - self._last < self.min_interval_s:
            return
        self._last = now
        line = "[bench] " + progress_line(self.label, self.done, self.total, now - self.t0, note=note)
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# ---- output ----------------------------------------------------------------------------------------
def write_result(path: str | Path, result: dict[str, Any], table: str) -> int:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, sort_keys=True, default=str))
    print(table, flush=True)
    log(f"wrote {path}")
    return 0


def run_command(args, defaults: dict[str, Any], quick: dict[str, Any], dry_run, run, table) -> int:
    """What every scheduler benchmark command does: apply the ``--quick`` profile, then either print
    the plan (``--dry-run``) or measure, print the table and write the JSON."""
    apply_profile(args, defaults, quick)
    if args.dry_run:
        return print_plan(dry_run(args))
    result = run(args)
    return write_result(args.json, result, table(result))


def not_a_measurement(result: dict[str, Any]) -> list[str]:
    """The table's closing line when the host was busy at the start (empty otherwise)."""
    return [] if result["measurement"] else [f"NOT A MEASUREMENT: {result['host']['warning']}"]


def print_plan(plan: dict[str, Any]) -> int:
    """``--dry-run``: what the benchmark would start and send, without starting anything."""
    print(json.dumps(plan, indent=2, default=str), flush=True)
    log("dry run: nothing was started")
    return 0
