"""OpenAI-compatible ``/v1/images/generations`` (``b64_json`` and ``url``), and the answer it shares with
``/v1/images/edits`` (:mod:`omni_ext.api.edits`: :func:`respond_encoded`).

The engine call is vLLM-Omni's (same prompt and sampling-parameter construction as its own route);
added here (the request checked by :mod:`omni_ext.api.intake`): ``response_format=url`` served
from durable storage by ``GET /v1/images/{id}/content``, admission (429 past the scheduler's bound)
before anything is queued, the generation accounted in the server's queue while it runs (and aborted if the client goes
away), encoding off the event loop, and OpenAI-style errors.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omni_ext import partials
from omni_ext.api import links, media, schemas
from omni_ext.api.disconnect import ClientGone, run_admitted
from omni_ext.api.errors import APIError, StorageError, generation_error, storage
from omni_ext.api.intake import ImageReply, read_image_request
from omni_ext.api.jobs import Job, JobSpec
from omni_ext.api.state import ApiState, admitting_state, engine_client, get_state, now
from omni_ext.api.tenants import Tenant

logger = logging.getLogger("omni_ext.api")
router = APIRouter()
#: The response header listing the request's OpenAI hint fields that were accepted and not applied.
IGNORED_HEADER = "x-omni-ext-ignored-fields"
#: How often a stream looks for the worker's new partial images (a preview is a VAE decode: far slower).
PARTIAL_POLL_S = 0.05

def response_metrics(stage_durations: Any, peak_memory_mb: Any) -> dict[str, Any]:
    """vLLM-Omni's ``metrics`` field of an image answer (its route's shape): the pipeline's stage durations
    (text encoding, denoise loop, VAE) and the peak memory, which its clients and benchmarks read."""
    return {"stage_durations": stage_durations or None,
            "peak_memory_mb": float(peak_memory_mb) if peak_memory_mb else None}


async def _generate(request: Request, spec: JobSpec, request_id: str,
                    metrics: dict[str, Any] | None = None) -> list[Any]:
    """vLLM-Omni's image generation call; returns PIL images (and fills ``metrics``, when given)."""
    from vllm_omni.entrypoints.openai.diffusion import _generate_with_async_omni
    from vllm_omni.entrypoints.openai.images.helpers import _extract_images_from_result

    engine = engine_client(request)
    stage_configs = getattr(request.app.state, "stage_configs", None) or getattr(engine, "stage_configs", None)
    prompt, params = spec.request
    result = await _generate_with_async_omni(
        engine_client=engine, gen_params=params, stage_configs=list(stage_configs or []), prompt=prompt,
        request_id=request_id,
    )
    if metrics is not None:
        metrics.update(response_metrics(getattr(result, "stage_durations", None),
                                        getattr(result, "peak_memory_mb", None)))
    return _extract_images_from_result(result)


async def _respond(request: Request, state: ApiState, spec: JobSpec, reply: ImageReply,
                   images: list[Any], metrics: dict[str, Any] | None) -> JSONResponse:
    fmt, compression = reply.output_format, reply.output_compression
    encoding = time.perf_counter()
    encoded = [await media.off_loop(media.encode_image, img, fmt, compression) for img in images]
    if metrics and metrics.get("stage_durations"):  # beside the pipeline's stages, where they are reported
        metrics["stage_durations"]["omni_ext.encode"] = time.perf_counter() - encoding
    return await respond_encoded(request, state, spec, reply, encoded,
                                 f"{images[0].width}x{images[0].height}" if images else None, metrics)


