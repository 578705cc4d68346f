"""Ascend (NPU) defaults for the tuned executor's workers. Pure decisions, testable without NPU.

Sources: ``research/anchors.md`` section 4 (vllm-ascend tuning guide, CANN env reference, MindIE-SD
service examples). Every value is a *default*: a variable the operator already set is never touched.

- ``TASK_QUEUE_ENABLE=2``: level-2 operator dispatch pipeline (eager mode; diffusion on NPU never
  compiles in vLLM-Omni 0.30, so the ACL-graph caveat that wants 1 does not apply).
- ``PYTORCH_NPU_ALLOC_CONF=expandable_segments:True``: less allocator fragmentation between the
  differently-shaped activations of text encoder, DiT and VAE.
- ``CPU_AFFINITY_CONF=1``: bind torch_npu's hot host threads to NUMA-local cores (coarse mode; the
  fine mode 2 depends on the container's NUMA mapping). torch_npu 2.10.0.post4 slices the cores by
  the devices *this process* sees (``NPUAffinityController.cpp`` ``getNPUDefaultCores``: block =
  online cores / ``aclrtGetDeviceCount``, device d gets block d, by its local index). A replica that
  sees only its own cards (``ASCEND_RT_VISIBLE_DEVICES``, as vLLM-Omni narrows each replica) therefore
  slices from local device 0: with two cards per replica every replica's rank 0 lands on the first
  half of the cores, and with one card each every process is "bound" to all cores.
  :func:`replica_affinity_conf` gives each visible card its slice of the host by its index among all
  the host's cards (torch_npu's own ``npu<i>:<a>-<b>`` option, i = local index), from the cores this
  process may use (a cpuset-limited container: torch_npu skips binding to cores outside the mask).
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
from collections.abc import Mapping, Sequence
from pathlib import Path

BASE_DEFAULTS: dict[str, str] = {
    "TASK_QUEUE_ENABLE": "2",
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "CPU_AFFINITY_CONF": "1",
}


def aiv_expansion_allowed(
    environ: Mapping[str, str], *, num_groups: int, group_size: int, nodes: int = 1, unit_size: int = 1,
    unit_domains: int = 1,
) -> bool:
    """Whether ``HCCL_OP_EXPANSION_MODE=AIV`` is valid for this worker layout: ``num_groups`` CFG groups
    of ``group_size`` units of ``unit_size`` processes (the TP x sequence-parallel size; ``unit_domains``:
    how many of TP and SP are above 1). AIV allows one communication domain at a time: one group with
    collectives, and either no TP/SP (the CFG group) or no CFG parallel and one of TP or SP; CFG 2 x SP
    runs the two halves' SP all-to-alls at once (in two domains), and under the scheduler's single
    mode two jobs at once; TP x SP in a unit is two domains."""
    if nodes != 1 or group_size * unit_size < 2 or num_groups != 1:
        return False
    if (group_size > 1 and unit_size > 1) or unit_domains > 1:
        return False
    return environ.get("HCCL_DETERMINISTIC", "").strip().lower() != "true"


def _runs(cores: Sequence[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for c in sorted(cores):
        if out and c == out[-1][1] + 1:
            out[-1] = (out[-1][0], c)
        else:
            out.append((c, c))
    return out


def replica_affinity_conf(
    conf: str, visible: str | None, total_cards: int, allowed_cores: Sequence[int]
) -> str | None:
    """``CPU_AFFINITY_CONF`` giving each card this process sees its own slice of the host's cores, or
    None to keep ``conf`` as it is.

    Only a mode-only value (``"1"``/``"2"``) is refined, and only when the process sees a subset of
    the host's ``total_cards`` (``visible``: ``ASCEND_RT_VISIBLE_DEVICES``, the runtime's indices
    0..total_cards-1): then card ``c`` (local index ``i``) gets ``allowed_cores[c*b:(c+1)*b]`` with
    ``b = len(allowed_cores) // total_cards``, the slice a process seeing every card would give it,
    as ``npu<i>:<a>-<b>`` options (repeated for a non-contiguous slice, which torch_npu accumulates).
    """
    mode = conf.strip()
    if mode not in ("1", "2") or not visible or not visible.strip():
        return None
    try:
        cards = [int(x) for x in visible.split(",") if x.strip()]
    except ValueError:
        return None
    cores = sorted(set(allowed_cores))
    block = len(cores) // total_cards if total_cards > 0 else 0
    if block < 1 or len(cards) >= total_cards or any(c < 0 or c >= total_cards for c in cards):
        return None
    parts = [mode]
    for local, card in enumerate(cards):
        parts += [f"npu{local}:{a}-{b}" if a != b else f"npu{local}:{a}"
                  for a, b in _runs(cores[card * block:(card + 1) * block])]
    return ",".join(parts)


def host_cards(dev: Path = Path("/dev")) -> int:
    """The Ascend cards of this host or container (``/dev/davinci<N>`` nodes, whatever their numbers)."""
    return sum(1 for p in dev.glob("davinci*") if p.name[len("davinci"):].isdigit()) if dev.is_dir() else 0


def ascend_worker_env(
    environ: Mapping[str, str] | None = None, *, num_groups: int, group_size: int, nodes: int = 1,
    total_cards: int | None = None, allowed_cores: Sequence[int] | None = None, unit_size: int = 1,
    unit_domains: int = 1,
) -> dict[str, str]:
    """Variables to add to the workers' environment on an Ascend host. Never overrides the user,
    except that a mode-only ``CPU_AFFINITY_CONF`` gets this replica's cores (:func:`replica_affinity_conf`).
    ``total_cards`` and ``allowed_cores`` default to this host's (``/dev/davinci*``, the CPU mask)."""
    env = os.environ if environ is None else environ
    out = {k: v for k, v in BASE_DEFAULTS.items() if k not in env}
    conf = env.get("CPU_AFFINITY_CONF", out.get("CPU_AFFINITY_CONF"))
    if conf is not None:
        per_replica = replica_affinity_conf(
            conf, env.get("ASCEND_RT_VISIBLE_DEVICES"),
            host_cards() if total_cards is None else total_cards,
            sorted(os.sched_getaffinity(0)) if allowed_cores is None else allowed_cores,
        )
        if per_replica is not None:
            out["CPU_AFFINITY_CONF"] = per_replica
    if "HCCL_OP_EXPANSION_MODE" not in env and aiv_expansion_allowed(
        env, num_groups=num_groups, group_size=group_size, nodes=nodes, unit_size=unit_size, unit_domains=unit_domains
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
