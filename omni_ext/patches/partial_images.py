"""Patch bodies for ``partial-images`` (see the registry in ``omni_ext.patches``; the plan and the
files: :mod:`omni_ext.partials`).

Qwen-Image's denoise loop (``QwenImageCFGParallelMixin.diffuse``: Qwen-Image, -Edit, -Edit-Plus and
their tuned and DMD2 classes) is wrapped to note, on the job's thread, which of the batch's requests
asked for partial images and the output's latent grid (``img_shapes``); the scheduler step every
CFG-parallel pipeline calls (``CFGParallelMixin.scheduler_step_maybe_with_cfg``) is wrapped to decode,
after the planned steps, the clean-latent estimate ``x_t - sigma_t * v`` of each such request with the
pipeline's own VAE, on the one process that reports the job's progress (every rank of a CFG pair
holds the same latents after the step). Nothing is written back: the latents, the RNG and the
output are what they are without the patch, and a request that asks for nothing costs one
attribute read per step.
"""

from __future__ import annotations

import functools
import io
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from omni_ext.patches import patch_attr

logger = logging.getLogger("omni_ext.patches")
_job = threading.local()  # the running loop's plan (one job per thread: a paused job keeps its own)


@dataclass
class _Plan:
    """One denoise loop's partial images: ``wants`` (engine request id, partials, its latent rows)."""

    wants: list[tuple[str, int, slice]]
    steps: dict[str, tuple[int, ...]]
    height: int
    width: int
    done: int = 0
    made: dict[str, int] = field(default_factory=dict)


def _reporter() -> bool:
    """Whether this process decodes the job's partials: the one that reports its step progress."""
    from vllm_omni.diffusion.models import progress_bar as pb

    from omni_ext.executor.role import reports_progress

    report = reports_progress()
    return pb._is_rank_zero() if report is None else report


def _plan(pipe: Any, bound: dict[str, Any]) -> _Plan | None:
    from omni_ext import partials
    from omni_ext.patches.step_progress import current_requests

    reqs = current_requests()
    asked = [(r, partials.wanted(getattr(getattr(r, "sampling_params", None), "extra_args", None))) for r in reqs]
    if not any(n for _, n in asked) or not _reporter():
        return None
    latents, img_shapes, timesteps = bound["latents"], bound["img_shapes"], bound["timesteps"]
    rows = [max(1, int(getattr(r.sampling_params, "num_outputs_per_prompt", 1) or 1)) for r, _ in asked]
    if sum(rows) != latents.shape[0]:
        logger.warning("partial-images: a batch of %d latents for %d outputs; no partial images", latents.shape[0],
                       sum(rows))
        return None
    _, h, w = img_shapes[0][0]  # the output's latent grid (an edit's reference grids follow it)
    scale = pipe.vae_scale_factor * 2
    wants, start = [], 0
    for (req, n), count in zip(asked, rows):
        if n:
            wants.append((req.request_id, n, slice(start, start + count)))
        start += count
    total = len(timesteps)
    return _Plan(wants, {rid: partials.partial_steps(total, n) for rid, n, _ in wants}, h * scale, w * scale)


def decode_png(pipe: Any, latents: Any, height: int, width: int) -> list[bytes]:
    """Packed Qwen-Image latents -> one PNG per row, as the pipeline's own decode and vLLM-Omni's
    post-processing make the final image (unpack, de-normalise, VAE, [-1, 1] -> 8 bits)."""
    import torch
    from PIL import Image

    lat = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor).to(pipe.vae.dtype)
    cfg = pipe.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(lat.device, lat.dtype)
    std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(lat.device, lat.dtype)
    image = pipe.vae.decode(lat / std + mean, return_dict=False)[0][:, :, 0]
    pixels = ((image.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    out = []
    for row in pixels:
        buf = io.BytesIO()
        Image.fromarray(row).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def _after_step(pipe: Any, plan: _Plan, noise_pred: Any, t: Any, latents: Any) -> None:
    import torch

    from omni_ext import partials

    plan.done += 1
    due = [(rid, rows) for rid, _, rows in plan.wants if plan.done in plan.steps[rid]]
    if not due or not isinstance(noise_pred, torch.Tensor) or not isinstance(latents, torch.Tensor):
        return
    with torch.no_grad():
        estimate = latents - (t.to(latents.dtype) / 1000.0) * noise_pred  # flow matching: sigma_t = t / 1000
        for rid, rows in due:
            index = plan.made.get(rid, 0)
            try:
                png = decode_png(pipe, estimate[rows], plan.height, plan.width)[0]
            except Exception:  # a preview must never fail the generation
                logger.exception("partial-images: decoding partial %d of %s failed", index, rid)
                continue
            if partials.write(rid, index, png):
                plan.made[rid] = index + 1


def apply() -> None:
    from vllm_omni.diffusion.distributed.cfg_parallel import CFGParallelMixin
    from vllm_omni.diffusion.models.qwen_image.cfg_parallel import QwenImageCFGParallelMixin
    import inspect

    diffuse = QwenImageCFGParallelMixin.diffuse
    signature = inspect.signature(diffuse)

    @functools.wraps(diffuse)
    def _diffuse(self, *args, **kwargs):
        plan = None
        if type(self).scheduler_step_maybe_with_cfg is _step:  # not a pipeline-parallel stage
            try:
                plan = _plan(self, signature.bind(self, *args, **kwargs).arguments)
            except Exception:
                logger.exception("partial-images: no partial images for this loop")
        if plan is None:
            return diffuse(self, *args, **kwargs)
        outer, _job.plan = getattr(_job, "plan", None), plan
        try:
            return diffuse(self, *args, **kwargs)
        finally:
            _job.plan = outer

    step = CFGParallelMixin.scheduler_step_maybe_with_cfg

    @functools.wraps(step)
    def _step(self, noise_pred, t, latents, *args, **kwargs):
        out = step(self, noise_pred, t, latents, *args, **kwargs)
        plan = getattr(_job, "plan", None)
        if plan is not None:
            _after_step(self, plan, noise_pred, t, latents)
        return out

    patch_attr(CFGParallelMixin, "scheduler_step_maybe_with_cfg", _step)
    _step = CFGParallelMixin.scheduler_step_maybe_with_cfg  # the installed one (applying twice keeps the first)
    patch_attr(QwenImageCFGParallelMixin, "diffuse", _diffuse)


def apply_edits() -> None:
    """The engine call of vLLM-Omni's edit endpoint carries the partial images omni-ext's edit route
    asked for (:data:`omni_ext.partials.REQUESTED`, set around its call of that endpoint)."""
    from vllm_omni.entrypoints.openai import api_server

    from omni_ext import partials

    inner = api_server._generate_with_async_omni

    @functools.wraps(inner)
    async def _generate_with_async_omni(engine_client, gen_params, stage_configs, **kwargs):
        count = partials.REQUESTED.get()
        if count:
            gen_params.extra_args = {**(getattr(gen_params, "extra_args", None) or {}), partials.KEY: count}
        return await inner(engine_client, gen_params, stage_configs, **kwargs)

    patch_attr(api_server, "_generate_with_async_omni", _generate_with_async_omni)
