"""OpenAI-compatible ``/v1/videos`` (async jobs) and vLLM-Omni's ``/v1/videos/sync``.

Generation itself is vLLM-Omni's (``OmniOpenAIServingVideo._run_and_extract``: defaults, LoRA,
reference media, the engine call); this module owns what is around it: one body parser for JSON and
multipart, OpenAI's ``seconds``/``size`` mapped to the model's native frames and fps, validation
before a job exists, durable job records, step progress and ``openai-poll-after-ms``, cancellation,
and MP4/thumbnail encoding off the event loop.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import time
import uuid
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omni_ext.api import media, schemas
from omni_ext.api.errors import APIError, from_pydantic, not_found
from omni_ext.api.forms import Body, parse_body
from omni_ext.api.jobs import Job
from omni_ext.progress import clear_progress, read_progress
from omni_ext.api.state import VIDEO_DEFAULTS, ApiState, engine_client, get_state, now
from omni_ext.api.validation import InvalidRequest, check_sampling_params

logger = logging.getLogger("omni_ext.api")
router = APIRouter()

ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
POLL_MIN_MS, POLL_MAX_MS = 100, 5000
_OWN_FIELDS = {"seconds", "size", "input_reference"}


# ---- request building -------------------------------------------------------------------------
def _video_request_fields() -> set[str]:
    from vllm_omni.entrypoints.openai.protocol.videos import VideoGenerationRequest

    return set(VideoGenerationRequest.model_fields)


def _positive_int(value: Any, name: str, upper: int) -> int:
    try:
        number = float(str(value).strip())
    except ValueError:
        number = float("nan")
    if number != number or not number.is_integer():  # NaN, inf or fractional
        raise APIError(HTTPStatus.BAD_REQUEST, f"'{name}' must be a positive integer, got {value!r}.", param=name,
                       code="invalid_value")
    if not 1 <= number <= upper:
        raise APIError(HTTPStatus.BAD_REQUEST, f"'{name}' must be between 1 and {upper}, got {value!r}.", param=name,
                       code="invalid_value")
    return int(number)


def _size(value: Any) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*", str(value))
    if not m:
        raise APIError(HTTPStatus.BAD_REQUEST, f"'size' must look like WIDTHxHEIGHT (e.g. 832x480), got {value!r}.",
                       param="size", code="invalid_value")
    return int(m.group(1)), int(m.group(2))


def _reference_image(body: Body, state: ApiState) -> Any:
    """The uploaded ``input_reference`` (file or ``{"image_url": data-URL}``) as a PIL image."""
    raw: bytes | None = None
    if "input_reference" in body.files:
        raw = body.files["input_reference"][2]
    else:
        ref = body.fields.get("input_reference")
        if isinstance(ref, dict) and isinstance(ref.get("image_url"), str):
            url = ref["image_url"]
            if not url.startswith("data:") or ";base64," not in url:
                raise APIError(HTTPStatus.BAD_REQUEST, "input_reference.image_url must be a base64 data URL here "
                               "(this server does not fetch remote URLs).", param="input_reference", code="invalid_value")
            import base64

            try:
                raw = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
            except ValueError:
                raise APIError(HTTPStatus.BAD_REQUEST, "input_reference.image_url is not valid base64.",
                               param="input_reference", code="invalid_value") from None
        elif ref is not None:
            raise APIError(HTTPStatus.BAD_REQUEST, "input_reference must be an image file or {\"image_url\": ...}.",
                           param="input_reference", code="invalid_value")
    if raw is None:
        return None
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(raw))
        img.load()
    except (UnidentifiedImageError, OSError):
        raise APIError(HTTPStatus.BAD_REQUEST, "input_reference is not a readable image.", param="input_reference",
                       code="invalid_image") from None
    if state.limits.pipeline in ("WanPipeline", "QwenImagePipeline"):
        raise APIError(HTTPStatus.BAD_REQUEST, f"The served model ({state.limits.pipeline}) generates from text only "
                       "and cannot use input_reference.", param="input_reference", code="unsupported_parameter")
    return img.convert("RGB")


def configured_defaults(handler: Any) -> dict[str, Any]:
    """Video fields the operator configured as server defaults (deploy YAML / --default-sampling-params).

    They win over the model's native defaults below, so a preset's size and frame count apply to
    requests that do not name their own.
    """
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    try:
        configured = handler._resolve_default_sampling_params()
    except Exception:
        return {}
    blank = OmniDiffusionSamplingParams()
    return {k: getattr(configured, k) for k in ("width", "height", "num_frames", "fps")
            if getattr(configured, k, None) is not None and getattr(configured, k) != getattr(blank, k)}


def build_video_request(body: Body, state: ApiState, configured: dict[str, Any] | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """(vLLM-Omni VideoGenerationRequest, reference image or None, facts for the job record)."""
    from vllm_omni.entrypoints.openai.protocol.videos import VideoGenerationRequest

    if not state.limits.is_video:
        raise APIError(HTTPStatus.BAD_REQUEST, f"The served model ({state.limits.pipeline or 'unknown'}) does not "
                       "generate video; use /v1/images/generations.", code="unsupported_model")
    fields = dict(body.fields)
    allowed = _video_request_fields() | _OWN_FIELDS
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise APIError(HTTPStatus.BAD_REQUEST, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                       code="unknown_parameter")
    unknown_files = sorted(set(body.files) - {"input_reference"})
    if unknown_files:
        raise APIError(HTTPStatus.BAD_REQUEST, f"Unexpected file field: {unknown_files[0]}", param=unknown_files[0],
                       code="unknown_parameter")
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise APIError(HTTPStatus.BAD_REQUEST, "'prompt' is required and must be a non-empty string.", param="prompt",
                       code="missing_required_parameter")
    model = fields.get("model")
    if not isinstance(model, (str, type(None))):
        raise APIError(HTTPStatus.BAD_REQUEST, "'model' must be a string.", param="model", code="invalid_value")
    if model not in (None, "", state.model_name, state.model_path):
        raise APIError(HTTPStatus.NOT_FOUND, f"The model '{model}' does not exist on this server (serving "
                       f"'{state.model_name}').", param="model", code="model_not_found")
    fields.pop("model", None)
    # The operator's configured defaults (a preset's size/frames/fps) win over the model's native ones.
    native = {**VIDEO_DEFAULTS.get(state.limits.pipeline or "", {}), **(configured or {})}
    if "size" in fields:
        fields["width"], fields["height"] = _size(fields.pop("size"))
    elif "width" in native and "height" in native and "width" not in fields and "height" not in fields:
        fields["width"], fields["height"] = native["width"], native["height"]
    seconds = fields.pop("seconds", None)
    if seconds is not None:
        secs = _positive_int(seconds, "seconds", 60)
        fps = _positive_int(fields.get("fps") or native.get("fps", 16), "fps", 240)
        fields.setdefault("fps", fps)
        if "num_frames" not in fields:
            frames = secs * fps
            fields["num_frames"] = frames // 4 * 4 + 1 if state.limits.is_video else frames
    else:
        for key in ("fps", "num_frames"):
            if key in native:
                fields.setdefault(key, native[key])
    ref_image = _reference_image(body, state)
    fields.pop("input_reference", None)
    try:
        vreq = VideoGenerationRequest(**fields)
    except Exception as exc:  # pydantic.ValidationError
        raise from_pydantic(exc) from None
    vp = vreq.resolve_video_params()
    try:
        check_sampling_params(
            SimpleNamespace(height=vp.height, width=vp.width, num_frames=vp.num_frames,
                            num_inference_steps=vreq.num_inference_steps, guidance_scale=vreq.guidance_scale,
                            true_cfg_scale=vreq.true_cfg_scale, guidance_scale_2=getattr(vreq, "guidance_scale_2", None),
                            num_outputs_per_prompt=vreq.num_outputs_per_prompt or 1),
            state.limits,
        )
    except InvalidRequest as exc:
        raise APIError(HTTPStatus.BAD_REQUEST, exc.message, param=exc.param, code="invalid_value") from None
    fps = vp.fps or native.get("fps") or 16
    facts = {
        "width": vp.width, "height": vp.height, "num_frames": vp.num_frames, "fps": fps,
        "steps": vreq.num_inference_steps,
        "seconds": str(seconds) if seconds is not None else str(max(1, round((vp.num_frames or 1) / fps))),
    }
    return vreq, ref_image, facts


# ---- generation -------------------------------------------------------------------------------
def _handler(request: Request) -> Any:
    handler = getattr(request.app.state, "openai_serving_video", None)
    if handler is None or not hasattr(handler, "_run_and_extract"):
        raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "Video generation is not available on this server.",
                       code="video_unavailable")
    stage_configs = getattr(request.app.state, "stage_configs", None)
    if stage_configs and hasattr(handler, "set_stage_configs_if_missing"):
        handler.set_stage_configs_if_missing(stage_configs)
    return handler


def _client_error(exc: BaseException) -> APIError | None:
    from fastapi import HTTPException
    from vllm_omni.errors import OmniClientError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, OmniClientError):
        return APIError(exc.status_code, exc.message, code="invalid_value")
    if isinstance(exc, HTTPException) and 400 <= exc.status_code < 500:
        return APIError(exc.status_code, str(exc.detail), code="invalid_value")
    return None


async def generate_mp4(handler: Any, vreq: Any, request_id: str, ref_image: Any, on_started=None) -> tuple[bytes, Any]:
    """Run vLLM-Omni's generation, then encode the MP4 off the event loop exactly as vLLM-Omni does."""
    from vllm_omni.entrypoints.openai.serving_video import ReferenceImage
    from vllm_omni.entrypoints.openai.video_api_utils import _encode_video_bytes

    artifacts = await handler._run_and_extract(
        vreq, request_id, reference_image=ReferenceImage(data=ref_image) if ref_image is not None else None,
        on_started=on_started,
    )
    video = artifacts.videos[0]
    if isinstance(video, bytes):  # pre-encoded by the worker (extra_params.preencode_mp4)
        return video, artifacts
    options = {"preset": "ultrafast", "threads": "0"}
    if isinstance(vreq.extra_params, dict) and "video_codec_options" in vreq.extra_params:
        options = vreq.extra_params["video_codec_options"]
    audio = artifacts.audios[0] if artifacts.audios else None
    extra = {"audio": audio, "audio_sample_rate": artifacts.audio_sample_rate} if audio is not None else {}
    mp4 = await media.off_loop(
        _encode_video_bytes, video, fps=artifacts.output_fps, video_codec_options=options,
        frame_converter=getattr(handler, "_video_frame_converter", None), **extra,
    )
    return mp4, artifacts


