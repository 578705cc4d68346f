"""``CpuOmniPlatform``: vLLM-Omni's platform interface implemented for a host with no accelerator.

Why a platform and not patches: vLLM-Omni resolves everything device-specific (torch device,
collective backend, attention backend, memory accounting, autocast) through
``current_omni_platform``. Without one, a CPU host gets ``UnspecifiedOmniPlatform`` and the worker
dies in ``set_device``. It also subclasses vLLM's own ``CpuPlatform`` so vLLM-side code
(config checks, custom ops) sees a CPU platform too.

Memory numbers are real (process RSS and its high-water mark), not zeros, so vLLM-Omni's
``peak_memory_mb`` per request means something on CPU.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from typing import Any

import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

from omni_ext.platform import memory, threads

logger = logging.getLogger("omni_ext.platform")


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    """vLLM-Omni platform for CPU-only hosts (selected by omni-ext's platform plugin)."""

    _omni_enum = OmniPlatformEnum.OOT
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"
    device_control_env_var: str = "OMNI_EXT_CPU_VISIBLE_DEVICES"
    _threads_logged: bool = False

    # ---- devices -------------------------------------------------------------------------
    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        # One logical "device" per worker: the executor places ranks by index, never by count.
        return max(1, threads.usable_cores())

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "cpu"

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        """Called once per worker after RANK/WORLD_SIZE are set: size this worker's thread pool (the
        cores are split over every worker of the server, not only this worker's world)."""
        world = threads.workers_on_host()
        before = torch.get_num_threads()
        n = threads.apply_worker_threads(world)
        if n != before or not cls._threads_logged:
            cls._threads_logged = True
            logger.info("omni-ext CPU worker rank %s/%d uses %d thread(s)", os.environ.get("RANK", "0"), world, n)

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def record_device_event(cls):
        return None

    # ---- memory (real figures) -----------------------------------------------------------
    @classmethod
    def reset_peak_memory_stats(cls, device: Any = None) -> None:
        memory.reset_peak()

    @classmethod
    def max_memory_allocated(cls, device: Any = None) -> int:
        return memory.peak_rss_bytes()

    @classmethod
    def max_memory_reserved(cls, device: Any = None) -> int:
        return memory.peak_rss_bytes()

    @classmethod
    def memory_allocated(cls, device: Any = None) -> int:
        return memory.rss_bytes()

    @classmethod
    def memory_reserved(cls, device: Any = None) -> int:
        return memory.rss_bytes()

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return memory.host_memory()[0]

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        return memory.host_memory()

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return memory.host_memory()[1]

    # ---- capabilities --------------------------------------------------------------------
    @classmethod
    def get_diffusion_attn_backend_cls(
        cls,
        selected_backend: str | None,
        head_size: int,
        allow_trtllm_default: bool = False,
    ) -> str:
        if selected_backend and selected_backend.upper() not in ("TORCH_SDPA", "SDPA", "CPU_SDPA"):
            logger.warning("Attention backend %s is not available on CPU; using torch SDPA", selected_backend)
        return "omni_ext.platform.attention.CpuSDPABackend"

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        # Inductor on CPU needs a C++ toolchain per shape and compiles for minutes on 2 cores.
        return False

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def has_flash_attn_package(cls) -> bool:
        return False

    @classmethod
    def create_autocast_context(cls, *, device_type: str, dtype: torch.dtype, enabled: bool = True):
        # CPU autocast changes numerics (and is slower for bf16 GEMMs without AMX); run as loaded.
        return nullcontext()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False
