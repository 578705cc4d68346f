"""Request bodies as clients really send them: JSON, or multipart with SDK-style bracketed keys.

- openai-python before 2.27 sends ``videos.create`` as JSON unless a file is attached; 2.27 and
  later always send multipart/form-data, where ``extra_body`` values arrive as strings
  (``"4"``, ``"true"``), nested dicts as ``key[sub]`` and lists as ``key[]``.
- vLLM-Omni's own clients send multipart with JSON-encoded strings for ``extra_params``/``lora``.
Both become one plain dict here; pydantic then coerces types. Uploads are size-limited while
being read: a body larger than the limit is refused with 413 before it is read whole.

The field parsers below (ids, ``size``, bounded numbers, prompt and model) are shared by the video and
image routes, so that one field is parsed, bounded and worded the same way everywhere. They need
neither FastAPI nor vLLM-Omni (only :class:`~omni_ext.api.errors.APIError`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from omni_ext.api.errors import APIError, bad_request
from omni_ext.api.limits import MAX_PRIORITY, MIN_PRIORITY, SIZE_DIGITS
from omni_ext.scheduler.order import PRIORITY_ARG

if TYPE_CHECKING:
    from fastapi import Request

#: Job and media ids (also what keeps a path parameter out of the file system).
ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_SIZE_RE = re.compile(rf"\s*(\d{{1,{SIZE_DIGITS}}})\s*[xX]\s*(\d{{1,{SIZE_DIGITS}}})\s*")
_BRACKET = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]*\])+)$")
_JSON_FIELDS = ("extra_params", "lora", "image_reference", "video_reference", "audio_reference", "input_reference")


@dataclass
class Body:
    fields: dict[str, Any]
    files: dict[str, tuple[str, str, bytes]] = field(default_factory=dict)  # name -> (filename, type, data)


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

    async def replay():
        return {"type": "http.request", "body": raw, "more_body": False}

    try:
        form = await FormRequest(request.scope, replay).form(max_files=16, max_fields=256)
    except Exception as exc:  # starlette raises MultiPartException / HTTPException on malformed bodies
        raise APIError(HTTPStatus.BAD_REQUEST, f"Malformed form body: {getattr(exc, 'detail', exc)}", code="invalid_form") from None
    fields: dict[str, Any] = {}
    files: dict[str, tuple[str, str, bytes]] = {}
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if not allow_files:
                raise APIError(HTTPStatus.BAD_REQUEST, f"File uploads are not accepted here ('{key}').", param=key)
            files[key] = (value.filename or key, value.content_type or "application/octet-stream", await value.read())
            continue
        _set_nested(fields, key, value)
    return Body(fields={k: _maybe_json(k, v) for k, v in fields.items()}, files=files)


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
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise bad_request("'prompt' is required and must be a non-empty string.", "prompt",
                          "missing_required_parameter")
    return prompt


def check_model(fields: dict[str, Any], served_name: str, served_path: str) -> None:
    """``model`` may be omitted or name the served model (by its served name or its path)."""
    model = fields.get("model")
    if not isinstance(model, (str, type(None))):
        raise bad_request("'model' must be a string.", "model")
    if model not in (None, "", served_name, served_path):
        raise APIError(HTTPStatus.NOT_FOUND, f"The model '{model}' does not exist on this server (serving "
                       f"'{served_name}').", param="model", code="model_not_found")


def request_fields(body: Body, *, accepted: Iterable[str], served: tuple[str, str], files: Iterable[str] = (),
                   size: bool = False, ints: Mapping[str, tuple[int, int]] | None = None) -> tuple[dict[str, Any], str]:
    """The checks a generation request starts with, in the order its first mistake is reported:
    unknown fields (:func:`check_known`) and file fields (``files`` are accepted), ``prompt``,
    ``model`` (``served``: the served model's name and path); then, when asked, ``size`` (as
    ``width``/``height``) and each of ``ints`` (name -> bounds, in order; absent or null ones are
    left as they are). Returns (the fields without ``model``, the prompt); the caller's own fields follow."""
    fields = dict(body.fields)
    check_known(fields, accepted)
    unknown_files = sorted(set(body.files) - set(files))
    if unknown_files:
        raise bad_request(f"Unexpected file field: {unknown_files[0]}", unknown_files[0], "unknown_parameter")
    prompt = check_prompt(fields)
    check_model(fields, *served)
    fields.pop("model", None)
    if size and "size" in fields:
        fields["width"], fields["height"] = parse_size(fields.pop("size"))
    for name, (lo, hi) in (ints or {}).items():
        if fields.get(name) is not None:
            fields[name] = bounded_int(fields[name], name, lo, hi)
    return fields, prompt


def with_priority(extra: dict[str, Any] | None, priority: int) -> dict[str, Any] | None:
    """``extra`` (a request's ``extra_params``) carrying ``priority`` to the executor; the key is
    left out at the default 0, so that vLLM-Omni's "Applied extra_params" log line stays the user's."""
    out = {k: v for k, v in (extra or {}).items() if k != PRIORITY_ARG}
    if priority:
        out[PRIORITY_ARG] = priority
    return out if out or extra is not None else None
