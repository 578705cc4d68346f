"""A request as clients send it, checked once, becomes one :class:`~omni_ext.api.jobs.JobSpec`.

Everything a generation request is checked against is here, in the order its first mistake is
reported, so that a bad request is answered 400 before a job exists and one field is parsed,
bounded and worded the same way on every route:

1. **The body** as clients really send it: JSON, or multipart with SDK-style bracketed keys.
   openai-python before 2.27 sends ``videos.create`` as JSON unless a file is attached; 2.27 and
   later always send multipart/form-data, where ``extra_body`` values arrive as strings (``"4"``,
   ``"true"``), nested dicts as ``key[sub]`` and lists as ``key[]``. vLLM-Omni's own clients send
   multipart with JSON-encoded strings for ``extra_params``/``lora``. Both become one plain dict;
   pydantic then coerces types. Uploads are size-limited while being read: a body larger than the
   limit is refused with 413 before it is read whole.
2. **The fields** (unknown ones, ids, ``prompt``, ``model``, ``size``, bounded numbers), then
   vLLM-Omni's own request model.
3. **The served model's limits** (:func:`check_request`, :class:`ModelLimits`
   read at start-up): the one rule set behind every route, also applied at the engine's door to
   the routes omni-ext does not own (:mod:`omni_ext.api.validation`).
4. **The job**: its :class:`~omni_ext.models.families.JobShape` from the model-family table, and
   ``priority`` and ``deadline_s`` carried in the engine request's extra parameters.

The routes (:mod:`omni_ext.api.videos`, :mod:`omni_ext.api.images`) call :func:`read_video_request`
or :func:`read_image_request` and get the spec, or the error.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
import math
import os
import random
import re
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Protocol

from omni_ext import partials
from omni_ext.api import media
from omni_ext.api.errors import APIError, bad_request, from_pydantic, storage
from omni_ext.api.jobs import JobSpec
from omni_ext.api.limits import (
    MAX_COMPRESSION, MAX_FPS, MAX_FRAMES, MAX_OUTPUTS, MAX_PIXELS, MAX_PRIORITY, MAX_PROMPT_CHARS, MAX_SECONDS, MAX_SEED,
    MAX_STEPS, MAX_USER_CHARS, MIN_PRIORITY, MIN_STEPS, QUALITY_STEPS, SIZE_DIGITS,
)
from omni_ext.models import families
from omni_ext.models.families import ModelFamily, job_shape
from omni_ext.scheduler.priority import DEADLINE_ARG, PRIORITY_ARG

if TYPE_CHECKING:
    from fastapi import Request

    from omni_ext.api.settings import ApiSettings
    from omni_ext.api.tokens import PromptTokens

#: Job and media ids (also what keeps a path parameter out of the file system).
ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_SIZE_RE = re.compile(rf"\s*(\d{{1,{SIZE_DIGITS}}})\s*[xX]\s*(\d{{1,{SIZE_DIGITS}}})\s*")
_BRACKET = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]*\])+)$")
_JSON_FIELDS = ("extra_params", "lora", "image_reference", "video_reference", "audio_reference", "input_reference")


@dataclass
class Body:
    fields: dict[str, Any]
    files: dict[str, tuple[str, str, bytes]] = field(default_factory=dict)  # name -> (filename, type, data)
    #: Every part of each file field, in order (``files`` keeps the last, as a single-file form field reads
    #: it): ``input_references`` is one field sent several times.
    file_lists: dict[str, list[tuple[str, str, bytes]]] = field(default_factory=dict)

    def parts(self, name: str) -> list[tuple[str, str, bytes]]:
        """Every uploaded part of the file field ``name`` (none: an empty list)."""
        if name in self.file_lists:
            return list(self.file_lists[name])
        return [self.files[name]] if name in self.files else []


async def read_limited(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise _too_large(limit)
        except ValueError:
            raise APIError(HTTPStatus.BAD_REQUEST, "Invalid Content-Length header.", code="invalid_header") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def replay(body: bytes, receive: Callable[[], Any]) -> Callable[[], Any]:
    """An ASGI ``receive`` that gives ``body`` (already read) in one message, then the client's own
    messages (its disconnect): a body read once, then parsed or passed on. The body is forgotten once given."""
    box = [body]

    async def replayed() -> dict[str, Any]:
        if box:
            return {"type": "http.request", "body": box.pop(), "more_body": False}
        return await receive()

    return replayed


def _too_large(limit: int) -> APIError:
    return APIError(
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        f"Request body exceeds the limit of {limit // 2**20} MiB.",
        code="request_too_large",
    )


def _set_nested(out: dict[str, Any], key: str, value: Any) -> None:
    m = _BRACKET.match(key)
    if not m:
        out[key] = value
        return
    parts = [m.group(1)] + re.findall(r"\[([^\[\]]*)\]", m.group(2))
    node: Any = out
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        nxt = parts[i + 1] if not last else None
        if part == "":  # key[] -> list append
            if not isinstance(node, list):
                raise APIError(HTTPStatus.BAD_REQUEST, f"Malformed form field name '{key}'.", param=key, code="invalid_field")
            if last:
                node.append(value)
                return
            node.append({})
            node = node[-1]
            continue
        if isinstance(node, list):
            raise APIError(HTTPStatus.BAD_REQUEST, f"Malformed form field name '{key}'.", param=key, code="invalid_field")
        if last:
            node[part] = value
        else:
            node = node.setdefault(part, [] if nxt == "" else {})


def _maybe_json(name: str, value: Any) -> Any:
    if name in _JSON_FIELDS and isinstance(value, str) and value.strip()[:1] in ("{", "["):
        try:
            return json.loads(value)
        except ValueError:
            raise APIError(HTTPStatus.BAD_REQUEST, f"'{name}' is not valid JSON.", param=name, code="invalid_json") from None
    return value


async def parse_body(request: Request, limit: int, *, allow_files: bool = True) -> Body:
    """Parse a JSON or multipart/urlencoded body into plain fields (and uploaded files)."""
    from starlette.datastructures import UploadFile
    from starlette.requests import Request as FormRequest

    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    raw = await read_limited(request, limit)
    if ctype in ("application/json", "") or ctype.endswith("+json"):
        if not raw.strip():
            raise APIError(HTTPStatus.BAD_REQUEST, "Request body is empty; expected a JSON object.", code="empty_body")
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise APIError(HTTPStatus.BAD_REQUEST, f"Body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(HTTPStatus.BAD_REQUEST, "JSON body must be an object.", code="invalid_json")
        return Body(fields={k: _maybe_json(k, v) for k, v in data.items()})
    if ctype not in ("multipart/form-data", "application/x-www-form-urlencoded"):
        raise APIError(
            HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
            f"Unsupported Content-Type '{ctype}'; send application/json or multipart/form-data.",
            code="unsupported_media_type",
        )

    try:
        # max_files: Starlette's default, as vLLM-Omni's own form takes them (input_references has no count of
        # its own there); the body's size is bounded above.
        form = await FormRequest(request.scope, replay(raw, request.receive)).form(max_files=1000, max_fields=256)
    except Exception as exc:  # starlette raises MultiPartException / HTTPException on malformed bodies
        raise APIError(HTTPStatus.BAD_REQUEST, f"Malformed form body: {getattr(exc, 'detail', exc)}", code="invalid_form") from None
    del raw  # parsed (file parts over 1 MiB spooled to disk): not held beside the files read back below
    fields: dict[str, Any] = {}
    files: dict[str, tuple[str, str, bytes]] = {}
    file_lists: dict[str, list[tuple[str, str, bytes]]] = {}
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if not allow_files:
                raise APIError(HTTPStatus.BAD_REQUEST, f"File uploads are not accepted here ('{key}').", param=key)
            key = key[:-2] if key.endswith("[]") else key  # an SDK's list of files: input_references[]
            files[key] = (value.filename or key, value.content_type or "application/octet-stream", await value.read())
            file_lists.setdefault(key, []).append(files[key])
            continue
        _set_nested(fields, key, value)
    return Body(fields={k: _maybe_json(k, v) for k, v in fields.items()}, files=files, file_lists=file_lists)


# ---- fields ------------------------------------------------------------------------------------
def parse_size(value: Any) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` (``x`` or ``X``, blanks around the numbers allowed) as ``(width, height)``."""
    m = _SIZE_RE.fullmatch(str(value))
    if not m:
        raise bad_request(f"'size' must look like WIDTHxHEIGHT (e.g. 832x480), got {value!r}.", "size")
    return int(m.group(1)), int(m.group(2))


