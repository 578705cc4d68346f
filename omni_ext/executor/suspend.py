"""What a paused job keeps, and what the job that runs meanwhile would clobber: saved at the pause,
restored at the resume (step-level preemption; the decision is :mod:`omni_ext.scheduler.preempt`'s,
the threads are :mod:`omni_ext.executor.worker`'s).

A paused job's own frames (its thread, blocked at a step boundary: :func:`omni_ext.executor.role.boundary`)
keep its latents, step index, generator and everything else local to its denoise loop. What is
*shared* between the jobs of one worker process, and that another job changes, is:

- the pipeline object's per-request state: its attributes (``_guidance_scale``, ``_num_timesteps``,
  ``_current_timestep``, Wan's ``scheduler`` when a request rebuilds it, Qwen's ``_omx_split``, ...)
  and, in place, the state of each diffusers scheduler it holds (``set_timesteps`` and ``step``
  mutate ``timesteps``, ``sigmas``, ``_step_index``, UniPC's ``model_outputs``/``last_sample``...);
- torch's global random state, on the host and on the job's device;
- the process's job role (:data:`omni_ext.executor.role.ROLE`: mode, CFG rank, sequence number,
  step count, pause count);
- vLLM-Omni's forward context (a module global, ``vllm_omni.diffusion.forward_context._forward_context``).

Restored, the paused job computes exactly the bytes of an uninterrupted run (tested on the tiny Wan
and Qwen-Image, a CFG pair and one rank: ``tests/test_preemption.py``). State the executor cannot
capture this way (a cache backend's per-request cache: TeaCache, cache-dit) makes it refuse to
preempt at all (:mod:`omni_ext.executor.ranks`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omni_ext.executor.role import ROLE


def _is_scheduler(value: Any) -> bool:
    """A diffusers-style scheduler: the object whose in-place state a denoise loop advances."""
    return callable(getattr(value, "set_timesteps", None)) and callable(getattr(value, "step", None))


@dataclass
class Snapshot:
    role: dict[str, Any]
    cpu_rng: Any
    device_rng: Any = None
    attrs: dict[str, Any] = field(default_factory=dict)
    schedulers: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    forward_context: Any = None


def save(pipeline: Any, device: Any = None) -> Snapshot:
    """The shared state of the job that pauses now (see the module docstring); ``device``: its torch
    device (its random state is saved too when it is an accelerator)."""
    import torch

    attrs = dict(vars(pipeline)) if pipeline is not None else {}
    schedulers = [(v, copy.deepcopy(vars(v))) for v in attrs.values() if _is_scheduler(v)]
    return Snapshot(
        role={f.name: getattr(ROLE, f.name) for f in dataclasses.fields(ROLE)},
        cpu_rng=torch.get_rng_state(),
        device_rng=_device_rng(device, None),
        attrs=attrs,
        schedulers=schedulers,
        forward_context=_forward_context(),
    )


def restore(snap: Snapshot, pipeline: Any, device: Any = None) -> None:
    """Put the state of :func:`save` back, in place (other code holds references to these objects)."""
    import torch

    for name, value in snap.role.items():
        setattr(ROLE, name, value)
    torch.set_rng_state(snap.cpu_rng)
    _device_rng(device, snap.device_rng)
    if pipeline is not None:
        vars(pipeline).update(snap.attrs)
    for scheduler, state in snap.schedulers:
        vars(scheduler).clear()
        vars(scheduler).update(state)
    _forward_context(snap.forward_context, set_it=True)


def _device_module(device: Any) -> Any:
    """``torch.cuda`` / ``torch.npu`` for an accelerator device, else None (``torch.npu`` exists once
    the platform imported torch_npu; never imported here)."""
    import torch

    kind = getattr(device, "type", None)
    if kind in (None, "cpu"):
        return None
    return getattr(torch, kind, None)


def _device_rng(device: Any, state: Any) -> Any:
    """The device's random state (``state`` None), or set it."""
    mod = _device_module(device)
    if mod is None:
        return None
    if state is None:
        return mod.get_rng_state(device)
    mod.set_rng_state(state, device)
    return None


def bind_device(device: Any) -> None:
    """Make ``device`` the current device of the calling thread: on CUDA and NPU the current device is
    per host thread, and a job's thread is a new one (a CPU device needs nothing)."""
    mod = _device_module(device)
    if mod is not None:
        mod.set_device(device)


def _forward_context(value: Any = None, *, set_it: bool = False) -> Any:
    try:
        from vllm_omni.diffusion import forward_context as fc
    except ImportError:  # pragma: no cover - vLLM-Omni is a dependency
        return None
    if set_it:
        fc._forward_context = value
        return None
    return fc._forward_context