async def _run_job(state: ApiState, handler: Any, job: Job, vreq: Any, ref_image: Any) -> None:
    started = time.monotonic()

    async def on_started() -> None:
        if job.status == "queued":
            job.status, job.progress = "in_progress", max(job.progress, 1)
            job.meta["started_at"] = time.time()
            state.store.save(job)

    try:
        mp4, artifacts = await generate_mp4(handler, vreq, job.id, ref_image, on_started=on_started)
        job.status = "in_progress"
        job.progress = max(job.progress, 95)
        job.meta["encoding"] = True
        state.store.save(job)
        thumb = await media.off_loop(media.mp4_thumbnail, mp4)
        await media.off_loop(media.write_atomic, state.media_path(f"{job.id}.mp4"), mp4)
        await media.off_loop(media.write_atomic, state.media_path(f"{job.id}.webp"), thumb)
        job.media = {"video": f"{job.id}.mp4", "thumbnail": f"{job.id}.webp"}
        job.status, job.progress, job.completed_at = "completed", 100, now()
        if state.settings.ttl_s:
            job.expires_at = job.completed_at + state.settings.ttl_s
        job.meta.update({
            "inference_time_s": round(time.monotonic() - started, 3),
            "stage_durations": artifacts.stage_durations,
            "peak_memory_mb": artifacts.peak_memory_mb,
            "fps": artifacts.output_fps,
        })
        job.meta.pop("encoding", None)
        state.record_duration(time.monotonic() - started)
        state.store.save(job)
        logger.info("omni-ext video %s completed in %.2f s", job.id, time.monotonic() - started)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # the job fails cleanly; the server keeps serving
        client = _client_error(exc)
        job.status, job.completed_at = "failed", now()
        if client is not None:
            job.error_code, job.error_message = client.code or "invalid_request", client.message
        else:
            logger.exception("omni-ext video %s failed", job.id)
            job.error_code, job.error_message = "generation_failed", f"Video generation failed: {exc}"
        state.store.save(job)
    finally:
        clear_progress(job.id)
        state.tasks.pop(job.id, None)


