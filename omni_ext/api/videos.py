"""OpenAI-compatible ``/v1/videos`` (async jobs) and vLLM-Omni's ``/v1/videos/sync``.

Generation itself is vLLM-Omni's (``OmniOpenAIServingVideo._run_and_extract``: defaults, LoRA,
reference media, the engine call); the request is checked and mapped (OpenAI's ``seconds``/``size``
to the model's native frames and fps) by :mod:`omni_ext.api.intake`. This module owns what is
around the generation: admission (429 past the scheduler's bound) before a job exists, durable job
records, queue position and predicted start of a queued job, step progress and
``openai-poll-after-ms``, cancellation (``DELETE``, or a ``/sync`` client that goes away), and
MP4/thumbnail encoding off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omni_ext.api import media, schemas
from omni_ext.api.disconnect import ClientGone, run_admitted
from omni_ext.api.errors import APIError, StorageError, bad_request, generation_error, storage
from omni_ext.api.intake import (
    ID_RE, Body, bounded_int, check_known, parse_body, read_video_request, reference_items, video_spec,
)
from omni_ext.api.jobs import Job, JobSpec
from omni_ext.api.limits import MAX_PAGE
from omni_ext.api.queue import Admitted, QueueView
from omni_ext.api.state import ApiState, abort, get_state, now, video_state
from omni_ext.progress import PAUSED, clear_progress, read_progress

logger = logging.getLogger("omni_ext.api")
router = APIRouter()

POLL_MIN_MS, POLL_MAX_MS = 100, 5000


# ---- generation -------------------------------------------------------------------------------
async def generate(handler: Any, spec: JobSpec, request_id: str, admitted: Admitted) -> Any:
    """vLLM-Omni's generation (its artifacts), reporting its start through ``admitted`` (vLLM-Omni's
    ``on_started``); the engine slot is free once this returns. The request's reference image(s) are
    decoded already, its uploads (``input_references``, ``control_reference``, latent-edit media:
    :attr:`JobSpec.uploads`) persisted; its ``video_reference`` and ``audio_reference`` are decoded here, by
    vLLM-Omni's own decoders as its route does. They reach vLLM-Omni's generation call as its route hands
    them over, and every temporary file is removed when the generation ends, however it ends."""
    from vllm_omni.entrypoints.openai.serving_video import ReferenceImage
    from vllm_omni.entrypoints.openai.video.generation.helpers import _cleanup_video_references

    async def on_started() -> None:
        admitted.started()

    reference = ReferenceImage(data=spec.reference) if spec.reference is not None else None
    uploads = spec.uploads
    video = audio = None
    try:
        video, audio = await media_references(handler, spec.request, spec.reference_video)
        if uploads is not None:
            video = video if video is not None else uploads.video  # input_references come without video_reference
            audio = _with_uploaded_audio(uploads.audio, audio)
        media_refs = {k: v for k, v in (("reference_video", video), ("reference_audio", audio),
                                        ("latent_edit_input", uploads and uploads.latent_edit)) if v is not None}
        return await handler._run_and_extract(spec.request, request_id, reference_image=reference,
                                              on_started=on_started, **media_refs)
    finally:
        _cleanup_video_references(video, audio)
        release_uploads(spec)


def release_uploads(spec: JobSpec) -> None:
    """Remove the temporary files of ``spec``'s uploads (none: nothing to do; again: nothing more)."""
    if spec.uploads is not None:
        spec.uploads.cleanup()


def _with_uploaded_audio(uploaded: Any, decoded: Any) -> Any:
    """The uploaded reference audio (``input_references``) then the decoded ``audio_reference`` items, as one
    ``ReferenceAudio``, as vLLM-Omni's route joins them (one path alone, else their list)."""
    if uploaded is None or decoded is None:
        return decoded if uploaded is None else uploaded
    from vllm_omni.entrypoints.openai.serving_video import ReferenceAudio

    paths = [*reference_items(uploaded.path), *reference_items(decoded.path)]
    return ReferenceAudio(path=paths if len(paths) > 1 else paths[0],
                          cleanup_paths=(*uploaded.cleanup_paths, *decoded.cleanup_paths))


