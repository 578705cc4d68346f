"""The layouts omni-ext's TunedExecutor runs, and what a server's layout means for its queue.

One module for the executor's layout rules, read by everything that needs them: which parallel
layouts the TunedExecutor refuses and why (:func:`tuned_refusal`: the executor stops at start-up
with it, a preset notes it, the planner avoids it), and how many jobs a layout runs at once
(:meth:`ServerLayout.slots`: the API's admission and the head's dispatch count them).

What the API process knows of the engine behind it: executor, CFG and data parallel sizes,
replicas, and omni-ext's options.

Read from the diffusion stage vLLM-Omni resolved (``engine_client.stage_configs``): that is what
the engine was built from, whichever channel set it (command-line flags, a deploy YAML, a
preset), and where the TunedExecutor reads its own options (``od_config.additional_config``).
The server's parsed arguments are the fallback, for an app state without stage configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_ext.models import families
from omni_ext.scheduler.config import CfgMode, omni_ext_section

#: ``--distributed-executor-backend`` of omni-ext's executor ends with this class name.
TUNED_EXECUTOR = "TunedExecutor"


@dataclass(frozen=True)
class Parallel:
    """The parallel sizes of one replica, as vLLM-Omni's options name them."""

    cfg: int = 1
    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    pp: int = 1
    vae_patch: int = 1
    hsdp: bool = False
    step_execution: bool = False


@dataclass(frozen=True)
class Refusal:
    """Why the TunedExecutor will not run a layout: ``option`` (the flag and value to drop),
    ``reason`` (what a preset's note quotes) and ``instead`` (what to do)."""

    option: str
    reason: str
    instead: str = "or serve with vLLM-Omni's own executor"

    def __str__(self) -> str:
        return self.reason

    def message(self) -> str:
        """The executor's start-up error."""
        return f"omni-ext TunedExecutor: drop {self.option}: {self.reason}; {self.instead}."


def tuned_refusal(p: Parallel) -> Refusal | None:
    """Why the TunedExecutor refuses the layout ``p`` (None: it runs it). Its worker groups are CFG
    groups (1 or 2 units), several of them for data parallel; a unit is the TP x Ulysses x Ring
    processes of one CFG half, which run every job together (vLLM-Omni's own TP layers and SP
    attention inside); each unit runs its own requests."""
    if p.pp > 1:
        return Refusal(f"--pipeline-parallel-size {p.pp}",
                       "it refuses pipeline parallel (CFG, tensor, sequence and data parallel only)")
    if p.cfg > 2:
        return Refusal(f"--cfg-parallel-size {p.cfg}", f"it runs cfg_parallel_size 1 or 2, not {p.cfg}",
                       "use --cfg-parallel-size 2 with data parallel for more ranks")
    if p.vae_patch > 1:
        # vLLM-Omni's VAE patch parallel runs collectives over the whole worker world, which
        # cannot work while ranks run different requests (data parallel, single-rank jobs).
        return Refusal(f"--vae-patch-parallel-size {p.vae_patch}",
                       "its worker groups are CFG and data-parallel groups only, without VAE patch parallel",
                       "the TunedExecutor splits the Wan VAE decode (tiled or not) between the two ranks of a CFG "
                       "pair itself (omni_ext/executor/vae_pipeline.py), or serve with vLLM-Omni's executor to use "
                       "its VAE patch parallel")
    if p.hsdp:
        return Refusal("--use-hsdp", "it does not shard weights over its ranks (HSDP)")
    if p.step_execution:
        return Refusal("--step-execution", "it runs whole requests and refuses step execution",
                       "drop streaming output, or serve with vLLM-Omni's own executor")
    return None


