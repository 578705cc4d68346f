"""OpenAPI request-body schemas for omni-ext's routes (documentation, SDK generators, schemathesis).

The routes parse bodies themselves (JSON and multipart share one parser), so FastAPI cannot infer
these; they are declared here to match what the parsers accept.
"""

from __future__ import annotations

from typing import Any

_SIZE = {"type": "string", "pattern": r"^\d{1,5}x\d{1,5}$", "example": "832x480"}

VIDEO_CREATE: dict[str, Any] = {
    "type": "object",
    "required": ["prompt"],
    "additionalProperties": False,
    "properties": {
        "prompt": {"type": "string", "minLength": 1},
        "model": {"type": "string"},
        "seconds": {"type": "string", "pattern": r"^[1-9]\d?$", "description": "Clip length; mapped to the model's native fps and frame count."},
        "size": _SIZE,
        "input_reference": {"type": "string", "format": "binary"},
        "negative_prompt": {"type": "string"},
        "num_inference_steps": {"type": "integer", "minimum": 1, "maximum": 200},
        "guidance_scale": {"type": "number", "minimum": 0},
        "guidance_scale_2": {"type": "number", "minimum": 0},
        "true_cfg_scale": {"type": "number", "minimum": 0},
        "seed": {"type": "integer", "minimum": 0},
        "width": {"type": "integer", "minimum": 16},
        "height": {"type": "integer", "minimum": 16},
        "num_frames": {"type": "integer", "minimum": 1},
        "fps": {"type": "integer", "minimum": 1},
        "flow_shift": {"type": "number"},
        "boundary_ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "extra_params": {"type": "object"},
    },
}

IMAGE_GENERATE: dict[str, Any] = {
    "type": "object",
    "required": ["prompt"],
    "additionalProperties": False,
    "properties": {
        "prompt": {"type": "string", "minLength": 1},
        "model": {"type": "string"},
        "n": {"type": "integer", "minimum": 1, "maximum": 10},
        "size": {"oneOf": [_SIZE, {"type": "string", "enum": ["auto"]}]},
        "response_format": {"type": "string", "enum": ["b64_json", "url"]},
        "output_format": {"type": "string", "enum": ["png", "jpeg", "webp"]},
        "output_compression": {"type": "integer", "minimum": 0, "maximum": 100},
        "negative_prompt": {"type": "string"},
        "num_inference_steps": {"type": "integer", "minimum": 1, "maximum": 1000},
        "guidance_scale": {"type": "number", "minimum": 0},
        "true_cfg_scale": {"type": "number", "minimum": 0},
        "seed": {"type": "integer", "minimum": 0, "maximum": 4294967295},
        "extra_params": {"type": "object"},
    },
}


def body(schema: dict[str, Any], *, multipart: bool = False) -> dict[str, Any]:
    content = {"application/json": {"schema": schema}}
    if multipart:
        content["multipart/form-data"] = {"schema": schema}
    return {"requestBody": {"required": True, "content": content}}
