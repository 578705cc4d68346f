"""The host's own ceiling for CFG parallel: the transformer loop alone, no serving stack at all.

Runs the tiny model's ``WanTransformer3DModel`` (diffusers) on latents of the benchmark's shape, one
thread per process: one process doing both guidance branches per step, then two processes doing one
branch each plus a gloo all-gather of the prediction per step (exactly the CFG-parallel exchange).
The ratio is what two cores of this host give at best; ``omni-ext bench cfg-parallel`` writes it
beside the end-to-end figures so a shortfall can be told apart from serving overhead.

:class:`SpCeiling` (:func:`measure_sp` alone) is the ceiling of ``cfg-parallel --sp N`` (CFG 2 x Ulysses N): vLLM-Omni's own
diffusion worker (``DiffusionWorker``: its gloo groups, its Wan transformer with the Ulysses SP
hooks, omni-ext's plugin and patches as in a server's worker) built in 2N bare processes, and the
pipeline's own ``predict_noise_maybe_with_cfg`` timed in a loop: per step each CFG rank runs its
branch with the sequence split over its Ulysses group (all-to-alls in attention), then the CFG
all-gather and the guidance combine. The same worker in one process (sequential CFG, full sequence)
is the one-device loop. No server, no scheduler, no request path: the processes stay up and wait on
stdin between timed loops, so one start serves every repetition.

:class:`JobPair` is the yardstick of ``omni-ext bench mixed`` (two data-parallel groups side by side):
whole bare jobs, as a server's job is (diffusers' ``WanPipeline``: text encoding, the CFG denoise loop,
the VAE decode; then vLLM-Omni's own MP4 encode), one alone vs two at once, at each length of the
burst. On this VM the transformer loop alone did not show what two whole jobs side by side do, and a
ceiling measured once after the bursts missed the slow phases of the host that the bursts met; the
benchmark runs one repetition of it after each round of bursts instead.
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
        with torch.inference_mode():  # as the servers run it (vLLM-Omni's model runner)
            return m(hidden_states=x, timestep=t, encoder_hidden_states=e, return_dict=False)[0]

    fwd()
    if mode == "one":
        t0 = time.perf_counter()
        for _ in range(steps):
            fwd()
            fwd()
        return {"seconds": time.perf_counter() - t0}
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    out = [torch.empty_like(fwd()) for _ in range(2)]  # the prediction: out_channels, not in_channels
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        dist.all_gather(out, fwd())
    dt = time.perf_counter() - t0
    dist.destroy_process_group()
    return {"seconds": dt}


def latent_shape(model: Path, height: int, width: int, frames: int) -> list[int]:
    """The transformer's input of one request: its channels (16 for T2V, 36 for I2V's noise + mask +
    image latents, 48 for TI2V-5B) and the VAE's compression (8x, or the Wan2.2 VAE's 16x)."""
    transformer = json.loads((Path(model) / "transformer" / "config.json").read_text())
    vae = json.loads((Path(model) / "vae" / "config.json").read_text())
    spatial = int(vae.get("scale_factor_spatial") or 8)
    temporal = int(vae.get("scale_factor_temporal") or 4)
    return [1, int(transformer["in_channels"]), 1 + (frames - 1) // temporal, height // spatial, width // spatial]


def measure(model: Path, height: int, width: int, frames: int, steps: int, reps: int = 3, independent: bool = False) -> dict:
    """``reps`` alternating runs of one process vs two; medians and their ratio. With ``independent``
    the two processes do not talk (data parallel): the ratio is their combined throughput vs one."""
    from omni_ext.server_process import free_port

    lat = latent_shape(model, height, width, frames)
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


# ---- CFG x Ulysses: vLLM-Omni's own worker in bare processes ----------------------------------------
#: Marks a child's answer on stdout (vLLM-Omni may print other lines there).
MARK = "OMNI_EXT_CEILING "


def sp_env(world: int) -> dict[str, str]:
    """The environment of a ``world``-process CFG x SP worker: as the benchmark's servers have it."""
    return {"OMNI_EXT_CPU_VISIBLE_DEVICES": ",".join(str(i) for i in range(world)), "OMP_NUM_THREADS": "1"}


