"""Pure decisions of the tuned executor (no vLLM imports): CFG need, job cost and time limits."""

from __future__ import annotations

import math
import os
from typing import Any

# Pipelines whose CFG rule omni-ext knows; any other model is treated as "needs the whole CFG group",
# which is vLLM-Omni's own behaviour.
WAN_ARCHS = {"WanPipeline", "Wan22Pipeline", "WanT2VPipeline"}
QWEN_IMAGE_ARCHS = {"QwenImagePipeline"}


def _get(obj: Any, name: str, default: Any = None) -> Any:
    return getattr(obj, name, default) if obj is not None else default


def wan_guidance(sp: Any, default: float = 4.0) -> tuple[float, float]:
    """(guidance_low, guidance_high) exactly as Wan22Pipeline resolves them."""
    g = _get(sp, "guidance_scale") if _get(sp, "guidance_scale_provided", False) else default
    low = g if isinstance(g, (int, float)) else g[0]
    g2 = _get(sp, "guidance_scale_2")
    if _get(sp, "guidance_scale_2_provided", False) and g2 is not None:
        high = g2
    elif isinstance(g, (list, tuple)) and len(g) > 1:
        high = g[1]
    else:
        high = low
    return float(low), float(high)


def needs_cfg(model_arch: str | None, prompt: Any, sp: Any) -> bool:
    """Whether a request runs two guidance branches (and so can use a whole CFG group)."""
    if model_arch in WAN_ARCHS:
        low, high = wan_guidance(sp)
        return low > 1.0 or high > 1.0
    if model_arch in QWEN_IMAGE_ARCHS:
        scale = _get(sp, "true_cfg_scale") or 4.0
        has_neg = isinstance(prompt, dict) and (
            prompt.get("negative_prompt") is not None or prompt.get("negative_prompt_embeds") is not None
        )
        return scale > 1.0 and has_neg
    return True


def cost_units(sp: Any, cfg: bool) -> float:
    """A request's expected work in arbitrary units: steps x latent volume x branches, plus decode."""
    steps = _get(sp, "num_inference_steps") or 40
    h = _get(sp, "height") or 480
    w = _get(sp, "width") or 832
    frames = _get(sp, "num_frames") or 1
    volume = (h / 16.0) * (w / 16.0) * (1 + (max(1, int(frames)) - 1) / 4.0)
    return float(volume * (steps * (2 if cfg else 1) + 4))


def job_time_limit_s(units: float, sec_per_unit: float | None, environ: dict[str, str] | None = None) -> float | None:
    """Time limit for one job: a multiple of its expected cost, never a fixed per-forward timeout.

    ``OMNI_EXT_JOB_TIMEOUT_S`` forces a fixed limit; ``OMNI_EXT_JOB_TIMEOUT_FACTOR`` (default 10)
    scales the estimate; ``OMNI_EXT_JOB_TIMEOUT_MIN_S`` (default 120) is the floor. Before any
    request has been measured there is no estimate and no limit (worker death is still detected at
    once by the process monitor).
    """
    env = os.environ if environ is None else environ
    fixed = env.get("OMNI_EXT_JOB_TIMEOUT_S")
    if fixed:
        return float(fixed)
    if sec_per_unit is None or not math.isfinite(sec_per_unit) or sec_per_unit <= 0:
        return None
    factor = float(env.get("OMNI_EXT_JOB_TIMEOUT_FACTOR", "10"))
    floor = float(env.get("OMNI_EXT_JOB_TIMEOUT_MIN_S", "120"))
    return max(floor, factor * units * sec_per_unit)