async def media_references(handler: Any, vreq: Any, input_video: bytes | None = None) -> tuple[Any, Any]:
    """The request's ``video_reference`` and ``audio_reference`` items (and an ``input_reference`` upload that
    is a video, ``input_video``) as vLLM-Omni's ``ReferenceVideo`` and ``ReferenceAudio`` (None where it has
    none), decoded as vLLM-Omni's ``/v1/videos`` decodes them: videos to at most the frames the pipeline keeps
    (its decode spec), audio URLs to temporary files. A reference that does not decode is a 400
    ``invalid_reference``."""
    from vllm_omni.entrypoints.openai.serving_video import ReferenceAudio, ReferenceVideo
    from vllm_omni.entrypoints.openai.video.generation.helpers import _reference_video_decode_spec
    from vllm_omni.entrypoints.openai.errors import InvalidInputReferenceError
    from vllm_omni.entrypoints.openai.video_api_utils import VideoFrames, decode_audio_url, decode_input_reference

    videos = reference_items(getattr(vreq, "video_reference", None))
    if input_video is not None:
        videos.append(input_video)
    audios = reference_items(getattr(vreq, "audio_reference", None))
    if not videos and not audios:
        return None, None
    paths: list[str] = []
    frames: list[Any] | None = None
    audio_paths: list[str] = []
    try:
        if videos:
            decode = _reference_video_decode_spec(vreq, getattr(handler, "stage_configs", None))
            for item in videos:
                upload = isinstance(item, bytes)
                data = await decode_input_reference(None, None if upload else item, item if upload else None,
                                                    max_video_frames=decode.max_frames, video_keep=decode.keep)
                if not isinstance(data, VideoFrames):
                    raise InvalidInputReferenceError("video_reference did not decode to a video")
                if data.source_path is not None:
                    paths.append(data.source_path)
                elif len(videos) == 1:
                    frames = list(data)
                else:
                    raise InvalidInputReferenceError("multiple video URL references must be downloadable source videos")
        for item in audios:
            audio_paths.append(await decode_audio_url(item.audio_url))
    except (InvalidInputReferenceError, ValueError) as exc:
        for path in (*paths, *audio_paths):
            with contextlib.suppress(OSError):
                os.unlink(path)
        param = ("input_reference" if input_video is not None and not getattr(vreq, "video_reference", None)
                 else "video_reference" if videos else "audio_reference")
        raise bad_request(str(exc) or "Invalid reference.", param, "invalid_reference") from None
    video = (ReferenceVideo(data=paths, cleanup_paths=tuple(paths)) if paths
             else ReferenceVideo(data=frames) if frames is not None else None)
    audio = (ReferenceAudio(path=audio_paths if len(audio_paths) > 1 else audio_paths[0],  # one alone, as vLLM-Omni's
                            cleanup_paths=tuple(audio_paths)) if audio_paths else None)
    return video, audio


async def encode_mp4(handler: Any, vreq: Any, artifacts: Any) -> bytes:
    """The generated video as MP4 bytes, encoded off the event loop exactly as vLLM-Omni does."""
    from vllm_omni.entrypoints.openai.video_api_utils import _encode_video_bytes

    video = artifacts.videos[0]
    if isinstance(video, bytes):  # pre-encoded by the worker (extra_params.preencode_mp4)
        return video
    options = {"preset": "ultrafast", "threads": "0"}
    if isinstance(vreq.extra_params, dict) and "video_codec_options" in vreq.extra_params:
        options = vreq.extra_params["video_codec_options"]
    audio = artifacts.audios[0] if artifacts.audios else None
    extra = {"audio": audio, "audio_sample_rate": artifacts.audio_sample_rate} if audio is not None else {}
    return await media.off_loop(
        _encode_video_bytes, video, fps=artifacts.output_fps, video_codec_options=options,
        frame_converter=getattr(handler, "_video_frame_converter", None), **extra,
    )


def _mark_running(state: ApiState, job: Job) -> None:
    """A queued job's record turns ``in_progress`` once the queue sees it run."""
    if job.status == "queued" and state.queue.running(job.id):
        job.status, job.progress = "in_progress", max(job.progress, 1)
        job.meta["started_at"] = time.time()
        state.store.save(job)


