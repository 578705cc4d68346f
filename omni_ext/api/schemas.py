"""OpenAPI request-body schemas for omni-ext's routes (documentation, SDK generators, schemathesis).

The routes parse bodies themselves (JSON and multipart share one parser), so FastAPI cannot infer
these; they are declared here to match what the parsers accept, and every bound is built from
:mod:`omni_ext.api.limits`, the constants the parsers and the validator enforce. The fields of
vLLM-Omni's own ``VideoGenerationRequest`` that ``/v1/videos`` passes through and omni-ext does not
describe itself are taken from that pydantic model's JSON schema (:func:`_vllm_omni_video_fields`),
so that the schema lists exactly what the parser accepts (``tests/test_api_units.py`` compares
them). :func:`fields_markdown` is the reference page ``docs/reference/api-fields.md`` (:mod:`omni_ext.reference`).
"""

from __future__ import annotations

import json
from typing import Any

from omni_ext import partials
from omni_ext.api.limits import (
    MAX_COMPRESSION, MAX_FPS, MAX_FRAMES, MAX_OUTPUTS, MAX_PIXELS, MAX_PRIORITY, MAX_PROMPT_CHARS, MAX_SECONDS, MAX_SEED,
    MAX_STEPS, MAX_USER_CHARS, MAX_VIDEO_GUIDANCE, MAX_VIDEO_STEPS, MIN_PRIORITY, MIN_STEPS, QUALITY_STEPS, SIZE_DIGITS,
)
from omni_ext import REGENERATE_DOCS as REGENERATE


def integer_pattern(hi: int) -> str:
    """A regex for the decimal integers 1..``hi`` written plainly (no sign, blank or leading zero)."""
    digits = str(hi)

    def then_any(n: int) -> str:
        return "" if n == 0 else r"\d" if n == 1 else rf"\d{{{n}}}"

    shorter = [r"[1-9]" + then_any(k) for k in range(len(digits) - 1)]
    below = []  # as long as hi but smaller: hi's first i digits, a smaller digit, then any digits
    for i, d in enumerate(digits):
        lowest, top = (1 if i == 0 else 0), int(d) - 1
        if top >= lowest:
            smaller = str(top) if top == lowest else f"[{lowest}-{top}]"
            below.append(digits[:i] + smaller + then_any(len(digits) - i - 1))
    return "^(?:" + "|".join(shorter + below + [digits]) + ")$"


def _integer(lo: int, hi: int | None = None) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, **({"maximum": hi} if hi is not None else {})}


def _number(lo: float, hi: float | None = None) -> dict[str, Any]:
    return {"type": "number", "minimum": lo, **({"maximum": hi} if hi is not None else {})}


_SIZE = {"type": "string", "pattern": rf"^\d{{1,{SIZE_DIGITS}}}x\d{{1,{SIZE_DIGITS}}}$", "example": "832x480",
         "description": f"WIDTHxHEIGHT, each a multiple of the model's spatial multiple, at most {MAX_PIXELS} pixels."}
_SIDE = {**_integer(1), "description": "A multiple of the model's spatial multiple (e.g. 16)."}
_PRIORITY = {**_integer(MIN_PRIORITY, MAX_PRIORITY), "default": 0,
             "description": "Lower runs earlier (vLLM's convention); ordered by omni-ext's TunedExecutor."}
_DEADLINE = {"type": "number", "exclusiveMinimum": 0,
             "description": "Seconds from arrival by which the request should be done (default: the scheduler's "
                            "slo_factor x its predicted time); the scheduler's order \"slo\" starts it early enough "
                            "when it can."}

_BINARY = {"type": "string", "format": "binary"}

