"""``omni-ext bench ...`` sub-commands (wired into ``omni_ext.cli.build_parser``)."""

from __future__ import annotations

import argparse


def _common(p: argparse.ArgumentParser, steps: int, size: str, frames: int, reps: int) -> None:
    p.add_argument("--json", required=True, help="write the measurements and ratios here")
    p.add_argument("--model-size", choices=["tiny", "small", "med"], default="med", help="tiny Wan2.1 preset")
    p.add_argument("--size", default=size, help="WxH of the generated video")
    p.add_argument("--frames", type=int, default=frames)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--reps", type=int, default=reps, help="repetitions per configuration (median reported)")
    p.add_argument("--models-dir", default=None, help="where the tiny model is built/cached")
    p.add_argument("--workdir", default=None, help="server logs and storage (default: a new temp dir)")
    p.add_argument("--start-timeout", type=float, default=1200.0)


def _cfg(args) -> int:
    from omni_ext.bench.runner import main_cfg_parallel

    return main_cfg_parallel(args)


def _dp(args) -> int:
    from omni_ext.bench.runner import main_data_parallel

    return main_data_parallel(args)


def add_subcommands(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks on real servers (TunedExecutor vs vLLM-Omni)")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    c = bsub.add_parser("cfg-parallel", help="one request at a time: one device vs stock cfg 2 vs omni-ext cfg 2")
    # 80x80x17, 25 steps on the "med" tiny Wan: a CFG step ~180 ms on one thread, VAE decode + text
    # encoding ~6 % of one-device time (Wan2.1-1.3B at 832x480x81, 50 steps: 5-15 %).
    _common(c, steps=25, size="80x80", frames=17, reps=5)
    c.add_argument("--skip-ceiling", action="store_true", help="skip the no-server transformer-loop ceiling")
    c.set_defaults(func=_cfg)
    d = bsub.add_parser("data-parallel", help="8 concurrent requests: 2 groups vs 1; CFG-free on a cfg-2 group")
    _common(d, steps=25, size="80x80", frames=17, reps=3)
    d.add_argument("--concurrency", type=int, default=8)
    d.add_argument("--skip-stock-dp", action="store_true", help="skip vLLM-Omni's in-executor DP measurement")
    d.add_argument("--skip-ceiling", action="store_true", help="skip the no-server two-process ceiling")
    d.set_defaults(func=_dp)