async def _run_job(state: ApiState, handler: Any, job: Job, spec: JobSpec, admitted: Admitted) -> None:
    """An admitted async job, from generation to stored media; it reports its life through ``admitted``."""
    started = time.monotonic()
    try:
        artifacts = await generate(handler, spec, job.id, admitted)
        job.status = "in_progress"
        job.progress = max(job.progress, 95)
        job.meta["encoding"] = True
        state.store.save(job)
        admitted.finished()  # its slot is free; encoding runs here, in the API process
        mp4 = await encode_mp4(handler, spec.request, artifacts)
        thumb = await media.off_loop(media.mp4_thumbnail, mp4)
        files = {"video": f"{job.id}.mp4", "thumbnail": f"{job.id}.webp"}
        try:
            state.ensure_room(len(mp4) + len(thumb))
            await state.write_media(files["video"], mp4)
            await state.write_media(files["thumbnail"], thumb)
            state.result_bytes["video"] = len(mp4) + len(thumb)
        except StorageError:
            state.remove_files(files.values())  # a video without its thumbnail is not kept either
            raise
        job.media = files
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
        state.store.save(job)
        state.archive.remove(job.id)
        logger.info("omni-ext video %s completed in %.2f s", job.id, time.monotonic() - started)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # the job fails cleanly (storage_full, generation_failed, ...); the server keeps serving
        if job.id in state.parked:  # set aside by a drain (its engine request aborted): it runs after the restart
            return
        error = generation_error(exc, "Video generation", job.id)
        job.status, job.completed_at = "failed", now()
        if state.settings.ttl_s:  # a failed job's record expires like a finished one's
            job.expires_at = job.completed_at + state.settings.ttl_s
        job.error_code, job.error_message = error.code or "invalid_request", error.message
        state.store.save(job)
        state.archive.remove(job.id)
    finally:
        admitted.dropped()  # failed or cancelled (a finished job is already gone)
        clear_progress(job.id)
        state.tasks.pop(job.id, None)
        state.admitted.pop(job.id, None)


# ---- views ------------------------------------------------------------------------------------
def _live(state: ApiState, job: Job, queued: dict[str, QueueView]) -> tuple[float | None, dict[str, Any] | None]:
    """Bring an active job's status and monotone progress (0-100) up to date, from the queue's
    account and the workers' step reports. Returns its predicted seconds until it starts (queued)
    or ends (running), None when unknown, and its ``progress_detail``: ``state`` (``queued``,
    ``running``, ``paused`` while step-level preemption holds it in worker memory, ``encoding``)
    and, once known, the denoise ``steps_done`` of ``steps_total``. ``queued``: :meth:`RequestQueue.views`."""
    if not job.active:
        return 0.0, None
    progress = job.progress
    view = queued.get(job.id)
    detail: dict[str, Any] = {"state": "running"}
    if job.meta.get("encoding"):
        progress, remaining, detail = max(progress, 95), 0.2, {"state": "encoding"}
    elif view is not None:  # still queued: when it is predicted to start
        remaining, detail = view.wait_s, {"state": "queued"}
    else:
        _mark_running(state, job)
        progress, remaining = max(progress, job.progress), None
        step = read_progress(job.id)
        if step is not None:
            progress = max(progress, 2 + int(88 * step.fraction))
            detail = {"state": "paused" if step.mode == PAUSED else "running",
                      "steps_done": step.done, "steps_total": step.total}
            rest = step.remaining_s()
            if rest is not None and step.mode != PAUSED:
                remaining = rest * 1.15  # plus VAE decode and encoding, ~15 % of denoising
    if progress != job.progress:
        job.progress = progress
        state.store.save(job)
    return remaining, detail


def poll_after_ms(remaining_s: float | None) -> int:
    """How long a client should wait before polling again: a quarter of the predicted remaining time."""
    if remaining_s is None:
        return 1000
    return int(min(POLL_MAX_MS, max(POLL_MIN_MS, remaining_s * 1000 / 4)))


