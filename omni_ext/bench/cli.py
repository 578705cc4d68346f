"""``omni-ext bench ...`` sub-commands (wired into ``omni_ext.cli.build_parser``)."""

from __future__ import annotations

import argparse

from omni_ext.bench.common import add_quiet_options, positive_int


def _common(p: argparse.ArgumentParser, steps: int, size: str, frames: int, reps: int,
            sizes: tuple[str, ...] = ("tiny", "small", "med")) -> None:
    p.add_argument("--json", required=True, help="write the measurements and ratios here")
    p.add_argument("--model-size", choices=sizes, default="med",
                   help="tiny Wan2.1 preset" + (" (1.3b: Wan2.1-T2V-1.3B's transformer at full size, one server at a "
                                               "time)" if "1.3b" in sizes else ""))
    p.add_argument("--size", default=size, help="WxH of the generated video")
    p.add_argument("--frames", type=int, default=frames)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--reps", type=int, default=reps, help="repetitions per configuration (median reported)")
    p.add_argument("--models-dir", default=None, help="where the tiny model is built/cached")
    p.add_argument("--workdir", default=None, help="server logs and storage (default: a new temp dir)")
    p.add_argument("--start-timeout", type=float, default=1200.0)
    add_quiet_options(p)


def _scheduler_common(p: argparse.ArgumentParser, frames_type=int) -> None:
    """Options of the scheduler benchmarks. Workload options default to None: ``--quick`` or the
    benchmark's own defaults fill what the command line leaves unset (``common.apply_profile``)."""
    p.add_argument("--json", default=None, help="write the figures, goals, pass/fail and every run here (required unless --dry-run)")
    p.add_argument("--quick", action="store_true", help="a small, fast version (smoke test; figures are not meaningful)")
    p.add_argument("--dry-run", action="store_true", help="print the servers, commands and requests; start nothing")
    p.add_argument("--model-size", choices=["tiny", "small", "med"], default="med", help="tiny Wan2.1 preset")
    p.add_argument("--size", default=None, help="WxH of the generated video")
    p.add_argument("--frames", type=frames_type, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--models-dir", default=None, help="where the tiny model is built/cached")
    p.add_argument("--workdir", default=None, help="server logs and storage (default: a new temp dir)")
    p.add_argument("--start-timeout", type=float, default=1200.0)
    add_quiet_options(p)


def _tiny_models() -> tuple[str, ...]:
    from omni_ext.models.tiny import MODELS

    return MODELS


def _cfg(args) -> int:
    if args.single_jobs:  # its own module (it uses runner's server specs; runner does not import it)
        from omni_ext.bench.single import main

        return main(args)
    from omni_ext.bench.runner import main_cfg_parallel

    return main_cfg_parallel(args)


def _dp(args) -> int:
    from omni_ext.bench.runner import main_data_parallel

    return main_data_parallel(args)


def _module_main(module: str):
    """``omni_ext.bench.<module>.main``, imported when the command runs (not when the CLI is built)."""

    def run(args) -> int:
        import importlib

        return importlib.import_module(f"omni_ext.bench.{module}").main(args)

    return run


def _scheduler_bench(module: str):
    main = _module_main(module)

    def run(args) -> int:
        if not args.dry_run and not args.json:
            raise SystemExit(f"omni-ext bench {args.bench_command}: --json OUT is required (or --dry-run)")
        return main(args)

    return run


def _module_command(bsub, name: str, module: str, help: str, description: str) -> None:
    """A sub-command whose options and ``main`` live in ``omni_ext.bench.<module>`` (``add_arguments``)."""
    import importlib

    p = bsub.add_parser(name, help=help, description=description)
    importlib.import_module(f"omni_ext.bench.{module}").add_arguments(p)
    p.set_defaults(func=_module_main(module))


def add_subcommands(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks on real servers (TunedExecutor vs vLLM-Omni, the request scheduler)")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    c = bsub.add_parser("cfg-parallel", help="one request at a time: one device vs stock cfg 2 vs omni-ext cfg 2 "
                        "(--sp N: stock vs omni-ext on cfg 2 x ulysses N; --single-jobs: the per-job overhead grid)")
    # 80x80x17, 25 steps on the "med" tiny Wan: a CFG step ~180 ms on one thread, VAE decode + text
    # encoding ~6 % of one-device time (Wan2.1-1.3B at 832x480x81, 50 steps: 5-15 %).
    _common(c, steps=25, size="80x80", frames=17, reps=5, sizes=("tiny", "small", "med", "1.3b"))
    c.add_argument("--skip-ceiling", action="store_true", help="skip the no-server transformer-loop ceiling")
    c.add_argument("--model", choices=[m for m in _tiny_models() if m != "qwen-image"], default=None,
                   help="side-by-side rows for this tiny model (an image-to-video or edit one gets a reference "
                        "image with each request; an edit model is sent image edits of --size): vLLM-Omni's "
                        "executor vs the TunedExecutor on CFG 2 (x Ulysses --sp), and "
                        "the bare loop of the same layout (the --sp figures)")
    c.add_argument("--sp", type=positive_int, default=1, metavar="N",
                   help="N > 1: CFG 2 x Ulysses N (2N processes), vLLM-Omni's executor vs the TunedExecutor, "
                        "and the bare 2N-process loop as ceiling")
    c.add_argument("--settle", type=float, default=2.0, metavar="S",
                   help="--sp/--model/--single-jobs: seconds between alternated requests (vLLM-Omni's idle workers poll busily "
                        "for a while after a request, which slowed the other server's next request by ~20 %%)")
    from omni_ext.bench.single import DEFAULT_FRAMES, DEFAULT_SIZE, DEFAULT_STEPS, MODELS, int_list, model_list

    c.add_argument("--single-jobs", action="store_true",
                   help="per-job overhead (issue 38): single requests, one at a time, on ONE pair of servers per model "
                        "(vLLM-Omni's executor and routes vs the TunedExecutor, CFG 2, one thread per process, as "
                        "--model starts them), alternated with --settle between them, --reps alternations per row. "
                        "Rows: the tiny Wan2.1 at --single-frames x --single-steps, the same Wan as FastWan's few-step "
                        "WanDMDPipeline (its 3 distilled steps, CFG-free) at --single-frames, then the tiny Qwen-Image at "
                        "--single-steps, all at --single-size; the pairs run one after the other. Per row: median "
                        "latency stock and tuned, tuned_vs_stock = stock/tuned (goal >= 1.00), overhead ms = tuned - "
                        "stock (goal <= 10); then an overall verdict. Ignores --size/--frames/--steps and the ceiling "
                        "options; not with --model or --sp > 1. Defaults (14 rows, 2 warm-ups + 2 x --reps requests each, "
                        "every one after --settle): ~13-15 min on 2 cores with the three pairs' starts. Each row also "
                        "reports the TunedExecutor's prediction error of its jobs (its log)")
    c.add_argument("--single-frames", type=int_list, default=DEFAULT_FRAMES, metavar="F,F",
                   help=f"--single-jobs: the Wan video rows' frame counts, 4k+1 (default {','.join(map(str, DEFAULT_FRAMES))})")
    c.add_argument("--single-steps", type=int_list, default=DEFAULT_STEPS, metavar="S,S",
                   help=f"--single-jobs: the step counts of every model's rows (default {','.join(map(str, DEFAULT_STEPS))})")
    c.add_argument("--single-size", default=DEFAULT_SIZE, metavar="WxH",
                   help=f"--single-jobs: the size of every row (default {DEFAULT_SIZE})")
    c.add_argument("--single-models", type=model_list, default=MODELS, metavar="M,M",
                   help=f"--single-jobs: which server pairs to run, in this order (default {','.join(MODELS)})")
    c.add_argument("--ceiling-reps", type=positive_int, default=3, help="--sp: timed loops per ceiling layout (median)")
    c.set_defaults(func=_cfg)
    d = bsub.add_parser("data-parallel", help="8 concurrent requests: 2 groups vs 1; CFG-free on a cfg-2 group")
    _common(d, steps=25, size="80x80", frames=17, reps=3)
    d.add_argument("--concurrency", type=int, default=8)
    d.add_argument("--skip-stock-dp", action="store_true", help="skip vLLM-Omni's in-executor DP measurement")
    d.add_argument("--skip-ceiling", action="store_true", help="skip the no-server two-process ceiling")
    d.set_defaults(func=_dp)

    a = bsub.add_parser(
        "adaptive", help="cfg-2 group: cfg_mode pair vs single vs adaptive, one request at a time and 8 concurrent",
        description="Three TunedExecutor --cfg-parallel-size 2 servers (cfg_mode pair, single, adaptive), one after "
                    "another. Defaults: 80x80, 17 frames, 25 steps, 5 sequential requests, 3 bursts of 8 "
                    "(~10 min on 2 cores with the ceilings). --quick: 64x64, 9 frames, 6 steps, 2 + 1 burst of 4, no ceiling.")
    _scheduler_common(a)
    a.add_argument("--low-load-requests", type=int, default=None, help="sequential requests per server (p50 latency)")
    a.add_argument("--concurrency", type=int, default=None, help="requests per high-load burst")
    a.add_argument("--reps", type=int, default=None, help="high-load bursts per server (median throughput)")
    a.add_argument("--together", action="store_true", help="run the three servers at once, alternating requests")
    a.add_argument("--skip-ceiling", action="store_true", default=None, help="skip the bare host ceilings")
    a.set_defaults(func=_scheduler_bench("adaptive"))

    m = bsub.add_parser(
        "mixed", help="two groups: a burst of mixed lengths, the default order (slo) vs fifo, makespan / lower bound",
        description="Two TunedExecutor servers with data_parallel_size 2 (the default order slo, order fifo), side by side. "
                    "Defaults: 64x64, 20 steps, frames 81,17,81,17,81,17, 2 single timings per length, 3 bursts "
                    "per order, each round of bursts followed by the bare yardstick (whole jobs without a server, "
                    "alone and two at once) (~6 min on 2 cores; --order-variants ~+4 min). "
                    "--quick: frames 33,9,33,9, 4 steps, 1 burst, no yardstick.")
    _scheduler_common(m, frames_type=str)
    m.add_argument("--single-reps", type=int, default=None, help="single-job timings per length (median)")
    m.add_argument("--reps", type=int, default=None, help="bursts per arrival order and server (median makespan)")
    m.add_argument("--order-variants", action="store_true", default=None,
                   help="also send the burst longest last (ascending) and short/long alternating")
    m.add_argument("--skip-ceiling", action="store_true", default=None,
                   help="skip the bare yardstick (whole jobs without a server, alone and two at once); goal then 1.10")
    where = m.add_mutually_exclusive_group()
    where.add_argument("--replicas", type=int, default=None, metavar="2",
                       help="across vLLM-Omni replicas in one server (num_replicas: 2): omni-ext dispatch vs round robin")
    where.add_argument("--multi-host", action="store_true", default=False,
                       help="across a multi-machine head and a headless replica on loopback: omni-ext dispatch vs "
                            "--omni-lb-policy least-queue-length")
    m.set_defaults(func=_scheduler_bench("mixed"))

    ad = bsub.add_parser(
        "admission", help="a burst 3x what max_wait_s admits (429 + Retry-After, retries); then an interactive priority -1 request",
        description="One TunedExecutor server with data_parallel_size 2 and scheduler max_wait_s. Defaults: 64x64, 17 "
                    "frames, 20 steps, max_wait_s 12 (~3-4 min on 2 cores). --quick: 9 frames, 6 steps, max_wait_s 3.")
    _scheduler_common(ad)
    ad.add_argument("--max-wait-s", type=float, default=None, help="the server's omni_ext.scheduler.max_wait_s")
    ad.add_argument("--burst-factor", type=float, default=None, help="burst = this x the jobs admission should take")
    ad.add_argument("--max-burst", type=int, default=None, help="at most this many clients in the burst")
    ad.add_argument("--calib-rounds", type=int, default=None, help="rounds of 2 concurrent jobs that measure job time")
    ad.add_argument("--max-retries", type=int, default=None, help="retries per refused client")
    ad.add_argument("--interactive-delay", type=float, default=None,
                    help="send the interactive request this fraction of a job time after the server is full")
    ad.add_argument("--max-fill", type=int, default=None, help="at most this many batch jobs to fill the server")
    ad.add_argument("--skip-priority", action="store_true", default=None, help="skip the priority measurement")
    ad.set_defaults(func=_scheduler_bench("admission"))

    _module_command(
        bsub, "serving", "serving",
        help="closed-loop clients against servers or presets, back to back: p50/p90/p99, req/s, errors",
        description="Drives each configuration through the OpenAI routes as clients would (--concurrency clients, "
                    "--requests each or --duration), one configuration after another on the same workload. "
                    "Configurations: --url (a running server), --preset, --config 'label=serve args', "
                    "--suite topologies. Defaults (video): 64x64, 17 frames, 20 steps, 4 clients, 16 requests, "
                    "\"med\" tiny model. --quick: 32x32, 5 frames, 2 steps, 2 clients, 4 requests, tiny model.")
    _module_command(
        bsub, "stream", "stream",
        help="a Poisson stream of short and long videos at several loads: SLO attainment, order slo vs fifo vs stock",
        description="Four servers of the tiny Wan on two groups (omni-ext's default order slo, order fifo, stock "
                    "vLLM-Omni in 2 replicas, and slo without preemption), started together and measured one at a "
                    "time on the same seeded streams. Defaults: 64x64, short 9 frames x 8 steps, long 81 x 20, 75 %% "
                    "short, loads 0.5,0.7,0.9 of the measured capacity, 150 s of arrivals each (~40 min on 2 cores). "
                    "--quick: 32x32, 5x2 and 17x6, load 0.7, 20 s. --repeat N: N runs on the same servers (seeds "
                    "--seed + i), each and the median reported; a figure passes when the median and two thirds of "
                    "the runs (2 of 3) meet it.")
    _module_command(
        bsub, "batching", "batching",
        help="a burst of concurrent images under --max-num-seqs: TunedExecutor vs vLLM-Omni's executor (goal: "
             "throughput >= stock's), beside unbatched stock and the bare host ceiling",
        description="Three servers of the tiny Qwen-Image on one worker, each started, measured and stopped in "
                    "turn: stock-b1 (vLLM-Omni's executor, --max-num-seqs 1), stock-b4 (--max-num-seqs 4 "
                    "--request-batch-max-wait-ms 200) and tuned-b4 (the same with the TunedExecutor). Each: a "
                    "warm-up, then --rounds bursts of --requests concurrent CFG images (median throughput); the "
                    "batch sizes from the server logs; then the bare ceiling, one DiffusionWorker without a "
                    "server, one at a time vs in chunks. Defaults: 64x64, 8 steps, \"med\" model, 16 requests, 3 "
                    "rounds. --quick: 32x32, 2 steps, \"tiny\" model, 8 requests, 1 round.")
    _module_command(
        bsub, "api-poll", "api_poll",
        help="status-poll latency while videos finish: vLLM-Omni's routes vs omni-ext's (p99 goal < 100 ms)",
        description="Starts the tiny Wan model twice, one after the other (vLLM-Omni's routes: "
                    "OMNI_EXT_DISABLE_PATCHES=openai-routes; then omni-ext's), submits --videos at once in each and "
                    "polls GET /v1/videos/{id} at --rate from a separate thread until all are done.")
