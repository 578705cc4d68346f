"""Request bodies as clients really send them: JSON, or multipart with SDK-style bracketed keys.

- openai-python before 2.27 sends ``videos.create`` as JSON unless a file is attached; 2.27 and
  later always send multipart/form-data, where ``extra_body`` values arrive as strings
  (``"4"``, ``"true"``), nested dicts as ``key[sub]`` and lists as ``key[]``.
- vLLM-Omni's own clients send multipart with JSON-encoded strings for ``extra_params``/``lora``.
Both become one plain dict here; pydantic then coerces types. Uploads are size-limited while
being read: a body larger than the limit is refused with 413 before it is read whole.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import Request
from starlette.datastructures import UploadFile

from omni_ext.api.errors import APIError

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
        form = await Request(request.scope, replay).form(max_files=16, max_fields=256)
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


def parse_bool(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {value!r}")
