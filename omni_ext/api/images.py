"""OpenAI-compatible ``/v1/images/generations`` (``b64_json`` and ``url``) and ``/v1/images/edits``.

The engine call is vLLM-Omni's (same prompt and sampling-parameter construction as its own route);
added here: ``response_format=url`` served from durable storage by ``GET /v1/images/{id}/content``,
validation and admission (429 past the scheduler's bound) before anything is queued, ``priority``,
the generation accounted in the server's queue while it runs (and aborted if the client goes
away), encoding off the event loop, and OpenAI-style errors.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import random
import sqlite3
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omni_ext.api import media, schemas
from omni_ext.api.disconnect import ClientGone, run_admitted
from omni_ext.api.errors import APIError, StorageError, bad_request, generation_error, storage
from omni_ext.api.forms import (
    Body, optional_float, optional_int, parse_body, parse_size, priority_of, request_fields, with_priority,
)
from omni_ext.api.jobs import Job, JobSpec
from omni_ext.api.limits import MAX_COMPRESSION, MAX_OUTPUTS, MAX_SEED, MAX_STEPS, MIN_STEPS
from omni_ext.api.state import ApiState, engine_client, get_state, now
from omni_ext.api.validation import InvalidRequest, check_request
from omni_ext.models.families import job_shape

logger = logging.getLogger("omni_ext.api")
router = APIRouter()

_ACCEPTED = {
    "prompt", "model", "n", "size", "response_format", "output_format", "output_compression", "quality", "style",
    "background", "moderation", "user", "stream", "partial_images",
    # vLLM-Omni extensions
    "negative_prompt", "num_inference_steps", "guidance_scale", "true_cfg_scale", "seed", "generator_device",
    "extra_params", "flow_shift", "priority",
}


@dataclass(frozen=True)
class ImageReply:
    """How a generation's images go back to the client."""

    response_format: str  # ``b64_json`` or ``url``
    output_format: str  # ``png``, ``jpeg`` or ``webp``
    output_compression: int | None


def parse_generation(fields: dict[str, Any], state: ApiState) -> tuple[JobSpec, ImageReply]:
    """A generation request, parsed and checked (bounds, then the served model's limits) before any work:
    its :class:`~omni_ext.api.jobs.JobSpec` (vLLM-Omni's prompt and sampling parameters, as its own
    route builds them, with ``priority`` in their extra arguments) and how to answer it."""
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams, OmniTextPrompt

    _, prompt = request_fields(Body(fields), accepted=_ACCEPTED, served=(state.model_name, state.model_path))
    if fields.get("stream") not in (None, False, "false"):
        raise bad_request("Streaming image generation is not supported by this server.", "stream",
                          "unsupported_parameter")
    fmt = fields.get("response_format") or "b64_json"
    if not isinstance(fmt, str) or fmt not in ("b64_json", "url"):
        raise bad_request("'response_format' must be 'b64_json' or 'url'.", "response_format")
    out_fmt = fields.get("output_format") or "png"
    if not isinstance(out_fmt, str) or out_fmt not in media.IMAGE_TYPES:
        raise bad_request("'output_format' must be 'png', 'jpeg' or 'webp'.", "output_format")
    for name in ("negative_prompt", "generator_device"):
        if fields.get(name) is not None and not isinstance(fields[name], str):
            raise bad_request(f"'{name}' must be a string.", name)
    width = height = None
    if fields.get("size") not in (None, "auto"):
        width, height = parse_size(fields["size"])
    n = optional_int(fields, "n", 1, MAX_OUTPUTS, 1)
    reply = ImageReply(fmt, out_fmt, optional_int(fields, "output_compression", 0, MAX_COMPRESSION))
    steps = optional_int(fields, "num_inference_steps", MIN_STEPS, MAX_STEPS)
    guidance_scale = optional_float(fields, "guidance_scale")
    true_cfg_scale = optional_float(fields, "true_cfg_scale")
    seed = optional_int(fields, "seed", 0, MAX_SEED)
    flow_shift = optional_float(fields, "flow_shift")
    priority = priority_of(fields)
    extra_params = fields.get("extra_params")
    if extra_params is not None and not isinstance(extra_params, dict):
        raise bad_request("'extra_params' must be an object.", "extra_params")
    try:
        check_request(state.limits, width=width, height=height, steps=steps, n=n,
                      guidance={"guidance_scale": guidance_scale, "true_cfg_scale": true_cfg_scale})
    except InvalidRequest as exc:
        raise bad_request(exc.message, exc.param) from None
    negative_prompt = fields.get("negative_prompt")
    engine_prompt = OmniTextPrompt(prompt=prompt, modalities=["image"])
    if negative_prompt is not None:
        engine_prompt["negative_prompt"] = negative_prompt
    params = OmniDiffusionSamplingParams(num_outputs_per_prompt=n)
    extra = with_priority(extra_params, priority) or {}
    if flow_shift is not None:
        extra["flow_shift"] = flow_shift
    if extra:
        params.extra_args = extra
    if width is not None:
        params.width, params.height = width, height
        engine_prompt["height"], engine_prompt["width"] = height, width
    for name, value in (("num_inference_steps", steps), ("guidance_scale", guidance_scale),
                        ("true_cfg_scale", true_cfg_scale), ("generator_device", fields.get("generator_device"))):
        if value is not None:
            setattr(params, name, value)
    params.seed = seed if seed is not None else random.randint(0, MAX_SEED)
    shape = job_shape(state.limits.pipeline, width=width, height=height, steps=steps, n=n,
                      negative_prompt=negative_prompt, guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale)
    spec = JobSpec(request=(engine_prompt, params), prompt=prompt, shape=shape, priority=priority, width=width,
                   height=height, steps=steps, n=n)
    return spec, reply


