"""``POST /v1/images/edits`` through omni-ext's intake, for every model that takes a reference image.

The request is read, checked, admitted and answered here as a generation is: unknown fields refused
with a 400 naming them, the served names (404 for another), bounds and the model's limits, OpenAI's
hints (``quality`` as steps, ``background``, ...), the SDK's ``mask`` as vLLM-Omni's ``mask_image``,
429 with Retry-After past the scheduler's bound, ``b64_json`` or a ``url`` link, and errors in the
generations' shape. The edit itself is run by vLLM-Omni's own edit endpoint, handed the checked form:
that endpoint builds the edit's prompt (its reference images, the mask, ``size`` "auto" as the first
image's size) exactly as stock vLLM-Omni does, so an edit gives stock's bytes for the same seed.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import uuid
from http import HTTPStatus
from typing import Any

from starlette.requests import Request

from omni_ext import partials
from omni_ext.api.disconnect import run_admitted
from omni_ext.api.errors import APIError, bad_request
from omni_ext.api.intake import _IMAGE_FIELDS, Body, build_image_request, parse_body, replay

logger = logging.getLogger("omni_ext.api")

#: The form fields of vLLM-Omni 0.30's edit endpoint (``image[]``/``url[]`` read as ``image``/``url``;
#: a coupling, checked against its signature in tests/test_api_units.py).
VLLM_OMNI_FIELDS = frozenset({
    "image", "url", "prompt", "model", "n", "size", "response_format", "output_format", "background",
    "output_compression", "stream", "user", "mask_image", "reference_image", "negative_prompt",
    "num_inference_steps", "guidance_scale", "guidance_scale_2", "strength", "true_cfg_scale", "seed",
    "generator_device", "lora", "layers", "resolution", "bot_task", "sys_type", "system_prompt",
    "return_stage_metrics",
})
#: Fields of OpenAI's edit request that vLLM-Omni's endpoint does not read: ``mask`` is sent on as
#: ``mask_image``; the hints are applied or reported here (:func:`omni_ext.api.intake.hints`).
OPENAI_FIELDS = frozenset({"mask", "quality", "input_fidelity", "partial_images", "safety_identifier", "moderation",
                           "style"})
#: What an edit request may carry; the rest is refused (400, the field named).
FIELDS = VLLM_OMNI_FIELDS | OPENAI_FIELDS
FILES = ("image", "mask", "mask_image", "reference_image")
#: Consumed here, not sent to vLLM-Omni's endpoint (``response_format``: the endpoint always answers
#: b64_json, a url link is made here).
_HERE_ONLY = OPENAI_FIELDS - {"mask"}


def check_edit(body: Body, state: Any) -> tuple[Any, Any]:
    """An edit request's checks, in a generation's order, then an edit's own: its spec (shape,
    priority, steps for admission) and its reply. ``input_fidelity`` is an OpenAI hint reported as
    not applied; ``strength`` is 0..1."""
    from omni_ext.api.intake import check_known, optional_float

    check_known(body.fields, FIELDS - set(FILES))
    unknown_files = sorted(set(body.files) - set(FILES))
    if unknown_files:
        raise bad_request(f"Unexpected file field: {unknown_files[0]}", unknown_files[0], "unknown_parameter")
    common = {k: v for k, v in body.fields.items() if k in _IMAGE_FIELDS}
    spec, reply = build_image_request(common, state)
    if not body.parts("image") and body.fields.get("url") in (None, "", []):
        raise bad_request("An edit needs the image to edit: the file field 'image' (or 'url').", "image",
                          "missing_required_parameter")
    strength = optional_float(body.fields, "strength")
    if strength is not None and not 0.0 <= strength <= 1.0:
        raise bad_request("'strength' must be from 0 to 1.", "strength")
    optional_float(body.fields, "guidance_scale_2")
    fidelity = body.fields.get("input_fidelity")
    if fidelity is not None:
        if fidelity not in ("high", "low"):
            raise bad_request("'input_fidelity' must be 'high' or 'low'.", "input_fidelity")
        reply = dataclasses.replace(reply, ignored=(*reply.ignored, "input_fidelity"))
    return spec, reply


def stock_form(body: Body, spec: Any) -> tuple[bytes, bytes]:
    """The checked request as vLLM-Omni's edit endpoint reads it (multipart): ``mask`` as ``mask_image``,
    the steps ``quality`` chose, b64_json, and nothing it does not read. Returns (body, boundary)."""
    boundary = uuid.uuid4().hex.encode()
    parts: list[bytes] = []

    def field(name: str, value: Any) -> None:
        text = value if isinstance(value, str) else json.dumps(value)
        parts.append(b'Content-Disposition: form-data; name="%s"\r\n\r\n%s' % (name.encode(), text.encode()))

    def file(name: str, item: tuple[str, str, bytes]) -> None:
        filename, ctype, data = item
        parts.append(b'Content-Disposition: form-data; name="%s"; filename="%s"\r\nContent-Type: %s\r\n\r\n'
                     % (name.encode(), filename.replace('"', "").encode(), ctype.encode()) + data)

    # ``model`` was checked against every served name (an alias too); the endpoint knows only the first
    # ``stream`` is served here (the endpoint would stream only a multi-stage model, in its own way)
    fields = {k: v for k, v in body.fields.items() if k not in _HERE_ONLY and k not in ("model", "stream")}
    fields["response_format"] = "b64_json"
    if spec.steps is not None:  # the request's own steps, or the ones its quality hint chose
        fields["num_inference_steps"] = str(spec.steps)
    for name, value in fields.items():
        for item in value if isinstance(value, list) else [value]:
            if item is not None:
                field(name, item)
    for item in body.parts("image"):
        file("image", item)
    for name, sent_as in (("mask", "mask_image"), ("mask_image", "mask_image"), ("reference_image", "reference_image")):
        for item in body.parts(name)[:1]:
            file(sent_as, item)
    chunks = b"".join(b"--" + boundary + b"\r\n" + p + b"\r\n" for p in parts)
    return chunks + b"--" + boundary + b"--\r\n", boundary


async def edit_images(scope: Any, receive: Any, stock_app: Any) -> Any:
    """The whole edit: the response to send (raises :class:`APIError` for what is refused or failed)."""
    from omni_ext.api.images import admit, respond_encoded, stream
    from omni_ext.api.state import admitting_state

    request = Request(scope, receive)
    state = admitting_state(request)  # 503 before start-up or while draining
    body = await parse_body(request, state.settings.max_upload_bytes)
    if body.parts("mask") and (body.parts("mask_image") or body.fields.get("mask_image") is not None):
        raise bad_request("Send the mask once: 'mask' (OpenAI's name) or 'mask_image'.", "mask")
    spec, reply = check_edit(body, state)
    request_id = f"img_edit-{uuid.uuid4().hex}"
    admitted = admit(request, state, spec, reply, request_id, "image edit")
    form, boundary = stock_form(body, spec)
    inner_state: dict[str, Any] = dict(scope.get("state") or {})  # where the endpoint notes its request id
    metrics: dict[str, Any] = {}

    async def edited() -> list[bytes]:
        partials.REQUESTED.set(reply.partial_images)  # this task's context: the endpoint's engine call reads it
        status, answer = await _call(stock_app, scope, receive, form, boundary, inner_state)
        if status != HTTPStatus.OK:
            raise _error(status, answer, request_id)
        if isinstance(answer.get("metrics"), dict):
            metrics.update(answer["metrics"])  # its stage durations and peak memory, answered on
        return [base64.b64decode(d["b64_json"]) for d in answer.get("data") or []]

    if reply.stream:
        def engine_id() -> str | None:
            return getattr(inner_state.get("request_metadata"), "request_id", None)

        return stream(request, admitted, spec, reply, "image", "image_edit", edited(), engine_id)
    encoded = await run_admitted(request, admitted, "image", edited())
    if not encoded:
        raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR, "The model returned no image.", code="generation_failed")
    return await respond_encoded(request, state, spec, reply, encoded, None, metrics or None)


async def _call(stock_app: Any, scope: Any, receive: Any, form: bytes, boundary: bytes,
                inner_state: dict[str, Any]) -> tuple[int, dict]:
    """vLLM-Omni's endpoint on ``form``: (status, its JSON answer). ``inner_state``: its request's state
    (vLLM-Omni writes the engine request id there as ``request_metadata``)."""
    headers = [(k, v) for k, v in scope.get("headers", ()) if k not in (b"content-length", b"content-type")]
    headers += [(b"content-type", b"multipart/form-data; boundary=" + boundary),
                (b"content-length", str(len(form)).encode())]
    sent: list[dict] = []

    async def capture(message: dict) -> None:
        sent.append(message)

    await stock_app({**scope, "headers": headers, "state": inner_state}, replay(form, receive), capture)
    status = next((m["status"] for m in sent if m["type"] == "http.response.start"), 500)
    raw = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    try:
        answer = json.loads(raw) if raw else {}
    except ValueError:
        answer = {"detail": raw.decode("utf-8", "replace")[:2000]}
    return status, answer if isinstance(answer, dict) else {"detail": answer}


def _error(status: int, answer: dict, request_id: str) -> APIError:
    """vLLM-Omni's refusal (FastAPI's ``detail`` or vLLM's ``error`` object) in the generations' shape."""
    err = answer.get("error")
    message = (err.get("message") if isinstance(err, dict) else None) or answer.get("detail") or "unknown error"
    if not isinstance(message, str):
        message = json.dumps(message)
    if 400 <= status < 500:
        return APIError(HTTPStatus(status), message, code="invalid_request")
    logger.error("omni-ext: image edit %s failed: %s", request_id, message)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"Image edit failed: {message}", code="generation_failed")