# ---- views ------------------------------------------------------------------------------------
def _live_progress(state: ApiState, job: Job) -> tuple[int, float | None]:
    """(monotone progress 0-100, predicted seconds remaining) for a job, from worker step reports."""
    if not job.active:
        return job.progress, 0.0
    remaining: float | None = None
    progress = job.progress
    if job.meta.get("encoding"):
        progress = max(progress, 95)
        remaining = 0.2
    elif job.status == "in_progress":
        step = read_progress(job.id)
        if step is not None:
            progress = max(progress, 2 + int(88 * step.fraction))
            rest = step.remaining_s()
            if rest is not None:
                remaining = rest * 1.15  # plus VAE decode and encoding, ~15 % of denoising
    else:  # queued
        ahead = sum(1 for j in state.tasks if j != job.id) if state.tasks else 0
        if state.job_seconds is not None:
            remaining = state.job_seconds * max(1, ahead)
    if progress != job.progress:
        job.progress = progress
        state.store.save(job)
    return progress, remaining


def poll_after_ms(remaining_s: float | None) -> int:
    """How long a client should wait before polling again: a quarter of the predicted remaining time."""
    if remaining_s is None:
        return 1000
    return int(min(POLL_MAX_MS, max(POLL_MIN_MS, remaining_s * 1000 / 4)))


