"""``omni-ext device-check`` (``scripts/device_check.sh``): the one prepared run that proves the
accelerator path on whatever host it is started on, and says what it could not prove there.

It builds the tiny Wan2.1 model (:mod:`omni_ext.models.tiny`), serves it one server at a time with
vLLM-Omni's own executor and with omni-ext's TunedExecutor (one device: a single rank; two or more
devices, or a CPU host: CFG 2 and data parallel 2), sends the same seeded requests to each over HTTP,
and checks:

- the TunedExecutor's videos are byte-identical to vLLM-Omni's one-rank video of the same request
  (single rank, the CFG pair, both data-parallel groups at once), and ran where they should (pair
  mode on ranks 0 and 1; the two concurrent requests on different ranks);
- the split Wan VAE decode ran on the CFG pair (its log line), with VAE tiling on as the shipped Wan
  presets set it;
- no API/engine process holds a device context (``nvidia-smi`` / ``npu-smi`` process list against
  the server's process tree: only the worker processes may appear);
- the denoise time per step, stock vs tuned, from the server's own stage timings
  (``--enable-diffusion-pipeline-profiler``, the ``X-Stage-Durations`` header): a check on a
  device, information on a CPU host (one thread per worker on a shared host);
- step-level preemption's resume on the device itself, with torch and diffusers alone
  (:mod:`omni_ext.device_probe`, in a process of its own): a job paused twice at step boundaries
  while two others run on the same device ends byte-identical to its uninterrupted run (float32 and
  bfloat16). It runs also where the vLLM stack is missing (a card image without vLLM), where no
  server can start;
- the whole run fits the 8-minute budget.

On a CPU host the device-only checks are ``skipped`` with the reason. The pure parts (device
detection from the tools' output, process lists, the verdicts) are unit-tested in
``tests/test_device_check.py``, which also runs the whole script on the CPU host.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_ext.bench.common import BASE_ARGS, BASE_ENV, TUNED, additional_config, format_table, host_info

#: Every check the report names, in report order (all are present on every host).
CHECKS: tuple[str, ...] = (
    "platform-stack",
    "tiny-model",
    "identical.tuned-1rank",
    "identical.tuned-cfg2",
    "identical.tuned-dp2",
    "split-vae-decode",
    "device-context.api-engine",
    "step-time.1rank",
    "step-time.cfg2",
    "preempt-resume.device",
    "time-budget",
)
#: Checks that only a device can answer (skipped with "no device" on a CPU host).
DEVICE_ONLY: frozenset[str] = frozenset({"device-context.api-engine"})
#: Checks that need two devices (or the CPU platform's two worker processes).
TWO_DEVICES: frozenset[str] = frozenset({"identical.tuned-cfg2", "identical.tuned-dp2", "split-vae-decode", "step-time.cfg2"})
#: The whole run must fit this on a device host (the issue's budget).
BUDGET_S = 480.0
#: On a device, tuned per-step time above this multiple of stock's fails (a per-step host sync shows here).
MAX_STEP_RATIO = 1.10
#: The TunedExecutor logs one of these once per worker when the CFG pair splits the Wan VAE decode:
#: the tiled decode's tiles (VAE tiling on and the frame wider/taller than a tile) or the layer pipeline.
SPLIT_LINES = {"tiled": "Wan VAE tiled decode split between CFG ranks", "layers": "Wan VAE decode split between CFG ranks"}
#: vLLM-Omni names its worker processes ``vLLM-Omni::DiffusionWorker[_CFG0|_DP1|...]``; the
#: TunedExecutor keeps the names. Nothing else in a server's tree may hold a device context.
WORKER_NAME = "DiffusionWorker"
_START = re.compile(r"omni-ext: start request (\S+) on rank\(s\) \[([\d, ]+)\] \((\w+(?:-\w+)?)\)")


def log(msg: str) -> None:
    print(f"[device-check] {msg}", file=sys.stderr, flush=True)


# ---- the device -----------------------------------------------------------------------------------
@dataclass
class Device:
    kind: str  # "cuda" | "npu" | "cpu"
    count: int
    names: list[str] = field(default_factory=list)
    visible_env: str | None = None  # CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES as set
    tool: str | None = None  # the tool that listed the devices

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "count": self.count, "names": self.names, "visible_env": self.visible_env,
                "tool": self.tool}


def parse_nvidia_list(text: str) -> list[str]:
    """GPU names from ``nvidia-smi -L`` (``GPU 0: NVIDIA H200 (UUID: GPU-...)``)."""
    return [m.group(1).strip() for m in re.finditer(r"^GPU \d+: (.+?)(?: \(UUID.*)?$", text, re.M)]


def parse_npu_count(text: str) -> int:
    """NPU count from ``npu-smi info -l`` (``Total Count : 8``), else from ``npu-smi info``'s table."""
    m = re.search(r"Total Count\s*:\s*(\d+)", text)
    if m:
        return int(m.group(1))
    return len(re.findall(r"^\|\s*\d+\s+\S*910\S*\s*\|", text, re.M))


