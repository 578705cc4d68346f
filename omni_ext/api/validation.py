"""The served model's limits, read from its config files, and their check at the engine's door.

Stock vLLM-Omni 0.30 accepts them and does something else: a 30x30 Wan request is silently floored
to 16x16, ``num_inference_steps=0`` runs no denoising and returns noise with HTTP 200, Qwen-Image
with one step returns NaN (its scheduler's ``shift_terminal`` divides 0/0). Every route (videos,
images, chat) reaches the engine through ``AsyncOmni.generate``, so one check there (the
``validate-diffusion-requests`` patch, :func:`check_sampling_params`) covers the routes omni-ext does
not own; it raises vLLM-Omni's own ``OmniClientError``, which its routes already turn into a 4xx
JSON error. The rule set itself (:func:`~omni_ext.api.intake.check_request`) is the one omni-ext's
own routes answer with before a job exists.

The limits come from the served model's own config files (VAE downsampling x transformer patch
size), read where vLLM-Omni reads them (a local folder, or a hub id's snapshot:
:func:`omni_ext.models.registry.model_json`), not from a table of model names, so a new
architecture gets sensible checks too; whether it makes video, and whether it takes a reference
image, are vLLM-Omni's own answers (:func:`omni_ext.models.registry.facts_of`). The fixed bounds
(steps, frames, pixels, outputs) are :mod:`omni_ext.api.limits`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from omni_ext.api.intake import GUIDANCE_FIELDS, ModelLimits, check_request
from omni_ext.models import registry


def _vae_factor(vae: dict[str, Any]) -> int:
    if "scale_factor_spatial" in vae:
        return int(vae["scale_factor_spatial"])
    if "temperal_downsample" in vae:  # Wan / Qwen-Image VAEs: one 2x spatial step per entry
        return 2 ** len(vae["temperal_downsample"])
    if "block_out_channels" in vae:  # diffusers AutoencoderKL
        return 2 ** (len(vae["block_out_channels"]) - 1)
    return 0


def _patch(transformer: dict[str, Any]) -> int:
    p = transformer.get("patch_size", 1)
    if isinstance(p, (list, tuple)):
        p = p[-1]
    return int(p or 1)


@lru_cache(maxsize=16)
def limits_for_model(model: str, pipeline: str | None = None) -> ModelLimits:
    """The limits of the model at ``model`` (a folder or a hub id). ``pipeline``: the class vLLM-Omni's
    stage runs it as (its ``model_class_name``, which a registered topology may give: FastWan's
    ``WanDMDPipeline`` runs as ``WanPipeline``); default: ``model_index.json``'s ``_class_name``."""
    index = registry.model_index(model)
    if pipeline is None:
        pipeline = index.get("_class_name") if isinstance(index.get("_class_name"), str) else None
    vae = registry.model_json(model, "vae/config.json")
    transformer = registry.model_json(model, "transformer/config.json")
    scheduler = registry.model_json(model, "scheduler/scheduler_config.json")
    factor = _vae_factor(vae)
    multiple = factor * _patch(transformer) if factor else 0
    # FlowMatch schedulers stretched to a terminal sigma give sigmas [nan, 0] for a single step.
    min_steps = 2 if scheduler.get("shift_terminal") else 1
    facts = registry.facts_of(pipeline) if pipeline else None
    return ModelLimits(pipeline=pipeline, spatial_multiple=multiple, min_steps=min_steps,
                       is_video=(facts.output if facts else registry.output_type(pipeline)) == "video",
                       image_input=bool(facts and facts.image_input) or _conditions_on_image(index))


def _conditions_on_image(index: dict[str, Any]) -> bool:
    """A model whose pipeline class declares no image input but conditions on one per model: vLLM-Omni's
    ``Wan22Pipeline`` reads ``expand_timesteps`` from ``model_index.json`` (Wan2.2-TI2V-5B) and then runs
    image-to-video whenever a request carries an image."""
    return bool(index.get("expand_timesteps"))


def check_sampling_params(params: Any, limits: ModelLimits) -> None:
    """:func:`~omni_ext.api.intake.check_request` (the rule set omni-ext's own routes apply) for a
    sampling-params object (vLLM-Omni's, at ``AsyncOmni.generate``); raises
    :class:`~omni_ext.api.intake.InvalidRequest`."""
    check_request(
        limits,
        width=getattr(params, "width", None),
        height=getattr(params, "height", None),
        num_frames=getattr(params, "num_frames", None),
        steps=getattr(params, "num_inference_steps", None),
        n=getattr(params, "num_outputs_per_prompt", 1),
        guidance={name: getattr(params, name, None) for name in GUIDANCE_FIELDS},
    )