VIDEO_CREATE: dict[str, Any] = {
    "type": "object",
    "required": ["prompt"],
    "additionalProperties": False,
    "properties": {
        "prompt": {"type": "string", "minLength": 1, "maxLength": MAX_PROMPT_CHARS},
        "model": {"type": "string"},
        "seconds": {"type": "string", "pattern": integer_pattern(MAX_SECONDS),
                    "description": f"Clip length, 1 to {MAX_SECONDS}; mapped to the model's native fps and "
                                   "frame count."},
        "size": _SIZE,
        "input_reference": {"type": "string", "format": "binary"},
        # vLLM-Omni's own multipart uploads (omni_ext.api.intake.with_uploads), each only where the served
        # model takes it, as vLLM-Omni's route decides.
        "input_references": {"type": "array", "items": _BINARY,
                             "description": "Reference files, alone (without input_reference, image_reference or "
                                            "video_reference): a mixed-reference model's images, videos and audio, "
                                            "any other model's reference videos."},
        "control_reference": {**_BINARY, "description": "A control image or video, with control_type."},
        "control_type": {"type": "string", "description": "One of the served model's control upload types."},
        "source_video": {**_BINARY, "description": "Latent-mask editing: the source video (MP4 or MOV)."},
        "source_audio": {**_BINARY, "description": "Latent-mask editing: the source audio (WAV or MP3)."},
        "video_noise_mask": {**_BINARY, "description": "Latent-mask editing: the video mask, a UTF-8 JSON file."},
        "audio_noise_mask": {**_BINARY, "description": "Latent-mask editing: the audio mask, a UTF-8 JSON file."},
        "negative_prompt": {"type": "string", "maxLength": MAX_PROMPT_CHARS},
        "num_inference_steps": _integer(MIN_STEPS, MAX_VIDEO_STEPS),
        "guidance_scale": _number(0, MAX_VIDEO_GUIDANCE),
        "guidance_scale_2": _number(0, MAX_VIDEO_GUIDANCE),
        "true_cfg_scale": _number(0, MAX_VIDEO_GUIDANCE),
        "seed": _integer(0, MAX_SEED),
        "width": _SIDE,
        "height": _SIDE,
        "num_frames": _integer(1, MAX_FRAMES),
        "fps": _integer(1, MAX_FPS),
        "flow_shift": {"type": "number"},
        "boundary_ratio": _number(0, 1),
        "priority": _PRIORITY,
        "deadline_s": _DEADLINE,
        "extra_params": {"type": "object"},
        "num_outputs_per_prompt": {**_integer(1, 1), "description": "A video job makes one video (send one "
                                   "request per video)."},
    },
}

#: ``POST /v1/videos/{id}/remix``: OpenAI's ``VideoRemixParams``.
VIDEO_REMIX: dict[str, Any] = {
    "type": "object",
    "required": ["prompt"],
    "additionalProperties": False,
    "properties": {"prompt": {"type": "string", "minLength": 1, "maxLength": MAX_PROMPT_CHARS}},
}

IMAGE_GENERATE: dict[str, Any] = {
    "type": "object",
    "required": ["prompt"],
    "additionalProperties": False,
    "properties": {
        "prompt": {"type": "string", "minLength": 1, "maxLength": MAX_PROMPT_CHARS},
        "model": {"type": "string"},
        "n": _integer(1, MAX_OUTPUTS),
        "size": {"oneOf": [_SIZE, {"type": "string", "enum": ["auto"]}]},
        "response_format": {"type": "string", "enum": ["b64_json", "url"]},
        "output_format": {"type": "string", "enum": ["png", "jpeg", "webp"]},
        "output_compression": _integer(0, MAX_COMPRESSION),
        "negative_prompt": {"type": "string", "maxLength": MAX_PROMPT_CHARS},
        "num_inference_steps": _integer(MIN_STEPS, MAX_STEPS),
        "guidance_scale": _number(0),
        "true_cfg_scale": _number(0),
        "seed": _integer(0, MAX_SEED),
        "priority": _PRIORITY,
        "deadline_s": _DEADLINE,
        "extra_params": {"type": "object"},
        "system_prompt": {"type": "string", "maxLength": MAX_PROMPT_CHARS},
        "use_system_prompt": {"type": "boolean"},
        "bot_task": {"type": "string"},
        "quality": {"type": "string", "enum": ["auto", *QUALITY_STEPS]},
        "background": {"type": "string", "enum": ["auto", "opaque", "transparent"]},
        "style": {"type": "string", "enum": ["vivid", "natural"]},
        "moderation": {"type": "string", "enum": ["auto", "low"]},
        "user": {"type": "string", "maxLength": MAX_USER_CHARS},
        "safety_identifier": {"type": "string", "maxLength": MAX_USER_CHARS},
        "flow_shift": {"type": "number", "description": "The scheduler's flow shift (vLLM-Omni's extension)."},
        "generator_device": {"type": "string", "description": "Where the seed's generator runs (e.g. cpu)."},
        "layers": {"type": "integer", "description": "Qwen-Image-Layered: how many layers (vLLM-Omni's range)."},
        "lora": {"type": "object", "description": "A request LoRA: {name, path, scale} (vLLM-Omni's parser)."},
        "stream": {"type": "boolean", "description": "Server-sent events: image_generation.partial_image "
                   "events, then image_generation.completed (b64_json, n 1)."},
        "partial_images": {**_integer(0, partials.MAX_PARTIALS),
                           "description": "Previews sent before the image in a stream (stream: true; at most this "
                           "many; the Qwen-Image families make them, other models send none and report the field)."},
    },
}


