"""OpenAI-compatible ``/v1/images/generations`` (``b64_json`` and ``url``) and ``/v1/images/edits``.

The engine call is vLLM-Omni's (same prompt and sampling-parameter construction as its own route);
added here: ``response_format=url`` served from durable storage by ``GET /v1/images/{id}/content``,
validation before anything is queued, encoding off the event loop, and OpenAI-style errors.
"""

from __future__ import annotations

import base64
import logging
import random
import time
import uuid
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omni_ext.api import media, schemas
from omni_ext.api.errors import APIError, not_found
from omni_ext.api.forms import parse_body
from omni_ext.api.jobs import Job
from omni_ext.api.state import ApiState, engine_client, get_state, now
from omni_ext.api.validation import InvalidRequest, check_sampling_params
from omni_ext.api.videos import ID_RE

logger = logging.getLogger("omni_ext.api")
router = APIRouter()

_ACCEPTED = {
    "prompt", "model", "n", "size", "response_format", "output_format", "output_compression", "quality", "style",
    "background", "moderation", "user", "stream", "partial_images",
    # vLLM-Omni extensions
    "negative_prompt", "num_inference_steps", "guidance_scale", "true_cfg_scale", "seed", "generator_device",
    "extra_params", "flow_shift",
}
# Pipelines whose vLLM-Omni implementation accepts an input image.
_EDIT_PIPELINES = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline", "FluxKontextPipeline")


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def _int(fields: dict[str, Any], name: str, lo: int, hi: int, default: int | None) -> int | None:
    value = fields.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().lstrip("-").isdigit():
        raise _bad(f"'{name}' must be an integer, got {value!r}.", name)
    number = int(value)
    if not lo <= number <= hi:
        raise _bad(f"'{name}' must be between {lo} and {hi}, got {number}.", name)
    return number


def _float(fields: dict[str, Any], name: str) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise _bad(f"'{name}' must be a number, got {value!r}.", name) from None


def parse_generation(fields: dict[str, Any], state: ApiState) -> dict[str, Any]:
    unknown = sorted(set(fields) - _ACCEPTED)
    if unknown:
        raise _bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise _bad("'prompt' is required and must be a non-empty string.", "prompt", "missing_required_parameter")
    model = fields.get("model")
    if not isinstance(model, (str, type(None))):
        raise _bad("'model' must be a string.", "model")
    if model not in (None, "", state.model_name, state.model_path):
        raise APIError(HTTPStatus.NOT_FOUND, f"The model '{model}' does not exist on this server (serving "
                       f"'{state.model_name}').", param="model", code="model_not_found")
    if fields.get("stream") not in (None, False, "false"):
        raise _bad("Streaming image generation is not supported by this server.", "stream", "unsupported_parameter")
    fmt = fields.get("response_format") or "b64_json"
    if not isinstance(fmt, str) or fmt not in ("b64_json", "url"):
        raise _bad("'response_format' must be 'b64_json' or 'url'.", "response_format")
    out_fmt = fields.get("output_format") or "png"
    if not isinstance(out_fmt, str) or out_fmt not in media.IMAGE_TYPES:
        raise _bad("'output_format' must be 'png', 'jpeg' or 'webp'.", "output_format")
    for name in ("negative_prompt", "generator_device", "model"):
        if fields.get(name) is not None and not isinstance(fields[name], str):
            raise _bad(f"'{name}' must be a string.", name)
    width = height = None
    size = fields.get("size")
    if size not in (None, "auto"):
        from omni_ext.api.videos import _size

        width, height = _size(size)
    parsed = {
        "prompt": prompt, "n": _int(fields, "n", 1, 10, 1), "width": width, "height": height,
        "response_format": fmt, "output_format": out_fmt,
        "output_compression": _int(fields, "output_compression", 0, 100, None),
        "negative_prompt": fields.get("negative_prompt"),
        "num_inference_steps": _int(fields, "num_inference_steps", 1, 1000, None),
        "guidance_scale": _float(fields, "guidance_scale"), "true_cfg_scale": _float(fields, "true_cfg_scale"),
        "seed": _int(fields, "seed", 0, 2**32 - 1, None), "generator_device": fields.get("generator_device"),
        "extra_params": fields.get("extra_params"), "flow_shift": _float(fields, "flow_shift"),
    }
    if parsed["extra_params"] is not None and not isinstance(parsed["extra_params"], dict):
        raise _bad("'extra_params' must be an object.", "extra_params")
    try:
        check_sampling_params(
            SimpleNamespace(height=height, width=width, num_inference_steps=parsed["num_inference_steps"],
                            guidance_scale=parsed["guidance_scale"], true_cfg_scale=parsed["true_cfg_scale"],
                            num_outputs_per_prompt=parsed["n"]),
            state.limits,
        )
    except InvalidRequest as exc:
        raise _bad(exc.message, exc.param) from None
    return parsed


