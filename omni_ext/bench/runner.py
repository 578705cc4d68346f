"""``omni-ext bench cfg-parallel|data-parallel``: real servers, measured side by side, JSON out.

Every measurement starts real ``vllm-omni serve --omni`` processes on a tiny random-weight Wan2.1
model (``omni_ext.models.tiny``, float32, one thread per worker) and times real HTTP requests
(``POST /v1/videos/sync``) from the client. At most two servers run at a time; configurations that
are compared run side by side (requests alternate between them) so that the noise of a shared
machine hits both. Each figure is a median over ``--reps`` repetitions; the JSON keeps every run.

cfg-parallel: one device (1 worker, vLLM-Omni's mp executor) vs vLLM-Omni's ``--cfg-parallel-size 2``
(phase 1) and vs omni-ext's TunedExecutor cfg 2 (phase 2). One request at a time. The one-device
server runs vLLM-Omni's pipeline profiler, whose stage durations give the VAE decode + text
encoding share of one-device time (written to the JSON).

cfg-parallel --sp N (or --model M, then N may be 1): one request at a time on CFG 2 x Ulysses N (2N worker processes, one thread
each, ``OMNI_EXT_CPU_VISIBLE_DEVICES`` 0..2N-1), vLLM-Omni's executor vs omni-ext's TunedExecutor with
the same layout, side by side, both with vLLM-Omni's pipeline profiler (its ``diffuse`` stage is the
denoising loop inside the server), and the bare 2N-process ceiling (:class:`ceiling.SpCeiling`), one
bare loop after each alternation of the two servers (then the one-process loops of its speedup).
No one-device server: neither goal needs one (tuned vs stock is one layout; tuned vs the ceiling
compares loops), a third server would add ~40 % to the run, and the ceiling's bare one-process loop
still gives the SP speedup over one device. ``--model`` picks the tiny model (``omni_ext.models.tiny``:
the image-to-video ones get a fixed reference image with every request); the bare loop then runs that
model's pipeline class and latent shape (I2V's 36 input channels, TI2V-5B's 48 and 16x VAE).

cfg-parallel --single-jobs: the per-job overhead grid (issue 38), in :mod:`omni_ext.bench.single`: single
requests on one stock/tuned pair per model (the ``--model`` layout with sp 1), Wan2.1 videos and
Qwen-Image images at 1-8 steps, tuned_vs_stock and the overhead in ms per row.

data-parallel: 8 concurrent requests (a closed burst) against
- omni-ext 2 groups (``data_parallel_size`` 2, cfg 1) vs 1 group (phase 1) -> ``throughput_ratio_tuned``;
- vLLM-Omni's in-executor DP (``--num-gpus 2`` + stage override ``data_parallel_size`` 2) vs its
  1-worker mp executor (phase 2) -> ``throughput_ratio_stock``;
- CFG-free requests (guidance 1.0) on a cfg-2 group: omni-ext vs vLLM-Omni (phase 3) -> ``cfg_off``.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from omni_ext.bench.client import sync_burst, sync_request
from omni_ext.bench.common import (
    TUNED, Progress, Servers, figure, figures_table, finish_host, log, median, quiet_host, ratio, setup, size_hw,
    video_fields, write_result,
)


# ------------------------------------------------------------------------------------------------
def run_cfg_parallel(args) -> dict[str, Any]:
    model, workdir, base_args, env = setup(args)
    fields = video_fields(args)
    host = quiet_host(args)
    one_args = ["--distributed-executor-backend", "mp", "--enable-diffusion-pipeline-profiler"]
    servers = Servers(model, workdir, base_args, env)
    runs: dict[str, list[dict[str, Any]]] = {"one_device_phase1": [], "stock_cfg2": [], "one_device_phase2": [], "tuned_cfg2": []}
    out: dict[str, Any] = {
        "benchmark": "cfg-parallel",
        "model": f"tiny {_model(args)} '{args.model_size}' (random weights, float32)",
        "request": {k: fields[k] for k in ("size", "num_frames", "num_inference_steps", "guidance_scale")},
        "threads_per_worker": 1,
        "reps": args.reps,
        "host": host,
        "workdir": str(workdir),
    }
    try:
        for phase, other, other_args in (
            (1, "stock_cfg2", ["--cfg-parallel-size", "2"]),
            (2, "tuned_cfg2", ["--cfg-parallel-size", "2", "--distributed-executor-backend", TUNED]),
        ):
            specs = {other: other_args}
            if "one" not in servers.procs:
                specs = {"one": one_args, **specs}
            servers.start(specs, args.start_timeout)
            for name in ("one", other):  # warm-up (first-call costs), not recorded
                sync_request(servers.url(name), video_fields(args, seed=1))
            for i in range(args.reps):
                order = ("one", other) if i % 2 == 0 else (other, "one")
                for name in order:
                    r = sync_request(servers.url(name), fields)
                    key = f"one_device_phase{phase}" if name == "one" else other
                    runs[key].append(r)
                    print(f"[bench] phase {phase} rep {i}: {key} {r['latency_s']:.2f} s", flush=True)
            servers.stop(other)
    finally:
        servers.stop()
    if not getattr(args, "skip_ceiling", False):
        from omni_ext.bench.ceiling import measure

        w, h = (int(v) for v in args.size.split("x"))
        out["host_ceiling"] = measure(model, h, w, args.frames, args.steps)
        print(f"[bench] host ceiling (transformer loop only, no server): {out['host_ceiling']['speedup']:.3f}x", flush=True)
    lat = {k: [r["latency_s"] for r in v] for k, v in runs.items()}
    med = {k: median(v) for k, v in lat.items()}
    shares, step_ms = [], []
    for r in runs["one_device_phase1"] + runs["one_device_phase2"]:
        diffuse = next((v for k, v in r["stages"].items() if k.endswith("Pipeline.diffuse")), None)
        if diffuse:
            step_ms.append(1000.0 * diffuse / args.steps)
        st = r["stages"]
        vae = sum(v for k, v in st.items() if k.endswith("vae.decode"))
        te = sum(v for k, v in st.items() if k.endswith("text_encoder.forward"))
        if vae or te:
            shares.append((vae + te) / r["latency_s"])
    out.update(
        {
            "runs": runs,
            "median_latency_s": med,
            "vae_decode_plus_text_encode_share_of_one_device": median(shares) if shares else None,
            "cfg_step_ms_one_device": median(step_ms) if step_ms else None,
            "cfg_parallel": {
                "e2e_speedup_tuned": med["one_device_phase2"] / med["tuned_cfg2"],
                "e2e_speedup_stock": med["one_device_phase1"] / med["stock_cfg2"],
                "goal_e2e_speedup_tuned": 1.8,
                "per_rep_speedup_tuned": [o / t for o, t in zip(lat["one_device_phase2"], lat["tuned_cfg2"])],
                "per_rep_speedup_stock": [o / t for o, t in zip(lat["one_device_phase1"], lat["stock_cfg2"])],
            },
        }
    )
    return out


# ------------------------------------------------------------------------------------------------
#: Goals of ``cfg-parallel --sp N`` (issue 18): tuned at least as fast as vLLM-Omni's executor on the
#: same layout, and its denoising loop within 5 % of the bare loop of the same layout.
SP_GOALS = {"tuned_vs_stock": (">=", 1.0), "tuned_vs_ceiling": (">=", 0.95)}


def _model(args) -> str:
    return getattr(args, "model", None) or "wan2.1-t2v"


def sp_layout(sp: int) -> tuple[list[str], dict[str, str]]:
    """Serve flags and environment of the CFG 2 x Ulysses ``sp`` servers (one CPU "device" per rank)."""
    from omni_ext.bench.ceiling import sp_env

    return ["--cfg-parallel-size", "2", "--ulysses-degree", str(sp), "--enable-diffusion-pipeline-profiler"], sp_env(2 * sp)


def sp_server_specs(sp: int) -> dict[str, list[str]]:
    flags, _ = sp_layout(sp)
    return {"stock_sp": flags, "tuned_sp": [*flags, "--distributed-executor-backend", TUNED]}


def diffuse_s(stages: dict[str, Any]) -> float | None:
    """The denoising loop's seconds in vLLM-Omni's stage durations (``<Pipeline>.diffuse``), or None."""
    vals = [v for k, v in stages.items() if k.endswith(".diffuse") and isinstance(v, (int, float))]
    return float(max(vals)) if vals else None


def sp_summary(runs: dict[str, list[dict[str, Any]]], ceiling: dict[str, Any] | None, measurement: bool,
               steps: int | None = None) -> dict[str, Any]:
    """Medians, ratios and goals of ``cfg-parallel --sp`` from its runs and ceiling (pure).

    tuned_vs_stock: stock's median latency / tuned's (end to end, from the client).
    tuned_vs_ceiling: the bare loop's median seconds / tuned's median ``diffuse`` stage: the same
    steps of the same layout, so 1.0 is the bare loop's speed (the one-device loop / tuned's loop is
    then tuned's SP speedup, ``ceiling.speedup`` the best the host gives).
    per_step_overhead_ms (with ``steps``): what tuned's loop spends per denoise step over the bare loop
    and over stock's loop (median ``diffuse`` differences / steps)."""
    lat = {k: median([r["latency_s"] for r in v]) for k, v in runs.items()}
    loop = {}
    for k, v in runs.items():
        vals = [d for d in (diffuse_s(r.get("stages") or {}) for r in v) if d is not None]
        loop[k] = median(vals) if vals else None
    bare = (ceiling or {}).get("parallel_median_s")
    one = (ceiling or {}).get("one_process_median_s")
    figures = {
        "tuned_vs_stock": figure(ratio(lat.get("stock_sp"), lat.get("tuned_sp")), *SP_GOALS["tuned_vs_stock"], measurement,
                                 note="stock median latency / tuned median latency (end to end)"),
        "tuned_vs_ceiling": figure(ratio(bare, loop.get("tuned_sp")), *SP_GOALS["tuned_vs_ceiling"], measurement,
                                   note="bare CFG x SP loop median s / tuned median diffuse stage s"),
    }
    return {
        "median_latency_s": lat,
        "median_diffuse_s": loop,
        "figures": figures,
        "stock_vs_ceiling": ratio(bare, loop.get("stock_sp")),
        "sp_speedup_over_one_process_loop": {"tuned": ratio(one, loop.get("tuned_sp")), "stock": ratio(one, loop.get("stock_sp")),
                                             "ceiling": (ceiling or {}).get("speedup")},
        "per_rep_tuned_vs_stock": [ratio(s["latency_s"], t["latency_s"]) for s, t in zip(runs.get("stock_sp", []), runs.get("tuned_sp", []))],
        "per_step_overhead_ms": {"over_ceiling": per_step_ms(loop.get("tuned_sp"), bare, steps),
                                 "over_stock": per_step_ms(loop.get("tuned_sp"), loop.get("stock_sp"), steps)},
    }