def bounded_int(value: Any, name: str, lo: int, hi: int) -> int:
    """An integer from ``lo`` to ``hi``: a JSON number or a form string (``"4"``, ``" 4 "``, ``"4.0"``)."""
    number = _as_int(value)
    if number is None:
        raise bad_request(f"'{name}' must be an integer, got {value!r}.", name)
    if not lo <= number <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {number}.", name)
    return number


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    if isinstance(value, int):
        return value
    text = str(value).strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return None
    return int(number) if math.isfinite(number) and number.is_integer() else None


def optional_int(fields: dict[str, Any], name: str, lo: int, hi: int, default: int | None = None) -> int | None:
    """:func:`bounded_int` of ``fields[name]``, or ``default`` when it is absent or null."""
    value = fields.get(name)
    return default if value is None else bounded_int(value, name, lo, hi)


def priority_of(fields: dict[str, Any]) -> int:
    """A request's ``priority`` (lower runs earlier; 0 when absent), as the ``openai`` SDK's
    ``extra_body={"priority": -1}`` sends it: a JSON number, or a form string under multipart."""
    return optional_int(fields, "priority", MIN_PRIORITY, MAX_PRIORITY, 0)


def deadline_of(fields: dict[str, Any]) -> float | None:
    """A request's ``deadline_s`` (seconds from its arrival by which it should be done; None when absent
    or null: the scheduler's default, ``slo_factor`` x its predicted time), a positive number as JSON
    or a form string. What it does to the order is :mod:`omni_ext.scheduler.admission`'s."""
    value = fields.get("deadline_s")
    if value is None:
        return None
    try:
        number = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: a JSON integer past a float's range
        number = math.nan
    if not math.isfinite(number) or number <= 0:
        raise bad_request(f"'deadline_s' must be a positive number of seconds, got {value!r}.", "deadline_s")
    return number


def optional_float(fields: dict[str, Any], name: str) -> float | None:
    """``fields[name]`` as a float, None when absent or null (limits are the validator's)."""
    value = fields.get(name)
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise bad_request(f"'{name}' must be a number, got {value!r}.", name) from None


def check_known(fields: Iterable[str], accepted: Iterable[str]) -> None:
    """Refuse the first field a route does not know (OpenAI's wording), instead of ignoring it."""
    unknown = sorted(set(fields) - set(accepted))
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")


def check_prompt(fields: dict[str, Any]) -> str:
    """The request's ``prompt``; its text fields (``prompt``, ``negative_prompt``, ``system_prompt``) within
    :data:`~omni_ext.api.limits.MAX_PROMPT_CHARS` characters."""
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise bad_request("'prompt' is required and must be a non-empty string.", "prompt",
                          "missing_required_parameter")
    for name in ("prompt", "negative_prompt", "system_prompt"):
        value = fields.get(name)
        if isinstance(value, str) and len(value) > MAX_PROMPT_CHARS:
            raise bad_request(f"'{name}' is {len(value)} characters; this server takes at most {MAX_PROMPT_CHARS}.",
                              name, "string_above_max_length")
    return prompt


def check_model(fields: dict[str, Any], served_name: str, served_path: str, *aliases: str) -> None:
    """``model`` may be omitted or name the served model (by any of its served names, or its path)."""
    model = fields.get("model")
    if not isinstance(model, (str, type(None))):
        raise bad_request("'model' must be a string.", "model")
    if model not in (None, "", served_name, served_path, *aliases):
        raise APIError(HTTPStatus.NOT_FOUND, f"The model '{model}' does not exist on this server (serving "
                       f"'{served_name}').", param="model", code="model_not_found")


