"""Check presets with static rules: no vLLM needed, instant.

Why: the static rules catch the launch mistakes users actually make (CFG 3, more ranks than
devices, ``--data-parallel-size`` under ``--omni``, TP for a DiT on NPU, a 14B video that outruns
the 600 s forward timeout, ``seconds`` for Wan) instantly and without vLLM installed, so
``omni-ext serve --preset`` can refuse a broken launch before spending minutes on start-up. The
second layer, :mod:`omni_ext.presets.installed` (``omni-ext presets validate``), proves that the
installed vLLM-Omni accepts the rendered command and resolves the topology the preset promises.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omni_ext.presets.catalog import DEVICE_FAMILIES, PRESET_OBJECTIVES, Preset, PresetError
from omni_ext.presets.costs import CostTable, DeviceSpec, ModelSpec, Topology, load_cost_table
from omni_ext.presets.render import ENGINE_FLAGS, parse_size
from omni_ext.scheduler.config import scheduler_config

if TYPE_CHECKING:
    from omni_ext.presets.planner import Estimate

REQUEST_KEYS = frozenset({
    "size", "num_frames", "fps", "num_inference_steps", "guidance_scale", "guidance_scale_2", "true_cfg_scale",
    "negative_prompt",
})
#: Flags a preset must never carry: vLLM-Omni rejects them under --omni or they silently add redundant DP.
FORBIDDEN_FLAGS = {
    "--data-parallel-size": "rejected under --omni; data parallelism is topology.replicas (deploy YAML num_replicas)",
    "--data-parallel-size-local": "rejected under --omni; use topology.replicas",
    "--num-gpus": "more GPUs than cfg x ulysses x tp silently become an intra-engine DP group in which every rank "
                  "computes the same request; use topology.replicas",
    "--api-server-count": "rejected for diffusion models by vLLM-Omni",
}
#: Flags the renderer owns.
RENDERED_FLAGS = {"--omni", "--host", "--port", "--deploy-config", "--stage-overrides", "--default-sampling-params",
                  "--cfg-parallel-size", "--ulysses-degree", "--usp", "--ring-degree", "--ring", "--tensor-parallel-size",
                  "-tp", "--vae-patch-parallel-size", "--distributed-executor-backend", "--additional-config"}
NPU_ENV = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "TASK_QUEUE_ENABLE": None, "PYTORCH_NPU_ALLOC_CONF": None}
OFFLOAD_KEYS = ("enable_cpu_offload", "enable_layerwise_offload")
#: omni-ext's executor (``--distributed-executor-backend`` / deploy YAML ``distributed_executor_backend``).
TUNED_EXECUTOR = "omni_ext.executor.TunedExecutor"
#: Flags of vLLM-Omni's multi-machine mode: the renderer sets them from ``hosts`` and the launch role.
MULTI_HOST_FLAGS = {"--stage-id", "--omni-master-address", "-oma", "--omni-master-port", "-omp", "--headless",
                    "--omni-dp-size-local", "--worker-backend"}


@dataclass(frozen=True)
class Issue:
    level: str  # "error" or "warning"
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.message}"


def planner_request(preset: Preset) -> dict[str, Any]:
    """The preset's request in the planner's terms."""
    req = preset.request_defaults
    out: dict[str, Any] = {}
    if "size" in req:
        out["width"], out["height"] = parse_size(req["size"])
    if "num_frames" in req:
        out["num_frames"] = int(req["num_frames"])
    if "num_inference_steps" in req:
        out["steps"] = int(req["num_inference_steps"])
    return out


def requests_use_cfg(preset: Preset, costs: CostTable) -> bool:
    """Whether this preset's requests run CFG (Qwen-Image: only with a negative prompt)."""
    spec = costs.model(preset.model)
    req = preset.request_defaults
    if spec.cfg_rule == "qwen-image" and spec.family is not None:
        return "negative_prompt" in req and float(req.get("true_cfg_scale", spec.family.default_guidance)) > 1.0
    return float(req.get("guidance_scale", spec.reference.get("guidance_scale", 1.0))) > 1.0


