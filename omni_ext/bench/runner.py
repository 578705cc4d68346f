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

data-parallel: 8 concurrent requests (a closed burst) against
- omni-ext 2 groups (``data_parallel_size`` 2, cfg 1) vs 1 group (phase 1) -> ``throughput_ratio_tuned``;
- vLLM-Omni's in-executor DP (``--num-gpus 2`` + stage override ``data_parallel_size`` 2) vs its
  1-worker mp executor (phase 2) -> ``throughput_ratio_stock``;
- CFG-free requests (guidance 1.0) on a cfg-2 group: omni-ext vs vLLM-Omni (phase 3) -> ``cfg_off``.
"""

from __future__ import annotations

import json
from typing import Any

from omni_ext.bench.client import sync_burst, sync_request
from omni_ext.bench.common import TUNED, Servers, host_info, median, setup, video_fields, write_result


# ------------------------------------------------------------------------------------------------
def run_cfg_parallel(args) -> dict[str, Any]:
    model, workdir, base_args, env = setup(args)
    fields = video_fields(args)
    one_args = ["--distributed-executor-backend", "mp", "--enable-diffusion-pipeline-profiler"]
    servers = Servers(model, workdir, base_args, env)
    runs: dict[str, list[dict[str, Any]]] = {"one_device_phase1": [], "stock_cfg2": [], "one_device_phase2": [], "tuned_cfg2": []}
    out: dict[str, Any] = {
        "benchmark": "cfg-parallel",
        "model": f"tiny Wan2.1-T2V '{args.model_size}' (random weights, float32)",
        "request": {k: fields[k] for k in ("size", "num_frames", "num_inference_steps", "guidance_scale")},
        "threads_per_worker": 1,
        "reps": args.reps,
        "host": host_info(),
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
        if r["stages"].get("Wan22Pipeline.diffuse"):
            step_ms.append(1000.0 * r["stages"]["Wan22Pipeline.diffuse"] / args.steps)
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
        "host": host_info(),
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
