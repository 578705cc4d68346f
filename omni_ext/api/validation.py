"""Reject diffusion requests the model cannot honour, before they reach the engine.

Stock vLLM-Omni 0.30 accepts them and does something else: a 30x30 Wan request is silently floored
to 16x16, ``num_inference_steps=0`` runs no denoising and returns noise with HTTP 200, Qwen-Image
with one step returns NaN (its scheduler's ``shift_terminal`` divides 0/0). Every route (videos,
images, chat) reaches the engine through ``AsyncOmni.generate``, so one check there covers them all;
it raises vLLM-Omni's own ``OmniClientError``, which its routes already turn into a 4xx JSON error.

The limits come from the served model's own config files (VAE downsampling x transformer patch
size), not from a table of model names, so a new architecture gets sensible checks too; only
whether it makes video is the model-family table's answer. The fixed bounds (steps, frames,
pixels, outputs) are :mod:`omni_ext.api.limits`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from omni_ext.api.limits import MAX_FRAMES, MAX_OUTPUTS, MAX_PIXELS, MAX_STEPS
from omni_ext.models import families
from omni_ext.models.families import ModelFamily

GUIDANCE_FIELDS = ("guidance_scale", "true_cfg_scale", "guidance_scale_2")


@dataclass(frozen=True)
class ModelLimits:
    pipeline: str | None
    spatial_multiple: int  # height and width must be multiples of this (0: unknown, not checked)
    min_steps: int
    is_video: bool
    #: The served pipeline's entry in the model-family table (None: a class omni-ext does not list),
    #: looked up once with the limits, so that a request reads it without a look-up.
    family: ModelFamily | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", families.family_of(self.pipeline))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


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
def limits_for_model(model: str) -> ModelLimits:
    root = Path(model)
    index = _read_json(root / "model_index.json")
    pipeline = index.get("_class_name")
    vae = _read_json(root / "vae" / "config.json")
    transformer = _read_json(root / "transformer" / "config.json")
    scheduler = _read_json(root / "scheduler" / "scheduler_config.json")
    factor = _vae_factor(vae)
    multiple = factor * _patch(transformer) if factor else 0
    # FlowMatch schedulers stretched to a terminal sigma give sigmas [nan, 0] for a single step.
    min_steps = 2 if scheduler.get("shift_terminal") else 1
    return ModelLimits(pipeline=pipeline, spatial_multiple=multiple, min_steps=min_steps,
                       is_video=families.is_video(pipeline))


class InvalidRequest(ValueError):
    """A request field the model cannot honour; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def check_sampling_params(params: Any, limits: ModelLimits) -> None:
    """:func:`check_request` for a sampling-params object (vLLM-Omni's, at ``AsyncOmni.generate``)."""
    check_request(
        limits,
        width=getattr(params, "width", None),
        height=getattr(params, "height", None),
        num_frames=getattr(params, "num_frames", None),
        steps=getattr(params, "num_inference_steps", None),
        n=getattr(params, "num_outputs_per_prompt", 1),
        guidance={name: getattr(params, name, None) for name in GUIDANCE_FIELDS},
    )


def check_request(
    limits: ModelLimits,
    *,
    width: Any = None,
    height: Any = None,
    num_frames: Any = None,
    steps: Any = None,
    n: Any = 1,
    guidance: Mapping[str, Any] | None = None,
) -> None:
    """Raise :class:`InvalidRequest` for the first value outside the model's limits (None: not set).

    The one rule set behind every route: omni-ext's own routes call it with the fields they parsed
    (so a bad request is answered before a job exists), the ``validate-diffusion-requests`` patch
    through :func:`check_sampling_params` for every other route.
    """
    if steps is not None:
        if not isinstance(steps, int) or steps < limits.min_steps or steps > MAX_STEPS:
            raise InvalidRequest(
                f"num_inference_steps must be an integer from {limits.min_steps} to {MAX_STEPS} for this model, "
                f"got {steps!r}",
                "num_inference_steps",
            )
    for name, value in (("height", height), ("width", width)):
        if value is None:
            continue
        if not isinstance(value, int) or value <= 0:
            raise InvalidRequest(f"{name} must be a positive integer, got {value!r}", name)
        if limits.spatial_multiple and value % limits.spatial_multiple:
            raise InvalidRequest(
                f"{name} must be a multiple of {limits.spatial_multiple} for {limits.pipeline or 'this model'}, "
                f"got {value} (nearest valid: {max(limits.spatial_multiple, value // limits.spatial_multiple * limits.spatial_multiple)})",
                "size",
            )
    if isinstance(height, int) and isinstance(width, int) and height * width > MAX_PIXELS:
        raise InvalidRequest(f"size {width}x{height} exceeds the maximum of {MAX_PIXELS} pixels", "size")
    if limits.is_video and num_frames is not None:
        if not isinstance(num_frames, int) or num_frames < 1 or num_frames > MAX_FRAMES:
            raise InvalidRequest(f"num_frames must be an integer from 1 to {MAX_FRAMES}, got {num_frames!r}",
                                 "num_frames")
    if n is not None and (not isinstance(n, int) or not 1 <= n <= MAX_OUTPUTS):
        raise InvalidRequest(f"n must be an integer from 1 to {MAX_OUTPUTS}, got {n!r}", "n")
    for name, value in (guidance or {}).items():
        if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0):
            raise InvalidRequest(f"{name} must be a finite number >= 0, got {value!r}", name)