def visible_count(value: str | None, physical: int) -> int:
    """Devices a process sees under ``*_VISIBLE_DEVICES`` (indices or UUIDs; unset: all)."""
    if value is None:
        return physical
    items = [v for v in value.split(",") if v.strip() and v.strip() != "-1"]
    return min(len(items), physical) if physical else len(items)


def detect_device(run=subprocess.run) -> Device:
    """CUDA (``nvidia-smi -L``), else Ascend (``npu-smi info -l``), else CPU. The tools, not torch:
    the checking process must not open a device context itself (it is what the check looks for)."""
    if shutil.which("nvidia-smi"):
        try:
            out = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        names = parse_nvidia_list(out)
        if names:
            env = os.environ.get("CUDA_VISIBLE_DEVICES")
            return Device("cuda", visible_count(env, len(names)), names, env, "nvidia-smi")
    if shutil.which("npu-smi"):
        try:
            out = run(["npu-smi", "info", "-l"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        count = parse_npu_count(out)
        if count:
            env = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
            return Device("npu", visible_count(env, count), [f"npu{i}" for i in range(count)], env, "npu-smi")
    return Device("cpu", 0, [], None, None)


def platform_stack(device: Device) -> tuple[str, str]:
    """(status, detail) of the platform's vLLM stack: vllm-omni everywhere, vllm-ascend + torch-npu on NPU."""
    import importlib.metadata as md
    import importlib.util

    need = ["vllm-omni", "vllm", "torch"] + (["vllm-ascend", "torch-npu"] if device.kind == "npu" else [])
    found, missing = [], []
    for dist in need:
        try:
            found.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            missing.append(dist)
    if device.kind == "npu" and importlib.util.find_spec("torch_npu") is None and "torch-npu" not in missing:
        missing.append("torch_npu (module)")
    if missing:
        return "fail", f"missing {', '.join(missing)}; found {', '.join(found) or 'nothing'}"
    return "pass", ", ".join(found)


# ---- device process lists -------------------------------------------------------------------------
def parse_nvidia_apps(text: str) -> list[int]:
    """Pids from ``nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader``."""
    pids = []
    for line in text.splitlines():
        head = line.split(",", 1)[0].strip()
        if head.isdigit():
            pids.append(int(head))
    return pids


def parse_npu_apps(text: str) -> list[int]:
    """Pids from ``npu-smi info``'s process table: rows ``| <npu> <chip> | <pid> | <name> | <MB> |``
    (the device rows above it have a health word or a bus id in that column, never a bare number)."""
    pids = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"\d+\s+\d+", cells[0]) and cells[1].isdigit():
            pids.append(int(cells[1]))
    return pids


def device_pids(device: Device, run=subprocess.run) -> list[int] | None:
    """Pids holding a device context now (None: the tool could not be read)."""
    try:
        if device.kind == "cuda":
            res = run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                      capture_output=True, text=True, timeout=30)
            return parse_nvidia_apps(res.stdout) if res.returncode == 0 else None
        if device.kind == "npu":
            res = run(["npu-smi", "info"], capture_output=True, text=True, timeout=30)
            return parse_npu_apps(res.stdout) if res.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None
    return None


