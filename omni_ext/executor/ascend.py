"""Ascend (NPU) defaults for the tuned executor's workers. Pure decisions, testable without NPU.

Sources: ``research/anchors.md`` section 4 (vllm-ascend tuning guide, CANN env reference, MindIE-SD
service examples). Every value is a *default*: a variable the operator already set is never touched.

- ``TASK_QUEUE_ENABLE=2``: level-2 operator dispatch pipeline (eager mode; diffusion on NPU never
  compiles in vLLM-Omni 0.30, so the ACL-graph caveat that wants 1 does not apply).
- ``PYTORCH_NPU_ALLOC_CONF=expandable_segments:True``: less allocator fragmentation between the
  differently-shaped activations of text encoder, DiT and VAE.
- ``CPU_AFFINITY_CONF=1``: bind torch_npu's hot host threads to NUMA-local cores (coarse mode; the
  fine mode 2 depends on the container's NUMA mapping).
- ``HCCL_OP_EXPANSION_MODE=AIV``: collectives on the AI Vector cores, lower latency for the small
  per-step CFG all-gather. Only valid on one node, for a single communication domain active at a
  time, and ignored under ``HCCL_DETERMINISTIC=true``; so it is set only for exactly one CFG group of
  size > 1 on one node.
- The collective backend is HCCL (vLLM-Omni's NPU platform); :func:`collective_backend` states the
  expectation so the executor can refuse a mismatched platform early.

``torch_npu`` is imported lazily and only by :func:`npu_available`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

BASE_DEFAULTS: dict[str, str] = {
    "TASK_QUEUE_ENABLE": "2",
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "CPU_AFFINITY_CONF": "1",
}


def aiv_expansion_allowed(environ: Mapping[str, str], *, num_groups: int, group_size: int, nodes: int = 1) -> bool:
    """Whether ``HCCL_OP_EXPANSION_MODE=AIV`` is valid for this worker layout."""
    if nodes != 1 or group_size < 2 or num_groups != 1:
        return False
    return environ.get("HCCL_DETERMINISTIC", "").strip().lower() != "true"


def ascend_worker_env(
    environ: Mapping[str, str] | None = None, *, num_groups: int, group_size: int, nodes: int = 1
) -> dict[str, str]:
    """Variables to add to the workers' environment on an Ascend host (never overrides the user)."""
    env = os.environ if environ is None else environ
    out = {k: v for k, v in BASE_DEFAULTS.items() if k not in env}
    if "HCCL_OP_EXPANSION_MODE" not in env and aiv_expansion_allowed(
        env, num_groups=num_groups, group_size=group_size, nodes=nodes
    ):
        out["HCCL_OP_EXPANSION_MODE"] = "AIV"
    return out


def collective_backend(device_type: str) -> str:
    """The torch.distributed backend the workers must use for ``device_type``."""
    return {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}.get(device_type, "gloo")


def npu_available() -> bool:
    """True on a host with a usable Ascend NPU (lazy ``torch_npu`` import; False without it)."""
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
        import torch
    except Exception:
        return False
    try:
        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    except Exception:
        return False
