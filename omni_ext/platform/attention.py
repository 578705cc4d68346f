"""Diffusion attention on CPU: torch SDPA.

vLLM-Omni's ``AttentionImpl.forward`` dispatches only to CUDA/ROCm/NPU/XPU/MUSA paths and raises
``NotImplementedError`` for any other platform, so the CPU platform returns this backend whose impl
routes every call to the SDPA implementation's device-neutral path (2-D key masks broadcast as
``[B, 1, 1, K]``, which CPU SDPA handles natively).
"""

from __future__ import annotations

import torch
from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl


class CpuSDPAImpl(SDPAImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")


class CpuSDPABackend(SDPABackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_SDPA"

    @staticmethod
    def get_impl_cls() -> type[CpuSDPAImpl]:
        return CpuSDPAImpl