def context_verdict(tree: dict[int, str], holders: list[int] | None) -> tuple[str, str]:
    """(status, detail): ``tree`` is the server's processes (pid -> name, the API process first),
    ``holders`` the pids the device tool lists. Only worker processes may hold a device context."""
    if holders is None:
        return "skipped", "the device tool's process list could not be read"
    mine = {pid: name for pid, name in tree.items() if pid in holders}
    if not mine:
        return "skipped", (f"the device tool lists {len(holders)} process(es), none of them in this server's tree "
                           "(a container's PID namespace hides them): cannot tell")
    bad = {pid: name for pid, name in mine.items() if WORKER_NAME not in name}
    if bad:
        return "fail", "non-worker process(es) hold a device context: " + ", ".join(f"{n} (pid {p})" for p, n in bad.items())
    return "pass", "only workers hold a device context: " + ", ".join(f"{n} (pid {p})" for p, n in mine.items())


# ---- verdicts ---------------------------------------------------------------------------------------
def step_verdict(stock_ms: float | None, tuned_ms: float | None, on_device: bool,
                 max_ratio: float = MAX_STEP_RATIO) -> tuple[str, str]:
    """Tuned vs stock denoise time per step: fails on a device when tuned is slower than ``max_ratio``
    x stock; information only on a CPU host (a shared 2-core host's noise is larger than the effect)."""
    if stock_ms is None or tuned_ms is None:
        return "fail", f"no per-step timing from the server (stock {stock_ms}, tuned {tuned_ms})"
    ratio = tuned_ms / stock_ms if stock_ms > 0 else float("inf")
    text = f"stock {stock_ms:.2f} ms/step, tuned {tuned_ms:.2f} ms/step (tuned/stock {ratio:.2f})"
    if not on_device:
        return "pass", text + "; information only on a CPU host (where the next server starts beside it, --overlap-starts)"
    if ratio > max_ratio:
        return "fail", text + f" > {max_ratio:.2f}"
    return "pass", text + f" <= {max_ratio:.2f}"


def split_verdict(log_text: str, tiling: bool, size: str) -> tuple[str, str]:
    """Whether the CFG pair's log shows the split VAE decode, and the path the request should take:
    with tiling on and a frame over diffusers' 256-pixel tile, the tiled split (as at real sizes)."""
    w, h = (int(v) for v in size.lower().split("x"))
    want = "tiled" if tiling and max(w, h) > 256 else "layers"
    how = (f"VAE tiling {'on, as the shipped Wan presets' if tiling else 'off'}, {size}: "
           f"{'diffusers tiles it' if want == 'tiled' else 'one tile (the frame loop)'}")
    said = [ln[ln.index(SPLIT_LINES[want]):].strip() for ln in log_text.splitlines() if SPLIT_LINES[want] in ln]
    if said:
        return "pass", f"the CFG pair split the VAE decode ({how}): '{said[-1]}' logged"
    other = [k for k, line in SPLIT_LINES.items() if k != want and line in log_text]
    return "fail", (f"no '{SPLIT_LINES[want]}' in the tuned CFG-2 log ({how}): "
                    + (f"only the {other[0]} split ran" if other else "both CFG ranks decoded the whole video"))


def probe_verdict(report: dict[str, Any] | None, error: str = "") -> tuple[str, str]:
    """(status, detail) of :mod:`omni_ext.device_probe`'s JSON (None: it printed none; ``error``: why)."""
    if not report or not report.get("runs"):
        return "fail", f"the probe gave no report: {error[-300:]}"
    parts, ok = [], True
    for r in report["runs"]:
        if "error" in r:
            ok = False
            parts.append(f"{r.get('dtype')}: {r['error']}")
            continue
        good = bool(r["identical"]) and all(r["others_identical"].values())
        ok = ok and good
        parts.append(f"{r['dtype']}: {'byte-identical' if good else 'DIFFERS'} after pauses at steps "
                     f"{r['paused_at_steps']} (step {r['step_ms']:.2f} ms, save+restore {r['save_restore_ms']:.2f} ms)")
    where = report.get("device_name") or report.get("kind")
    return ("pass" if ok else "fail"), f"on {where}, torch {report.get('torch')}: " + "; ".join(parts)


def run_probe(device: Device, size: str, timeout: float = 240.0) -> tuple[str, str, dict[str, Any] | None]:
    """:mod:`omni_ext.device_probe` in a process of its own (this one must hold no device context)."""
    cmd = [sys.executable, "-m", "omni_ext.device_probe", "--kind", device.kind, "--size", size]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "fail", f"the probe ran past {timeout:.0f} s", None
    report = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                report = json.loads(line)
            except json.JSONDecodeError:
                pass
            break
    status, detail = probe_verdict(report, proc.stderr)
    return status, detail, report