async def respond_encoded(request: Request, state: ApiState, spec: JobSpec, reply: ImageReply, encoded: list[bytes],
                          size: str | None = None, metrics: dict[str, Any] | None = None) -> JSONResponse:
    """The answer to a generation or an edit whose images are encoded in ``reply.output_format``:
    ``b64_json``, or ``url`` links to them stored (all or none). ``size``: WxH (None: read from the first);
    ``metrics``: vLLM-Omni's (:func:`response_metrics`), carried as its own route answers them."""
    fmt = reply.output_format
    if size is None and encoded:
        size = await media.off_loop(media.image_size, encoded[0])
    data = []
    if reply.response_format == "b64_json":
        data = [{"b64_json": base64.b64encode(b).decode("ascii"), "revised_prompt": None} for b in encoded]
    else:
        base = links.base(request, state.settings)  # behind a proxy: the configured or trusted forwarded one
        stored: list[Job] = []
        try:
            state.ensure_room(sum(len(b) for b in encoded))
            state.result_bytes["image"] = max(len(b) for b in encoded)
            with storage("storing generated images"):
                for blob in encoded:
                    image_id = f"img_{uuid.uuid4().hex}"
                    name = f"{image_id}.{fmt}"
                    job = Job(id=image_id, kind="image", owner=state.tenant(request).owner, status="completed",
                              progress=100, model=state.model_name,
                              prompt=spec.prompt, completed_at=now(), media={"image": name},
                              meta={"content_type": media.IMAGE_TYPES[fmt],
                                    **({"end_user": reply.end_user} if reply.end_user else {})})
                    if state.settings.ttl_s:
                        job.expires_at = job.completed_at + state.settings.ttl_s
                    stored.append(job)  # first: a failed write below still removes its file
                    await state.write_media(name, blob)
                    state.store.add(job)
                    link = state.signed_link(f"/v1/images/{image_id}/content")  # keyless for <img> when signed
                    data.append({"url": base + link, "revised_prompt": None})
        except StorageError:  # all of the request's images or none: no url the client never got stays behind
            for job in stored:
                state.remove_media(job)
                with contextlib.suppress(sqlite3.Error):
                    state.store.delete(job.id)
            raise
    headers = {IGNORED_HEADER: ",".join(reply.ignored)} if reply.ignored else None
    body = {"created": int(time.time()), "data": data, "output_format": fmt, "size": size}
    if metrics is not None:
        body["metrics"] = metrics
    return JSONResponse(body, headers=headers)


def admit(request: Request, state: ApiState, spec: JobSpec, reply: ImageReply, request_id: str, what: str) -> Any:
    """A checked generation or edit, admitted: its hints and end user logged, room for its ``url``
    results (507), its owner recorded, its place in the queue (429 past the scheduler's bound)."""
    if reply.ignored or reply.end_user:
        logger.info("omni-ext: %s %s%s%s", what, request_id,
                    f" for end user {reply.end_user!r}" if reply.end_user else "",
                    f"; accepted as hints and not applied: {', '.join(reply.ignored)}" if reply.ignored else "")
    if reply.response_format == "url":
        state.admit_result("image", spec.n)  # 507 before any work when live results fill the store's quota
    state.own_request(request_id, state.tenant(request))
    return state.queue.admit(request_id, spec.priority, spec.shape, spec.deadline_s)


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _partial_b64(png: bytes, fmt: str, compression: int | None) -> str:
    """A worker's PNG preview in the request's ``output_format``, base64."""
    if fmt != "png":
        from PIL import Image
        import io

        png = await media.off_loop(media.encode_image, Image.open(io.BytesIO(png)), fmt, compression)
    return base64.b64encode(png).decode("ascii")