def request_fields(body: Body, *, accepted: Iterable[str], served: tuple[str, ...], files: Iterable[str] = (),
                   size: bool = False, ints: Mapping[str, tuple[int, int]] | None = None,
                   tokens: PromptTokens | None = None) -> tuple[dict[str, Any], str]:
    """The checks a generation request starts with, in the order its first mistake is reported:
    unknown fields (:func:`check_known`) and file fields (``files`` are accepted), ``prompt`` (its
    characters, then, with ``tokens``, its tokens in the served model's tokenizer),
    ``model`` (``served``: the served model's name, path and other names); then, when asked, ``size`` (as
    ``width``/``height``) and each of ``ints`` (name -> bounds, in order; absent or null ones are
    left as they are). Returns (the fields without ``model``, the prompt); the caller's own fields follow."""
    fields = dict(body.fields)
    check_known(fields, accepted)
    unknown_files = sorted(set(body.files) - set(files))
    if unknown_files:
        raise bad_request(f"Unexpected file field: {unknown_files[0]}", unknown_files[0], "unknown_parameter")
    prompt = check_prompt(fields)
    over = tokens.over(fields) if tokens is not None else None
    if over is not None:
        raise bad_request(f"'{over[0]}' is {over[1]} tokens of the served model's tokenizer; this server takes at "
                          f"most {tokens.bound}.", over[0], "string_above_max_length")
    check_model(fields, *served)
    fields.pop("model", None)
    if size and "size" in fields:
        fields["width"], fields["height"] = parse_size(fields.pop("size"))
    for name, (lo, hi) in (ints or {}).items():
        if fields.get(name) is not None:
            fields[name] = bounded_int(fields[name], name, lo, hi)
    return fields, prompt


def with_priority(extra: dict[str, Any] | None, priority: int, deadline_s: float | None = None) -> dict[str, Any] | None:
    """``extra`` (a request's ``extra_params``) carrying ``priority`` and ``deadline_s`` to the executor;
    each key is left out at its default (0, None), so that vLLM-Omni's "Applied extra_params" log line
    stays the user's, and a user's own key never overrides the parsed field."""
    out = {k: v for k, v in (extra or {}).items() if k not in (PRIORITY_ARG, DEADLINE_ARG)}
    if priority:
        out[PRIORITY_ARG] = priority
    if deadline_s is not None:
        out[DEADLINE_ARG] = deadline_s
    return out if out or extra is not None else None


# ---- the served model's limits -----------------------------------------------------------------
@dataclass(frozen=True)
class ModelLimits:
    pipeline: str | None
    spatial_multiple: int  # height and width must be multiples of this (0: unknown, not checked)
    min_steps: int
    is_video: bool  # vLLM-Omni's output type of the class is "video"
    image_input: bool = False  # the class takes a reference image (vLLM-Omni's metadata and class flags)
    #: The served pipeline's entry in the model-family table (None: a class omni-ext does not list),
    #: looked up once with the limits, so that a request reads it without a look-up.
    family: ModelFamily | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", families.family_of(self.pipeline))


class Served(Protocol):
    """What intake reads of the server a request came to (:class:`omni_ext.api.state.ApiState` is one):
    the served model's names and limits, and the upload limit."""

    model_name: str
    model_path: str
    model_aliases: tuple[str, ...]
    limits: ModelLimits
    settings: ApiSettings
    prompt_tokens: PromptTokens | None


GUIDANCE_FIELDS = ("guidance_scale", "true_cfg_scale", "guidance_scale_2")


