"""Patch body for ``dmd2-forward-kwargs`` (see the registry in ``omni_ext.patches``).

vLLM-Omni 0.30.0's ``DMD2PipelineMixin.forward`` calls the base pipeline's forward with
``guidance_scale`` and ``num_inference_steps`` keywords that ``Wan22Pipeline.forward`` and
``QwenImagePipeline.forward`` do not take, so every DMD2 model on those bases dies in the server's
warm-up (``TypeError``). The replacement passes them only to a base forward that declares them; the
request's sampling params already carry both (``_sanitize_dmd2_request``).
"""

from __future__ import annotations

import inspect
from typing import Any

from omni_ext.patches import is_patched, patch_attr


def _forward(self: Any, req: Any, **kwargs: Any) -> Any:
    from vllm_omni.diffusion.models.dmd2.mixin import DMD2PipelineMixin

    self._sanitize_dmd2_request(req)
    kwargs.pop("guidance_scale", None)
    kwargs.pop("num_inference_steps", None)
    base_forward = super(DMD2PipelineMixin, self).forward
    dmd2 = {"guidance_scale": self.dmd2_config.guidance_scale,
            "num_inference_steps": self.dmd2_config.num_inference_steps}
    params = inspect.signature(base_forward).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        dmd2 = {k: v for k, v in dmd2.items() if k in params}
    return base_forward(req, **dmd2, **kwargs)


def apply() -> None:
    from vllm_omni.diffusion.models.dmd2.mixin import DMD2PipelineMixin

    if not is_patched(DMD2PipelineMixin.forward):
        patch_attr(DMD2PipelineMixin, "forward", _forward)
