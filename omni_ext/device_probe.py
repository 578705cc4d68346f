"""``python -m omni_ext.device_probe``: step-level preemption's resume on the platform's own device,
with torch and diffusers alone (no vLLM stack needed), for ``omni_ext.device_check``.

A card host may lack the vLLM-Omni stack for its platform (the H200 image this project is lent has
torch 2.11 and no vLLM; a CUDA vLLM wheel is far over what can be carried there), and then no server
can start. What can still be proven there is the part of preemption that only a device can break:
a job's thread blocked at a denoise-step boundary while another job's thread runs on the same
device, and the paused job's state saved and put back (:mod:`omni_ext.executor.suspend`: the
pipeline's per-request attributes, the diffusers scheduler's state in place, whose tensors live on
the device, the host's and the device's random state, the process's job role). On a card the
threads' current device is per thread (``bind_device``), the device random state is per device, and
the paused job's last kernels may still be queued when the other job's start.

The probe runs the real pieces: the tiny Wan transformer and the Wan2.1 UniPC scheduler
(:mod:`omni_ext.models.tiny`), a CFG denoise loop with the step boundary of a SINGLE job
(:func:`omni_ext.executor.role.check_step_cancel`: the board, the agreed pause step, the worker's
pause hook), and the worker's own job thread (:class:`omni_ext.executor.worker.JobThread`: its
``pause``/``resume``/``settle``). Job A runs alone; then A again, paused twice by the executor's
pause token while jobs B and C (other seeds and shapes) run to the end on the same device; A's
final latents must be byte-identical to the uninterrupted run's, and B's and C's to theirs alone.
It prints one JSON object: per dtype the verdict, the steps paused at, the per-step time and the
cost of one save + restore.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

from omni_ext.executor import suspend
from omni_ext.executor.role import (AT, AT_SEQ, NO_JOB, PAUSE, ROLE, SECTIONS, check_step_cancel, new_board, pause_token,
                                    set_role)
from omni_ext.executor.worker import JobThread, _device
from omni_ext.scheduler.placement import JobMode

#: (seed, frames, height, width, steps) of the jobs: A is the one paused, B and C run while it is.
JOBS = {"A": (11, 9, 64, 96, 8), "B": (22, 5, 32, 64, 4), "C": (33, 9, 32, 32, 3)}
TEXT_TOKENS = 8
GUIDANCE = 5.0


def torch_device(kind: str) -> Any:
    """The torch device of the platform (``npu`` needs torch_npu imported first, lazily)."""
    import torch

    if kind == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
    return torch.device(f"{kind}:0" if kind != "cpu" else "cpu")


def denoise(pipeline: Any, transformer: Any, device: Any, dtype: Any, job: str) -> Any:
    """One job's CFG denoise loop as Wan's (two transformer calls per step, UniPC), with the
    step boundary a SINGLE job passes before each step. Returns the final latents (float32)."""
    import torch

    seed, frames, height, width, steps = JOBS[job]
    gen = torch.Generator(device).manual_seed(seed)
    shape = (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
    latents = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    text_dim = transformer.config.text_dim
    cond = torch.randn((1, TEXT_TOKENS, text_dim), generator=gen, device=device).to(dtype)
    uncond = torch.randn((1, TEXT_TOKENS, text_dim), generator=gen, device=device).to(dtype)
    scheduler = pipeline.scheduler
    scheduler.set_timesteps(steps, device=device)
    for t in scheduler.timesteps:
        check_step_cancel()
        x, ts = latents.to(dtype), t.expand(1)
        with torch.no_grad():
            c = transformer(hidden_states=x, timestep=ts, encoder_hidden_states=cond, return_dict=False)[0]
            u = transformer(hidden_states=x, timestep=ts, encoder_hidden_states=uncond, return_dict=False)[0]
        noise = u + GUIDANCE * (c - u)
        latents = scheduler.step(noise, t, latents, return_dict=False)[0]
    return latents


class ProbeJob(JobThread):
    """The worker's job thread with the probe's loop in place of a vLLM-Omni request (its
    ``pause``/``resume``/``settle`` are the worker's)."""

    def __init__(self, worker: Any, name: str, seq: int, fn: Any) -> None:
        super().__init__(worker, None, 0, SimpleNamespace(job_id=name))
        self.seq, self.fn, self.result, self.error = seq, fn, None, None

    def run(self) -> None:
        try:
            suspend.bind_device(_device(self.worker))
            set_role(JobMode.SINGLE, seq=self.seq, ranks=(0,))
            ROLE.pause_hook = self.pause
            self.result = self.fn()
            set_role(NO_JOB)
        except BaseException as exc:  # reported, never left hanging
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            with self.cv:
                self.state = "done"
                self.cv.notify_all()


def _wait_step(board: Any, seq: int, step: int, job: ProbeJob, timeout: float = 120.0) -> None:
    """Until rank 0 has published step ``step`` of job ``seq`` (the executor watches the same cells),
    or the job has ended."""
    world = len(board) // SECTIONS
    end = time.monotonic() + timeout
    while time.monotonic() < end and job.state != "done":
        with board.get_lock():
            if board[AT_SEQ * world] == seq and board[AT * world] >= step:
                return
        time.sleep(0.0005)
    if job.state == "done":
        return
    raise TimeoutError(f"job {seq} did not reach step {step}")


def probe_dtype(kind: str, dtype_name: str, size: str) -> dict[str, Any]:
    import torch

    from omni_ext.models.tiny import wan_scheduler, wan_transformer

    device = torch_device(kind)
    dtype = getattr(torch, dtype_name)
    transformer = wan_transformer(size).to(device=device, dtype=dtype).eval()
    pipeline = SimpleNamespace(scheduler=wan_scheduler(), _guidance_scale=GUIDANCE)
    worker = SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(pipeline=pipeline), device=device))
    board = new_board(multiprocessing.get_context("spawn"), 1)
    ROLE.rank, ROLE.cancel_slots = 0, board
    seqs = iter(range(1, 100))

    def alone(job: str) -> tuple[bytes, float]:
        thread = ProbeJob(worker, job, next(seqs), lambda: denoise(pipeline, transformer, device, dtype, job))
        t0 = time.perf_counter()
        thread.start()
        thread.join()
        if thread.error:
            raise RuntimeError(f"job {job}: {thread.error}")
        out = thread.result.cpu()
        return out.numpy().tobytes(), time.perf_counter() - t0

    alone("B")  # first calls (kernels, allocator) out of the timed runs
    ref = {job: alone(job) for job in JOBS}
    step_s = ref["A"][1] / JOBS["A"][4]

    a_seq = next(seqs)
    a = ProbeJob(worker, "A", a_seq, lambda: denoise(pipeline, transformer, device, dtype, "A"))
    a.start()
    paused_at, during = [], {}
    for number, (at, other) in enumerate(((2, "B"), (5, "C")), start=1):
        _wait_step(board, a_seq, at, a)
        board[PAUSE] = pause_token(a_seq, number)  # the executor's pause request (ranks.py)
        if a.settle() != "paused":
            raise RuntimeError(f"job A ended before its pause {number}" + (f": {a.error}" if a.error else ""))
        board[PAUSE] = 0
        paused_at.append(a.step)
        during[other] = alone(other)[0]
        a.resume()
    a.join()
    if a.error:
        raise RuntimeError(f"job A: {a.error}")
    resumed = a.result.cpu().numpy().tobytes()

    # the cost of one pause's bookkeeping: save + restore with the scheduler's state after a run
    costs = []
    for _ in range(20):
        t0 = time.perf_counter()
        snap = suspend.save(pipeline, device)
        suspend.restore(snap, pipeline, device)
        if device.type != "cpu":
            getattr(torch, device.type).synchronize()
        costs.append(time.perf_counter() - t0)
    identical = resumed == ref["A"][0]
    others = {job: during[job] == ref[job][0] for job in during}
    return {"identical": identical, "others_identical": others, "paused_at_steps": paused_at,
            "step_ms": round(step_s * 1000, 3), "save_restore_ms": round(statistics.median(costs) * 1000, 3),
            "device": str(device), "dtype": dtype_name, "size": size,
            "jobs": {k: dict(zip(("seed", "frames", "height", "width", "steps"), v)) for k, v in JOBS.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="omni_ext.device_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=["cuda", "npu", "cpu"], default="cpu", help="the device to run on")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--size", choices=["tiny", "small", "med"], default="tiny", help="tiny Wan transformer preset")
    args = p.parse_args(argv)
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "kind": args.kind, "runs": []}
    for name in args.dtypes.split(","):
        try:
            out["runs"].append(probe_dtype(args.kind, name.strip(), args.size))
        except Exception as exc:
            out["runs"].append({"dtype": name, "error": f"{type(exc).__name__}: {exc}"})
    if args.kind == "cuda":
        out["device_name"] = torch.cuda.get_device_name(0)
    print(json.dumps(out), flush=True)
    ok = all(r.get("identical") and all(r.get("others_identical", {}).values()) for r in out["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
