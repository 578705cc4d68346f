"""Patch body for ``validate-diffusion-requests`` (see the registry in ``omni_ext.patches``).

Wraps ``AsyncOmni.generate`` so every diffusion request is checked against the served model's
limits (``omni_ext.api.validation``) before it is queued. Failures raise vLLM-Omni's own
``OmniClientError`` (HTTP 400 with an OpenAI-style body on every route); nothing reaches the
engine, so the server keeps serving.
"""

from __future__ import annotations

import functools

from omni_ext.patches import patch_attr


def _diffusion_params(sampling_params_list) -> list:
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    return [p for p in (sampling_params_list or ()) if isinstance(p, OmniDiffusionSamplingParams)]


def apply() -> None:
    from vllm_omni.entrypoints.async_omni import AsyncOmni
    from vllm_omni.errors import OmniClientError

    from omni_ext.api.intake import InvalidRequest
    from omni_ext.api.validation import check_sampling_params, limits_for_model

    original = AsyncOmni.generate

    @functools.wraps(original)
    async def generate(self, *args, **kwargs):
        params = _diffusion_params(kwargs.get("sampling_params_list"))
        if params:
            limits = limits_for_model(str(getattr(self, "model", "") or ""))
            try:
                for p in params:
                    check_sampling_params(p, limits)
            except InvalidRequest as exc:
                raise OmniClientError(exc.message, status_code=400, error_type="invalid_request_error") from exc
        async for out in original(self, *args, **kwargs):
            yield out

    patch_attr(AsyncOmni, "generate", generate)