def skip_reason(name: str, device: Device) -> str | None:
    """Why ``name`` cannot run on this host, or None."""
    if name in DEVICE_ONLY and device.kind == "cpu":
        return "skipped: no device (a CPU host has no device context to hold; needs an NVIDIA GPU or an Ascend NPU)"
    if name in TWO_DEVICES and device.kind != "cpu" and device.count < 2:
        return f"skipped: {device.count} visible {device.kind} device(s); CFG 2 and data parallel 2 need two"
    return None


def exit_code(checks: list[dict[str, Any]]) -> int:
    return 1 if any(c["status"] == "fail" for c in checks) else 0


def table(report: dict[str, Any]) -> str:
    d = report["device"]
    head = (f"device: {d['kind']} x{d['count']}" + (f" ({', '.join(d['names'])})" if d["names"] else "")
            if d["kind"] != "cpu" else f"device: none (CPU host, {os.cpu_count()} cores)")
    rows = [[c["name"], c["status"], c["detail"] if len(c["detail"]) <= 110 else c["detail"][:107] + "..."]
            for c in report["checks"]]
    return head + "\n" + format_table(["check", "status", "detail"], rows) + f"\ntotal {report['elapsed_s']:.0f} s"


# ---- the run ----------------------------------------------------------------------------------------
def _stage(stages: dict[str, Any], suffix: str) -> float | None:
    vals = [v for k, v in stages.items() if k.endswith(suffix) and isinstance(v, (int, float))]
    return float(vals[0]) if vals else None


def _video(url: str, fields: dict[str, Any]) -> dict[str, Any]:
    """One ``POST /v1/videos/sync``: the MP4 bytes and the server's stage timings."""
    import requests

    form = {k: (None, str(v)) for k, v in fields.items()}
    r = requests.post(url + "/v1/videos/sync", files=form, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"POST /v1/videos/sync answered {r.status_code}: {r.text[:300]}")
    try:
        stages = json.loads(r.headers.get("X-Stage-Durations") or "{}")
    except ValueError:
        stages = {}
    return {"mp4": r.content, "stages": stages, "diffuse_s": _stage(stages, ".diffuse")}


def _starts(log_text: str) -> list[tuple[tuple[int, ...], str]]:
    return [(tuple(int(x) for x in m.group(2).split(",")), m.group(3)) for m in _START.finditer(log_text)]


