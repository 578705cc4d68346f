"""Check rendered presets against the *installed* vLLM-Omni: its own CLI parser and config loader.

Why a second layer after the static rules (:mod:`omni_ext.presets.validate`): the presets are
written against vLLM-Omni 0.30, but a host may run another 0.30.x (or a vendor build). Parsing the
rendered command with ``vllm-omni serve``'s parser and resolving it with its config loader proves
that this vLLM-Omni accepts every flag and deploy-YAML key and resolves the topology the preset
promises (no silent intra-engine DP, replicas not dropped, the stage env applied). It imports vLLM
(~15 s), so it is its own command, ``omni-ext presets validate``, not part of ``omni-ext doctor``
(which must stay fast and work without vLLM); the test suite runs the same checks.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from omni_ext.models.families import FAMILIES
from omni_ext.presets.catalog import PresetError
from omni_ext.presets.costs import CostTable, load_cost_table
from omni_ext.presets.render import REGISTERED_PIPELINE_CLASSES, Rendered, additional_config, default_sampling_params


def registered_by_class() -> set[str]:
    """Diffusers class names (and aliases) the installed vLLM-Omni maps to a registered topology."""
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES
    from vllm_omni.config.stage_config import PipelineConfig

    out: set[str] = set()
    for entry in OMNI_PIPELINES.values():
        if isinstance(entry, PipelineConfig) and entry.diffusers_class_name:
            out.add(entry.diffusers_class_name)
            out.update(entry.diffusers_class_aliases)
    return out


def registry_problems(by_class: set[str], costs: CostTable | None = None) -> list[str]:
    """Where the family table's ``topology`` disagrees with a registry that knows ``by_class``.

    Registration is per class while the table's ``topology`` is per family, so a family passes when
    one of its classes is registered (``"registered"``) or none is (otherwise); the classes the
    presets actually serve (``costs.yaml``) must each be registered exactly when their family says so.
    """
    costs = costs or load_cost_table()
    problems: list[str] = []
    for family in FAMILIES:
        upstream = sorted(set(family.pipelines) & by_class)
        if family.topology == "registered" and not upstream:
            problems.append(f"family {family.name}: none of {', '.join(family.pipelines)} is registered by diffusers "
                            "class any more: its deploy YAML would be ignored")
        elif family.topology != "registered" and upstream:
            problems.append(f"family {family.name}: {', '.join(upstream)} is now registered upstream: set its "
                            "topology to 'registered' (its presets could use a plain deploy YAML)")
    served = sorted({spec.pipeline_class for spec in costs.models.values()} & REGISTERED_PIPELINE_CLASSES)
    problems += [f"{c} is no longer registered by diffusers class: its deploy YAML would be ignored"
                 for c in served if c not in by_class]
    return problems


def role_problems(rendered: Rendered, args: Any) -> list[str]:
    """Where a parsed host command of a multi-host preset is not the host it should be.

    vLLM-Omni's resolver does not see the multi-machine flags (they are read when the runtime
    starts), so they are checked on the parsed namespace: stage 0 on every host, this host's
    replica count as ``--omni-dp-size-local`` (the head's ``DistStageRuntime`` and a replica host's
    ``run_headless`` take the local replica count from it, not from the deploy YAML), and a replica
    host headless with the ``multi_process`` worker backend (``run_headless`` refuses anything else).
    A one-host launch must carry none of them.
    """
    preset = rendered.preset
    got = {"stage_id": getattr(args, "stage_id", None), "headless": bool(getattr(args, "headless", False)),
           "omni_dp_size_local": int(getattr(args, "omni_dp_size_local", 1) or 1),
           "omni_master_address": getattr(args, "omni_master_address", None)}
    if rendered.role is None:
        if got["stage_id"] is not None or got["headless"] or got["omni_master_address"] is not None:
            return [f"a one-host launch in multi-machine mode: {got}"]
        return []
    want = {"stage_id": 0, "headless": rendered.headless, "omni_dp_size_local": preset.topology.replicas}
    problems = [f"{key}: {got[key]!r}, want {value!r} ({rendered.role} of {preset.hosts} hosts)"
                for key, value in want.items() if got[key] != value]
    if not got["omni_master_address"] or getattr(args, "omni_master_port", None) is None:
        problems.append("no --omni-master-address/--omni-master-port: the host cannot reach the head")
    if rendered.headless and getattr(args, "worker_backend", None) != "multi_process":
        problems.append(f"worker_backend {getattr(args, 'worker_backend', None)!r}: headless needs multi_process")
    return problems


class OmniValidator:
    """Parses rendered launches with ``vllm-omni serve``'s own parser and resolves them with its config loader.

    Building the parser imports vLLM (slow, ~15 s): make one validator and validate many launches
    with it (``omni-ext presets validate`` does; the tests share one per module). Building it
    also runs the ``vllm.general_plugins`` entry points exactly as ``vllm-omni serve`` does, so
    :attr:`hook_registered` tells whether omni-ext's plugin hook registers the preset pipelines.
    """

    def __init__(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm_omni.entrypoints.cli.serve import OmniServeCommand
        from vllm_omni.utils.tracking_parser import TrackingArgumentParser

        from omni_ext.presets import pipelines

        self.parser = TrackingArgumentParser(prog="vllm-omni")
        subparsers = self.parser.add_subparsers(dest="subparser")
        self.command = OmniServeCommand()
        self.command.subparser_init(subparsers).set_defaults(dispatch_function=self.command.cmd)
        self.hook_registered = pipelines.is_registered()
        # Do what the plugin hook does so the config check below does not depend on that wiring.
        pipelines.register_preset_pipelines()
        self._tmp = tempfile.TemporaryDirectory(prefix="omni-ext-validate-")
        self._stubs: dict[str, str] = {}

    def close(self) -> None:
        self._tmp.cleanup()

    def registry_problems(self) -> list[str]:
        """Where the family table's ``topology`` disagrees with the installed pipeline registry."""
        return registry_problems(registered_by_class())

    def stub_model(self, pipeline_class: str) -> str:
        """A folder with only ``model_index.json``: enough for vLLM-Omni to detect and route the model."""
        if pipeline_class not in self._stubs:
            folder = Path(self._tmp.name) / f"stub-{pipeline_class}"
            folder.mkdir()
            (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline_class, "_diffusers_version": "0.40.0"}))
            self._stubs[pipeline_class] = str(folder)
        return self._stubs[pipeline_class]

    def parse(self, argv: list[str]) -> Any:
        """``argv`` after the executable (``serve MODEL --omni ...``); parser errors become PresetError."""
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = self.parser.parse_args(argv)
        except SystemExit as exc:
            raise PresetError(f"vllm-omni serve's parser rejected the command: {err.getvalue().strip()}") from exc
        try:
            self.command.validate(args)
        except ValueError as exc:
            raise PresetError(f"vllm-omni serve rejected the command: {exc}") from exc
        # vLLM-Omni 0.30.0 means to reject these under --omni, but its check reads an attribute that
        # nothing sets; enforce it here.
        explicit = set(getattr(args, "explicit_keys", ()) or ())
        dp = sorted(k for k in explicit if k.startswith("data_parallel") or k == "enable_expert_parallel")
        if dp:
            raise PresetError(f"{', '.join(dp)} under --omni: configure replicas with the deploy YAML num_replicas")
        return args

    def validate(self, rendered: Rendered, costs: CostTable | None = None) -> dict[str, Any]:
        """Parse and resolve ``rendered``; check the resolved config is the preset's topology. Returns a summary."""
        from vllm_omni.config.resolver import resolve_omni_config
        from vllm_omni.engine.stage_init_utils import split_devices_for_replicas
        from vllm_omni.entrypoints.utils import prepare_stage_config_inputs
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        costs = costs or load_cost_table()
        preset = rendered.preset
        spec = costs.model(preset.model)
        model = rendered.model if os.path.isdir(rendered.model) else self.stub_model(spec.pipeline_class)
        flags = list(rendered.flags)
        if rendered.deploy is not None:
            path = Path(self._tmp.name) / f"{preset.name}.yaml"
            path.write_text(yaml.safe_dump(rendered.deploy, sort_keys=False))
            flags[flags.index("--deploy-config") + 1] = str(path)
        launch = rendered.argv[1:]
        launch[1] = model
        launch[launch.index("--omni") + 1 + (1 if rendered.headless else 4):] = flags
        args = self.parse(launch)
        kwargs = args.get_explicit_kwargs_dict()
        kwargs.pop("model", None)
        kwargs.pop("model_tag", None)
        kwargs.setdefault("log_stats", not args.disable_log_stats)
        inputs = prepare_stage_config_inputs(model, kwargs, trust_remote_code=None)
        try:
            resolution = resolve_omni_config(
                inputs.model,
                trust_remote_code=inputs.trust_remote_code,
                cli_overrides=inputs.kwargs,
                deploy_config_path=inputs.deploy_config_path,
                stage_overrides=inputs.stage_overrides,
                strategy_config_path=inputs.strategy_config_path,
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise PresetError(f"vLLM-Omni's config loader rejected preset {preset.name}: {exc}") from exc
        if len(resolution.stage_configs) != 1:
            raise PresetError(f"{preset.name}: expected one diffusion stage, vLLM-Omni resolved {len(resolution.stage_configs)}")
        stage = resolution.stage_configs[0]
        par, runtime, diff = stage.parallel_config, stage.runtime_config, stage.diffusion_config
        topo = preset.topology
        got = {
            "cfg": par.cfg_parallel_size, "ulysses": par.ulysses_degree, "ring": par.ring_degree,
            "tp": par.tensor_parallel_size, "vae_patch": par.vae_patch_parallel_size, "replicas": runtime.num_replicas,
        }
        problems = [f"{k}: preset {v}, vLLM-Omni resolved {got[k]}" for k, v in topo.as_dict().items() if got[k] != v]
        if par.data_parallel_size != 1:
            problems.append(f"vLLM-Omni inferred intra-engine data_parallel_size={par.data_parallel_size}: every DP rank "
                            "would compute the same request")
        if par.world_size != topo.ranks_per_replica:
            problems.append(f"world size {par.world_size} != {topo.ranks_per_replica} ranks per replica")
        try:
            split = split_devices_for_replicas(runtime.devices, runtime.num_replicas, par.world_size, 0)
        except ValueError as exc:
            problems.append(f"devices {runtime.devices!r}: {exc}")
            split = []
        if runtime.devices is not None and len(split) != topo.replicas:
            problems.append(f"devices {runtime.devices!r} split into {len(split)} groups, want {topo.replicas}")
        if diff.model_arch != spec.pipeline_class:
            problems.append(f"pipeline {diff.model_arch!r}, want {spec.pipeline_class!r}")
        if rendered.deploy is not None:
            env = dict(runtime.env or {})
            missing = {k: v for k, v in preset.stage_env.items() if env.get(k) != v}
            if missing:
                problems.append(f"stage env not applied: {missing}")
        dsp = default_sampling_params(preset)
        resolved_dsp = dict(stage.model_config.default_sampling_params or {})
        if any(resolved_dsp.get(k) != v for k, v in dsp.items()):
            problems.append(f"default sampling params {resolved_dsp} do not contain {dsp}")
        try:
            OmniDiffusionSamplingParams(**dsp)
        except TypeError as exc:
            problems.append(f"request defaults are not sampling params: {exc}")
        for key, value in preset.engine.items():
            if hasattr(diff, key) and key != "dtype" and getattr(diff, key) != value:
                problems.append(f"engine.{key}: preset {value!r}, vLLM-Omni resolved {getattr(diff, key)!r}")
        if preset.executor and diff.distributed_executor_backend != preset.executor:
            problems.append(f"executor not applied: {diff.distributed_executor_backend!r}")
        if preset.scheduler and diff.engine_backend != preset.scheduler:
            problems.append(f"scheduler not applied: engine_backend={diff.engine_backend!r}")
        extra = additional_config(preset, costs)
        resolved_extra = dict(getattr(diff, "additional_config", None) or {})
        if resolved_extra != extra:
            problems.append(f"additional_config {resolved_extra} (omni-ext's scheduler options), want {extra}")
        problems += role_problems(rendered, args)
        if problems:
            raise PresetError(f"{preset.name}: vLLM-Omni resolves a different deployment:\n  - " + "\n  - ".join(problems))
        return {"name": preset.name, "channel": rendered.channel, "resolved": got, "world_size": par.world_size,
                "devices": runtime.devices, "env": dict(runtime.env or {}), "default_sampling_params": resolved_dsp}