class InvalidRequest(ValueError):
    """A request field the model cannot honour; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def check_request(
    limits: ModelLimits,
    *,
    width: Any = None,
    height: Any = None,
    num_frames: Any = None,
    steps: Any = None,
    n: Any = 1,
    guidance: Mapping[str, Any] | None = None,
) -> None:
    """Raise :class:`InvalidRequest` for the first value outside the model's limits (None: not set).

    The one rule set behind every route: omni-ext's own routes call it with the fields they parsed
    (so a bad request is answered before a job exists), the ``validate-diffusion-requests`` patch
    through :func:`check_sampling_params` for every other route.
    """
    if steps is not None:
        if not isinstance(steps, int) or steps < limits.min_steps or steps > MAX_STEPS:
            raise InvalidRequest(
                f"num_inference_steps must be an integer from {limits.min_steps} to {MAX_STEPS} for this model, "
                f"got {steps!r}",
                "num_inference_steps",
            )
    for name, value in (("height", height), ("width", width)):
        if value is None:
            continue
        if not isinstance(value, int) or value <= 0:
            raise InvalidRequest(f"{name} must be a positive integer, got {value!r}", name)
        if limits.spatial_multiple and value % limits.spatial_multiple:
            raise InvalidRequest(
                f"{name} must be a multiple of {limits.spatial_multiple} for {limits.pipeline or 'this model'}, "
                f"got {value} (nearest valid: {max(limits.spatial_multiple, value // limits.spatial_multiple * limits.spatial_multiple)})",
                "size",
            )
    if isinstance(height, int) and isinstance(width, int) and height * width > MAX_PIXELS:
        raise InvalidRequest(f"size {width}x{height} exceeds the maximum of {MAX_PIXELS} pixels", "size")
    if limits.is_video and num_frames is not None:
        if not isinstance(num_frames, int) or num_frames < 1 or num_frames > MAX_FRAMES:
            raise InvalidRequest(f"num_frames must be an integer from 1 to {MAX_FRAMES}, got {num_frames!r}",
                                 "num_frames")
    if n is not None and (not isinstance(n, int) or not 1 <= n <= MAX_OUTPUTS):
        raise InvalidRequest(f"n must be an integer from 1 to {MAX_OUTPUTS}, got {n!r}", "n")
    for name, value in (guidance or {}).items():
        if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0):
            raise InvalidRequest(f"{name} must be a finite number >= 0, got {value!r}", name)


def _check_limits(limits: ModelLimits, **values: Any) -> None:
    """:func:`check_request` as a route answers it: 400 naming the field."""
    try:
        check_request(limits, **values)
    except InvalidRequest as exc:
        raise bad_request(exc.message, exc.param) from None


# ---- videos -------------------------------------------------------------------------------------
#: ``seconds`` on a model whose native fps omni-ext does not know.
FALLBACK_FPS = 16
_VIDEO_OWN_FIELDS = {"seconds", "size", "input_reference", "priority", "deadline_s", "control_type"}
#: File fields of vLLM-Omni 0.30's own ``/v1/videos`` form beside ``input_reference``: several reference
#: files, a model's control video/image (with ``control_type``), and latent-mask editing's source media and
#: JSON masks. They are carried by :func:`with_uploads`.
UPLOAD_FIELDS = ("input_references", "control_reference", "source_video", "source_audio", "video_noise_mask",
                 "audio_noise_mask")
#: Integer fields of a video request bounded here, in the order their errors are reported (after ``size``).
_VIDEO_INTS = {"priority": (MIN_PRIORITY, MAX_PRIORITY), "seconds": (1, MAX_SECONDS), "fps": (1, MAX_FPS),
               "seed": (0, MAX_SEED)}


@functools.cache
def _video_request_fields() -> frozenset[str]:
    from vllm_omni.entrypoints.openai.protocol.videos import VideoGenerationRequest

    return frozenset(VideoGenerationRequest.model_fields)


def _reference_image(body: Body, state: Served) -> Any:
    """The uploaded ``input_reference`` (file or ``{"image_url": data-URL}``) as a PIL image, or its bytes
    when it is a video file (:func:`is_video_container`)."""
    raw: bytes | None = None
    if "input_reference" in body.files:
        raw = body.files["input_reference"][2]
    else:
        ref = body.fields.get("input_reference")
        if isinstance(ref, dict) and isinstance(ref.get("image_url"), str):
            url = ref["image_url"]
            if not url.startswith("data:") or ";base64," not in url:
                raise bad_request("input_reference.image_url must be a base64 data URL here "
                                  "(this server does not fetch remote URLs).", "input_reference")
            try:
                raw = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
            except ValueError:
                raise bad_request("input_reference.image_url is not valid base64.", "input_reference") from None
        elif ref is not None:
            raise bad_request("input_reference must be an image file or {\"image_url\": ...}.", "input_reference")
    if raw is None:
        return None
    if not state.limits.image_input:  # vLLM-Omni's own answer for the class, before any decoding
        raise bad_request(f"The served model ({state.limits.pipeline}) generates from text only and cannot use "
                          "input_reference.", "input_reference", "unsupported_parameter")
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(raw))  # the header only: nothing is decoded yet
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError):
        if is_video_container(raw):  # vLLM-Omni's route takes a video here too: decoded at generation
            return raw
        raise bad_request("input_reference is not a readable image or video.", "input_reference", "invalid_image") from None
    _check_pixel_bound(*img.size, "input_reference")
    try:
        img.load()
    except (OSError, ValueError, Image.DecompressionBombError):
        raise bad_request("input_reference is not a readable image.", "input_reference", "invalid_image") from None
    return img.convert("RGB")


def is_video_container(raw: bytes) -> bool:
    """Whether ``raw`` starts like a video file (MP4/MOV/3GP ``ftyp``, Matroska/WebM, AVI, MPEG-TS/PS): the
    uploads vLLM-Omni's ``/v1/videos`` decodes as a video when they are no image. Only the magic bytes are
    read; the decoder judges the rest."""
    return (raw[4:8] == b"ftyp" or raw[:4] == b"\x1a\x45\xdf\xa3" or (raw[:4] == b"RIFF" and raw[8:12] == b"AVI ")
            or raw[:1] == b"\x47" and len(raw) > 188 and raw[188:189] == b"\x47" or raw[:4] == b"\x00\x00\x01\xba")


def _check_pixel_bound(width: int, height: int, param: str) -> None:
    """400 ``image_too_large`` for a reference image over :func:`max_reference_pixels`."""
    bound = max_reference_pixels()
    if bound > 0 and width * height > bound:
        raise bad_request(f"{param} is {width}x{height} ({width * height} pixels), over this server's bound of "
                          f"{bound} pixels (VLLM_MAX_IMAGE_PIXELS).", param, "image_too_large")


def check_upload_pixels(data: bytes, param: str) -> None:
    """An uploaded file that is an image is held to the reference images' pixel bound, read from its header
    before anything is decoded (as ``input_reference``); bytes that are no image are left to vLLM-Omni's own
    checks of the field."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
    except Image.DecompressionBombError:
        raise bad_request(f"{param} holds an image past the decoder's pixel limit.", param, "image_too_large") from None
    except (UnidentifiedImageError, OSError, ValueError):
        return
    _check_pixel_bound(width, height, param)


def max_reference_pixels() -> int:
    """The pixel bound of a reference image, read from its header before anything is decoded: vLLM's own
    ``VLLM_MAX_IMAGE_PIXELS`` (vLLM-Omni's video route checks the same one); 0 or less: no bound."""
    from vllm import envs

    return int(envs.VLLM_MAX_IMAGE_PIXELS)


