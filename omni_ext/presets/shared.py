"""What the planner, the renderer and the checker of presets share, in a module that imports none of them.

Why a leaf: all three read the same facts about a preset (its request in the planner's terms,
whether that request runs CFG, where omni-ext's TunedExecutor applies). Kept in any one of them,
the other two import it back and the modules import each other. The rules underneath are not
written here: a size parses as the API parses a request's (:func:`omni_ext.api.intake.parse_size`),
CFG follows the family table (:func:`omni_ext.models.families.needs_cfg`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from omni_ext.api.errors import APIError
from omni_ext.api.intake import parse_size as parse_request_size
from omni_ext.models.families import needs_cfg
from omni_ext.presets.catalog import Preset, PresetError
from omni_ext.presets.costs import CostTable, ModelSpec, Topology, load_cost_table
from omni_ext.scheduler import layout


def parse_size(size: Any) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` as ``(width, height)``, or :class:`PresetError`: a preset's size is sent as a request's."""
    try:
        return parse_request_size(size)
    except APIError:
        raise PresetError(f"size must look like 832x480, got {size!r}") from None


@dataclass(frozen=True)
class PresetSampling:
    """A preset's request as the family table reads sampling params (by attribute, like vLLM-Omni's):
    fields left None take the family's native values."""

    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: Any = None
    guidance_scale_provided: bool = False
    guidance_scale_2: Any = None
    guidance_scale_2_provided: bool = False
    true_cfg_scale: Any = None


def planner_request(preset: Preset) -> dict[str, Any]:
    """The preset's request in the planner's terms."""
    req = preset.request_defaults
    out: dict[str, Any] = {}
    if "size" in req:
        out["width"], out["height"] = parse_size(req["size"])
    if "num_frames" in req:
        out["num_frames"] = int(req["num_frames"])
    if "num_inference_steps" in req:
        out["steps"] = int(req["num_inference_steps"])
    return out


def requests_use_cfg(preset: Preset, costs: CostTable) -> bool:
    """Whether this preset's requests run CFG (Qwen-Image: only with a negative prompt).

    The family table's rule on the preset's request defaults; a guidance scale they leave unset is
    the cost table's reference request's (the one the estimates are for), else the family's default.
    """
    spec = costs.model(preset.model)
    req = preset.request_defaults
    guidance = req.get("guidance_scale", spec.reference.get("guidance_scale"))
    sp = PresetSampling(guidance_scale=guidance, guidance_scale_provided=guidance is not None,
                        guidance_scale_2=req.get("guidance_scale_2"),
                        guidance_scale_2_provided="guidance_scale_2" in req, true_cfg_scale=req.get("true_cfg_scale"))
    return needs_cfg(spec.pipeline_class, {"negative_prompt": req.get("negative_prompt")}, sp)


def tuned_executor_refusal(preset: Preset, costs: CostTable | None = None) -> str | None:
    """Why omni-ext's TunedExecutor does not apply to ``preset`` (None: it does, and the preset should select it).

    The executor's own refusals (:func:`omni_ext.scheduler.layout.tuned_refusal`), plus the family
    table's ``tuned_class``: only
    families with omni-ext's tuned pipeline (Wan2.1/2.2 T2V, Qwen-Image) gain from it. A preset
    that selected it where it refuses would not start at all.
    """
    costs = costs or load_cost_table()
    return tuned_refusal(costs.model(preset.model), preset.topology, preset.engine)


def tuned_refusal(spec: ModelSpec, topo: Topology, engine: dict[str, Any] | None = None) -> str | None:
    """:func:`tuned_executor_refusal` for a model and topology (what the planner has before any preset)."""
    family = spec.family
    if family is None or family.tuned_class is None:
        return f"{spec.label} has no omni-ext tuned pipeline (omni_ext/models/families.py tuned_class)"
    refusal = layout.tuned_refusal(dataclasses.replace(topo, step_execution=bool((engine or {}).get("step_execution"))))
    return None if refusal is None else refusal.reason
