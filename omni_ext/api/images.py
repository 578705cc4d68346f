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
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omni_ext.api import media, schemas
from omni_ext.api.disconnect import ClientGone, run_admitted
from omni_ext.api.errors import APIError, StorageError, bad_request, generation_error, storage
from omni_ext.api.forms import (
    check_known, check_model, check_prompt, optional_float, optional_int, parse_body, parse_size, priority_of,
)
from omni_ext.api.jobs import Job
from omni_ext.api.limits import MAX_COMPRESSION, MAX_OUTPUTS, MAX_SEED, MAX_STEPS, MIN_STEPS
from omni_ext.api.queue import JobShape, job_shape, with_priority
from omni_ext.api.state import ApiState, engine_client, get_state, now
from omni_ext.api.validation import InvalidRequest, check_request

logger = logging.getLogger("omni_ext.api")
router = APIRouter()

_ACCEPTED = {
    "prompt", "model", "n", "size", "response_format", "output_format", "output_compression", "quality", "style",
    "background", "moderation", "user", "stream", "partial_images",
    # vLLM-Omni extensions
    "negative_prompt", "num_inference_steps", "guidance_scale", "true_cfg_scale", "seed", "generator_device",
    "extra_params", "flow_shift", "priority",
}


def parse_generation(fields: dict[str, Any], state: ApiState) -> dict[str, Any]:
    """A generation request's fields, parsed and checked (bounds, then the served model's limits) before any work."""
    check_known(fields, _ACCEPTED)
    prompt = check_prompt(fields)
    check_model(fields, state.model_name, state.model_path)
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
    parsed = {
        "prompt": prompt, "n": optional_int(fields, "n", 1, MAX_OUTPUTS, 1), "width": width, "height": height,
        "response_format": fmt, "output_format": out_fmt,
        "output_compression": optional_int(fields, "output_compression", 0, MAX_COMPRESSION),
        "negative_prompt": fields.get("negative_prompt"),
        "num_inference_steps": optional_int(fields, "num_inference_steps", MIN_STEPS, MAX_STEPS),
        "guidance_scale": optional_float(fields, "guidance_scale"),
        "true_cfg_scale": optional_float(fields, "true_cfg_scale"),
        "seed": optional_int(fields, "seed", 0, MAX_SEED), "generator_device": fields.get("generator_device"),
        "extra_params": fields.get("extra_params"), "flow_shift": optional_float(fields, "flow_shift"),
        "priority": priority_of(fields),
    }
    if parsed["extra_params"] is not None and not isinstance(parsed["extra_params"], dict):
        raise bad_request("'extra_params' must be an object.", "extra_params")
    try:
        check_request(state.limits, width=width, height=height, steps=parsed["num_inference_steps"], n=parsed["n"],
                      guidance={name: parsed[name] for name in ("guidance_scale", "true_cfg_scale")})
    except InvalidRequest as exc:
        raise bad_request(exc.message, exc.param) from None
    return parsed


def image_shape(pipeline: str | None, p: dict[str, Any]) -> JobShape:
    """What a parsed generation request costs (:func:`omni_ext.api.queue.job_shape`)."""
    return job_shape(pipeline, width=p["width"], height=p["height"], steps=p["num_inference_steps"], n=p["n"],
                     negative_prompt=p["negative_prompt"], guidance_scale=p["guidance_scale"],
                     true_cfg_scale=p["true_cfg_scale"])


async def _generate(request: Request, p: dict[str, Any], request_id: str) -> list[Any]:
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
    extra = with_priority(p["extra_params"], p["priority"]) or {}
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
    params.seed = p["seed"] if p["seed"] is not None else random.randint(0, MAX_SEED)
    result = await _generate_with_async_omni(
        engine_client=engine, gen_params=params, stage_configs=list(stage_configs or []), prompt=prompt,
        request_id=request_id,
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
        stored: list[Job] = []
        try:
            with storage("storing generated images"):
                for blob in encoded:
                    image_id = f"img_{uuid.uuid4().hex}"
                    name = f"{image_id}.{fmt}"
                    job = Job(id=image_id, kind="image", status="completed", progress=100, model=state.model_name,
                              prompt=p["prompt"], completed_at=now(), media={"image": name},
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
    p = parse_generation(body.fields, state)
    request_id = f"img_gen-{uuid.uuid4().hex}"
    state.queue.admit(request_id, p["priority"], image_shape(state.limits.pipeline, p))  # or 429
    try:
        images = await run_admitted(request, state, request_id, "image", _generate(request, p, request_id))
    except ClientGone:
        raise
    except Exception as exc:
        raise generation_error(exc, "Image generation", request_id) from None
    if not images:
        raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR, "The model returned no image.", code="generation_failed")
    return await _respond(request, state, p, images)


@router.get("/v1/images/{image_id}/content")
async def image_content(request: Request, image_id: str) -> Response:
    state = get_state(request)
    job = state.find_job("image", image_id)
    data = await state.read_media(job, "image", f"Image {image_id}")
    return Response(data, media_type=job.meta.get("content_type", "image/png"))