def stream(request: Request, admitted: Any, spec: JobSpec, reply: ImageReply, what: str, kind: str,
           work: Awaitable[list[bytes]], engine_id: Callable[[], str | None]) -> StreamingResponse:
    """``stream=true``: OpenAI's server-sent events for one image (``kind`` ``image_generation`` or
    ``image_edit``): ``<kind>.partial_image`` for each preview the worker decodes (read from
    :mod:`omni_ext.partials` under the engine request id ``engine_id()`` gives once it is known), then
    ``<kind>.completed`` with the final image, or an ``error`` event (the SDK raises it) for a generation
    that fails once the stream has begun. ``work`` gives the final image encoded in ``output_format``;
    it runs admitted (its queue slot, abort when the client leaves, as a JSON request)."""
    fmt, compression = reply.output_format, reply.output_compression
    common = {"background": "opaque", "output_format": fmt, "quality": "auto"}
    size = f"{spec.width}x{spec.height}" if spec.width else "auto"

    async def events() -> AsyncIterator[bytes]:
        seen: set[int] = set()
        task = asyncio.ensure_future(run_admitted(request, admitted, what, work))
        rid = None
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=PARTIAL_POLL_S)
                rid = rid or engine_id()
                for index, png in partials.read_new(rid, seen) if rid else []:
                    yield _sse(f"{kind}.partial_image", {"type": f"{kind}.partial_image", "partial_image_index": index,
                                                         "b64_json": await _partial_b64(png, fmt, compression),
                                                         "created_at": int(time.time()),
                                                         "size": size if spec.width else media.image_size(png),
                                                         **common})
                if done:
                    break
            try:
                encoded = task.result()
            except ClientGone:
                return
            except APIError as exc:
                yield _sse("error", exc.body())
                return
            except Exception as exc:
                label = "Image edit" if kind == "image_edit" else "Image generation"
                yield _sse("error", generation_error(exc, label, admitted.job_id).body())
                return
            if not encoded:
                yield _sse("error", APIError(HTTPStatus.INTERNAL_SERVER_ERROR, "The model returned no image.",
                                             code="generation_failed").body())
                return
            final = size if spec.width else await media.off_loop(media.image_size, encoded[0])
            yield _sse(f"{kind}.completed", {
                "type": f"{kind}.completed", "b64_json": base64.b64encode(encoded[0]).decode("ascii"),
                "created_at": int(time.time()), "size": final, **common,
                "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                          "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}}})
        finally:
            # The client left mid-stream and the response was cancelled with it (nothing may be awaited
            # here any more): its slot is freed now, and vLLM-Omni's generate aborts its engine request
            # when the generation's task is cancelled.
            if not task.done():
                if admitted.cancelled("client_disconnected"):
                    logger.info("omni-ext %s %s: client disconnected mid-stream; generation aborted and its slot "
                                "freed", what, admitted.job_id)
                task.cancel()
            if rid:
                partials.clear(rid)

    headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
    if reply.ignored:
        headers[IGNORED_HEADER] = ",".join(reply.ignored)
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


@router.post("/v1/images/generations", openapi_extra=schemas.body(schemas.IMAGE_GENERATE))
async def generate_images(request: Request) -> Response:
    state = admitting_state(request)  # 503 before start-up or while draining
    spec, reply = await read_image_request(request, state)
    request_id = f"img_gen-{uuid.uuid4().hex}"
    admitted = admit(request, state, spec, reply, request_id, "image request")
    if reply.stream:
        async def encoded() -> list[bytes]:
            images = await _generate(request, spec, request_id)
            return [await media.off_loop(media.encode_image, img, reply.output_format, reply.output_compression)
                    for img in images]

        return stream(request, admitted, spec, reply, "image", "image_generation", encoded(), lambda: request_id)
    metrics: dict[str, Any] = {}
    try:
        images = await run_admitted(request, admitted, "image", _generate(request, spec, request_id, metrics))
    except ClientGone:
        raise
    except Exception as exc:
        raise generation_error(exc, "Image generation", request_id) from None
    if not images:
        raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR, "The model returned no image.", code="generation_failed")
    return await _respond(request, state, spec, reply, images, metrics)


@router.post("/v1/images/variations")
async def image_variations(request: Request) -> JSONResponse:
    """OpenAI's ``images.create_variation`` (DALL-E 2's, no prompt): no diffusion pipeline vLLM-Omni
    serves makes a variation without one. A clear 400 naming what does the same, instead of "No route"."""
    state = get_state(request)
    kind = f"{state.model_name} ({state.limits.pipeline or 'unknown'})"
    edits = state.limits.image_input and not state.limits.is_video
    raise APIError(HTTPStatus.BAD_REQUEST,
                   "Image variations (a new image from an image, without a prompt) are not served by "
                   f"{kind}. " + ("Send the image with a prompt that describes it to /v1/images/edits "
                                  "(client.images.edit) instead." if edits else
                                  "Serve an edit model (e.g. Qwen-Image-Edit) and send the image with a prompt to "
                                  "/v1/images/edits (client.images.edit) instead."),
                   param=None, code="unsupported_endpoint")


@router.get("/v1/images/{image_id}/content")
async def image_content(request: Request, image_id: str) -> Response:
    state = get_state(request)
    path = request.scope["path"].removeprefix(request.scope.get("root_path", ""))
    # a signed link is a capability (omni_ext.api.signed): it opens this one image to whoever holds it
    tenant = Tenant(owner=None, admin=True) if state.signed_request(path, request.url.query) else state.tenant(request)
    job = state.find_job("image", image_id, tenant)
    data = await state.read_media(job, "image", f"Image {image_id}")
    return Response(data, media_type=job.meta.get("content_type", "image/png"))
