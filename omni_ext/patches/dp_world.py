"""Patch body for ``dp-world`` (see the registry in ``omni_ext.patches``).

``--additional-config '{"omni_ext": {"data_parallel_size": N}}'`` asks the TunedExecutor for N
data-parallel groups. vLLM-Omni never reads that key: it sizes the stage's world from its own
parallel config (CFG x SP x TP x PP x its ``data_parallel_size``), and from that world it derives
the stage's ``devices``, the device count it checks against the visible devices
(``stage_init_utils.build_diffusion_config``), the device locks and ``num_gpus``. Raising the
world later, inside the executor, is too late: the check has passed for a CFG-only world, and the
extra ranks (device index = rank) die in ``set_device`` with only "exited during start-up".

So omni-ext's key is turned into vLLM-Omni's own ``data_parallel_size`` of the stage where the
stage's engine values are merged, before anything is derived from them:

- ``omni_config._stage_engine_values`` (every stage config: registered pipelines, deploy YAMLs,
  the generic fallback) merges deploy YAML and CLI values; when the merged ``additional_config``
  names a data-parallel size and the stage's own is unset or 1, it is merged again with that size
  as a CLI value;
- ``StageConfigFactory._normalize_default_diffusion`` (the generic fallback) computes the stage's
  ``devices`` from its parallel config before the stage config exists, so it gets the size too.

A stage whose own ``data_parallel_size`` differs from omni-ext's is refused (both numbers named).
From there on vLLM-Omni's own start-up sees the whole world, and refuses a layout that needs more
devices than are visible ("Stage 0 requires 4 device(s) ..., but 2 device(s) are available").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from omni_ext.patches import is_patched, mark, patch_attr
from omni_ext.scheduler.config import omni_ext_section

logger = logging.getLogger("omni_ext.patches")

KEY = "data_parallel_size"


def requested_dp(additional_config: Any, stage_dp: Any) -> int | None:
    """The data-parallel size to give the stage, or None to leave it as it is.

    ``additional_config`` is the stage's (dict or JSON string); ``stage_dp`` is vLLM-Omni's own
    ``data_parallel_size`` of the stage (None when unset). Raises ``ValueError`` on a bad value or
    when both are set to different sizes."""
    raw = omni_ext_section(additional_config).get(KEY)
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ValueError(f"omni_ext.{KEY} must be a positive integer, got {raw!r}")
    own = int(stage_dp) if stage_dp is not None else None
    if own not in (None, 1, raw):
        raise ValueError(f"omni_ext.{KEY}={raw} conflicts with the stage's {KEY}={own}: set one of them")
    return None if own == raw else raw


def _stage_dp(parallel: Mapping[str, Any]) -> Any:
    nested = parallel.get("parallel_config")
    if isinstance(nested, Mapping) and nested.get(KEY) is not None:
        return nested.get(KEY)
    return parallel.get(KEY)


def _wrap_stage_engine_values(orig: Any) -> Any:
    def _stage_engine_values(stage_deploy: Any, topology: Any, stage_cli_overrides: Any = None) -> Any:
        values = orig(stage_deploy, topology, stage_cli_overrides)
        additional = values.diffusion.to_kwargs().get("additional_config")
        dp = requested_dp(additional, _stage_dp(values.parallel))
        if dp is None:
            return values
        logger.info("omni-ext: stage %s data_parallel_size=%d from omni_ext.%s", topology.stage_id, dp, KEY)
        return orig(stage_deploy, topology, {**dict(stage_cli_overrides or {}), KEY: dp})

    _stage_engine_values.__wrapped__ = orig  # type: ignore[attr-defined]
    return _stage_engine_values


def _wrap_normalize(orig: Any) -> Any:
    func = orig.__func__

    def _normalize_default_diffusion(cls: Any, kwargs: dict[str, Any]) -> Any:
        dp = requested_dp(kwargs.get("additional_config"), kwargs.get(KEY))
        return func(cls, kwargs if dp is None else {**kwargs, KEY: dp})

    _normalize_default_diffusion.__wrapped__ = func  # type: ignore[attr-defined]
    return classmethod(mark(_normalize_default_diffusion))  # marked inside too: getattr sees the function


def apply() -> None:
    from vllm_omni.config import omni_config
    from vllm_omni.config.config_factory import StageConfigFactory

    if not is_patched(omni_config._stage_engine_values):
        patch_attr(omni_config, "_stage_engine_values", _wrap_stage_engine_values(omni_config._stage_engine_values))
    current = StageConfigFactory.__dict__["_normalize_default_diffusion"]  # the classmethod itself
    if not is_patched(current.__func__):
        patch_attr(StageConfigFactory, "_normalize_default_diffusion", _wrap_normalize(current))
