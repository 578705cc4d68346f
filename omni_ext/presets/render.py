"""Turn a :class:`Preset` into the exact ``vllm-omni serve`` launch: flags, deploy YAML, environment.

Why this split between deploy YAML and CLI flags: vLLM-Omni 0.30 honours a ``--deploy-config`` YAML
only for models that resolve to a registered pipeline. Wan2.1/2.2 diffusers (``WanPipeline``) do, so
their presets are a YAML (replicas, devices, parallel sizes, per-stage env, default sampling
params). Qwen-Image takes the generic fallback, which ignores YAML content and drops
``num_replicas``/``env`` from ``--stage-overrides``; single-replica Qwen-Image presets therefore use
CLI flags only, and multi-replica ones name omni-ext's registered topology (``pipeline:
omni_ext_qwen_image``, see :mod:`omni_ext.presets.pipelines`). Which pipeline class takes which
channel is the family table's ``topology`` (:mod:`omni_ext.models.families`), not a list kept here.
Nothing here invents a flag: everything goes through vLLM-Omni's own channels, and
:mod:`omni_ext.presets.installed` parses the result with vLLM-Omni's own parser and config loader.
"""

from __future__ import annotations

import copy
import json
import shlex
from dataclasses import dataclass, field
from typing import Any

import yaml

from omni_ext.models.families import FAMILIES, cost_units, family_of
from omni_ext.presets.catalog import ROLES, Preset, PresetError
from omni_ext.presets.costs import CostTable, load_cost_table
from omni_ext.presets.pipelines import OMNI_EXT_PIPELINES
from omni_ext.presets.planner import preset_estimate
from omni_ext.presets.shared import PresetSampling, parse_size, planner_request, requests_use_cfg

FORMATS = ("cmd", "yaml", "env", "script")
#: ``--omni-master-port`` when the operator names none (vLLM-Omni 0.30 has no default for it).
DEFAULT_MASTER_PORT = 29555

#: Pipelines whose family vLLM-Omni 0.30 registers a topology for (so a deploy YAML is honoured):
#: the family table's ``topology == "registered"``. :mod:`omni_ext.presets.installed` checks the
#: table against the installed registry.
REGISTERED_PIPELINE_CLASSES = frozenset(p for f in FAMILIES if f.topology == "registered" for p in f.pipelines)

#: Preset ``engine`` keys: deploy-YAML stage keys of vLLM-Omni 0.30 and their ``vllm-omni serve`` flags.
ENGINE_FLAGS: dict[str, str] = {
    "flow_shift": "--flow-shift",
    "boundary_ratio": "--boundary-ratio",
    "vae_use_tiling": "--vae-use-tiling",
    "vae_use_slicing": "--vae-use-slicing",
    "enforce_eager": "--enforce-eager",
    "max_num_seqs": "--max-num-seqs",
    "request_batch_max_wait_ms": "--request-batch-max-wait-ms",
    "step_execution": "--step-execution",
    "cache_backend": "--cache-backend",
    "enable_cpu_offload": "--enable-cpu-offload",
    "enable_layerwise_offload": "--enable-layerwise-offload",
    "dtype": "--dtype",
}
#: Engine keys that are pipeline-wide (top level) in a deploy YAML rather than per stage.
TOP_LEVEL_ENGINE_KEYS = frozenset({"dtype"})

_TOPOLOGY_KEYS = (
    ("cfg", "cfg_parallel_size", "--cfg-parallel-size"),
    ("ulysses", "ulysses_degree", "--ulysses-degree"),
    ("ring", "ring_degree", "--ring-degree"),
    ("tp", "tensor_parallel_size", "--tensor-parallel-size"),
    ("vae_patch", "vae_patch_parallel_size", "--vae-patch-parallel-size"),
)

#: Request fields that become server-side default sampling params (OmniDiffusionSamplingParams fields).
SAMPLING_KEYS = ("num_inference_steps", "guidance_scale", "guidance_scale_2", "true_cfg_scale", "num_frames", "fps")


