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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property

from omni_ext.presets.catalog import DEVICE_FAMILIES, PRESET_OBJECTIVES, Preset, PresetError
from omni_ext.presets.costs import CostTable, DeviceSpec, ModelSpec, Topology, load_cost_table
from omni_ext.presets.planner import preset_estimate
from omni_ext.presets.render import ENGINE_FLAGS
from omni_ext.presets.shared import parse_size, requests_use_cfg, tuned_executor_refusal
from omni_ext.scheduler.config import scheduler_config

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
    #: The check rule that found it (:data:`CHECK_RULES`).
    rule: str = field(default="", compare=False)

    def __str__(self) -> str:
        return f"{self.level}: {self.message}"


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


@dataclass
class PresetFacts:
    """What the check rules read: the preset, the cost table, and what follows from them, worked out
    when a rule first asks (the rules after a failed gate never ask for an unknown model's spec)."""

    preset: Preset
    costs: CostTable

    @property
    def topo(self) -> Topology:
        return self.preset.topology

    @cached_property
    def spec(self) -> ModelSpec:
        return self.costs.model(self.preset.model)

    @cached_property
    def platform(self) -> str:
        return self.costs.platform(self.preset.device)

    @cached_property
    def device(self) -> DeviceSpec:
        """The device family's reference device: memory and time are judged on it."""
        return self.costs.reference_device(self.preset.device)

    @cached_property
    def usable_gb(self) -> float | None:
        return self.costs.usable_memory_gb(self.device)


Findings = Iterator[Issue]


def _error(message: str) -> Issue:
    return Issue("error", message)


def _warning(message: str) -> Issue:
    return Issue("warning", message)


# ---- identity ----------------------------------------------------------------------------------
def _known_model(f: PresetFacts) -> Findings:
    if f.preset.model not in f.costs.models:
        yield _error(f"unknown model {f.preset.model!r}; known: {', '.join(sorted(f.costs.models))}")


def _known_device(f: PresetFacts) -> Findings:
    if f.preset.device not in DEVICE_FAMILIES:
        yield _error(f"device must be one of {', '.join(DEVICE_FAMILIES)}, got {f.preset.device!r}")


def _known_objective(f: PresetFacts) -> Findings:
    if f.preset.objective not in PRESET_OBJECTIVES:
        yield _error(f"objective must be one of {', '.join(PRESET_OBJECTIVES)}, got {f.preset.objective!r}")


def _name_convention(f: PresetFacts) -> Findings:
    """The name says what the preset is, so that a list of names is a list of deployments."""
    preset = f.preset
    want = expected_name(preset)
    variant = preset.name[len(want) + 1:] if preset.name.startswith(want + ".") else ""
    if preset.name != want and not (variant.isidentifier() and variant.islower()):
        yield _error(f"name {preset.name!r} should be {want!r} (<model>.<device>.[<hosts>]x<count>.<objective>[.<variant>])")


def _hosts_count(f: PresetFacts) -> Findings:
    if f.preset.hosts < 1:
        yield _error(f"hosts must be >= 1, got {f.preset.hosts}")


# ---- topology ----------------------------------------------------------------------------------
def _positive_degrees(f: PresetFacts) -> Findings:
    if min(f.topo.as_dict().values()) < 1:
        yield _error("every topology degree must be >= 1")


def _cfg_branches(f: PresetFacts) -> Findings:
    if f.topo.cfg > 2:
        yield _error(f"cfg {f.topo.cfg} > 2: {f.spec.label} has two CFG branches (conditional and unconditional); "
                     "use cfg 1 or 2")


def _ranks_fit_devices(f: PresetFacts) -> Findings:
    topo, count = f.topo, f.preset.count
    if topo.devices > count:
        yield _error(f"more parallel ranks than devices: {topo.describe()} needs {topo.devices}, the preset has {count}")
    elif topo.devices < count:
        yield _warning(f"{count - topo.devices} of {count} devices stay idle with {topo.describe()}")


def _sequence_parallel_divides_heads(f: PresetFacts) -> Findings:
    sp = f.topo.ulysses * f.topo.ring
    if f.spec.heads % sp:
        yield _error(f"Ulysses x Ring = {sp} does not divide the {f.spec.heads} attention heads of {f.spec.label}")


def _vae_patch_within_replica(f: PresetFacts) -> Findings:
    if f.topo.vae_patch > f.topo.ranks_per_replica:
        yield _error(f"vae_patch {f.topo.vae_patch} is larger than the {f.topo.ranks_per_replica} ranks of one replica")


def _cfg_needs_guidance(f: PresetFacts) -> Findings:
    """CFG parallel splits the two guidance branches: a request that runs one leaves the second rank idle."""
    if f.topo.cfg != 2 or requests_use_cfg(f.preset, f.costs):
        return
    if f.spec.cfg_rule == "qwen-image":
        yield _error("cfg 2 but the requests run no CFG: Qwen-Image only runs CFG when the request carries "
                     "negative_prompt; add request_defaults.negative_prompt (and send it) or use cfg 1")
    else:
        yield _error("cfg 2 but guidance_scale <= 1 runs no CFG: the second rank would idle; use cfg 1")