def video_object(job: Job, view: QueueView | None = None, detail: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI's video object, plus vLLM-Omni's timing fields, while it is active omni-ext's
    ``progress_detail`` (:func:`_live`) and, while it waits, ``queue_position``, ``predicted_wait_s``
    and ``predicted_start_at``."""
    obj: dict[str, Any] = {
        "id": job.id, "object": "video", "model": job.model, "status": job.status, "progress": job.progress,
        "created_at": job.created_at, "completed_at": job.completed_at, "expires_at": job.expires_at,
        "prompt": job.prompt, "seconds": job.seconds, "size": job.size,
        "remixed_from_video_id": job.meta.get("remixed_from_video_id"),
        "error": {"code": job.error_code, "message": job.error_message} if job.status == "failed" else None,
    }
    for key in ("priority", "num_frames", "fps", "inference_time_s", "peak_memory_mb", "stage_durations"):
        if key in job.meta:
            obj[key] = job.meta[key]
    if detail is not None and job.active:
        obj["progress_detail"] = detail
    if view is not None:
        known = view.wait_s is not None
        obj.update({"queue_position": view.position,
                    "predicted_wait_s": round(view.wait_s, 1) if known else None,
                    "predicted_start_at": int(round(time.time() + view.wait_s)) if known else None})
    return obj


def _video_response(state: ApiState, job: Job) -> JSONResponse:
    queued = state.queue.views()
    remaining, detail = _live(state, job, queued)
    headers = {"openai-poll-after-ms": str(poll_after_ms(remaining))} if job.active else None
    return JSONResponse(video_object(job, queued.get(job.id), detail), headers=headers)


# ---- routes -----------------------------------------------------------------------------------
@router.post("/v1/videos", openapi_extra=schemas.body(schemas.VIDEO_CREATE, multipart=True))
async def create_video(request: Request) -> JSONResponse:
    # 503 before start-up, while draining, or without a video handler; 507 when live results fill the store
    state, backend, tenant = video_state(request)
    spec, body = await read_video_request(request, state, backend.defaults, backend.handler)
    return await _create(state, backend, tenant, spec, body)


@router.post("/v1/videos/{video_id}/remix", openapi_extra=schemas.body(schemas.VIDEO_REMIX))
async def remix_video(request: Request, video_id: str) -> JSONResponse:
    """OpenAI's remix: a new job with the source video's parameters and seed and a new ``prompt``; the
    source must be the caller's (404 otherwise, as for any other route) and completed (409)."""
    state, backend, tenant = video_state(request)
    source = state.find_job("video", video_id, tenant)
    if source.status != "completed":
        raise APIError(HTTPStatus.CONFLICT, f"Video {video_id} is {source.status}; a remix needs a completed video.",
                       param="video_id", code="video_not_ready" if source.active else "video_failed")
    kept = source.meta.get("remix")
    if kept is None:
        raise bad_request(f"Video {video_id} was made from uploaded or referenced media, which is not kept after its "
                          "job; send a new create with that media and the new prompt instead.", "video_id",
                          "unsupported_remix")
    fields = (await parse_body(request, state.settings.max_upload_bytes, allow_files=False)).fields
    check_known(fields, ("prompt",))
    spec = await video_spec(Body({**kept, "prompt": fields.get("prompt")}), state, backend.defaults, backend.handler)
    return await _create(state, backend, tenant, spec, Body({**kept, "prompt": spec.prompt}), remixed_from=video_id)


async def _create(state: ApiState, backend: Any, tenant: Any, spec: JobSpec, body: Any,
                  remixed_from: str | None = None) -> JSONResponse:
    """Admit a checked video request, store its job (and its request, for a restart), and start it."""
    job_id = f"video_{uuid.uuid4().hex}"
    try:
        admitted = state.queue.admit(job_id, spec.priority, spec.shape, spec.deadline_s)  # or 429
        try:
            with storage(f"storing video {job_id}"):
                job = state.store.create(
                    id=job_id, kind="video", owner=tenant.owner, model=state.model_name, prompt=spec.prompt,
                    seconds=spec.seconds,
                    size=f"{spec.width}x{spec.height}",
                    meta={"num_frames": spec.frames, "fps": spec.fps, "priority": spec.priority,
                          **({"remix": spec.remix} if spec.remix is not None else {}),
                          **({"remixed_from_video_id": remixed_from} if remixed_from else {})},
                )
                try:  # kept until the job ends, so that a restart runs it again (omni_ext.api.drain)
                    await asyncio.to_thread(state.archive.save, job_id, body)
                except BaseException:
                    state.archive.remove(job_id)
                    with contextlib.suppress(Exception):
                        state.store.delete(job_id)
                    raise
        except StorageError:
            admitted.dropped()  # refused after all: its admission must not hold capacity
            raise
    except BaseException:
        release_uploads(spec)  # refused: its uploads' temporary files go with it
        raise
    del body
    _start_job(state, backend.handler, job, spec, admitted)
    view = admitted.view
    logger.info("omni-ext video %s queued (%s, %s frames, %s steps, priority %d, predicted start in %.1f s, %d ahead)",
                job.id, job.size, spec.frames, spec.steps, spec.priority, admitted.decision.wait_s, view.position)
    # Its view is the admission's decision, made a moment ago on the same account.
    return JSONResponse(video_object(job, view), headers={"openai-poll-after-ms": str(poll_after_ms(view.wait_s))})


def _start_job(state: ApiState, handler: Any, job: Job, spec: JobSpec, admitted: Admitted) -> None:
    state.admitted[job.id] = admitted
    task = asyncio.create_task(_run_job(state, handler, job, spec, admitted))
    if spec.uploads is not None:  # also for a job deleted before its task ever ran
        task.add_done_callback(lambda _task: release_uploads(spec))
    state.tasks[job.id] = task


def restart_failure(state: ApiState, job_id: str) -> None:
    """Fail ``job_id`` with ``server_restarted`` (a stop cut it mid-run) and forget its kept request."""
    job = state.store.get(job_id)
    if job is not None and job.active:
        job.status, job.completed_at = "failed", now()
        if state.settings.ttl_s:
            job.expires_at = job.completed_at + state.settings.ttl_s
        job.error_code = "server_restarted"
        job.error_message = "The server stopped while this job was running (past its drain time); submit it again."
        state.store.save(job)
    state.archive.remove(job_id)


async def resume_job(state: ApiState, job: Job) -> bool:
    """Run again a job a previous process accepted, from its kept request; False (and the job failed
    ``server_restarted``, or with the check that now refuses it) when it cannot be."""
    backend = state.video
    body = state.archive.load(job.id)
    if backend is None or body is None:
        restart_failure(state, job.id)
        return False
    try:
        spec = await video_spec(body, state, backend.defaults, backend.handler)
    except APIError as exc:  # the server's configuration changed and refuses it now
        job.status, job.completed_at = "failed", now()
        job.error_code, job.error_message = exc.code or "invalid_request", exc.message
        state.store.save(job)
        state.archive.remove(job.id)
        return False
    admitted = state.queue.admit(job.id, spec.priority, spec.shape, spec.deadline_s, accepted=True)
    _start_job(state, backend.handler, job, spec, admitted)
    return True


@router.post("/v1/videos/sync", openapi_extra=schemas.body(schemas.VIDEO_CREATE, multipart=True))
async def create_video_sync(request: Request) -> Response:
    # 503 before start-up, while draining, or without a video handler
    state, backend, tenant = video_state(request, stores=False)
    spec, body = await read_video_request(request, state, backend.defaults, backend.handler)
    del body  # nothing kept: its client holds the connection
    request_id = f"video_sync-{uuid.uuid4().hex}"
    state.own_request(request_id, tenant)
    timeout = float(os.environ.get("VLLM_OMNI_VIDEO_SYNC_TIMEOUT", "600"))
    started = time.perf_counter()
    try:
        admitted = state.queue.admit(request_id, spec.priority, spec.shape, spec.deadline_s)  # or 429
        artifacts = await run_admitted(request, admitted, "video", asyncio.wait_for(
            generate(backend.handler, spec, request_id, admitted), timeout=timeout))
        encoding = time.perf_counter()
        mp4 = await encode_mp4(backend.handler, spec.request, artifacts)
        stages = {**(artifacts.stage_durations or {}), "omni_ext.encode": time.perf_counter() - encoding}
    except (ClientGone, APIError):
        raise
    except asyncio.TimeoutError:
        raise APIError(HTTPStatus.GATEWAY_TIMEOUT, f"Video generation timed out after {timeout:.0f} s.",
                       code="timeout") from None
    except Exception as exc:
        raise generation_error(exc, "Video generation", request_id) from None
    finally:
        release_uploads(spec)  # however it ended (also when refused or never started)
    return Response(mp4, media_type="video/mp4", headers={
        "X-Request-Id": request_id,
        "X-Model": state.model_name,
        "X-Inference-Time-S": f"{time.perf_counter() - started:.3f}",
        "X-Stage-Durations": json.dumps(stages, separators=(",", ":")),
        "X-Peak-Memory-MB": f"{artifacts.peak_memory_mb or 0:.3f}",
    })


@router.get("/v1/videos")
async def list_videos(request: Request, after: str | None = None, limit: str = "20", order: str = "desc") -> JSONResponse:
    state = get_state(request)
    lim = bounded_int(limit, "limit", 1, MAX_PAGE)
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be 'asc' or 'desc'.", "order")
    if after is not None and not ID_RE.match(after):
        raise bad_request("Invalid 'after' id.", "after", "invalid_id")
    try:
        jobs, has_more = state.store.list("video", after=after, limit=lim, order=order, owner=state.tenant(request).scope)
    except KeyError:
        raise bad_request(f"No video with id '{after}' to page after.", "after") from None
    queued = state.queue.views()
    data = [video_object(j, queued.get(j.id), _live(state, j, queued)[1]) for j in jobs]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": has_more})


@router.get("/v1/videos/{video_id}")
async def retrieve_video(request: Request, video_id: str) -> JSONResponse:
    state = get_state(request)
    return _video_response(state, state.find_job("video", video_id, state.tenant(request)))


@router.get("/v1/videos/{video_id}/content")
async def video_content(request: Request, video_id: str, variant: str = "video") -> Response:
    state = get_state(request)
    job = state.find_job("video", video_id, state.tenant(request))
    if variant not in _VARIANT_TYPES:
        raise bad_request("'variant' must be 'video', 'thumbnail' or 'spritesheet'.", "variant")
    if job.status != "completed":
        raise APIError(HTTPStatus.CONFLICT, f"Video {video_id} is {job.status}; content is available once it is "
                       "completed.", param="video_id", code="video_not_ready" if job.active else "video_failed")
    subject = f"The content of video {video_id}"
    if variant == "spritesheet" and "spritesheet" not in job.media:
        # made on its first request, from the stored mp4 (no job pays for a sheet nobody asks for), then kept
        # with the job's other media (its quota, its expiry)
        mp4 = await state.read_media(job, "video", subject)
        sheet = await media.off_loop(media.mp4_spritesheet, mp4)
        name = f"{job.id}.sprites.jpg"
        await state.write_media(name, sheet)
        job.media["spritesheet"] = name
        state.store.save(job)
        return Response(sheet, media_type=_VARIANT_TYPES[variant])
    data = await state.read_media(job, variant, subject)
    return Response(data, media_type=_VARIANT_TYPES[variant])


#: What ``GET /v1/videos/{id}/content?variant=`` returns: the mp4, a WebP of its first frame, and a JPEG
#: grid of evenly spaced frames (:func:`omni_ext.api.media.mp4_spritesheet`).
_VARIANT_TYPES = {"video": "video/mp4", "thumbnail": "image/webp", "spritesheet": "image/jpeg"}


@router.delete("/v1/videos/{video_id}")
async def delete_video(request: Request, video_id: str) -> JSONResponse:
    state = get_state(request)
    job = state.find_job("video", video_id, state.tenant(request))
    task = state.tasks.get(video_id)
    admitted = state.admitted.get(video_id)
    if job.active:
        if admitted is not None:
            admitted.cancelled("deleted")  # its capacity is free now, whatever the engine does next
        await abort(request, video_id)
        if task is not None:
            task.cancel()
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=10)
            except (asyncio.CancelledError, asyncio.TimeoutError, Exception):
                pass
    state.remove_media(job)
    state.archive.remove(video_id)
    with storage(f"deleting video {video_id}"):
        state.store.delete(video_id)
    clear_progress(video_id)
    logger.info("omni-ext video %s deleted (was %s)", video_id, job.status)
    return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})