def video_object(job: Job) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "id": job.id, "object": "video", "model": job.model, "status": job.status, "progress": job.progress,
        "created_at": job.created_at, "completed_at": job.completed_at, "expires_at": job.expires_at,
        "prompt": job.prompt, "seconds": job.seconds, "size": job.size, "remixed_from_video_id": None,
        "error": {"code": job.error_code, "message": job.error_message} if job.status == "failed" else None,
    }
    for key in ("num_frames", "fps", "inference_time_s", "peak_memory_mb", "stage_durations"):
        if key in job.meta:
            obj[key] = job.meta[key]
    return obj


def _video_response(state: ApiState, job: Job) -> JSONResponse:
    _, remaining = _live_progress(state, job)
    headers = {"openai-poll-after-ms": str(poll_after_ms(remaining))} if job.active else None
    return JSONResponse(video_object(job), headers=headers)


def _job_or_404(state: ApiState, video_id: str) -> Job:
    if not ID_RE.match(video_id):
        raise APIError(HTTPStatus.BAD_REQUEST, "Invalid video id.", param="video_id", code="invalid_id")
    job = state.store.get(video_id)
    if job is None or job.kind != "video":
        raise not_found("video", video_id)
    return job


async def _parse_create(request: Request) -> tuple[ApiState, Any, Any, Any, dict[str, Any]]:
    """What both create routes start with: (state, vLLM-Omni handler, request, reference image, facts)."""
    state = get_state(request)
    engine_client(request)
    body = await parse_body(request, state.settings.max_upload_bytes)
    handler = _handler(request)
    vreq, ref_image, facts = build_video_request(body, state, configured_defaults(handler))
    return state, handler, vreq, ref_image, facts


# ---- routes -----------------------------------------------------------------------------------
@router.post("/v1/videos", openapi_extra=schemas.body(schemas.VIDEO_CREATE, multipart=True))
async def create_video(request: Request) -> JSONResponse:
    state, handler, vreq, ref_image, facts = await _parse_create(request)
    if state.store.count_active("video") >= state.settings.max_queued:
        raise APIError(HTTPStatus.TOO_MANY_REQUESTS, f"Too many queued videos (limit {state.settings.max_queued}); "
                       "retry later.", code="queue_full", headers={"retry-after": "5"})
    job = Job(
        id=f"video_{uuid.uuid4().hex}", kind="video", model=state.model_name, prompt=vreq.prompt,
        seconds=facts["seconds"], size=f"{facts['width']}x{facts['height']}",
        meta={"num_frames": facts["num_frames"], "fps": facts["fps"]},
    )
    state.store.add(job)
    state.tasks[job.id] = asyncio.create_task(_run_job(state, handler, job, vreq, ref_image))
    logger.info("omni-ext video %s queued (%s, %s frames, %s steps)", job.id, job.size, facts["num_frames"], facts["steps"])
    return _video_response(state, job)


