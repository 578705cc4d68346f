"""Decide whether omni-ext's CPU platform should activate in this process.

vLLM-Omni lets an out-of-tree platform plugin win over its own detectors, and two active out-of-tree
plugins are a start-up error. So the CPU platform must step aside whenever a real accelerator is
present (vLLM-Omni's CUDA/ROCm/NPU/XPU platform must win) or when the operator switches it off.
The checks here are cheap and never import ``torch_npu`` or initialise CUDA.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from omni_ext import environment

logger = logging.getLogger("omni_ext.platform")

ENV_SWITCH = "OMNI_EXT_CPU_PLATFORM"
CPU_PLATFORM_QUALNAME = "omni_ext.platform.cpu.CpuOmniPlatform"


def switch_value(environ: dict[str, str] | None = None) -> str:
    """``auto`` (default), ``1`` (force on) or ``0`` (off), from ``OMNI_EXT_CPU_PLATFORM``."""
    env = os.environ if environ is None else environ
    raw = environment.value(ENV_SWITCH, env).strip().lower()
    if raw in ("0", "false", "off", "no"):
        return "0"
    if raw in ("1", "true", "on", "yes", "force"):
        return "1"
    return "auto"


def accelerator_present(dev: Path = Path("/dev"), check_torch: bool = True) -> str | None:
    """Name of an accelerator visible to this host, or None.

    Looks at device nodes and driver-level hints rather than importing torch_npu or calling
    ``torch.cuda.is_available()`` (which would initialise CUDA in the API process).
    """
    if any(dev.glob("davinci[0-9]*")):
        return "npu"
    if any(dev.glob("nvidia[0-9]*")):
        return "cuda"
    if (dev / "kfd").exists() and any(dev.glob("dri/renderD*")):
        return "rocm"
    if not check_torch:
        return None
    try:
        import torch

        acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        if acc is not None and acc.type not in ("cpu", "meta"):
            return acc.type
    except Exception:  # pragma: no cover - torch always importable in a serving env
        return None
    return None


def cpu_platform_qualname(environ: dict[str, str] | None = None, dev: Path = Path("/dev")) -> str | None:
    """Entry point body for ``vllm_omni.platform_plugins``: the CPU platform, or None to stay out."""
    switch = switch_value(environ)
    if switch == "0":
        logger.debug("omni-ext CPU platform disabled by %s=0", ENV_SWITCH)
        return None
    if switch == "auto":
        acc = accelerator_present(dev)
        if acc is not None:
            logger.debug("omni-ext CPU platform inactive: %s accelerator present", acc)
            return None
    return CPU_PLATFORM_QUALNAME