@dataclass
class RenderOptions:
    """What the operator supplies at launch time."""

    model: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    devices: list[int] | None = None
    deploy_path: str | None = None
    executable: str = "vllm-omni"
    #: Multi-host presets only: ``"head"`` or ``"replica"`` (:data:`omni_ext.presets.catalog.ROLES`),
    #: and the head's address and master port, which every host's command names.
    role: str | None = None
    master_address: str | None = None
    master_port: int = DEFAULT_MASTER_PORT


@dataclass
class Rendered:
    """A rendered launch. ``flags`` are everything after ``--omni`` except host and port (and
    ``--headless``, which :attr:`argv` puts first for a replica host: it has no HTTP endpoint)."""

    preset: Preset
    model: str
    host: str
    port: int
    flags: list[str]
    env: dict[str, str]
    deploy: dict[str, Any] | None
    deploy_path: str | None
    channel: str
    executable: str = "vllm-omni"
    notes: list[str] = field(default_factory=list)
    role: str | None = None

    @property
    def headless(self) -> bool:
        return self.role == "replica"

    @property
    def argv(self) -> list[str]:
        if self.headless:
            return [self.executable, "serve", self.model, "--omni", "--headless", *self.flags]
        return [self.executable, "serve", self.model, "--omni", "--host", self.host, "--port", str(self.port), *self.flags]


def parse_devices(text: str) -> list[int]:
    """``"0-3,6,7"`` -> ``[0, 1, 2, 3, 6, 7]`` (physical device ids, order kept, no duplicates)."""
    out: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            if not (lo.strip().isdigit() and hi.strip().isdigit()) or int(lo) > int(hi):
                raise PresetError(f"bad device range {part!r} (use e.g. 0-7 or 0,1,4,5)")
            out.extend(range(int(lo), int(hi) + 1))
        elif part.isdigit():
            out.append(int(part))
        else:
            raise PresetError(f"bad device id {part!r} (use e.g. 0-7 or 0,1,4,5)")
    if len(set(out)) != len(out):
        raise PresetError(f"device list {text!r} names a device twice")
    if not out:
        raise PresetError("empty device list")
    return out


def default_sampling_params(preset: Preset) -> dict[str, Any]:
    """Server-side defaults derived from ``request_defaults`` (prompts and ``seconds`` are not sampling params)."""
    req = preset.request_defaults
    out: dict[str, Any] = {}
    if "size" in req:
        out["width"], out["height"] = parse_size(req["size"])
    for key in SAMPLING_KEYS:
        if key in req:
            out[key] = req[key]
    return out


def config_channel(preset: Preset, costs: CostTable | None = None) -> tuple[str, str | None]:
    """``("deploy-yaml", pipeline_key_or_None)`` or ``("cli", None)`` for this preset's model."""
    costs = costs or load_cost_table()
    pipeline_class = costs.model(preset.model).pipeline_class
    if pipeline_class in REGISTERED_PIPELINE_CLASSES:
        return "deploy-yaml", None
    if preset.topology.replicas > 1 and pipeline_class in OMNI_EXT_PIPELINES:
        return "deploy-yaml", OMNI_EXT_PIPELINES[pipeline_class]
    return "cli", None


def visible_devices_env(preset: Preset, costs: CostTable | None = None) -> str | None:
    costs = costs or load_cost_table()
    return costs.families[preset.device].get("visible_devices_env")