def preset_estimate(preset: Preset, costs: CostTable | None = None) -> tuple[DeviceSpec, Estimate]:
    """The planner's estimate for ``preset`` on its family's reference device, with its own request."""
    from omni_ext.presets.planner import estimate

    costs = costs or load_cost_table()
    device = costs.reference_device(preset.device)
    # Every host's replicas serve requests: throughput counts them all; latency is one replica's.
    est = estimate(costs.model(preset.model), device, preset.total_topology, requests_use_cfg=requests_use_cfg(preset, costs),
                   request=planner_request(preset), costs=costs)
    return device, est


def tuned_executor_refusal(preset: Preset, costs: CostTable | None = None) -> str | None:
    """Why omni-ext's TunedExecutor does not apply to ``preset`` (None: it does, and the preset should select it).

    The refusals of ``TunedExecutor._init_executor`` (``omni_ext/executor/tuned.py``: CFG 1 or 2 and
    data parallel only; no tensor, sequence or pipeline parallel; no step execution), kept here as
    pure rules so a preset is checked without vLLM, plus the family table's ``tuned_class``: only
    families with omni-ext's tuned pipeline (Wan2.1/2.2 T2V, Qwen-Image) gain from it. A preset
    that selected it where it refuses would not start at all.
    """
    costs = costs or load_cost_table()
    return tuned_refusal(costs.model(preset.model), preset.topology, preset.engine)


def tuned_refusal(spec: ModelSpec, topo: Topology, engine: dict[str, Any] | None = None) -> str | None:
    """:func:`tuned_executor_refusal` for a model and topology (what the planner has before any preset)."""
    family = spec.family
    if family is None or family.tuned_class is None:
        return f"{spec.label} has no omni-ext tuned pipeline (omni_ext/models/families.py tuned_class)"
    if topo.tp > 1:
        return (f"it refuses tensor parallel (tensor_parallel_size={topo.tp}; CFG and data parallel only, "
                "omni_ext/executor/tuned.py), so vLLM-Omni's own executor runs this preset")
    if topo.ulysses * topo.ring > 1:
        return (f"it refuses sequence parallel (Ulysses {topo.ulysses} x Ring {topo.ring}; CFG and data parallel only, "
                "omni_ext/executor/tuned.py), so vLLM-Omni's own executor runs this preset")
    if topo.cfg > 2:
        return f"it runs cfg_parallel_size 1 or 2, not {topo.cfg}"
    if topo.vae_patch > 1:
        return "its worker groups are CFG and data-parallel groups only, without VAE patch parallel"
    if (engine or {}).get("step_execution"):
        return "it runs whole requests and refuses step execution"
    return None


def expected_name(preset: Preset) -> str:
    """``<model>.<device>.x<count>.<objective>``, or ``<model>.<device>.<hosts>x<count>.<objective>`` across hosts."""
    count = f"{preset.hosts}x{preset.count}" if preset.hosts > 1 else f"x{preset.count}"
    return f"{preset.model}.{preset.device}.{count}.{preset.objective}"


def check_qualname(qualname: str, base: str) -> str | None:
    """None when ``qualname`` imports (and subclasses ``base`` when vLLM-Omni is importable); else why not."""
    module_name, _, attr = qualname.rpartition(".")
    if not module_name:
        return f"{qualname!r} is not a dotted import path"
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        return f"{qualname!r} does not import: {exc}"
    base_module, _, base_attr = base.rpartition(".")
    try:
        base_cls = getattr(importlib.import_module(base_module), base_attr)
    except ImportError:
        return None
    if not (isinstance(obj, type) and issubclass(obj, base_cls)):
        return f"{qualname!r} is not a subclass of {base}"
    return None


