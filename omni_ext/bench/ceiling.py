"""The host's own ceiling for CFG parallel: the transformer loop alone, no serving stack at all.

Runs the tiny model's ``WanTransformer3DModel`` (diffusers) on latents of the benchmark's shape, one
thread per process: one process doing both guidance branches per step, then two processes doing one
branch each plus a gloo all-gather of the prediction per step (exactly the CFG-parallel exchange).
The ratio is what two cores of this host give at best; ``omni-ext bench cfg-parallel`` writes it
beside the end-to-end figures so a shortfall can be told apart from serving overhead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _child(model: str, mode: str, rank: int, port: int, steps: int, lat: list[int]) -> dict:
    import torch
    import torch.distributed as dist
    from diffusers import WanTransformer3DModel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = WanTransformer3DModel.from_pretrained(str(Path(model) / "transformer"), torch_dtype=torch.float32).eval()
    x = torch.randn(*lat)
    t = torch.tensor([500])
    e = torch.randn(1, 512, m.config.text_dim)

    def fwd():
        with torch.no_grad():
            return m(hidden_states=x, timestep=t, encoder_hidden_states=e, return_dict=False)[0]

    fwd()
    if mode == "one":
        t0 = time.perf_counter()
        for _ in range(steps):
            fwd()
            fwd()
        return {"seconds": time.perf_counter() - t0}
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    out = [torch.empty_like(x) for _ in range(2)]
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        dist.all_gather(out, fwd())
    dt = time.perf_counter() - t0
    dist.destroy_process_group()
    return {"seconds": dt}


def measure(model: Path, height: int, width: int, frames: int, steps: int, reps: int = 3, independent: bool = False) -> dict:
    """``reps`` alternating runs of one process vs two; medians and their ratio. With ``independent``
    the two processes do not talk (data parallel): the ratio is their combined throughput vs one."""
    from omni_ext.server_process import free_port

    lat = [1, 16, 1 + (frames - 1) // 4, height // 8, width // 8]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(mode: str) -> float:
        port = free_port()
        ranks = (0,) if mode == "one" else (0, 1)
        args = [json.dumps([str(model), "one" if mode == "pair_of_ones" else mode, r, port, steps, lat]) for r in ranks]
        procs = [
            subprocess.Popen([sys.executable, "-m", "omni_ext.bench.ceiling", a], stdout=subprocess.PIPE, env=env, text=True)
            for a in args
        ]
        outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
        return max(o["seconds"] for o in outs)

    # Alternate one process with the two-process mode being measured (and only that one).
    other = "pair_of_ones" if independent else "two"
    one, two = [], []
    for i in range(reps):
        for mode in (("one", other) if i % 2 == 0 else (other, "one")):
            (one if mode == "one" else two).append(run(mode))
    one.sort()
    two.sort()
    base = {"latent_shape": lat, "steps": steps, "one_process_s": one}
    if independent:
        return {
            "what": "transformer forward loop only (diffusers WanTransformer3DModel), no server; throughput of "
                    "2 independent processes (both branches each) vs 1 process",
            **base,
            "two_independent_processes_s": two,
            "throughput_ratio": 2 * one[len(one) // 2] / two[len(two) // 2],
        }
    return {
        "what": "transformer forward loop only (diffusers WanTransformer3DModel), no server; "
                "1 process x 2 branches vs 2 processes x 1 branch + gloo all-gather per step",
        **base,
        "two_processes_s": two,
        "speedup": one[len(one) // 2] / two[len(two) // 2],
    }

if __name__ == "__main__":
    model, mode, rank, port, steps, lat = json.loads(sys.argv[1])
    print(json.dumps(_child(model, mode, rank, port, steps, lat)))