def scheduler_seed(preset: Preset, costs: CostTable | None = None) -> float | None:
    """Seconds per cost unit that seed the request scheduler's cost model
    (``omni_ext.scheduler.seconds_per_unit``), from the preset's cost-table estimate.

    The planner's latency of one of the preset's requests on one replica, divided by that request's
    :func:`omni_ext.models.families.cost_units` (with CFG when the preset's requests run it), to 3
    significant digits; the server replaces it with its own measurements as jobs finish. None when
    the cost table has no estimate, and for ``cpu`` presets: they serve tiny random-weight models
    whose time is per-request overhead that does not scale with the units (the planner's 0.003 s
    for a tiny Wan video would tell the scheduler that every job is free).
    """
    costs = costs or load_cost_table()
    if costs.platform(preset.device) == "cpu":
        return None
    _, est = preset_estimate(preset, costs)
    if est.latency_s is None:
        return None
    spec = costs.model(preset.model)
    req = {**spec.reference, **planner_request(preset)}  # the request the estimate is for
    sp = PresetSampling(width=req["width"], height=req["height"], num_frames=req.get("num_frames"),
                        num_inference_steps=req["steps"])
    units = cost_units(spec.pipeline_class, sp, cfg=requests_use_cfg(preset, costs))
    return float(f"{est.latency_s / units:.3g}")


def additional_config(preset: Preset, costs: CostTable | None = None) -> dict[str, Any]:
    """The preset's ``additional_config`` with :func:`scheduler_seed` merged in: what every render
    format passes to vLLM-Omni (deploy YAML stage ``additional_config`` or ``--additional-config``).
    Whatever the preset sets itself wins, including an explicit ``seconds_per_unit: null``."""
    config = copy.deepcopy(preset.additional_config)
    seed = scheduler_seed(preset, costs)
    if seed is None:
        return config
    section = config.setdefault("omni_ext", {})
    if isinstance(section, dict):
        scheduler = section.setdefault("scheduler", {})
        if isinstance(scheduler, dict):
            scheduler.setdefault("seconds_per_unit", seed)
    return config


def deploy_yaml(preset: Preset, pipeline_key: str | None = None, costs: CostTable | None = None) -> dict[str, Any]:
    """The deploy YAML mapping (schema: vllm_omni/config/stage_config.py StageDeployConfig)."""
    topo = preset.topology
    doc: dict[str, Any] = {}
    if pipeline_key:
        doc["pipeline"] = pipeline_key
    doc["async_chunk"] = False
    for key in sorted(TOP_LEVEL_ENGINE_KEYS & set(preset.engine)):
        doc[key] = preset.engine[key]
    if preset.executor:
        doc["distributed_executor_backend"] = preset.executor
    stage: dict[str, Any] = {
        "stage_id": 0,
        "num_replicas": topo.replicas,
        "devices": ",".join(str(i) for i in range(topo.devices)),
    }
    for attr, key, _ in _TOPOLOGY_KEYS:
        if getattr(topo, attr) > 1:
            stage[key] = getattr(topo, attr)
    for key, value in preset.engine.items():
        if key not in TOP_LEVEL_ENGINE_KEYS:
            stage[key] = value
    if preset.scheduler:
        stage["engine_backend"] = preset.scheduler
    extra = additional_config(preset, costs)
    if extra:
        stage["additional_config"] = extra
    if preset.stage_env:
        stage["env"] = dict(preset.stage_env)
    dsp = default_sampling_params(preset)
    if dsp:
        stage["default_sampling_params"] = dsp
    doc["stages"] = [stage]
    return doc


def cli_flags(preset: Preset, costs: CostTable | None = None) -> list[str]:
    """Flags that configure the preset without a deploy YAML (generic-fallback models)."""
    topo = preset.topology
    flags: list[str] = []
    for attr, _, flag in _TOPOLOGY_KEYS:
        if getattr(topo, attr) > 1:
            flags += [flag, str(getattr(topo, attr))]
    for key, value in preset.engine.items():
        flag = ENGINE_FLAGS[key]
        if isinstance(value, bool):
            if value:
                flags.append(flag)
        else:
            flags += [flag, str(value)]
    if preset.executor:
        flags += ["--distributed-executor-backend", preset.executor]
    if preset.scheduler:
        flags += ["--stage-overrides", json.dumps({"0": {"engine_backend": preset.scheduler}}, separators=(",", ":"))]
    extra = additional_config(preset, costs)
    if extra:
        flags += ["--additional-config", json.dumps(extra, separators=(",", ":"), sort_keys=True)]
    dsp = default_sampling_params(preset)
    if dsp:
        flags += ["--default-sampling-params", json.dumps({"0": dsp}, separators=(",", ":"))]
    return flags