def per_step_ms(a_s: float | None, b_s: float | None, steps: int | None) -> float | None:
    """Milliseconds per step that loop ``a_s`` takes over loop ``b_s`` (None when a figure is missing)."""
    if a_s is None or b_s is None or not steps:
        return None
    return 1000.0 * (a_s - b_s) / steps


#: Model sizes whose servers run one at a time (each worker holds Wan2.1-T2V-1.3B's transformer in
#: float32: two servers of two workers each do not fit a 24 GiB host), so stock's and tuned's requests
#: are measured in two blocks instead of alternated.
SEQUENTIAL_SIZES = ("1.3b",)


class MemoryPeak:
    """Samples a server's process tree while it serves: the peak of its proportional set size (shared
    pages counted once across processes) and of the host's used memory (MemTotal - MemAvailable).

    A sample reads each process's ``/proc/PID/smaps``, which walks its page tables: on a worker holding
    Wan2.1-1.3B's 5.3 GiB transformer that took 35-65 % of a core at one sample every 0.5 s, on a host
    whose two cores both workers use (top, 2026-12-07). So it samples only while untimed requests run
    (``with``), plus :meth:`sample_now` between timed ones, never beside a timed request."""

    def __init__(self, server: Any, interval_s: float = 0.5) -> None:
        self.server, self.interval_s = server, interval_s
        self.pss_mb = self.host_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="omni-ext-bench-memory")

    def __enter__(self) -> MemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        import psutil

        while True:
            self.sample(psutil)
            if self._stop.wait(self.interval_s):
                return

    def sample_now(self) -> None:
        """One sample, outside any timed request (the server's footprint as the timed requests left it)."""
        import psutil

        self.sample(psutil)

    def sample(self, psutil: Any) -> None:
        pss = 0.0
        for p in self.server.processes():
            try:
                info = p.memory_full_info()
                pss += getattr(info, "pss", info.rss)
            except (psutil.Error, OSError):
                continue
        vm = psutil.virtual_memory()
        self.pss_mb = max(self.pss_mb, pss / 2**20)
        self.host_mb = max(self.host_mb, (vm.total - vm.available) / 2**20)

    def result(self) -> dict[str, float]:
        return {"peak_server_pss_mb": round(self.pss_mb), "peak_host_used_mb": round(self.host_mb)}