async def _generate(request: Request, spec: JobSpec, request_id: str) -> list[Any]:
    """vLLM-Omni's image generation call; returns PIL images."""
    from vllm_omni.entrypoints.openai.diffusion import _generate_with_async_omni
    from vllm_omni.entrypoints.openai.images.helpers import _extract_images_from_result

    engine = engine_client(request)
    stage_configs = getattr(request.app.state, "stage_configs", None) or getattr(engine, "stage_configs", None)
    prompt, params = spec.request
    result = await _generate_with_async_omni(
        engine_client=engine, gen_params=params, stage_configs=list(stage_configs or []), prompt=prompt,
        request_id=request_id,
    )
    return _extract_images_from_result(result)


async def _respond(request: Request, state: ApiState, spec: JobSpec, reply: ImageReply,
                   images: list[Any]) -> JSONResponse:
    fmt, compression = reply.output_format, reply.output_compression
    encoded = [await media.off_loop(media.encode_image, img, fmt, compression) for img in images]
    data = []
    if reply.response_format == "b64_json":
        data = [{"b64_json": base64.b64encode(b).decode("ascii"), "revised_prompt": None} for b in encoded]
    else:
        base = str(request.base_url).rstrip("/")
        stored: list[Job] = []
        try:
            with storage("storing generated images"):
                for blob in encoded:
                    image_id = f"img_{uuid.uuid4().hex}"
                    name = f"{image_id}.{fmt}"
                    job = Job(id=image_id, kind="image", status="completed", progress=100, model=state.model_name,
                              prompt=spec.prompt, completed_at=now(), media={"image": name},
                              meta={"content_type": media.IMAGE_TYPES[fmt]})
                    if state.settings.ttl_s:
                        job.expires_at = job.completed_at + state.settings.ttl_s
                    await media.off_loop(media.write_atomic, state.media_path(name), blob)
                    stored.append(job)
                    state.store.add(job)
                    data.append({"url": f"{base}/v1/images/{image_id}/content", "revised_prompt": None})
        except StorageError:  # all of the request's images or none: no url the client never got stays behind
            for job in stored:
                state.remove_media(job)
                with contextlib.suppress(sqlite3.Error):
                    state.store.delete(job.id)
            raise
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
    spec, reply = parse_generation(body.fields, state)
    request_id = f"img_gen-{uuid.uuid4().hex}"
    admitted = state.queue.admit(request_id, spec.priority, spec.shape)  # or 429
    try:
        images = await run_admitted(request, admitted, "image", _generate(request, spec, request_id))
    except ClientGone:
        raise
    except Exception as exc:
        raise generation_error(exc, "Image generation", request_id) from None
    if not images:
        raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR, "The model returned no image.", code="generation_failed")
    return await _respond(request, state, spec, reply, images)


@router.get("/v1/images/{image_id}/content")
async def image_content(request: Request, image_id: str) -> Response:
    state = get_state(request)
    job = state.find_job("image", image_id)
    data = await state.read_media(job, "image", f"Image {image_id}")
    return Response(data, media_type=job.meta.get("content_type", "image/png"))
