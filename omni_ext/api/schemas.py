"""OpenAPI request-body schemas for omni-ext's routes (documentation, SDK generators, schemathesis).

The routes parse bodies themselves (JSON and multipart share one parser), so FastAPI cannot infer
these; they are declared here to match what the parsers accept, and every bound is built from
:mod:`omni_ext.api.limits`, the constants the parsers and the validator enforce.
"""

from __future__ import annotations

from typing import Any

from omni_ext.api.limits import (
    MAX_COMPRESSION, MAX_FPS, MAX_FRAMES, MAX_OUTPUTS, MAX_PIXELS, MAX_PRIORITY, MAX_PROMPT_CHARS, MAX_SECONDS, MAX_SEED,
    MAX_STEPS, MAX_USER_CHARS, MAX_VIDEO_GUIDANCE, MAX_VIDEO_STEPS, MIN_PRIORITY, MIN_STEPS, QUALITY_STEPS, SIZE_DIGITS,
)


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
    },
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
    },
}


def body(schema: dict[str, Any], *, multipart: bool = False) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body is ``schema`` (as JSON, and as a form if ``multipart``)."""
    content = {"application/json": {"schema": schema}}
    if multipart:
        content["multipart/form-data"] = {"schema": schema}
    return {"requestBody": {"required": True, "content": content}}