def _request(args):
    """(send one request, its fields) of ``--model``: an image edit for the edit models, else a video."""
    if _model(args).startswith("qwen-image-edit"):
        from omni_ext.bench.client import sync_edit_request
        from omni_ext.bench.common import edit_fields

        return sync_edit_request, edit_fields
    return sync_request, video_fields


def run_cfg_parallel_sp(args) -> dict[str, Any]:
    model, workdir, base_args, env = setup(args)
    flags, sp_env_vars = sp_layout(args.sp)
    send, request_fields = _request(args)
    fields = request_fields(args)
    host = quiet_host(args)
    servers = Servers(model, workdir, base_args, {**env, **sp_env_vars})
    runs: dict[str, list[dict[str, Any]]] = {"stock_sp": [], "tuned_sp": []}
    sequential = args.model_size in SEQUENTIAL_SIZES
    memory: dict[str, dict[str, float]] = {}
    ceiling_reps = 0 if args.skip_ceiling else args.ceiling_reps
    bare, ceiling, ceiling_error = None, None, None
    h, w = size_hw(args.size)
    frames = args.frames if _model(args).startswith("wan") else 1  # the bare loop's request shape
    total = 2 * args.reps + (2 * ceiling_reps if sequential else (args.reps + ceiling_reps if ceiling_reps else 0))
    progress = Progress(f"cfg-parallel {_model(args)} --sp {args.sp}", total, min_interval_s=0.0)
    try:
        # --model rows: the stock server is vLLM-Omni as it ships (common.STOCK_ENV); the --sp figures keep
        # omni-ext's generic worker patches on both, as they were measured
        from omni_ext.bench.common import STOCK_ENV

        envs = {"stock_sp": STOCK_ENV} if getattr(args, "model", None) or sequential else None

        def measure(name: str, i: int) -> None:
            time.sleep(args.settle)  # the other server's workers poll busily for a while after a request
            r = send(servers.url(name), fields)
            runs[name].append(r)
            d = diffuse_s(r["stages"])
            progress.advance(note=f"rep {i}: {name} {r['latency_s']:.2f} s" + (f" (diffuse {d:.2f} s)" if d else ""))

        if sequential:  # one server at a time: two full-size transformers per server fill the host
            for name, spec in sp_server_specs(args.sp).items():
                servers.start({name: spec}, args.start_timeout, envs=envs)
                peak = MemoryPeak(servers.procs[name])
                with peak:  # sampled during the untimed warm-up only (see MemoryPeak)
                    send(servers.url(name), request_fields(args, seed=1))  # warm-up, not recorded
                for i in range(args.reps):
                    measure(name, i)
                peak.sample_now()
                memory[name] = peak.result()
                servers.stop(name)
        else:
            servers.start(sp_server_specs(args.sp), args.start_timeout, envs=envs)
            for name in runs:  # warm-up (first-call costs), not recorded
                send(servers.url(name), request_fields(args, seed=1))
            if ceiling_reps:  # the bare loop interleaved with the servers' requests (ceiling.SpCeiling)
                from omni_ext.bench.ceiling import SpCeiling

                bare = SpCeiling(model, h, w, frames, args.steps, args.sp, workdir)

            def bare_loop(name: str, note: str) -> None:
                nonlocal bare, ceiling_error
                if bare is None:
                    return
                try:
                    seconds = bare.run(name)  # its processes start at its first loop
                except Exception as exc:  # recorded: the servers' figures still stand
                    ceiling_error = f"{type(exc).__name__}: {str(exc)[:2000]}"
                    log(f"ceiling failed: {ceiling_error[:300]}")
                    bare.close()
                    bare = None
                    return
                progress.advance(note=f"{note} {seconds:.2f} s")

            for i in range(args.reps):
                for name in (("stock_sp", "tuned_sp") if i % 2 == 0 else ("tuned_sp", "stock_sp")):
                    measure(name, i)
                if bare is not None:
                    time.sleep(args.settle)
                    bare_loop("parallel", f"rep {i}: bare loop")
            servers.stop()
            for i in range(ceiling_reps if bare is not None else 0):  # the one-process loop (the speedup), alone
                bare_loop("one", f"ceiling rep {i}: one process")
            if bare is not None:
                ceiling = bare.result()
    finally:
        servers.stop()
        if bare is not None:
            bare.close()
    if ceiling_reps and sequential:
        from omni_ext.bench.ceiling import measure_sp

        try:
            ceiling = measure_sp(model, h, w, frames, args.steps, args.sp, workdir, reps=ceiling_reps, progress=progress)
        except Exception as exc:  # recorded: the servers' figures still stand
            ceiling_error = f"{type(exc).__name__}: {str(exc)[:2000]}"
            log(f"ceiling failed: {ceiling_error[:300]}")
    progress.close()
    finish_host(host)
    return {
        "benchmark": "cfg-parallel --sp",
        "model": f"tiny {_model(args)} '{args.model_size}' (random weights, float32)",
        "layout": {"cfg": 2, "ulysses": args.sp, "processes_per_server": 2 * args.sp, "threads_per_process": 1},
        "request": {k: fields[k] for k in ("size", "num_frames", "num_inference_steps", "guidance_scale", "true_cfg_scale")
                    if k in fields},
        "reps": args.reps,
        "host": host,
        "measurement": host["measurement"],
        "workdir": str(workdir),
        "servers": servers.commands,
        "runs": runs,
        "host_ceiling": ceiling,
        "ceiling_error": ceiling_error,
        "servers_one_at_a_time": sequential,
        "memory": memory,
        **sp_summary(runs, ceiling, host["measurement"], steps=args.steps),
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f} ms"


