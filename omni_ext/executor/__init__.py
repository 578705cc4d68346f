"""omni-ext's tuned diffusion executor for vLLM-Omni 0.30.

Select it with vLLM-Omni's own option (or ``distributed_executor_backend:`` in a deploy YAML)::

    vllm-omni serve MODEL --omni --distributed-executor-backend omni_ext.executor.TunedExecutor \
        --cfg-parallel-size 2 [--additional-config '{"omni_ext": {"data_parallel_size": 2}}']

What it does differently from vLLM-Omni's ``MultiprocDiffusionExecutor`` (details in
:mod:`omni_ext.executor.tuned`):

- CFG parallel end to end: each CFG rank encodes only its own prompt, the Wan VAE decode is split
  between the two ranks as a two-stage layer pipeline (bitwise the same arithmetic), the per-step
  exchange stays vLLM-Omni's single all-gather of the noise prediction.
- Real data parallel: with ``dp`` CFG groups, different requests run on different groups at once.
- No wasted rank: a request that needs no CFG runs on ONE rank of a CFG group, so a cfg-2 group
  serves two such requests at the same time.
- Request scheduling (:mod:`omni_ext.scheduler`): client priority with aging, longest predicted job
  first, and CFG requests on a whole group while it is idle, on one rank each once others wait.
- Failure handling: a dead worker fails the requests on its group at once with a clear error and that
  group's workers are replaced while the other groups serve (each group is a torch.distributed world
  of its own; ``/health`` says ``degraded``, or 503 ``respawning`` when no group can serve); a request
  past its time limit (which follows its expected cost instead of a fixed 600 s) is stopped at its
  next step, and killed only if it does not stop.
- Ascend defaults for the workers (see :mod:`omni_ext.executor.ascend`).

The package is import-light: the executor class is loaded on first attribute access, so the pure
helpers (``ascend``, ``protocol``, ``role``) import without vLLM. Its scheduling decisions
(placement, cost, time limits) are pure code in :mod:`omni_ext.scheduler`.
"""

from __future__ import annotations

__all__ = ["TunedExecutor"]


def __getattr__(name: str):
    if name == "TunedExecutor":
        from omni_ext.executor.tuned import TunedExecutor

        return TunedExecutor
    raise AttributeError(name)