def multi_host_flags(preset: Preset, role: str, master_address: str, master_port: int) -> list[str]:
    """vLLM-Omni 0.30's multi-machine flags for one host of ``preset``.

    Every host runs stage 0 (``--stage-id 0``) and names the head's master address and port; the
    head starts the master there, a replica host registers with it. ``--omni-dp-size-local`` is how
    many replicas this host runs: vLLM-Omni sets the local stage's ``num_replicas`` from it (head:
    ``DistStageRuntime._validate_single_stage_mode_replica_constraints``) and splits the deploy
    YAML's ``devices`` into that many groups (replica host: ``get_headless_replica_devices``), so it
    equals the deploy YAML's ``num_replicas``. A replica host needs ``--worker-backend
    multi_process`` (``run_headless`` refuses anything else).
    """
    if role not in ROLES:
        raise PresetError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    flags = ["--stage-id", "0", "--omni-master-address", master_address, "--omni-master-port", str(master_port),
             "--omni-dp-size-local", str(preset.topology.replicas)]
    if role == "replica":
        flags += ["--worker-backend", "multi_process"]
    return flags


def role_notes(preset: Preset, role: str) -> list[str]:
    """What the operator of one host must know: start order, which address, what the head logs."""
    others = preset.hosts - 1
    if role == "head":
        return [f"head of {preset.hosts} hosts: the HTTP endpoint; it keeps the queue and binds each request to a replica "
                f"when it can start there (its own {preset.topology.replicas} and those of {others} replica host(s)); "
                "start it first, then each replica host; it logs 'attached remote replica' as one joins"]
    return [f"replica host (one of {others}): no HTTP endpoint; start it after the head, with the head's address "
            "reachable from this host as --master-address; the head fails only this host's jobs if it goes away"]


def render(preset: Preset, options: RenderOptions | None = None, costs: CostTable | None = None) -> Rendered:
    """Render ``preset``; raises :class:`PresetError` when the options cannot work (e.g. too few devices)."""
    costs = costs or load_cost_table()
    opts = options or RenderOptions()
    model = opts.model or costs.model(preset.model).hf_id
    if not model:
        raise PresetError(f"preset {preset.name} serves a local tiny model: pass --model PATH "
                          f"(make one with `omni-ext make-tiny-model ...`)")
    env = dict(preset.env)
    notes: list[str] = []
    if preset.multi_host and opts.role is None:
        raise PresetError(f"preset {preset.name} spans {preset.hosts} hosts: render one command per host with "
                          f"--role head (the endpoint) or --role replica (every other host) and --master-address ADDR")
    if not preset.multi_host and opts.role is not None:
        raise PresetError(f"preset {preset.name} runs on one host; --role is for multi-host presets (hosts > 1)")
    if preset.multi_host and not opts.master_address:
        raise PresetError(f"preset {preset.name} spans {preset.hosts} hosts: pass --master-address, the head host's "
                          "address as every host reaches it")
    if opts.devices is not None:
        if len(opts.devices) < preset.topology.devices:
            raise PresetError(
                f"preset {preset.name} runs {preset.topology.devices} parallel ranks "
                f"({preset.topology.describe()}) but --devices names only {len(opts.devices)}"
            )
        var = visible_devices_env(preset, costs)
        if var:
            env[var] = ",".join(str(d) for d in opts.devices)
        if len(opts.devices) > preset.topology.devices:
            notes.append(f"{len(opts.devices) - preset.topology.devices} of the given devices stay idle")
    channel, pipeline_key = config_channel(preset, costs)
    deploy = None
    deploy_path = None
    if channel == "deploy-yaml":
        deploy = deploy_yaml(preset, pipeline_key, costs)
        deploy_path = opts.deploy_path or f"{preset.name}.deploy.yaml"
        flags = ["--deploy-config", deploy_path]
        if pipeline_key:
            notes.append(f"the deploy YAML selects omni-ext's registered pipeline {pipeline_key!r}: vLLM-Omni ignores "
                         "deploy YAMLs for Qwen-Image otherwise, and num_replicas has no other channel")
    else:
        flags = cli_flags(preset, costs)
        env.update(preset.stage_env)
        notes.append("configured by CLI flags: vLLM-Omni 0.30 ignores deploy YAML content for this model "
                     "(generic diffusion fallback); per-stage env is set on the process instead")
    if opts.role is not None:
        assert opts.master_address is not None
        flags += multi_host_flags(preset, opts.role, opts.master_address, int(opts.master_port))
        notes += role_notes(preset, opts.role)
    flags += list(preset.flags)
    return Rendered(preset, model, opts.host, int(opts.port), flags, env, deploy, deploy_path, channel,
                    opts.executable, notes, opts.role)