def _sp_worker(model: str, rank: int, world: int, cfg: int, ulysses: int, port: int, steps: int, lat: list[int]) -> None:
    import torch
    import torch.distributed as dist
    from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.worker.diffusion_worker import DiffusionWorker
    from vllm_omni.plugins import load_omni_general_plugins

    load_omni_general_plugins()  # omni-ext's plugin and patches, as vLLM-Omni's worker_main does
    torch.set_num_threads(1)
    od = OmniDiffusionConfig.from_kwargs(
        model=model, dtype=torch.float32, enforce_eager=True, num_gpus=world,
        parallel_config=DiffusionParallelConfig(cfg_parallel_size=cfg, ulysses_degree=ulysses))
    od.enrich_config()
    od.master_port = port  # every rank the parent's port (each would settle its own otherwise)
    worker = DiffusionWorker(local_rank=rank, rank=rank, od_config=od)
    pipe = worker.model_runner.pipeline
    torch.manual_seed(0)
    step = _qwen_edit_step(pipe, lat, model) if type(pipe).__name__.startswith("QwenImageEdit") else _wan_step(pipe, lat)

    def loop(n: int) -> float:
        with torch.inference_mode(), set_forward_context(vllm_config=worker.vllm_config, omni_diffusion_config=od):
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            return time.perf_counter() - t0

    loop(1)  # first-call costs
    print(MARK + json.dumps({"ready": True, "rank": rank}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        print(MARK + json.dumps({"seconds": loop(steps)}), flush=True)
    worker.shutdown()


def _wan_step(pipe, lat: list[int]):
    """One CFG step of a Wan pipeline (text- or image-to-video: ``lat`` has the transformer's input channels).

    A model whose pipeline expands its timesteps (Wan2.2 TI2V-5B, ``expand_timesteps`` in its
    ``model_index.json``) gets them as its image mode's ``diffuse`` makes them: one per patch token, 0 on
    the reference's first latent frame. The transformer then embeds a timestep per token, as in the
    server; a single timestep made the bare loop 9-10 ms per step cheaper than the servers' (2026-12-07)."""
    import torch

    tf = pipe.transformer
    x = torch.randn(*lat)
    pos, neg = torch.randn(1, 512, tf.config.text_dim), torch.randn(1, 512, tf.config.text_dim)
    t = torch.tensor([500.0])
    if getattr(pipe, "expand_timesteps", False):
        patch = tf.config.patch_size
        mask = torch.ones(1, 1, *lat[2:])
        mask[:, :, 0] = 0
        mask = mask[:, :, :, :: patch[1], :: patch[2]][:, :, :, : lat[3] // patch[1], : lat[4] // patch[2]]
        t = (mask[0][0] * t).flatten().unsqueeze(0)

    def step() -> torch.Tensor:
        kw = {"hidden_states": x, "timestep": t, "attention_kwargs": None, "return_dict": False, "current_model": tf}
        return pipe.predict_noise_maybe_with_cfg(
            do_true_cfg=True, true_cfg_scale=4.0, positive_kwargs={**kw, "encoder_hidden_states": pos},
            negative_kwargs={**kw, "encoder_hidden_states": neg}, cfg_normalize=False)

    return step


def _qwen_edit_step(pipe, lat: list[int], model: str):
    """One CFG step of a Qwen-Image-Edit pipeline as its ``diffuse`` makes it: the packed noise latents of
    the output (``lat``'s height and width over 2) followed by the reference image's, which the edit
    pipelines resize to a 1024x1024 area first (vLLM-Omni's ``calculate_dimensions``), and the benchmark's
    prompt and negative prompt encoded by the pipeline's own ``encode_prompt`` with the reference image as
    the pipeline feeds it (Edit: at the 1024x1024 area; Edit-Plus: at 384x384), so the text sequence holds
    the same vision tokens as in the server. The prediction is sliced back to the output's tokens."""
    import torch
    from PIL import Image
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit import calculate_dimensions

    from omni_ext.bench.common import NEGATIVE, PROMPT, reference_png

    tf = pipe.transformer  # vLLM-Omni's own Qwen-Image transformer: no diffusers config
    config = json.loads((Path(model) / "transformer" / "config.json").read_text())
    h, w = lat[3] // 2, lat[4] // 2
    ref_w, ref_h = calculate_dimensions(1024 * 1024, w / h)
    rh, rw = ref_h // pipe.vae_scale_factor // 2, ref_w // pipe.vae_scale_factor // 2
    x = torch.randn(1, h * w + rh * rw, config["in_channels"])
    import io

    image = Image.open(io.BytesIO(reference_png(lat[4] * 8, lat[3] * 8))).convert("RGB")
    if "Plus" in type(pipe).__name__:
        cw, ch = calculate_dimensions(384 * 384, w / h)
        prompt_image: object = [image.resize((cw, ch))]
    else:
        prompt_image = image.resize((ref_w, ref_h))
    with torch.no_grad():
        pos, pos_mask = pipe.encode_prompt(prompt=PROMPT, image=prompt_image)
        neg, neg_mask = pipe.encode_prompt(prompt=NEGATIVE, image=prompt_image, prompt_name="negative_prompt")
    tf.do_true_cfg = True
    shapes = [[(1, h, w), (1, rh, rw)]]
    kw = {"hidden_states": x, "timestep": torch.tensor([0.5]), "guidance": None, "img_shapes": shapes,
          "return_dict": False, "attention_kwargs": {}}
    positive = {**kw, "encoder_hidden_states": pos, "encoder_hidden_states_mask": pos_mask, "txt_seq_lens": [pos.shape[1]]}
    negative = {**kw, "encoder_hidden_states": neg, "encoder_hidden_states_mask": neg_mask, "txt_seq_lens": [neg.shape[1]]}

    def step() -> torch.Tensor:
        return pipe.predict_noise_maybe_with_cfg(True, 4.0, positive, negative, True, h * w)

    return step


class _Group:
    """``world`` worker processes of one layout, kept up between timed loops."""

    def __init__(self, model: Path, world: int, cfg: int, ulysses: int, steps: int, lat: list[int], log_dir: Path) -> None:
        from omni_ext.server_process import free_port

        port = free_port()
        env = {**os.environ, **sp_env(world)}
        self.procs = []
        for rank in range(world):
            arg = json.dumps([str(model), rank, world, cfg, ulysses, port, steps, lat])
            log = open(log_dir / f"ceiling-cfg{cfg}-sp{ulysses}-rank{rank}.log", "w")
            self.procs.append(subprocess.Popen([sys.executable, "-m", "omni_ext.bench.ceiling", "--sp-worker", arg],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True))
        for p in self.procs:
            self._answer(p)

    @staticmethod
    def _answer(p: subprocess.Popen) -> dict:
        for line in p.stdout:
            at = line.find(MARK)  # vLLM-Omni's worker prefixes its stdout lines ("(DiffusionWorker pid=N) ")
            if at >= 0:
                return json.loads(line[at + len(MARK):])
        raise RuntimeError(f"ceiling worker {p.pid} ended (exit {p.wait()}) without answering; see its log")

    def run(self) -> float:
        for p in self.procs:
            p.stdin.write("run\n")
            p.stdin.flush()
        return max(self._answer(p)["seconds"] for p in self.procs)

    def close(self) -> None:
        _close(self.procs)


def _close(procs: list[subprocess.Popen]) -> None:
    """End bare processes that wait on stdin: EOF, then a kill after a minute."""
    for p in procs:
        try:
            p.stdin.close()
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class SpCeiling:
    """The bare CFG 2 x Ulysses ``ulysses`` loop (``parallel``: 2 x ``ulysses`` processes) and the same
    worker in one process (``one``), kept up so that their timed loops can interleave with the servers'
    requests: ``cfg-parallel --model`` times one bare loop after every alternation of the two servers,
    so that a drift of the host's speed within the run (on this shared host, 10 % between minutes) moves
    the ceiling with the servers instead of against them. Idle, the processes wait on their stdin."""

    def __init__(self, model: Path, height: int, width: int, frames: int, steps: int, ulysses: int, log_dir: Path) -> None:
        self.model, self.steps, self.ulysses, self.log_dir = model, steps, ulysses, log_dir
        self.lat = latent_shape(model, height, width, frames)
        self.groups: dict[str, _Group] = {}
        self.times: dict[str, list[float]] = {"one": [], "parallel": []}

    def start(self, name: str) -> None:
        """Start ``name``'s processes ("one" or "parallel"; each pays its first-call costs untimed)."""
        if name not in self.groups:
            world, cfg, ulysses = (2 * self.ulysses, 2, self.ulysses) if name == "parallel" else (1, 1, 1)
            self.groups[name] = _Group(self.model, world, cfg, ulysses, self.steps, self.lat, self.log_dir)

    def run(self, name: str) -> float:
        """One timed loop of ``name`` (started first if it is not up)."""
        self.start(name)
        self.times[name].append(self.groups[name].run())
        return self.times[name][-1]

    def result(self) -> dict:
        return sp_ceiling_result(self.times["one"], self.times["parallel"], self.ulysses, self.steps, self.lat)

    def close(self) -> None:
        for g in self.groups.values():
            g.close()
        self.groups.clear()


def measure_sp(model: Path, height: int, width: int, frames: int, steps: int, ulysses: int, log_dir: Path,
               reps: int = 3, progress=None) -> dict:
    """CFG 2 x Ulysses ``ulysses`` in 2 x ``ulysses`` bare processes vs the same worker in one process,
    ``reps`` alternating timed loops of ``steps`` steps each; the medians and their ratio."""
    bare = SpCeiling(model, height, width, frames, steps, ulysses, log_dir)
    try:
        bare.start("one")
        bare.start("parallel")
        for i in range(reps):
            for name in (("one", "parallel") if i % 2 == 0 else ("parallel", "one")):
                seconds = bare.run(name)
                if progress is not None:
                    progress.advance(note=f"ceiling rep {i}: {name} {seconds:.2f} s")
    finally:
        bare.close()
    return bare.result()


def sp_ceiling_result(one_s: list[float], parallel_s: list[float], ulysses: int, steps: int, lat: list[int]) -> dict:
    """The JSON of :func:`measure_sp` from its timings (pure)."""
    from omni_ext.bench.common import median, ratio

    world = 2 * ulysses
    return {
        "what": f"transformer loop only, no server: vLLM-Omni's own DiffusionWorker (its gloo groups, the model's "
                f"transformer (Wan or Qwen-Image) with the Ulysses SP hooks, omni-ext's plugin and patches) in {world} bare processes "
                f"(CFG 2 x Ulysses {ulysses}, one thread each), timing {steps} calls of the pipeline's "
                "predict_noise_maybe_with_cfg (each CFG rank its branch with the sequence split over its Ulysses "
                "group, then the CFG all-gather and the guidance combine); vs the same worker in 1 process "
                "(both branches, full sequence). Random latents and text embeddings of the request's shape; no "
                "text encoding, scheduler step, VAE, request path or HTTP.",
        "layout": {"cfg": 2, "ulysses": ulysses, "processes": world},
        "latent_shape": lat,
        "steps": steps,
        "one_process_s": sorted(one_s),
        "parallel_processes_s": sorted(parallel_s),
        "one_process_median_s": median(one_s),
        "parallel_median_s": median(parallel_s),
        "speedup": ratio(median(one_s), median(parallel_s)),
    }


# ---- whole bare jobs, one alone vs two at once (bench mixed) ----------------------------------------
def _job_worker(model: str, height: int, width: int, steps: int, lengths: list[int]) -> None:
    import torch
    from diffusers import WanPipeline
    from vllm_omni.entrypoints.openai.video_api_utils import _encode_video_bytes

    from omni_ext.bench.common import NEGATIVE, PROMPT

    torch.set_num_threads(1)
    pipe = WanPipeline.from_pretrained(model, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def job(frames: int, seed: int) -> float:
        t0 = time.perf_counter()
        video = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=height, width=width, num_frames=frames,
                     num_inference_steps=steps, guidance_scale=4.0, output_type="np",
                     generator=torch.Generator().manual_seed(seed)).frames[0]
        _encode_video_bytes(video, fps=8, video_codec_options={"preset": "ultrafast", "threads": "0"})
        return time.perf_counter() - t0

    for f in lengths:  # first-call costs of every shape
        job(f, 0)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] != "run":
            break
        print(MARK + json.dumps({"seconds": job(int(cmd[1]), int(cmd[2]))}), flush=True)


class JobPair:
    """Two bare processes that each run whole jobs on request (one thread each, as a group's worker):
    :meth:`rep` times every length once alone and once as two at once."""

    def __init__(self, model: Path, height: int, width: int, steps: int, lengths: list[int], log_dir: Path) -> None:
        self.lengths = sorted(set(lengths))
        self.times: dict[int, dict[str, list[float]]] = {f: {"one": [], "two": []} for f in self.lengths}
        self.procs: list[subprocess.Popen] = []
        self.steps, self.shape = steps, [height, width]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        arg = json.dumps([str(model), height, width, steps, self.lengths])
        for i in range(2):
            log = open(log_dir / f"ceiling-job-{i}.log", "w")
            self.procs.append(subprocess.Popen([sys.executable, "-m", "omni_ext.bench.ceiling", "--job-worker", arg],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True))
        self._seed = 100

    def ready(self) -> None:
        """Wait until both have paid their first calls (at start-up, so not while anything is timed)."""
        for p in self.procs:
            _Group._answer(p)

    def _send(self, procs: list[subprocess.Popen], frames: int) -> list[float]:
        for p in procs:
            self._seed += 1
            p.stdin.write(f"run {frames} {self._seed}\n")
            p.stdin.flush()
        return [_Group._answer(p)["seconds"] for p in procs]

    def rep(self, index: int) -> None:
        """Every length once alone and once two at once (which first alternates with ``index``)."""
        for f in self.lengths:
            for mode in (("one", "two") if index % 2 == 0 else ("two", "one")):
                self.times[f][mode] += self._send(self.procs[:1] if mode == "one" else self.procs, f)

    def result(self) -> dict:
        return job_pair_result(self.times, self.steps, self.shape)

    def close(self) -> None:
        _close(self.procs)


def job_pair_result(times: dict[int, dict[str, list[float]]], steps: int, shape: list[int]) -> dict:
    """The JSON of :class:`JobPair` (pure): per length the times and ``slowdown``, the median of a job's
    time beside another over the median alone."""
    from omni_ext.bench.common import median, ratio

    return {
        "what": "whole bare jobs, no server: diffusers' WanPipeline (text encoding, CFG denoise loop, VAE decode) "
                "and vLLM-Omni's MP4 encode, one thread per process; one job alone vs two processes each running "
                "one at the same time, every length once per round of bursts",
        "steps": steps, "height_width": shape,
        "by_length": {str(f): {"one_s": sorted(t["one"]), "two_s": sorted(t["two"]),
                               "slowdown": ratio(median(t["two"]), median(t["one"])) if t["one"] and t["two"] else None}
                      for f, t in times.items()},
    }


def weighted_slowdown(ceiling: dict, job_s: list[tuple[str, float]]) -> float | None:
    """How much slower a burst's work runs two at once than alone: each length's ``slowdown`` weighted
    by the time its jobs take alone (``job_s``: (length, seconds) per job of the burst)."""
    by = ceiling.get("by_length", {})
    if not job_s or any((by.get(f) or {}).get("slowdown") is None for f, _ in job_s):
        return None
    return sum(t * by[f]["slowdown"] for f, t in job_s) / sum(t for _, t in job_s)


if __name__ == "__main__":
    if sys.argv[1] == "--sp-worker":
        _sp_worker(*json.loads(sys.argv[2]))
        sys.exit(0)
    if sys.argv[1] == "--job-worker":
        _job_worker(*json.loads(sys.argv[2]))
        sys.exit(0)
    model, mode, rank, port, steps, lat = json.loads(sys.argv[1])
    print(json.dumps(_child(model, mode, rank, port, steps, lat)))
