"""How many devices this process may place ranks on, as vLLM-Omni's own start-up counts them.

vLLM-Omni narrows a stage to its devices through the platform's device-control variable
(``CUDA_VISIBLE_DEVICES``, ``ASCEND_RT_VISIBLE_DEVICES``, the CPU platform's
``OMNI_EXT_CPU_VISIBLE_DEVICES``), and counts the platform's devices when it is unset
(``stage_init_utils.build_diffusion_config``). An executor that binds rank r to local device r
needs at least as many as it has ranks; counting the same way lets it refuse a layout with both
numbers instead of losing ranks in ``set_device``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def visible_devices(platform: Any, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """``(count, where the count comes from)`` for ``platform`` (a vLLM-Omni platform class)."""
    env = os.environ if environ is None else environ
    var = getattr(platform, "device_control_env_var", None)
    raw = env.get(var) if var else None
    if raw is not None and raw.strip():
        return len([d for d in raw.split(",") if d.strip()]), f"{var}={raw}"
    return int(platform.get_device_count()), f"{getattr(platform, 'device_type', 'device')} device count"