# ----------------------------------------------------------------------------------------------
# output formats


def _yaml_text(rendered: Rendered) -> str:
    header = f"# vLLM-Omni deploy config for omni-ext preset {rendered.preset.name}\n# {rendered.preset.summary}\n"
    if rendered.deploy is None:
        return header + "# No deploy YAML: " + rendered.notes[0] + "\n"
    return header + yaml.safe_dump(rendered.deploy, sort_keys=False, default_flow_style=False)


def format_cmd(rendered: Rendered) -> str:
    """The exact command: environment assignments, then ``vllm-omni serve ...``, one flag per line."""
    lines = [f"{k}={shlex.quote(v)}" for k, v in sorted(rendered.env.items())]
    argv = rendered.argv
    parts = _pair([shlex.quote(t) for t in argv[4:]])
    return " \\\n  ".join(lines + [shlex.join(argv[:4])] + parts) + "\n"


def format_env(rendered: Rendered) -> str:
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(rendered.env.items()))


def format_script(rendered: Rendered, costs: CostTable | None = None) -> str:
    """A self-contained launch script; ``MODEL``, ``HOST``, ``PORT`` and the visible devices can be overridden."""
    costs = costs or load_cost_table()
    p = rendered.preset
    platform = costs.platform(p.device)
    var = visible_devices_env(p, costs)
    role = rendered.role
    render_cmd = f"omni-ext presets render {p.name}" + (f" --role {role}" if role else "") + " --format script"
    out = [
        "#!/usr/bin/env bash",
        f"# omni-ext preset {p.name}: {p.summary}",
    ]
    if role is not None:
        out += [f"# Role: {role} of {p.hosts} hosts; on this host: {p.topology.describe()} = {p.topology.devices} device(s).",
                *(f"# {line}" for line in role_notes(p, role)),
                "# MASTER_ADDR (required): the head host's address as every host reaches it; MASTER_PORT: its master port."]
    else:
        out.append(f"# Topology: {p.topology.describe()} = {p.topology.devices} device(s).")
    out += [
        f"# Generated by `{render_cmd}`. Do not edit: change",
        f"# omni_ext/presets/catalog/{p.name}.yaml and regenerate (`omni-ext presets write-scripts scripts/launch`);",
        "# tests/test_presets.py fails when the two disagree.",
        f"# Check the host first: omni-ext doctor --preset {p.name}",
    ]
    out += [f"# {line}" for line in request_hint(p, costs)]
    for note in p.notes:
        out.append(f"# Note: {note}")
    out.append("")
    if platform == "npu":
        out += [
            "# CANN must be sourced before torch_npu is imported.",
            'if [ -z "${ASCEND_TOOLKIT_HOME:-}" ] && [ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]; then',
            "  . /usr/local/Ascend/ascend-toolkit/set_env.sh",
            "fi",
            'if [ -z "${ASCEND_TOOLKIT_HOME:-}" ]; then',
            '  echo "CANN environment not found: source /usr/local/Ascend/ascend-toolkit/set_env.sh" >&2',
            "  exit 1",
            "fi",
            "",
        ]
    out.append("set -euo pipefail")
    out.append(f'MODEL="${{MODEL:-{rendered.model}}}"')
    if not rendered.headless:
        out.append(f'HOST="${{HOST:-{rendered.host}}}"')
        out.append(f'PORT="${{PORT:-{rendered.port}}}"')
    if role is not None:
        out.append('MASTER_ADDR="${MASTER_ADDR:?set MASTER_ADDR to the address of the head host}"')
        out.append(f'MASTER_PORT="${{MASTER_PORT:-{DEFAULT_MASTER_PORT}}}"')
    env = dict(rendered.env)
    if var:
        devices = env.pop(var, ",".join(str(i) for i in range(p.topology.devices)))
        out.append(f'export {var}="${{{var}:-{devices}}}"')
    for key, value in sorted(env.items()):
        out.append(f"export {key}={shlex.quote(value)}")
    flags = list(rendered.flags)
    if rendered.deploy is not None:
        out.append(f'DEPLOY_CONFIG="${{DEPLOY_CONFIG:-${{TMPDIR:-/tmp}}/omni-ext-{p.name}.yaml}}"')
        out.append("cat > \"$DEPLOY_CONFIG\" <<'YAML'")
        out.append(yaml.safe_dump(rendered.deploy, sort_keys=False, default_flow_style=False).rstrip("\n"))
        out.append("YAML")
        idx = flags.index("--deploy-config")
        flags[idx + 1] = "$DEPLOY_CONFIG"
    if role is not None:
        flags[flags.index("--omni-master-address") + 1] = "$MASTER_ADDR"
        flags[flags.index("--omni-master-port") + 1] = "$MASTER_PORT"
    variables = {"$DEPLOY_CONFIG", "$MASTER_ADDR", "$MASTER_PORT"}
    quoted = [f'"{f}"' if f in variables else shlex.quote(f) for f in flags]
    line = 'exec vllm-omni serve "$MODEL" --omni ' + ("--headless" if rendered.headless else '--host "$HOST" --port "$PORT"')
    out.append(" \\\n  ".join([line, *_pair(quoted), '"$@"']))
    return "\n".join(out) + "\n"


