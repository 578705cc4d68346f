"""What the API process knows of the engine behind it: executor, CFG and data parallel sizes,
replicas, and omni-ext's options; and from them how many jobs it runs at once (its slots).

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

    @property
    def tuned(self) -> bool:
        """Whether omni-ext's TunedExecutor runs the jobs (it orders them by priority, and writes a
        start marker when a job really starts on a rank)."""
        name = getattr(self.executor, "__name__", None) or str(self.executor or "")
        return name.endswith(TUNED_EXECUTOR)

    def replica_slots(self, cfg_mode: CfgMode, pipeline: str | None) -> int:
        """Jobs one replica runs at once. vLLM-Omni's executor runs one request at a time. The
        TunedExecutor runs one per rank where a request can use part of a CFG group (a model with
        omni-ext's tuned pipeline, ``cfg_mode`` "adaptive" or "single"), else one per CFG group."""
        if not self.tuned:
            return 1
        family = families.family_of(pipeline)
        splits_groups = family is not None and family.splits_cfg_groups
        return self.dp * self.cfg if splits_groups and cfg_mode != CfgMode.PAIR else self.dp

    def slots(self, cfg_mode: CfgMode, pipeline: str | None) -> int:
        """Jobs the server's replicas (as configured at start-up) run at once."""
        return self.replicas * self.replica_slots(cfg_mode, pipeline)


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
    return ServerLayout(executor=executor, cfg=_int(cfg), dp=_int(dp), replicas=_int(getattr(runtime, "num_replicas", None)),
                        additional_config=additional)