class Run:
    def __init__(self, args: argparse.Namespace, device: Device) -> None:
        self.args, self.device = args, device
        self.workdir = Path(args.workdir or tempfile.mkdtemp(prefix="omni-ext-device-check-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, tuple[str, str]] = {}
        self.servers: dict[str, dict[str, Any]] = {}
        self.model: Path | None = None
        #: servers started ahead of their turn (``serve(..., then=...)``), by name
        self._early: dict[str, Any] = {}
        self.overlap = {"on": True, "off": False}.get(args.overlap_starts, device.kind == "cpu")
        w, h = args.size.split("x")
        self.fields = {"prompt": "a red fox running through fresh snow", "negative_prompt": "blurry, low quality",
                       "size": f"{w}x{h}", "num_frames": args.frames, "num_inference_steps": args.steps,
                       "guidance_scale": 4.0, "fps": 8}

    def set(self, name: str, status: str, detail: str) -> None:
        self.results[name] = (status, detail)
        log(f"{name}: {status}: {detail}")

    def request(self, seed: int) -> dict[str, Any]:
        return {**self.fields, "seed": seed}

    def _process(self, name: str, serve_args: list[str]):
        from omni_ext.server_process import ServeProcess

        env = dict(BASE_ENV) if self.device.kind == "cpu" else {k: v for k, v in BASE_ENV.items() if k != "OMP_NUM_THREADS"}
        env.update({"VLLM_OMNI_SERVER_STORAGE__PATH": str(self.workdir / f"storage-{name}"),
                    "OMNI_EXT_API_DATA_DIR": str(self.workdir / f"api-{name}")})
        tiling = ["--vae-use-tiling"] if self.args.vae_tiling == "on" else []
        args = [*BASE_ARGS, "--enable-diffusion-pipeline-profiler", *tiling, *serve_args]
        proc = ServeProcess(model=str(self.model), args=args, env=env, log_path=self.workdir / f"{name}.log")
        self.servers[name] = {"command": " ".join(proc.command()), "log": str(proc.log_path), "t0": time.monotonic()}
        return proc.start()

    def serve(self, name: str, serve_args: list[str], body, then: tuple[str, list[str]] | None = None) -> None:
        """Start server ``name`` (or take it, started early), run ``body(proc)`` against it, stop it; a
        server that does not start fails the checks ``body`` would have answered (the caller names them).

        With ``--overlap-starts`` (a CPU host's default) the next server ``then`` starts now, beside
        this one: a start is mostly imports, one process at a time, so two starts share two cores
        instead of leaving one idle (the CPU run takes ~70 s instead of ~130 s). On a device the
        servers run one at a time: the per-step times are judged there and need the device alone."""
        proc = self._early.pop(name, None) or self._process(name, serve_args)
        if then is not None and self.overlap and then[0] not in self._early:
            self._early[then[0]] = self._process(*then)
        try:
            proc.wait_ready(self.args.start_timeout)
            self.servers[name]["ready_after_s"] = round(proc.ready_after_s or 0.0, 1)
            log(f"{name}: ready after {proc.ready_after_s:.0f} s")
            body(proc)
        finally:
            proc.stop()
            self.servers[name]["up_s"] = round(time.monotonic() - self.servers[name].pop("t0"), 1)

    def stop_early(self) -> None:
        """Stop servers started early whose turn never came (an earlier step failed)."""
        for name, proc in self._early.items():
            proc.stop()
            self.servers[name].pop("t0", None)
        self._early.clear()

    def timed(self, url: str, seed: int) -> tuple[bytes, float | None, list[float]]:
        """A warm-up, then ``--reps`` requests of ``seed``: (mp4 of the first, median s/step, per-step samples)."""
        _video(url, self.request(seed + 1000))  # first-call costs, not timed
        outs = [_video(url, self.request(seed)) for _ in range(self.args.reps)]
        samples = [o["diffuse_s"] * 1000.0 / self.args.steps for o in outs if o["diffuse_s"] is not None]
        if len({o["mp4"] for o in outs}) != 1:
            raise RuntimeError(f"{url}: the same request gave different bytes on repeat")
        return outs[0]["mp4"], (statistics.median(samples) if samples else None), samples

    def context(self, name: str, proc) -> dict[str, Any]:
        """The device-context verdict for server ``name`` while it is up (after its requests)."""
        tree: dict[int, str] = {}
        for p in proc.processes():
            try:
                tree[p.pid] = p.name()
            except Exception:
                continue
        status, detail = context_verdict(tree, device_pids(self.device))
        return {"server": name, "status": status, "detail": detail}

    def main(self) -> None:
        a, two = self.args, self.device.kind == "cpu" or self.device.count >= 2
        on_device = self.device.kind != "cpu"
        A, B = 1234, 4321
        ref: dict[int, bytes] = {}
        steps: dict[str, float | None] = {}
        contexts: list[dict[str, Any]] = []
        # tiny model
        from omni_ext.models.tiny import build_tiny_model

        t0 = time.monotonic()
        out = Path(a.models_dir or self.workdir / "models") / f"wan2.1-t2v-{a.model_size}-float32"
        try:
            if not (out / "model_index.json").exists():
                build_tiny_model("wan2.1-t2v", out, size=a.model_size, dtype="float32")
            self.model = out
            self.set("tiny-model", "pass", f"tiny Wan2.1-T2V '{a.model_size}' float32 at {out} ({time.monotonic() - t0:.0f} s)")
        except Exception as exc:
            self.set("tiny-model", "fail", f"{type(exc).__name__}: {exc}")
            return

        dp2 = additional_config(data_parallel_size=2)
        layouts = {"stock": ["--distributed-executor-backend", "mp"], "stock-cfg2": ["--cfg-parallel-size", "2"],
                   "tuned-dp2": ["--distributed-executor-backend", TUNED, *dp2],
                   "tuned": ["--distributed-executor-backend", TUNED],
                   "tuned-cfg2": ["--cfg-parallel-size", "2", "--distributed-executor-backend", TUNED]}
        order = ["stock", "stock-cfg2", "tuned-dp2", "tuned-cfg2"] if two else ["stock", "tuned"]

        def serve(name: str, body) -> None:
            later = order[order.index(name) + 1:]
            self.serve(name, layouts[name], body, then=(later[0], layouts[later[0]]) if later else None)

        # vLLM-Omni's executor, one rank: the reference bytes and per-step time
        def stock(proc) -> None:
            ref[A], steps["stock"], _ = self.timed(proc.url, A)
            ref[B] = _video(proc.url, self.request(B))["mp4"]
            if on_device:
                contexts.append(self.context("stock", proc))

        self._guard(["identical.tuned-1rank", "identical.tuned-cfg2", "identical.tuned-dp2", "step-time.1rank",
                     "step-time.cfg2"], lambda: serve("stock", stock))
        if not ref:
            return

        # vLLM-Omni's CFG parallel 2 (per-step reference for the tuned pair)
        if two:
            def stock_cfg2(proc) -> None:
                mp4, steps["stock-cfg2"], _ = self.timed(proc.url, A)
                steps["stock-cfg2-identical"] = float(mp4 == ref[A])

            self._guard(["step-time.cfg2"], lambda: serve("stock-cfg2", stock_cfg2))

        # TunedExecutor: one rank (one device) or data parallel 2 (two or more)
        def tuned_1rank(proc, dp: bool) -> None:
            before = len(_starts(proc.log_text()))
            mp4, steps["tuned"], _ = self.timed(proc.url, A)
            ran = _starts(proc.log_text())[before:]
            single = all(len(r) == 1 for r, _ in ran) and bool(ran)
            ok = mp4 == ref[A] and single
            where = "a data-parallel group of one rank" if dp else "the one rank"
            self.set("identical.tuned-1rank", "pass" if ok else "fail",
                     f"{len(mp4)} B mp4 on {where} {'==' if mp4 == ref[A] else '!='} vLLM-Omni's one rank"
                     + ("" if single else f"; ran on {ran}"))
            if dp:
                before = len(_starts(proc.log_text()))
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    got = dict(zip((A, B), pool.map(lambda s: _video(proc.url, self.request(s))["mp4"], (A, B))))
                ran = _starts(proc.log_text())[before:]
                ranks = sorted(r for r, _ in ran)
                same = all(got[s] == ref[s] for s in (A, B))
                apart = ranks == [(0,), (1,)]
                self.set("identical.tuned-dp2", "pass" if same and apart else "fail",
                         f"2 concurrent requests (seeds {A}, {B}) on ranks {ranks}: "
                         f"{'both ==' if same else 'NOT both =='} vLLM-Omni's one rank"
                         + ("" if apart else "; expected one on each group"))
            if on_device:
                contexts.append(self.context("tuned-dp2" if dp else "tuned", proc))

        if two:
            self._guard(["identical.tuned-1rank", "identical.tuned-dp2", "step-time.1rank"],
                        lambda: serve("tuned-dp2", lambda p: tuned_1rank(p, True)))
        else:
            self._guard(["identical.tuned-1rank", "step-time.1rank"],
                        lambda: serve("tuned", lambda p: tuned_1rank(p, False)))
        self.set("step-time.1rank", *step_verdict(steps.get("stock"), steps.get("tuned"), on_device, a.max_step_ratio))

        # TunedExecutor CFG 2: byte identity, pair mode, the split VAE decode, per-step time
        if two:
            def tuned_cfg2(proc) -> None:
                before = len(_starts(proc.log_text()))
                mp4, steps["tuned-cfg2"], _ = self.timed(proc.url, A)
                ran = _starts(proc.log_text())[before:]
                pair = bool(ran) and all(r == ((0, 1), "pair") for r in ran)
                self.set("identical.tuned-cfg2", "pass" if mp4 == ref[A] and pair else "fail",
                         f"{len(mp4)} B mp4 of the CFG pair {'==' if mp4 == ref[A] else '!='} vLLM-Omni's one rank"
                         + ("; ran as a pair on ranks 0,1" if pair else f"; ran as {ran}"))
                self.set("split-vae-decode", *split_verdict(proc.log_text(), a.vae_tiling == "on", self.fields["size"]))
                if on_device:
                    contexts.append(self.context("tuned-cfg2", proc))

            self._guard(["identical.tuned-cfg2", "split-vae-decode", "step-time.cfg2"],
                        lambda: serve("tuned-cfg2", tuned_cfg2))
            status, detail = step_verdict(steps.get("stock-cfg2"), steps.get("tuned-cfg2"), on_device, a.max_step_ratio)
            if "stock-cfg2-identical" in steps:
                detail += ("; vLLM-Omni's CFG 2 video == its one rank" if steps["stock-cfg2-identical"]
                           else "; vLLM-Omni's own CFG 2 video != its one rank (upstream, information)")
            self.set("step-time.cfg2", status, detail)

        if on_device:
            tuned = [c for c in contexts if c["server"] != "stock"]
            stock_note = "; ".join(f"{c['server']} (vLLM-Omni, information): {c['status']}: {c['detail']}"
                                   for c in contexts if c["server"] == "stock")
            worst = "fail" if any(c["status"] == "fail" for c in tuned) else \
                "pass" if tuned and all(c["status"] == "pass" for c in tuned) else "skipped"
            self.set("device-context.api-engine", worst,
                     "; ".join(f"{c['server']}: {c['status']}: {c['detail']}" for c in tuned) + (f"; {stock_note}" if stock_note else ""))

    def _guard(self, names: list[str], fn) -> None:
        """Run ``fn``; if it raises, each of ``names`` not answered yet fails with the error."""
        try:
            fn()
        except Exception as exc:
            text = f"{type(exc).__name__}: {str(exc)[:1500]}"
            log(f"error: {text}")
            for n in names:
                if n not in self.results:
                    self.set(n, "fail", text)


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    device = detect_device()
    log(f"device: {device.kind} x{device.count} {device.names}" if device.kind != "cpu" else "device: none (CPU host)")
    r = Run(args, device)
    r.set("platform-stack", *platform_stack(device))
    if r.results["platform-stack"][0] == "pass":
        try:
            r.main()
        finally:
            r.stop_early()
    status, detail, probe = run_probe(device, args.model_size)
    r.set("preempt-resume.device", status, detail)
    elapsed = time.monotonic() - t0
    r.set("time-budget", "pass" if elapsed <= args.budget_s else "fail",
          f"the run took {elapsed:.0f} s (budget {args.budget_s:.0f} s)")
    checks = []
    for name in CHECKS:
        reason = skip_reason(name, device)
        if reason is not None and name not in r.results:
            checks.append({"name": name, "status": "skipped", "detail": reason})
        elif name in r.results:
            status, detail = r.results[name]
            checks.append({"name": name, "status": status, "detail": detail})
        else:
            checks.append({"name": name, "status": "fail", "detail": "not reached (an earlier step failed; see above)"})
    return {"device": device.as_dict(), "checks": checks, "elapsed_s": round(elapsed, 1),
            "request": {k: r.fields[k] for k in ("size", "num_frames", "num_inference_steps", "guidance_scale")},
            "model_size": args.model_size, "vae_tiling": args.vae_tiling, "reps": args.reps,
            "host": host_info(), "servers": r.servers, "probe": probe, "workdir": str(r.workdir)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="write the report here (default: <workdir>/device_check.json)")
    p.add_argument("--workdir", default=None, help="server logs, storage and the model (default: a new temp dir)")
    p.add_argument("--models-dir", default=None, help="where the tiny model is built/cached (default: in the workdir)")
    p.add_argument("--model-size", choices=["tiny", "small", "med"], default="tiny", help="tiny Wan2.1 preset")
    p.add_argument("--size", default="288x32",
                   help="WxH of the videos: wider than diffusers' 256-pixel VAE tile, so tiling splits it as at real sizes")
    p.add_argument("--frames", type=int, default=9)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--reps", type=int, default=3, help="timed requests per server (median per-step time)")
    p.add_argument("--vae-tiling", choices=["on", "off"], default="on",
                   help="serve with --vae-use-tiling (on: as the shipped Wan presets on 910B/CUDA)")
    p.add_argument("--max-step-ratio", type=float, default=MAX_STEP_RATIO,
                   help="on a device, tuned/stock per-step time above this fails")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run must fit this")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--overlap-starts", choices=["auto", "on", "off"], default="auto",
                   help="start the next server while one serves (auto: on a CPU host only; see Run.serve)")


def main(args: argparse.Namespace) -> int:
    report = run(args)
    path = Path(args.json) if args.json else Path(report["workdir"]) / "device_check.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    print(table(report), flush=True)
    log(f"wrote {path}")
    return exit_code(report["checks"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="device_check", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