def build_video_request(body: Body, state: Served, defaults: dict[str, int]) -> JobSpec:
    """The request's :class:`~omni_ext.api.jobs.JobSpec`: vLLM-Omni's ``VideoGenerationRequest`` (with
    ``priority`` and ``deadline_s`` in its ``extra_params``), the reference image or None, its size, frames, fps, steps,
    ``seconds``, ``priority`` and :class:`~omni_ext.models.families.JobShape`.

    ``defaults`` (:attr:`VideoBackend.defaults`) fill what the request leaves out: ``size`` -> width and
    height, ``seconds`` -> frames at their fps. Every field is checked here, once, so that a bad request
    is answered 400 before a job exists: omni-ext's own bounds (:mod:`omni_ext.api.limits`), then
    vLLM-Omni's pydantic model, then the served model's limits.
    """
    from vllm_omni.entrypoints.openai.protocol.videos import VideoGenerationRequest

    limits = state.limits
    if not limits.is_video:
        raise bad_request(f"The served model ({limits.pipeline or 'unknown'}) does not generate video; use "
                          "/v1/images/generations.", None, "unsupported_model")
    fields, _ = request_fields(body, accepted=_video_request_fields() | _VIDEO_OWN_FIELDS,
                               files=("input_reference", *UPLOAD_FIELDS), served=(state.model_name, state.model_path, *state.model_aliases),
                               size=True, ints=_VIDEO_INTS, tokens=state.prompt_tokens)
    if body.parts("input_references") and any(
            "input_reference" in body.files or fields.get(name) not in (None, "")
            for name in ("input_reference", "image_reference", "video_reference")):
        raise bad_request("Provide input_references alone, without input_reference, image_reference, or "
                          "video_reference.", "input_references")  # vLLM-Omni's own answer
    if fields.get("control_type") is not None and not isinstance(fields["control_type"], str):
        raise bad_request("'control_type' must be a string.", "control_type")
    fields.pop("control_type", None)  # with its control_reference: with_uploads
    if "width" in defaults and "height" in defaults and "width" not in fields and "height" not in fields:
        fields["width"], fields["height"] = defaults["width"], defaults["height"]
    priority = fields.pop("priority", None) or 0
    deadline_s = deadline_of(fields)
    fields.pop("deadline_s", None)
    seconds = fields.pop("seconds", None)
    if seconds is not None:
        if fields.get("fps") is None:
            fields["fps"] = defaults.get("fps", FALLBACK_FPS)
        temporal = limits.family.latent_temporal if limits.family is not None else 4
        fields.setdefault("num_frames", seconds * fields["fps"] // temporal * temporal + 1)  # the VAE's 4k+1 frames
    else:
        for key in ("fps", "num_frames"):
            if key in defaults:
                fields.setdefault(key, defaults[key])
    ref_image = _reference_image(body, state)
    fields.pop("input_reference", None)
    try:
        vreq = VideoGenerationRequest(**fields)
    except Exception as exc:  # pydantic.ValidationError
        raise from_pydantic(exc) from None
    if (vreq.num_outputs_per_prompt or 1) > 1:
        # vLLM-Omni's route encodes only the first of them; a job here is one video (one mp4, one content URL)
        raise bad_request(f"A video job makes one video; 'num_outputs_per_prompt' {vreq.num_outputs_per_prompt} "
                          "would run them all and return the first. Send one request per video (each its own "
                          "seed).", "num_outputs_per_prompt", "unsupported_parameter")
    vp = vreq.resolve_video_params()
    _check_limits(limits, width=vp.width, height=vp.height, num_frames=vp.num_frames,
                  steps=vreq.num_inference_steps, n=vreq.num_outputs_per_prompt,
                  guidance={name: getattr(vreq, name, None) for name in GUIDANCE_FIELDS})
    vreq.extra_params = with_priority(vreq.extra_params, priority, deadline_s)
    shape = job_shape(limits.pipeline, width=vp.width, height=vp.height, frames=vp.num_frames,
                      steps=vreq.num_inference_steps, n=vreq.num_outputs_per_prompt or 1,
                      negative_prompt=vreq.negative_prompt, guidance_scale=vreq.guidance_scale,
                      guidance_scale_2=vreq.guidance_scale_2, true_cfg_scale=vreq.true_cfg_scale)
    return JobSpec(
        request=vreq, prompt=vreq.prompt, shape=shape, priority=priority, deadline_s=deadline_s, width=vp.width, height=vp.height,
        frames=vp.num_frames, fps=vp.fps, steps=vreq.num_inference_steps, n=vreq.num_outputs_per_prompt or 1,
        seconds=str(seconds if seconds is not None else max(1, round((vp.num_frames or 1) / vp.fps))),
        reference=None if isinstance(ref_image, bytes) else ref_image,
        reference_video=ref_image if isinstance(ref_image, bytes) else None,
    )


async def read_video_request(request: Request, state: Served, defaults: dict[str, int],
                             handler: Any = None) -> tuple[JobSpec, Body]:
    """The ``POST /v1/videos`` (and ``/sync``) body, read within the upload limit, as its checked spec, and
    the parsed body (what a restart needs to run the job again: :mod:`omni_ext.api.archive`).
    ``handler``: vLLM-Omni's video handler, whose answers say which uploads the served model takes
    (:func:`with_uploads`). A spec with :attr:`~omni_ext.api.jobs.JobSpec.uploads` holds temporary files:
    the caller removes them (``spec.uploads.cleanup()``) once the job ends or is refused."""
    body = await parse_body(request, state.settings.max_upload_bytes)
    if body.fields.get("seed") in (None, ""):  # drawn here, as for images: the job records the seed it ran with
        body.fields["seed"] = random.randint(0, MAX_SEED)  # (a remix reuses it; a restart re-runs it exactly)
    return await video_spec(body, state, defaults, handler), body


#: Fields whose value is media (a reference by URL or data URL): a request that has one, or any uploaded
#: file, is not kept for a remix (:func:`remix_fields`).
_MEDIA_FIELDS = ("input_reference", "image_reference", "video_reference", "audio_reference", "input_references")
#: The most JSON a job keeps of its request for a remix.
REMIX_FIELDS_BYTES = 16 * 1024


def remix_fields(body: Body) -> dict[str, Any] | None:
    """What a job keeps of its request so that ``POST /v1/videos/{id}/remix`` can run it again with a new
    prompt (its parameters and seed, no prompt), or None: a request with uploads or media references
    (their bytes are not kept past the job), or one too large to keep in its record."""
    if body.files or body.file_lists or any(body.fields.get(name) not in (None, "") for name in _MEDIA_FIELDS):
        return None
    kept = {k: v for k, v in body.fields.items() if k != "prompt"}
    try:
        return kept if len(json.dumps(kept)) <= REMIX_FIELDS_BYTES else None
    except (TypeError, ValueError):
        return None


async def video_spec(body: Body, state: Served, defaults: dict[str, int], handler: Any = None) -> JobSpec:
    """A parsed ``/v1/videos`` body as its checked spec (what :func:`read_video_request` does after the read;
    also a kept request run again after a restart, :mod:`omni_ext.api.drain`)."""
    if "input_reference" in body.files or body.fields.get("input_reference") is not None:
        # a reference image is decoded here: off the event loop, which keeps serving meanwhile
        spec = await media.off_loop(build_video_request, body, state, defaults)
    else:
        spec = build_video_request(body, state, defaults)
    spec = replace(await with_image_references(spec, state), remix=remix_fields(body))
    return await with_uploads(spec, body, handler)  # last: nothing after it can fail and leave its files behind


def reference_items(value: Any) -> list[Any]:
    """A request's ``image_reference`` / ``video_reference`` / ``audio_reference``: one item or a list."""
    return [] if value is None else list(value) if isinstance(value, list) else [value]


async def with_image_references(spec: JobSpec, state: Served) -> JobSpec:
    """``spec`` with its JSON ``image_reference`` items (``{"image_url": ...}``, as LiteLLM's ``hosted_vllm``
    provider sends them) decoded by vLLM-Omni's own decoder, beside an ``input_reference`` image. Video and
    audio references stay in the request and are decoded when the job runs
    (:func:`omni_ext.api.videos.generate`), which removes their temporary files however the job ends."""
    items = reference_items(getattr(spec.request, "image_reference", None))
    if not items:
        return spec
    if not state.limits.image_input:
        raise bad_request(f"The served model ({state.limits.pipeline}) generates from text only and cannot use "
                          "image_reference.", "image_reference", "unsupported_parameter")
    from PIL import Image

    from vllm_omni.entrypoints.openai.errors import InvalidInputReferenceError
    from vllm_omni.entrypoints.openai.video_api_utils import decode_input_reference

    images = [] if spec.reference is None else [spec.reference]
    for item in items:
        try:
            image = await decode_input_reference(item, None, None)
        except (InvalidInputReferenceError, ValueError) as exc:
            raise bad_request(str(exc) or "Invalid image_reference.", "image_reference", "invalid_image") from None
        if not isinstance(image, Image.Image):
            raise bad_request("image_reference did not decode to an image.", "image_reference", "invalid_image")
        images.append(image.convert("RGB"))
    spec.request.image_reference = None  # carried as the reference image(s) from here on
    return replace(spec, reference=images[0] if len(images) == 1 else images)


@dataclass
class Uploads:
    """A video request's uploads, persisted as vLLM-Omni's own ``/v1/videos`` persists them, for its generation
    call: ``video`` and ``audio`` (its ``ReferenceVideo``/``ReferenceAudio``) from ``input_references``,
    ``control_path`` (``control_reference``, also in the request's ``extra_params[control_type]``) and
    ``latent_edit`` (its ``LatentEditInput``: source media and masks). :meth:`cleanup` removes their temporary
    files, by vLLM-Omni's own clean-up, and may be called again."""

    video: Any = None
    audio: Any = None
    control_path: str | None = None
    latent_edit: Any = None

    def cleanup(self) -> None:
        from vllm_omni.entrypoints.openai.video.generation.helpers import _cleanup_video_references

        with contextlib.suppress(OSError):
            _cleanup_video_references(self.video, self.audio, self.control_path, self.latent_edit)


def _upload(part: tuple[str, str, bytes]) -> Any:
    """A parsed file part as the ``UploadFile`` vLLM-Omni's helpers read."""
    from starlette.datastructures import Headers, UploadFile

    filename, content_type, data = part
    return UploadFile(io.BytesIO(data), size=len(data), filename=filename,
                      headers=Headers({"content-type": content_type}))


@contextlib.contextmanager
def _answer(why: tuple[str, str] | Callable[[], tuple[str, str]]) -> Iterator[None]:
    """A refusal of vLLM-Omni's helpers (FastAPI's ``HTTPException``) as omni-ext's OpenAI-style error, with the
    same status and message; ``why``: its ``(param, code)``, or what tells them once it is raised."""
    from fastapi import HTTPException

    try:
        yield
    except HTTPException as exc:
        param, code = why() if callable(why) else why
        raise APIError(exc.status_code, str(exc.detail), param=param or None, code=code) from None


async def with_uploads(spec: JobSpec, body: Body, handler: Any) -> JobSpec:
    """``spec`` with the request's file fields beside ``input_reference`` (:data:`UPLOAD_FIELDS`) carried as
    vLLM-Omni's own ``/v1/videos`` carries them, by its own helpers, in its order and with its answers (the
    served model's capabilities are its handler's: ``supports_mixed_reference_inputs``,
    ``supported_control_upload_types``, ``supports_latent_mask_editing``):

    - ``input_references`` (alone; :func:`build_video_request` says so): a model of mixed references
      (MiniMax H3) gets its images as the reference images and its videos and audio as files, any other model
      every file as a reference video file;
    - ``control_reference`` with ``control_type``: a file whose path goes to ``extra_params[control_type]
      ["control_path"]``, only for a model that declares the type;
    - ``source_video``, ``source_audio``, ``video_noise_mask``, ``audio_noise_mask`` (JSON files): latent-mask
      editing, only for a model that supports it.

    Uploaded images are held to the reference images' pixel bound (:func:`check_upload_pixels`), and
    every upload to the body's size limit and to vLLM-Omni's own size caps. A refusal removes whatever was
    persisted; else the caller removes the files (:attr:`JobSpec.uploads`) when the job ends."""
    parts = {name: body.parts(name) for name in UPLOAD_FIELDS}
    control_type = body.fields.get("control_type")
    if not any(parts.values()) and control_type is None:
        return spec
    from types import SimpleNamespace

    from vllm_omni.entrypoints.openai.serving_video import LatentEditInput, ReferenceAudio, ReferenceVideo
    from vllm_omni.entrypoints.openai.video.generation.helpers import (
        _attach_control_upload, _persist_latent_edit_source, _persist_uploaded_control_reference,
        _persist_uploaded_media_references, _persist_uploaded_video_references, _read_latent_edit_mask_json,
        _validate_control_upload, _validate_latent_edit_inputs,
    )

    if handler is None:  # no video handler to ask: a model of no special capabilities
        handler = SimpleNamespace(supports_mixed_reference_inputs=False, supports_latent_mask_editing=False,
                                  supported_control_upload_types=frozenset())
    vreq = spec.request
    masks: dict[str, Any] = {}
    for name in ("video_noise_mask", "audio_noise_mask"):
        with _answer((name, "invalid_value")):
            masks[name] = await _read_latent_edit_mask_json(_upload(parts[name][-1]) if parts[name] else None,
                                                            field_name=name)
    sources = {name: _upload(parts[name][-1]) if parts[name] else None for name in ("source_video", "source_audio")}
    edit_param = next((n for n in ("source_video", "source_audio", "video_noise_mask", "audio_noise_mask") if parts[n]),
                      "")

    def edit_refusal() -> tuple[str, str]:
        return edit_param, "invalid_value" if handler.supports_latent_mask_editing else "unsupported_parameter"

    with _answer(edit_refusal):
        edit = _validate_latent_edit_inputs(handler, **sources, **masks)
    control = _upload(parts["control_reference"][-1]) if parts["control_reference"] else None

    def control_refusal() -> tuple[str, str]:
        if control is None:
            return "control_reference", "invalid_value"
        if not (control_type or "").strip():
            return "control_type", "invalid_value"
        if control_type.strip().lower() not in handler.supported_control_upload_types:
            return "control_type", "unsupported_parameter"
        return "extra_params", "invalid_value"

    with _answer(control_refusal):
        kind = _validate_control_upload(handler, vreq, control, control_type)
    if kind is not None:
        _attach_control_upload(vreq, kind)
        check_upload_pixels(parts["control_reference"][-1][2], "control_reference")
    for part in parts["input_references"]:
        check_upload_pixels(part[2], "input_references")

    uploads, edit_paths = Uploads(), []
    try:
        refs = parts["input_references"]
        if refs:
            with _answer(("input_references", "invalid_value")), storage("storing input_references"):
                if handler.supports_mixed_reference_inputs:
                    images, videos, audios = await _persist_uploaded_media_references([_upload(p) for p in refs])
                else:  # every file a reference video
                    images, audios = [], []
                    videos = await _persist_uploaded_video_references([_upload(p) for p in refs])
            if videos:
                uploads.video = ReferenceVideo(data=videos, cleanup_paths=tuple(videos))
            if audios:
                uploads.audio = ReferenceAudio(path=audios if len(audios) > 1 else audios[0],
                                               cleanup_paths=tuple(audios))
            if images:  # input_references come alone: these are the request's reference images
                spec = replace(spec, reference=images if len(images) > 1 else images[0])
        if kind is not None:
            with _answer(("control_reference", "invalid_value")), storage("storing control_reference"):
                uploads.control_path = await _persist_uploaded_control_reference(control)
            _attach_control_upload(vreq, kind, uploads.control_path)
        if edit:
            paths: dict[str, str] = {}
            for name, upload in sources.items():
                if upload is not None:
                    with _answer((name, "invalid_value")), storage(f"storing {name}"):
                        paths[name] = await _persist_latent_edit_source(upload, field_name=name)
                    edit_paths.append(paths[name])
            uploads.latent_edit = LatentEditInput(**paths, **masks, cleanup_paths=tuple(edit_paths))
    except BaseException:
        uploads.cleanup()
        for path in edit_paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    return replace(spec, uploads=uploads)


# ---- images -------------------------------------------------------------------------------------
_IMAGE_FIELDS = {
    "prompt", "model", "n", "size", "response_format", "output_format", "output_compression", "quality", "style",
    "background", "moderation", "user", "safety_identifier", "stream", "partial_images",
    # vLLM-Omni extensions
    "negative_prompt", "num_inference_steps", "guidance_scale", "true_cfg_scale", "seed", "generator_device",
    "extra_params", "flow_shift", "priority", "deadline_s", "lora", "layers", "system_prompt", "use_system_prompt",
    "bot_task",
}


@dataclass(frozen=True)
class ImageReply:
    """How a generation's images go back to the client."""

    response_format: str  # ``b64_json`` or ``url``
    output_format: str  # ``png``, ``jpeg`` or ``webp``
    output_compression: int | None
    #: OpenAI hint fields the request set that this server accepted and did not apply (a response header
    #: and a log line say so: :func:`hints`)
    ignored: tuple[str, ...] = ()
    #: the end user the client named (``safety_identifier``, else ``user``), recorded with the request
    end_user: str | None = None
    #: ``stream=true``: server-sent events (OpenAI's partial-image and completed events), not one JSON body
    stream: bool = False
    #: the partial images the worker decodes for a stream (0 where the model makes none: then reported ignored)
    partial_images: int = 0


def hints(fields: dict[str, Any], limits: ModelLimits, steps: int | None) -> tuple[int | None, tuple[str, ...], str | None]:
    """OpenAI's image hints: ``quality`` as a fraction of the native steps (:data:`QUALITY_STEPS`;
    ``steps`` the request set wins), ``background`` (``transparent`` refused: no model here makes an alpha
    channel), ``style`` and ``moderation`` (accepted, not applied), ``user``/``safety_identifier``
    (recorded). Returns (the steps to run, the fields accepted and not applied, the end user)."""
    ignored: list[str] = []
    quality = fields.get("quality")
    if quality not in (None, "auto"):
        if not isinstance(quality, str) or quality not in QUALITY_STEPS:
            raise bad_request(f"'quality' must be one of {['auto', *QUALITY_STEPS]}.", "quality")
        native = limits.family.native.steps if limits.family is not None else None
        if steps is None and native:
            steps = max(MIN_STEPS, limits.min_steps, round(native * QUALITY_STEPS[quality]))
        else:  # the request's own steps, or a model whose native steps omni-ext does not know
            ignored.append("quality")
    background = fields.get("background")
    if background not in (None, "auto", "opaque"):
        if background == "transparent":
            raise bad_request(f"The served model ({limits.pipeline or 'unknown'}) makes opaque images; "
                              "'background' may be 'auto' or 'opaque'.", "background", "unsupported_parameter")
        raise bad_request("'background' must be 'auto', 'opaque' or 'transparent'.", "background")
    for name, allowed in (("style", ("vivid", "natural")), ("moderation", ("auto", "low"))):
        value = fields.get(name)
        if value is not None:
            if value not in allowed:
                raise bad_request(f"'{name}' must be one of {list(allowed)}.", name)
            ignored.append(name)
    end_user = None
    for name in ("user", "safety_identifier"):
        value = fields.get(name)
        if value is not None:
            if not isinstance(value, str) or len(value) > MAX_USER_CHARS:
                raise bad_request(f"'{name}' must be a string of at most {MAX_USER_CHARS} characters.", name)
            end_user = value
    return steps, tuple(ignored), end_user


def build_image_request(fields: dict[str, Any], state: Served) -> tuple[JobSpec, ImageReply]:
    """A generation request, parsed and checked (bounds, then the served model's limits) before any work:
    its :class:`~omni_ext.api.jobs.JobSpec` (vLLM-Omni's prompt and sampling parameters, as its own
    route builds them, with ``priority`` and ``deadline_s`` in their extra arguments) and how to answer it."""
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams, OmniTextPrompt

    _, prompt = request_fields(Body(fields), accepted=_IMAGE_FIELDS, served=(state.model_name, state.model_path, *state.model_aliases),
                               tokens=state.prompt_tokens)
    stream, wanted = _streaming(fields)
    fmt = fields.get("response_format") or "b64_json"
    if not isinstance(fmt, str) or fmt not in ("b64_json", "url"):
        raise bad_request("'response_format' must be 'b64_json' or 'url'.", "response_format")
    if stream and fmt != "b64_json":
        raise bad_request("A streamed generation sends its image in its events as b64_json; leave "
                          "'response_format' out or set it to 'b64_json'.", "response_format", "unsupported_parameter")
    out_fmt = fields.get("output_format") or "png"
    if not isinstance(out_fmt, str) or out_fmt not in media.IMAGE_TYPES:
        raise bad_request("'output_format' must be 'png', 'jpeg' or 'webp'.", "output_format")
    for name in ("negative_prompt", "generator_device", "system_prompt", "bot_task"):
        if fields.get(name) is not None and not isinstance(fields[name], str):
            raise bad_request(f"'{name}' must be a string.", name)
    if fields.get("use_system_prompt") is not None and not isinstance(fields["use_system_prompt"], bool):
        raise bad_request("'use_system_prompt' must be a boolean.", "use_system_prompt")
    lora_request, lora_scale = _lora(fields.get("lora"))
    layers = _layers(fields.get("layers"))
    width = height = None
    if fields.get("size") not in (None, "auto"):
        width, height = parse_size(fields["size"])
    n = optional_int(fields, "n", 1, MAX_OUTPUTS, 1)
    if stream and n != 1:
        raise bad_request("A streamed generation makes one image; set 'n' to 1 or leave out 'stream'.", "n",
                          "unsupported_parameter")
    steps, ignored, end_user = hints(fields, state.limits, optional_int(fields, "num_inference_steps", MIN_STEPS,
                                                                        MAX_STEPS))
    partial_images = wanted if state.limits.family is not None and state.limits.family.partial_images else 0
    if wanted and not partial_images:  # OpenAI promises at most partial_images: this model makes none
        ignored = (*ignored, "partial_images")
    reply = ImageReply(fmt, out_fmt, optional_int(fields, "output_compression", 0, MAX_COMPRESSION), ignored,
                       end_user, stream, partial_images)
    guidance_scale = optional_float(fields, "guidance_scale")
    true_cfg_scale = optional_float(fields, "true_cfg_scale")
    seed = optional_int(fields, "seed", 0, MAX_SEED)
    flow_shift = optional_float(fields, "flow_shift")
    priority = priority_of(fields)
    deadline_s = deadline_of(fields)
    extra_params = fields.get("extra_params")
    if extra_params is not None and not isinstance(extra_params, dict):
        raise bad_request("'extra_params' must be an object.", "extra_params")
    _check_limits(state.limits, width=width, height=height, steps=steps, n=n,
                  guidance={"guidance_scale": guidance_scale, "true_cfg_scale": true_cfg_scale})
    negative_prompt = fields.get("negative_prompt")
    engine_prompt = OmniTextPrompt(prompt=prompt, modalities=["image"])
    if negative_prompt is not None:
        engine_prompt["negative_prompt"] = negative_prompt
    params = OmniDiffusionSamplingParams(num_outputs_per_prompt=n)
    extra = with_priority(extra_params, priority, deadline_s) or {}
    if partial_images:
        extra[partials.KEY] = partial_images  # the worker decodes them (omni_ext.partials)
    for name in ("use_system_prompt", "system_prompt", "bot_task"):  # as vLLM-Omni's own route carries them
        if fields.get(name) is not None:
            extra[name] = fields[name]
    if flow_shift is not None:
        extra["flow_shift"] = flow_shift
    if extra:
        params.extra_args = extra
    if width is not None:
        params.width, params.height = width, height
        engine_prompt["height"], engine_prompt["width"] = height, width
        # an AR stage's target grid (GLM-Image) follows the requested size, as on vLLM-Omni's route
        engine_prompt["mm_processor_kwargs"] = {"target_h": height, "target_w": width}
    for name, value in (("num_inference_steps", steps), ("guidance_scale", guidance_scale),
                        ("true_cfg_scale", true_cfg_scale), ("generator_device", fields.get("generator_device")),
                        ("lora_request", lora_request), ("lora_scale", lora_scale), ("layers", layers)):
        if value is not None:
            setattr(params, name, value)
    params.seed = seed if seed is not None else random.randint(0, MAX_SEED)
    shape = job_shape(state.limits.pipeline, width=width, height=height, steps=steps, n=n,
                      negative_prompt=negative_prompt, guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale)
    spec = JobSpec(request=(engine_prompt, params), prompt=prompt, shape=shape, priority=priority,
                   deadline_s=deadline_s, width=width, height=height, steps=steps, n=n)
    return spec, reply


def _streaming(fields: dict[str, Any]) -> tuple[bool, int]:
    """``stream`` (a JSON boolean, or "true"/"false" in a form) and ``partial_images`` (0-3, only with
    ``stream``): (whether to stream, the partial images asked for)."""
    value = fields.get("stream")
    if value in (None, False, "false", "False"):
        stream = False
    elif value in (True, "true", "True"):
        stream = True
    else:
        raise bad_request("'stream' must be a boolean.", "stream")
    wanted = optional_int(fields, "partial_images", 0, partials.MAX_PARTIALS, 0) or 0
    if wanted and not stream:
        raise bad_request("'partial_images' is sent only in a stream: set 'stream' to true, or leave it out or 0.",
                          "partial_images", "unsupported_parameter")
    return stream, wanted


def _lora(value: Any) -> tuple[Any, float | None]:
    """A request-level LoRA object (``{"name", "path", "scale"}``) as vLLM-Omni's own parser reads it."""
    if value is None:
        return None, None
    from vllm_omni.entrypoints.openai.utils import parse_lora_request

    try:
        return parse_lora_request(value)
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc) or "Invalid lora object.", "lora") from None


def _layers(value: Any) -> int | None:
    """Qwen-Image-Layered's ``layers``, within vLLM-Omni's own range."""
    if value is None:
        return None
    from vllm_omni.entrypoints.openai.image_api_utils import validate_layered_layers

    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request("'layers' must be an integer.", "layers")
    try:
        return validate_layered_layers(value)
    except ValueError as exc:
        raise bad_request(str(exc), "layers") from None


def _check_json(request: Request) -> None:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise APIError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "Send the image generation request as application/json.",
                       code="unsupported_media_type")


async def read_image_request(request: Request, state: Served) -> tuple[JobSpec, ImageReply]:
    """The ``POST /v1/images/generations`` body (JSON only, no files), as its checked spec and reply format."""
    _check_json(request)
    body = await parse_body(request, state.settings.max_upload_bytes, allow_files=False)
    return build_image_request(body.fields, state)