@dataclass(frozen=True)
class ServerLayout:
    """``executor``: the distributed executor backend (a ``module.Class`` path, a class, or None for
    vLLM-Omni's default); ``cfg``/``dp``: CFG-parallel and data-parallel sizes of one replica;
    ``replicas``: vLLM-Omni replicas of the stage; ``additional_config``: vLLM-Omni's
    ``additional_config`` (omni-ext's options live under its ``omni_ext`` key)."""

    executor: Any = None
    cfg: int = 1
    dp: int = 1
    replicas: int = 1
    additional_config: Any = None
    max_num_seqs: int = 1

    @property
    def tuned(self) -> bool:
        """Whether omni-ext's TunedExecutor runs the jobs (it orders them by priority, and writes a
        start marker when a job really starts on a rank)."""
        name = getattr(self.executor, "__name__", None) or str(self.executor or "")
        return name.endswith(TUNED_EXECUTOR)

    def cfg_mode(self, cfg_mode: CfgMode, pipeline: str | None) -> CfgMode:
        """The ``cfg_mode`` the TunedExecutor applies: the configured one for a model with omni-ext's
        tuned pipeline, else "pair" (its requests take a whole CFG group)."""
        family = families.family_of(pipeline)
        return cfg_mode if family is not None and family.splits_cfg_groups else CfgMode.PAIR

    def replica_slots(self, cfg_mode: CfgMode, pipeline: str | None) -> int:
        """Jobs one replica runs at once. vLLM-Omni's executor runs one request at a time. The
        TunedExecutor runs one per rank where a request can use part of a CFG group (a model with
        omni-ext's tuned pipeline, ``cfg_mode`` "adaptive" or "single"), else one per CFG group."""
        if not self.tuned:
            return 1
        return self.dp * self.cfg if self.cfg_mode(cfg_mode, pipeline) != CfgMode.PAIR else self.dp

    def slots(self, cfg_mode: CfgMode, pipeline: str | None) -> int:
        """Jobs the server's replicas (as configured at start-up) run at once."""
        return self.replicas * self.replica_slots(cfg_mode, pipeline)


def pause_refusal(pipeline: str | None, cache_backend: str | None) -> str | None:
    """Why the TunedExecutor cannot pause ``pipeline``'s jobs exactly (step-level preemption), or
    None. The pause point of a CFG pair is omni-ext's tuned pipeline; a cache backend keeps
    per-request state in the transformer that the pause does not save (:mod:`omni_ext.executor.suspend`).
    The executor applies it, and the API process's start predictions count pauses only where it allows them."""
    family = families.family_of(pipeline)
    if family is None or not family.splits_cfg_groups:
        return f"{pipeline} runs without omni-ext's tuned pipeline"
    if cache_backend not in (None, "", "none"):
        return f"cache backend {cache_backend!r} keeps per-request state a pause cannot save"
    return None


def _int(value: Any, default: int = 1) -> int:
    try:
        return max(1, int(value)) if value is not None else default
    except (TypeError, ValueError):
        return default


def diffusion_stage(stage_configs: Any) -> Any:
    """The first diffusion stage of vLLM-Omni's resolved stage configs, or None."""
    for stage in stage_configs or ():
        kind = getattr(stage, "stage_type", None)
        if str(getattr(kind, "value", kind)) == "diffusion" or hasattr(stage, "diffusion_config"):
            return stage
    return None


def server_layout(args: Any, stage_configs: Any = None) -> ServerLayout:
    """The layout from the resolved diffusion stage, each field falling back to the server's arguments."""
    stage = diffusion_stage(stage_configs)
    par = getattr(stage, "parallel_config", None)
    diff = getattr(stage, "diffusion_config", None)
    runtime = getattr(stage, "runtime_config", None)
    executor = (getattr(diff, "distributed_executor_backend", None) or getattr(runtime, "distributed_executor_backend", None)
                or getattr(args, "distributed_executor_backend", None))
    additional = getattr(diff, "additional_config", None) or getattr(args, "additional_config", None)
    cfg = getattr(par, "cfg_parallel_size", None) or getattr(args, "cfg_parallel_size", None)
    # The TunedExecutor's own rule: omni-ext's data_parallel_size, else vLLM-Omni's.
    dp = omni_ext_section(additional).get("data_parallel_size") or getattr(par, "data_parallel_size", None)
    seqs = getattr(diff, "max_num_seqs", None) or getattr(args, "max_num_seqs", None)
    return ServerLayout(executor=executor, cfg=_int(cfg), dp=_int(dp), replicas=_int(getattr(runtime, "num_replicas", None)),
                        additional_config=additional, max_num_seqs=_int(seqs))