def sp_table(result: dict[str, Any]) -> str:
    ceiling = result.get("host_ceiling") or {}
    extra = {"stock": {"tuned_vs_ceiling": result.get("stock_vs_ceiling")},
             "ceiling speedup": {"tuned_vs_ceiling": ceiling.get("speedup")}}
    lines = [figures_table(result["figures"], extra),
             f"median latency s: {result['median_latency_s']}",
             f"median diffuse s: {result['median_diffuse_s']}; bare loop s: {ceiling.get('parallel_median_s')}",
             f"tuned's loop per step over the bare loop / over stock's: "
             f"{_ms(result.get('per_step_overhead_ms', {}).get('over_ceiling'))} / "
             f"{_ms(result.get('per_step_overhead_ms', {}).get('over_stock'))}"]
    for name, mem in (result.get("memory") or {}).items():
        lines.append(f"{name}: peak PSS of the server's processes {mem['peak_server_pss_mb']} MiB, "
                     f"host used {mem['peak_host_used_mb']} MiB")
    if result.get("ceiling_error"):
        lines.append(f"ceiling failed: {result['ceiling_error'][:300]}")
    if not result["measurement"]:
        lines.append(f"NOT A MEASUREMENT: {result['host']['warning']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
def _paired_throughput(servers: Servers, a: str, b: str, fields: dict[str, Any], args) -> tuple[list, list]:
    for name in (a, b):
        sync_request(servers.url(name), {**fields, "seed": 1})  # warm-up
    ra, rb = [], []
    for i in range(args.reps):
        for name in ((a, b) if i % 2 == 0 else (b, a)):
            r = sync_burst(servers.url(name), fields, args.concurrency)
            (ra if name == a else rb).append(r)
            print(f"[bench] rep {i}: {name} {r['throughput_rps']:.3f} req/s ({r['wall_s']:.1f} s)", flush=True)
    return ra, rb


def run_data_parallel(args) -> dict[str, Any]:
    model, workdir, base_args, env = setup(args)
    cfg_on = video_fields(args)
    cfg_off = video_fields(args, guidance_scale=1.0)
    host = quiet_host(args)
    servers = Servers(model, workdir, base_args, env)
    dp2 = json.dumps({"omni_ext": {"data_parallel_size": 2}})
    res: dict[str, Any] = {}
    stock_error = None
    try:
        servers.start({"tuned_1group": ["--distributed-executor-backend", TUNED],
                       "tuned_2groups": ["--distributed-executor-backend", TUNED, "--additional-config", dp2]}, args.start_timeout)
        res["tuned_1group"], res["tuned_2groups"] = _paired_throughput(servers, "tuned_1group", "tuned_2groups", cfg_on, args)
        servers.stop()
        if not args.skip_stock_dp:
            try:
                servers.start({"stock_1worker": ["--distributed-executor-backend", "mp"],
                               "stock_dp2": ["--num-gpus", "2", "--stage-overrides", json.dumps({"0": {"data_parallel_size": 2}})]},
                              args.start_timeout)
                res["stock_1worker"], res["stock_dp2"] = _paired_throughput(servers, "stock_1worker", "stock_dp2", cfg_on, args)
            except Exception as exc:  # recorded, the other phases still run
                stock_error = f"{type(exc).__name__}: {str(exc)[:2000]}"
                print(f"[bench] stock DP phase failed: {stock_error[:300]}", flush=True)
            servers.stop()
        servers.start({"stock_cfg2": ["--cfg-parallel-size", "2"],
                       "tuned_cfg2": ["--cfg-parallel-size", "2", "--distributed-executor-backend", TUNED]}, args.start_timeout)
        res["stock_cfg2_cfg_off"], res["tuned_cfg2_cfg_off"] = _paired_throughput(servers, "stock_cfg2", "tuned_cfg2", cfg_off, args)
    finally:
        servers.stop()
    med = {k: median([r["throughput_rps"] for r in v]) for k, v in res.items()}
    ceiling = None
    if not getattr(args, "skip_ceiling", False):
        from omni_ext.bench.ceiling import measure

        w, h = (int(v) for v in args.size.split("x"))
        ceiling = measure(model, h, w, args.frames, args.steps, independent=True)
        print(f"[bench] host ceiling (2 independent processes, no server): {ceiling['throughput_ratio']:.3f}x", flush=True)

    def ratio(a: str, b: str) -> float | None:
        return med[a] / med[b] if a in med and b in med else None

    return {
        "benchmark": "data-parallel",
        "model": f"tiny Wan2.1-T2V '{args.model_size}' (random weights, float32)",
        "request": {k: cfg_on[k] for k in ("size", "num_frames", "num_inference_steps", "guidance_scale")},
        "concurrency": args.concurrency,
        "threads_per_worker": 1,
        "reps": args.reps,
        "host": host,
        "workdir": str(workdir),
        "runs": res,
        "median_throughput_rps": med,
        "host_ceiling": ceiling,
        "data_parallel": {
            "throughput_ratio_tuned": ratio("tuned_2groups", "tuned_1group"),
            "throughput_ratio_stock": ratio("stock_dp2", "stock_1worker"),
            "stock_error": stock_error,
            "goal_throughput_ratio_tuned": 1.9,
        },
        "cfg_off": {
            "throughput_ratio_tuned": ratio("tuned_cfg2_cfg_off", "stock_cfg2_cfg_off"),
            "request_guidance_scale": 1.0,
            "goal_throughput_ratio_tuned": 1.8,
        },
    }


def main_cfg_parallel(args) -> int:
    if args.sp > 1 or getattr(args, "model", None) or args.model_size in SEQUENTIAL_SIZES:
        result = run_cfg_parallel_sp(args)
        return write_result(args.json, result, sp_table(result))
    result = run_cfg_parallel(args)
    return _write(args, result, [("cfg_parallel.e2e_speedup_tuned", result["cfg_parallel"]["e2e_speedup_tuned"]),
                                 ("cfg_parallel.e2e_speedup_stock", result["cfg_parallel"]["e2e_speedup_stock"]),
                                 ("vae+text share of one device", result["vae_decode_plus_text_encode_share_of_one_device"]),
                                 ("cfg step ms on one device", result["cfg_step_ms_one_device"]),
                                 ("host ceiling (no server)", result.get("host_ceiling", {}).get("speedup"))])


def main_data_parallel(args) -> int:
    result = run_data_parallel(args)
    return _write(args, result, [("data_parallel.throughput_ratio_tuned", result["data_parallel"]["throughput_ratio_tuned"]),
                                 ("data_parallel.throughput_ratio_stock", result["data_parallel"]["throughput_ratio_stock"]),
                                 ("cfg_off.throughput_ratio_tuned", result["cfg_off"]["throughput_ratio_tuned"]),
                                 ("host ceiling (no server)", (result.get("host_ceiling") or {}).get("throughput_ratio"))])


def _write(args, result: dict[str, Any], lines: list[tuple[str, Any]]) -> int:
    text = "\n".join(f"{name}: {value:.3f}" if isinstance(value, float) else f"{name}: {value}" for name, value in lines)
    return write_result(args.json, result, text)