def check_preset(preset: Preset, costs: CostTable | None = None) -> list[Issue]:
    """All static problems of ``preset`` (empty when it is sound)."""
    costs = costs or load_cost_table()
    issues: list[Issue] = []
    err = lambda m: issues.append(Issue("error", m))  # noqa: E731
    warn = lambda m: issues.append(Issue("warning", m))  # noqa: E731
    if preset.model not in costs.models:
        err(f"unknown model {preset.model!r}; known: {', '.join(sorted(costs.models))}")
        return issues
    if preset.device not in DEVICE_FAMILIES:
        err(f"device must be one of {', '.join(DEVICE_FAMILIES)}, got {preset.device!r}")
        return issues
    if preset.objective not in PRESET_OBJECTIVES:
        err(f"objective must be one of {', '.join(PRESET_OBJECTIVES)}, got {preset.objective!r}")
    want = expected_name(preset)
    variant = preset.name[len(want) + 1:] if preset.name.startswith(want + ".") else ""
    if preset.name != want and not (variant.isidentifier() and variant.islower()):
        err(f"name {preset.name!r} should be {want!r} (<model>.<device>.[<hosts>]x<count>.<objective>[.<variant>])")
    if preset.hosts < 1:
        err(f"hosts must be >= 1, got {preset.hosts}")
    spec = costs.model(preset.model)
    topo = preset.topology
    platform = costs.platform(preset.device)

    # topology
    if min(topo.as_dict().values()) < 1:
        err("every topology degree must be >= 1")
        return issues
    if topo.cfg > 2:
        err(f"cfg {topo.cfg} > 2: {spec.label} has two CFG branches (conditional and unconditional); use cfg 1 or 2")
    if topo.devices > preset.count:
        err(f"more parallel ranks than devices: {topo.describe()} needs {topo.devices}, the preset has {preset.count}")
    elif topo.devices < preset.count:
        warn(f"{preset.count - topo.devices} of {preset.count} devices stay idle with {topo.describe()}")
    sp = topo.ulysses * topo.ring
    if spec.heads % sp:
        err(f"Ulysses x Ring = {sp} does not divide the {spec.heads} attention heads of {spec.label}")
    if topo.vae_patch > topo.ranks_per_replica:
        err(f"vae_patch {topo.vae_patch} is larger than the {topo.ranks_per_replica} ranks of one replica")
    use_cfg = requests_use_cfg(preset, costs)
    if topo.cfg == 2 and not use_cfg:
        if spec.cfg_rule == "qwen-image":
            err("cfg 2 but the requests run no CFG: Qwen-Image only runs CFG when the request carries negative_prompt; "
                "add request_defaults.negative_prompt (and send it) or use cfg 1")
        else:
            err("cfg 2 but guidance_scale <= 1 runs no CFG: the second rank would idle; use cfg 1")

    # memory and TP
    device = costs.reference_device(preset.device)
    usable = costs.usable_memory_gb(device)
    offload = any(preset.engine.get(k) for k in OFFLOAD_KEYS)
    if usable is not None:
        need = spec.rank_memory_gb(topo.tp)
        if need > usable and not offload:
            err(f"does not fit: {need:.1f} GB per rank > {usable:.1f} GB usable on {device.label}; "
                f"raise tp, use a larger device or set engine.enable_layerwise_offload")
        if topo.tp > 1 and spec.rank_memory_gb(topo.tp // 2) <= usable:
            where = "on NPU, where per-layer HCCL all-reduce costs more than it saves (TP2 = 1.12x, MindIE-SD)" \
                if platform == "npu" else "(per-layer all-reduce; SGLang: TP is not a default latency optimisation)"
            warn(f"TP {topo.tp} for a DiT without memory need ({spec.rank_memory_gb(topo.tp // 2):.1f} GB fits "
                 f"{usable:.1f} GB at TP {topo.tp // 2}) {where}; prefer cfg or ulysses")

    # engine, flags, env
    for key, value in preset.engine.items():
        if key not in ENGINE_FLAGS:
            err(f"unknown engine key {key!r}; allowed: {', '.join(sorted(ENGINE_FLAGS))}")
        elif value is False:
            err(f"engine.{key}: false is the default; remove the key")
    for token in preset.flags:
        flag = token.split("=", 1)[0]
        if flag in FORBIDDEN_FLAGS:
            err(f"flag {flag}: {FORBIDDEN_FLAGS[flag]}")
        elif flag in RENDERED_FLAGS or flag in MULTI_HOST_FLAGS:
            err(f"flag {flag} is set by the renderer from topology/engine/request_defaults; remove it from flags")
    if platform == "npu":
        for key, value in NPU_ENV.items():
            if key not in preset.env or (value is not None and preset.env[key] != value):
                warn(f"NPU preset without {key}{'=' + value if value else ''} in env (Ascend tuning; anchors.md section 4)")
    aiv = {**preset.env, **preset.stage_env}.get("HCCL_OP_EXPANSION_MODE")
    if aiv == "AIV" and sum(d > 1 for d in (topo.cfg, topo.ulysses, topo.ring, topo.tp)) > 1:
        warn("HCCL_OP_EXPANSION_MODE=AIV with more than one communication domain per rank (CANN supports one)")

    # request defaults
    req = preset.request_defaults
    if "seconds" in req:
        err("request_defaults.seconds: vLLM-Omni maps seconds to seconds x 24 frames (Wan wants 81 at 16 fps); "
            "use num_frames and fps")
    for key in sorted(set(req) - REQUEST_KEYS - {"seconds"}):
        err(f"unknown request_defaults key {key!r}; allowed: {', '.join(sorted(REQUEST_KEYS))}")
    if "size" in req:
        try:
            w, h = parse_size(req["size"])
            if w % 16 or h % 16:
                err(f"size {req['size']} must be a multiple of 16 in both dimensions")
        except PresetError as exc:
            err(str(exc))
    family = spec.family
    if family is not None and family.is_video and "num_frames" in req and (int(req["num_frames"]) - 1) % family.latent_temporal:
        err(f"num_frames {req['num_frames']} must be {family.latent_temporal}k+1 for {spec.label} "
            f"(e.g. {family.native.num_frames}); vLLM-Omni would snap it")

    # forward timeout
    if not issues or all(i.level == "warning" for i in issues):
        _, est = preset_estimate(preset, costs)
        for var, value in costs.timeout_env(est.latency_s).items():
            have = preset.env.get(var)
            if have is None or float(have) < float(value):
                err(f"one request is estimated at {est.latency_s:.0f} s on {device.label}, past half of vLLM-Omni's "
                    f"{costs.timeouts['default_s']} s default: set env {var}={value} (now {have or 'unset'}); "
                    "a forward past VLLM_OMNI_DLO_DP_WAVE_TIMEOUT kills the whole worker group")

    # executor: omni-ext's TunedExecutor wherever it applies, never where it would refuse to start
    refusal = tuned_executor_refusal(preset, costs)
    if preset.executor == TUNED_EXECUTOR and refusal:
        err(f"executor: the TunedExecutor would refuse to start: {refusal}")
    elif preset.executor is None and refusal is None:
        warn(f"the TunedExecutor applies to this preset: select it (executor: {TUNED_EXECUTOR})")
    # optional executor / scheduler: must import when set
    if preset.executor == TUNED_EXECUTOR:
        # omni-ext's own: importing it imports vLLM (~10 s, for every `presets render` and `serve`);
        # that its module is installed is enough here, tests/test_presets.py imports the class itself.
        if importlib.util.find_spec("omni_ext.executor.tuned") is None:
            err(f"executor: {TUNED_EXECUTOR} is not installed")
    elif preset.executor:
        why = check_qualname(preset.executor, "vllm_omni.diffusion.executor.abstract.DiffusionExecutor")
        if why:
            err(f"executor: {why}")
    if preset.scheduler:
        why = check_qualname(preset.scheduler, "vllm_omni.diffusion.diffusion_engine.DiffusionEngine")
        if why:
            err(f"scheduler (engine_backend): {why}")
    try:  # a typo in the scheduler's options fails here, not at server start
        scheduler_config(preset.additional_config)
    except ValueError as exc:
        err(f"additional_config: {exc}")
    if preset.launch_script and not preset.launch_script.endswith(".sh"):
        err(f"launch_script {preset.launch_script!r} must end in .sh")
    return issues


def require_valid(preset: Preset, costs: CostTable | None = None) -> list[Issue]:
    """Raise :class:`PresetError` listing every error; return the warnings."""
    issues = check_preset(preset, costs)
    errors = [i for i in issues if i.level == "error"]
    if errors:
        raise PresetError(f"preset {preset.name} is invalid:\n" + "\n".join(f"  - {e.message}" for e in errors))
    return issues