@router.post("/v1/videos/sync", openapi_extra=schemas.body(schemas.VIDEO_CREATE, multipart=True))
async def create_video_sync(request: Request) -> Response:
    import os

    state, handler, vreq, ref_image, _facts = await _parse_create(request)
    request_id = f"video_sync-{uuid.uuid4().hex}"
    timeout = float(os.environ.get("VLLM_OMNI_VIDEO_SYNC_TIMEOUT", "600"))
    started = time.perf_counter()
    try:
        mp4, artifacts = await asyncio.wait_for(generate_mp4(handler, vreq, request_id, ref_image), timeout=timeout)
    except asyncio.TimeoutError:
        raise APIError(HTTPStatus.GATEWAY_TIMEOUT, f"Video generation timed out after {timeout:.0f} s.",
                       code="timeout") from None
    except Exception as exc:
        client = _client_error(exc)
        if client is not None:
            raise client from None
        logger.exception("omni-ext sync video %s failed", request_id)
        raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"Video generation failed: {exc}",
                       code="generation_failed") from None
    finally:
        clear_progress(request_id)
    return Response(mp4, media_type="video/mp4", headers={
        "X-Request-Id": request_id,
        "X-Model": state.model_name,
        "X-Inference-Time-S": f"{time.perf_counter() - started:.3f}",
        "X-Stage-Durations": json.dumps(artifacts.stage_durations, separators=(",", ":")),
        "X-Peak-Memory-MB": f"{artifacts.peak_memory_mb or 0:.3f}",
    })


@router.get("/v1/videos")
async def list_videos(request: Request, after: str | None = None, limit: str = "20", order: str = "desc") -> JSONResponse:
    state = get_state(request)
    try:
        lim = int(limit)
    except ValueError:
        lim = -1
    if not 1 <= lim <= 100:
        raise APIError(HTTPStatus.BAD_REQUEST, "'limit' must be an integer from 1 to 100.", param="limit",
                       code="invalid_value")
    if order not in ("asc", "desc"):
        raise APIError(HTTPStatus.BAD_REQUEST, "'order' must be 'asc' or 'desc'.", param="order", code="invalid_value")
    if after is not None and not ID_RE.match(after):
        raise APIError(HTTPStatus.BAD_REQUEST, "Invalid 'after' id.", param="after", code="invalid_id")
    try:
        jobs, has_more = state.store.list("video", after=after, limit=lim, order=order)
    except KeyError:
        raise APIError(HTTPStatus.BAD_REQUEST, f"No video with id '{after}' to page after.", param="after",
                       code="invalid_value") from None
    for job in jobs:
        _live_progress(state, job)
    data = [video_object(j) for j in jobs]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": has_more})


@router.get("/v1/videos/{video_id}")
async def retrieve_video(request: Request, video_id: str) -> JSONResponse:
    state = get_state(request)
    return _video_response(state, _job_or_404(state, video_id))


@router.get("/v1/videos/{video_id}/content")
async def video_content(request: Request, video_id: str, variant: str = "video") -> Response:
    state = get_state(request)
    job = _job_or_404(state, video_id)
    if variant not in ("video", "thumbnail", "spritesheet"):
        raise APIError(HTTPStatus.BAD_REQUEST, "'variant' must be 'video' or 'thumbnail'.", param="variant",
                       code="invalid_value")
    if variant == "spritesheet":
        raise APIError(HTTPStatus.BAD_REQUEST, "The spritesheet variant is not produced by this server.",
                       param="variant", code="unsupported_variant")
    if job.status != "completed":
        raise APIError(HTTPStatus.CONFLICT, f"Video {video_id} is {job.status}; content is available once it is "
                       "completed.", param="video_id", code="video_not_ready" if job.active else "video_failed")
    name = job.media.get(variant)
    if not name:
        raise APIError(HTTPStatus.NOT_FOUND, f"The content of video {video_id} has expired.", param="video_id",
                       code="video_expired")
    try:
        data = await media.off_loop(state.media_path(name).read_bytes)
    except FileNotFoundError:
        raise APIError(HTTPStatus.NOT_FOUND, f"The content of video {video_id} is no longer stored.",
                       param="video_id", code="video_content_missing") from None
    return Response(data, media_type="video/mp4" if variant == "video" else "image/webp")


@router.delete("/v1/videos/{video_id}")
async def delete_video(request: Request, video_id: str) -> JSONResponse:
    state = get_state(request)
    job = _job_or_404(state, video_id)
    task = state.tasks.get(video_id)
    if job.active:
        try:
            await engine_client(request).abort(video_id)
        except Exception:
            logger.warning("omni-ext: abort of %s in the engine failed; cancelling the job", video_id, exc_info=True)
        if task is not None:
            task.cancel()
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=10)
            except (asyncio.CancelledError, asyncio.TimeoutError, Exception):
                pass
    state.remove_media(job)
    state.store.delete(video_id)
    clear_progress(video_id)
    logger.info("omni-ext video %s deleted (was %s)", video_id, job.status)
    return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})