# ---- memory and TP -----------------------------------------------------------------------------
def _memory_fits(f: PresetFacts) -> Findings:
    if f.usable_gb is None or any(f.preset.engine.get(k) for k in OFFLOAD_KEYS):
        return
    need = f.spec.rank_memory_gb(f.topo.tp)
    if need > f.usable_gb:
        yield _error(f"does not fit: {need:.1f} GB per rank > {f.usable_gb:.1f} GB usable on {f.device.label}; "
                     f"raise tp, use a larger device or set engine.enable_layerwise_offload")


def _tp_only_for_memory(f: PresetFacts) -> Findings:
    """TP for a DiT pays a per-layer all-reduce; it is worth it only when the weights need it."""
    tp, usable = f.topo.tp, f.usable_gb
    if usable is None or tp <= 1 or f.spec.rank_memory_gb(tp // 2) > usable:
        return
    where = "on NPU, where per-layer HCCL all-reduce costs more than it saves (TP2 = 1.12x, MindIE-SD)" \
        if f.platform == "npu" else "(per-layer all-reduce; SGLang: TP is not a default latency optimisation)"
    yield _warning(f"TP {tp} for a DiT without memory need ({f.spec.rank_memory_gb(tp // 2):.1f} GB fits "
                   f"{usable:.1f} GB at TP {tp // 2}) {where}; prefer cfg or ulysses")


# ---- engine, flags, env ------------------------------------------------------------------------
def _engine_keys(f: PresetFacts) -> Findings:
    for key, value in f.preset.engine.items():
        if key not in ENGINE_FLAGS:
            yield _error(f"unknown engine key {key!r}; allowed: {', '.join(sorted(ENGINE_FLAGS))}")
        elif value is False:
            yield _error(f"engine.{key}: false is the default; remove the key")


def _flags_not_rendered(f: PresetFacts) -> Findings:
    for token in f.preset.flags:
        flag = token.split("=", 1)[0]
        if flag in FORBIDDEN_FLAGS:
            yield _error(f"flag {flag}: {FORBIDDEN_FLAGS[flag]}")
        elif flag in RENDERED_FLAGS or flag in MULTI_HOST_FLAGS:
            yield _error(f"flag {flag} is set by the renderer from topology/engine/request_defaults; remove it from flags")


def _npu_env(f: PresetFacts) -> Findings:
    if f.platform != "npu":
        return
    env = f.preset.env
    for key, value in NPU_ENV.items():
        if key not in env or (value is not None and env[key] != value):
            yield _warning(f"NPU preset without {key}{'=' + value if value else ''} in env (Ascend tuning; anchors.md section 4)")


def _hccl_aiv_one_domain(f: PresetFacts) -> Findings:
    aiv = {**f.preset.env, **f.preset.stage_env}.get("HCCL_OP_EXPANSION_MODE")
    topo = f.topo
    if aiv == "AIV" and sum(d > 1 for d in (topo.cfg, topo.ulysses, topo.ring, topo.tp)) > 1:
        yield _warning("HCCL_OP_EXPANSION_MODE=AIV with more than one communication domain per rank (CANN supports one)")


# ---- request defaults --------------------------------------------------------------------------
def _no_seconds(f: PresetFacts) -> Findings:
    if "seconds" in f.preset.request_defaults:
        yield _error("request_defaults.seconds: vLLM-Omni maps seconds to seconds x 24 frames (Wan wants 81 at 16 fps); "
                     "use num_frames and fps")


def _known_request_keys(f: PresetFacts) -> Findings:
    for key in sorted(set(f.preset.request_defaults) - REQUEST_KEYS - {"seconds"}):
        yield _error(f"unknown request_defaults key {key!r}; allowed: {', '.join(sorted(REQUEST_KEYS))}")


def _size_multiple_of_16(f: PresetFacts) -> Findings:
    req = f.preset.request_defaults
    if "size" not in req:
        return
    try:
        w, h = parse_size(req["size"])
    except PresetError as exc:
        yield _error(str(exc))
        return
    if w % 16 or h % 16:
        yield _error(f"size {req['size']} must be a multiple of 16 in both dimensions")


def _frames_fit_latent(f: PresetFacts) -> Findings:
    req, family = f.preset.request_defaults, f.spec.family
    if family is not None and family.is_video and "num_frames" in req and (int(req["num_frames"]) - 1) % family.latent_temporal:
        yield _error(f"num_frames {req['num_frames']} must be {family.latent_temporal}k+1 for {f.spec.label} "
                     f"(e.g. {family.native.num_frames}); vLLM-Omni would snap it")


# ---- time --------------------------------------------------------------------------------------
def _forward_timeout(f: PresetFacts) -> Findings:
    _, est = preset_estimate(f.preset, f.costs)
    for var, value in f.costs.timeout_env(est.latency_s).items():
        have = f.preset.env.get(var)
        if have is None or float(have) < float(value):
            yield _error(f"one request is estimated at {est.latency_s:.0f} s on {f.device.label}, past half of vLLM-Omni's "
                         f"{f.costs.timeouts['default_s']} s default: set env {var}={value} (now {have or 'unset'}); "
                         "a forward past VLLM_OMNI_DLO_DP_WAVE_TIMEOUT kills the whole worker group")


# ---- executor and scheduler --------------------------------------------------------------------
def _executor_choice(f: PresetFacts) -> Findings:
    """omni-ext's TunedExecutor wherever it applies, never where it would refuse to start."""
    refusal = tuned_executor_refusal(f.preset, f.costs)
    if f.preset.executor == TUNED_EXECUTOR and refusal:
        yield _error(f"executor: the TunedExecutor would refuse to start: {refusal}")
    elif f.preset.executor is None and refusal is None:
        yield _warning(f"the TunedExecutor applies to this preset: select it (executor: {TUNED_EXECUTOR})")


def _executor_imports(f: PresetFacts) -> Findings:
    executor = f.preset.executor
    if executor == TUNED_EXECUTOR:
        # omni-ext's own: importing it imports vLLM (~10 s, for every `presets render` and `serve`);
        # that its module is installed is enough here, tests/test_presets.py imports the class itself.
        if importlib.util.find_spec("omni_ext.executor.tuned") is None:
            yield _error(f"executor: {TUNED_EXECUTOR} is not installed")
    elif executor:
        why = check_qualname(executor, "vllm_omni.diffusion.executor.abstract.DiffusionExecutor")
        if why:
            yield _error(f"executor: {why}")


def _scheduler_imports(f: PresetFacts) -> Findings:
    if f.preset.scheduler:
        why = check_qualname(f.preset.scheduler, "vllm_omni.diffusion.diffusion_engine.DiffusionEngine")
        if why:
            yield _error(f"scheduler (engine_backend): {why}")


def _scheduler_options(f: PresetFacts) -> Findings:
    """A typo in the scheduler's options fails here, not at server start."""
    try:
        scheduler_config(f.preset.additional_config)
    except ValueError as exc:
        yield _error(f"additional_config: {exc}")


def _launch_script_is_sh(f: PresetFacts) -> Findings:
    script = f.preset.launch_script
    if script and not script.endswith(".sh"):
        yield _error(f"launch_script {script!r} must end in .sh")


@dataclass(frozen=True)
class CheckRule:
    """One named static rule of :func:`check_preset`: ``check`` yields its findings, each with its reason."""

    check: Callable[[PresetFacts], Findings]
    #: Its errors end the check: the rules after it read what it found broken (an unknown model's spec,
    #: an unknown device family's platform, a degree of 0).
    gate: bool = False
    #: Runs only while no error has been found: an estimate of a broken preset says nothing.
    when_sound: bool = False

    @property
    def name(self) -> str:
        return self.check.__name__.lstrip("_")


#: The rules :func:`check_preset` runs, in the order their findings are reported.
CHECK_RULES: tuple[CheckRule, ...] = (
    CheckRule(_known_model, gate=True),
    CheckRule(_known_device, gate=True),
    CheckRule(_known_objective),
    CheckRule(_name_convention),
    CheckRule(_hosts_count),
    CheckRule(_positive_degrees, gate=True),
    CheckRule(_cfg_branches),
    CheckRule(_ranks_fit_devices),
    CheckRule(_sequence_parallel_divides_heads),
    CheckRule(_vae_patch_within_replica),
    CheckRule(_cfg_needs_guidance),
    CheckRule(_memory_fits),
    CheckRule(_tp_only_for_memory),
    CheckRule(_engine_keys),
    CheckRule(_flags_not_rendered),
    CheckRule(_npu_env),
    CheckRule(_hccl_aiv_one_domain),
    CheckRule(_no_seconds),
    CheckRule(_known_request_keys),
    CheckRule(_size_multiple_of_16),
    CheckRule(_frames_fit_latent),
    CheckRule(_forward_timeout, when_sound=True),
    CheckRule(_executor_choice),
    CheckRule(_executor_imports),
    CheckRule(_scheduler_imports),
    CheckRule(_scheduler_options),
    CheckRule(_launch_script_is_sh),
)


def _has_error(issues: list[Issue]) -> bool:
    return any(i.level == "error" for i in issues)


def check_preset(preset: Preset, costs: CostTable | None = None) -> list[Issue]:
    """All static problems of ``preset`` (empty when it is sound): :data:`CHECK_RULES`, in order."""
    facts = PresetFacts(preset, costs or load_cost_table())
    issues: list[Issue] = []
    for rule in CHECK_RULES:
        if rule.when_sound and _has_error(issues):
            continue
        found = [replace(issue, rule=rule.name) for issue in rule.check(facts)]
        issues.extend(found)
        if rule.gate and _has_error(found):
            break
    return issues


def require_valid(preset: Preset, costs: CostTable | None = None) -> list[Issue]:
    """Raise :class:`PresetError` listing every error; return the warnings."""
    issues = check_preset(preset, costs)
    errors = [i for i in issues if i.level == "error"]
    if errors:
        raise PresetError(f"preset {preset.name} is invalid:\n" + "\n".join(f"  - {e.message}" for e in errors))
    return issues