def _pair(tokens: list[str]) -> list[str]:
    """Group ``--flag value`` pairs for readability."""
    groups, i = [], 0
    while i < len(tokens):
        if tokens[i].startswith("--") and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            groups.append(f"{tokens[i]} {tokens[i + 1]}")
            i += 2
        else:
            groups.append(tokens[i])
            i += 1
    return groups


def request_hint(preset: Preset, costs: CostTable | None = None) -> list[str]:
    """How to call the server with the preset's request defaults (never ``seconds`` for video)."""
    costs = costs or load_cost_table()
    family = family_of(costs.model(preset.model).pipeline_class)
    req = preset.request_defaults
    fields = [f"{k}={v}" for k, v in req.items()]
    if family is not None and family.is_video:
        native = family.native
        lines = [f"Request: POST /v1/videos (multipart) prompt=... {' '.join(fields)}",
                 "Send these fields with every request: a front end may fill missing ones with the model's native "
                 f"{native.width}x{native.height}x{native.num_frames} defaults instead of this server's.",
                 "Send num_frames and fps, not seconds: stock vLLM-Omni turns seconds into seconds x 24 frames."]
    else:
        lines = [f"Request: POST /v1/images/generations (JSON) prompt=... {' '.join(fields)}",
                 "Send these fields with every request: vLLM-Omni 0.30's /v1/images/generations ignores server "
                 "default sampling params."]
    if preset.topology.cfg > 1 and family is not None and family.cfg_rule == "qwen-image":
        lines.append("CFG parallel only works when every request carries negative_prompt (Qwen-Image runs no CFG without one).")
    return lines


def format_rendered(rendered: Rendered, fmt: str, costs: CostTable | None = None) -> str:
    if fmt == "cmd":
        return format_cmd(rendered)
    if fmt == "yaml":
        return _yaml_text(rendered)
    if fmt == "env":
        return format_env(rendered)
    if fmt == "script":
        return format_script(rendered, costs)
    raise PresetError(f"format must be one of {', '.join(FORMATS)}")