def _vllm_omni_video_fields(listed: set[str]) -> dict[str, Any]:
    """vLLM-Omni's ``VideoGenerationRequest`` fields not in ``listed``, as its pydantic model describes
    them (``$ref`` inlined; titles and defaults dropped; ``null`` stays allowed where it is)."""
    try:
        from vllm_omni.entrypoints.openai.protocol.videos import VideoGenerationRequest
    except ImportError:  # pure tests without vLLM-Omni: the hand-written fields only
        return {}
    full = VideoGenerationRequest.model_json_schema()
    defs = full.get("$defs", {})

    def clean(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return clean(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: clean(v) for k, v in node.items() if k not in ("title", "default")}
        if isinstance(node, list):
            return [clean(v) for v in node]
        return node

    return {name: clean(prop) for name, prop in full["properties"].items() if name not in listed}


VIDEO_CREATE["properties"].update(_vllm_omni_video_fields(set(VIDEO_CREATE["properties"])))


def body(schema: dict[str, Any], *, multipart: bool = False) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body is ``schema`` (as JSON, and as a form if ``multipart``)."""
    content = {"application/json": {"schema": schema}}
    if multipart:
        content["multipart/form-data"] = {"schema": schema}
    return {"requestBody": {"required": True, "content": content}}


#: The fields OpenAI's own API defines on each route; every other field is an extension, sent with the SDKs'
#: ``extra_body``.
OPENAI_FIELDS = {
    "POST /v1/videos": {"prompt", "model", "seconds", "size", "input_reference"},
    "POST /v1/images/generations": {"prompt", "model", "n", "size", "response_format", "output_format",
                                    "output_compression", "quality", "style", "background", "moderation", "user",
                                    "safety_identifier", "stream", "partial_images"},
}


def _bounds(prop: dict[str, Any]) -> str:
    """A property's type and bounds in a few words."""
    options = prop.get("anyOf") or prop.get("oneOf")
    if options:
        kinds = list(dict.fromkeys(_bounds(p) for p in options if p.get("type") != "null"))
        nullable = any(p.get("type") == "null" for p in options)
        return " or ".join(kinds) + (" (or null)" if nullable else "")
    kind = prop.get("format") == "binary" and "file" or prop.get("type", "object")
    if kind == "array":
        return f"list of {_bounds(prop.get('items', {}))}"
    parts = [kind]
    if "enum" in prop:
        parts.append("one of " + ", ".join(f"`{json.dumps(v)}`" for v in prop["enum"]))
    lo = prop.get("minimum", prop.get("exclusiveMinimum"))
    hi = prop.get("maximum", prop.get("exclusiveMaximum"))
    if lo is not None or (hi is not None and hi < 2**53):
        parts.append(f"{'' if lo is None else lo}..{'' if hi is None or hi >= 2**53 else hi}")
    if "maxLength" in prop:
        parts.append(f"at most {prop['maxLength']} characters")
    if "pattern" in prop and "example" in prop:
        parts.append(f"e.g. `{prop['example']}`")
    return " ".join(parts)


def fields_markdown() -> str:
    """``docs/reference/api-fields.md``: every request field of ``/v1/videos`` and ``/v1/images/generations``, its
    type and bounds, and how an SDK sends it (OpenAI's own fields as arguments, extensions in ``extra_body``)."""
    lines = ["# Request fields", "",
             f"Generated from `omni_ext/api/schemas.py` (the OpenAPI schema, equal to what the parsers accept); "
             f"regenerate with `{REGENERATE}`.", "",
             "OpenAI's own fields are arguments of the SDK call; every other field is an extension, sent as "
             "`extra_body={\"name\": value}` (Python) or as a property of the body object with a "
             "`// @ts-expect-error` or a cast (Node).", ""]
    for route, schema in (("POST /v1/videos", VIDEO_CREATE), ("POST /v1/images/generations", IMAGE_GENERATE)):
        lines += [f"## `{route}`", "", "| field | type and bounds | how the SDK sends it | what it does |",
                  "|---|---|---|---|"]
        for name in sorted(schema["properties"], key=lambda n: (n not in OPENAI_FIELDS[route], n)):
            prop = schema["properties"][name]
            binary = prop.get("format") == "binary" or prop.get("items", {}).get("format") == "binary"
            how = ("argument" if name in OPENAI_FIELDS[route] else "a multipart file (`curl -F`)" if binary
                   else f"`extra_body={{\"{name}\": ...}}`")
            what = " ".join(str(prop.get("description", "")).split()).replace("|", "\\|")
            lines.append(f"| `{name}` | {_bounds(prop)} | {how} | {what} |")
        lines.append("")
    return "\n".join(lines)
