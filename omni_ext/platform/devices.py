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
from collections.abc import Mapping, Sequence
from typing import Any


def visible_devices(platform: Any, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """``(count, where the count comes from)`` for ``platform`` (a vLLM-Omni platform class)."""
    env = os.environ if environ is None else environ
    var = getattr(platform, "device_control_env_var", None)
    raw = env.get(var) if var else None
    if raw is not None and raw.strip():
        return len([d for d in raw.split(",") if d.strip()]), f"{var}={raw}"
    return int(platform.get_device_count()), f"{getattr(platform, 'device_type', 'device')} device count"


def group_devices_env(platform: Any, ranks: Sequence[int], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment that shows a worker group of the executor's ``ranks`` (consecutive) only its own
    devices, so that its world's rank ``i`` (vLLM-Omni's worker: device ``i``) lands on the executor's
    rank ``ranks[i]``'s device: the platform's visible-devices variable cut to those entries of what
    is visible now (its value, else the devices counted from 0). Nothing on a CPU host, where every
    worker's device is the CPU."""
    if getattr(platform, "device_type", "cpu") == "cpu" or not ranks:
        return {}
    var = getattr(platform, "device_control_env_var", None)
    if not var:
        return {}
    env = os.environ if environ is None else environ
    raw = env.get(var)
    visible = [d.strip() for d in raw.split(",") if d.strip()] if raw and raw.strip() else None
    if visible is None:
        visible = [str(i) for i in range(max(ranks) + 1)]
    return {var: ",".join(visible[r] for r in ranks)}