async def _generate(request: Request, p: dict[str, Any]) -> list[Any]:
    """vLLM-Omni's image generation call; returns PIL images."""
    from vllm_omni.entrypoints.openai.diffusion import _generate_with_async_omni
    from vllm_omni.entrypoints.openai.images.helpers import _extract_images_from_result
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams, OmniTextPrompt

    engine = engine_client(request)
    stage_configs = getattr(request.app.state, "stage_configs", None) or getattr(engine, "stage_configs", None)
    prompt = OmniTextPrompt(prompt=p["prompt"], modalities=["image"])
    if p["negative_prompt"] is not None:
        prompt["negative_prompt"] = p["negative_prompt"]
    params = OmniDiffusionSamplingParams(num_outputs_per_prompt=p["n"])
    extra = dict(p["extra_params"] or {})
    if p["flow_shift"] is not None:
        extra["flow_shift"] = p["flow_shift"]
    if extra:
        params.extra_args = extra
    if p["width"] is not None:
        params.width, params.height = p["width"], p["height"]
        prompt["height"], prompt["width"] = p["height"], p["width"]
    for name in ("num_inference_steps", "guidance_scale", "true_cfg_scale", "generator_device"):
        if p[name] is not None:
            setattr(params, name, p[name])
    params.seed = p["seed"] if p["seed"] is not None else random.randint(0, 2**32 - 1)
    result = await _generate_with_async_omni(
        engine_client=engine, gen_params=params, stage_configs=list(stage_configs or []), prompt=prompt,
        request_id=f"img_gen-{uuid.uuid4().hex}",
    )
    return _extract_images_from_result(result)


async def _respond(request: Request, state: ApiState, p: dict[str, Any], images: list[Any]) -> JSONResponse:
    fmt, compression = p["output_format"], p["output_compression"]
    encoded = [await media.off_loop(media.encode_image, img, fmt, compression) for img in images]
    data = []
    if p["response_format"] == "b64_json":
        data = [{"b64_json": base64.b64encode(b).decode("ascii"), "revised_prompt": None} for b in encoded]
    else:
        base = str(request.base_url).rstrip("/")
        for blob in encoded:
            image_id = f"img_{uuid.uuid4().hex}"
            name = f"{image_id}.{fmt}"
            await media.off_loop(media.write_atomic, state.media_path(name), blob)
            job = Job(id=image_id, kind="image", status="completed", progress=100, model=state.model_name,
                      prompt=p["prompt"], completed_at=now(), media={"image": name},
                      meta={"content_type": media.IMAGE_TYPES[fmt]})
            if state.settings.ttl_s:
                job.expires_at = job.completed_at + state.settings.ttl_s
            state.store.add(job)
            data.append({"url": f"{base}/v1/images/{image_id}/content", "revised_prompt": None})
    size = f"{images[0].width}x{images[0].height}" if images else None
    return JSONResponse({"created": int(time.time()), "data": data, "output_format": fmt, "size": size})


def _check_json(request: Request) -> None:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise APIError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "Send the image generation request as application/json.",
                       code="unsupported_media_type")


@router.post("/v1/images/generations", openapi_extra=schemas.body(schemas.IMAGE_GENERATE))
async def generate_images(request: Request) -> JSONResponse:
    state = get_state(request)
    _check_json(request)
    body = await parse_body(request, state.settings.max_upload_bytes, allow_files=False)
    p = parse_generation(body.fields, state)
    try:
        images = await _generate(request, p)
    except APIError:
        raise
    except Exception as exc:
        from omni_ext.api.videos import _client_error

        client = _client_error(exc)
        if client is not None:
            raise client from None
        logger.exception("omni-ext image generation failed")
        raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"Image generation failed: {exc}",
                       code="generation_failed") from None
    if not images:
        raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR, "The model returned no image.", code="generation_failed")
    return await _respond(request, state, p, images)


def supports_edits(pipeline: str | None) -> bool:
    return (pipeline or "") in _EDIT_PIPELINES


async def edits_unsupported(request: Request) -> JSONResponse:
    """``POST /v1/images/edits`` on a model that cannot edit: a clear 400 (vLLM-Omni's route serves the rest)."""
    state = get_state(request)
    raise APIError(HTTPStatus.BAD_REQUEST, f"The served model ({state.limits.pipeline or 'unknown'}) does not "
                   "support image edits; use /v1/images/generations.", param="image", code="unsupported_model")


@router.get("/v1/images/{image_id}/content")
async def image_content(request: Request, image_id: str) -> Response:
    state = get_state(request)
    if not ID_RE.match(image_id):
        raise APIError(HTTPStatus.BAD_REQUEST, "Invalid image id.", param="image_id", code="invalid_id")
    job = state.store.get(image_id)
    if job is None or job.kind != "image":
        raise not_found("image", image_id)
    name = job.media.get("image")
    if not name:
        raise APIError(HTTPStatus.NOT_FOUND, f"Image {image_id} has expired.", param="image_id", code="image_expired")
    try:
        data = await media.off_loop(state.media_path(name).read_bytes)
    except FileNotFoundError:
        raise APIError(HTTPStatus.NOT_FOUND, f"Image {image_id} is no longer stored.", param="image_id",
                       code="image_content_missing") from None
    return Response(data, media_type=job.meta.get("content_type", "image/png"))
