"""Preset data files (``omni_ext/presets/catalog/*.yaml``) as :class:`Preset` objects.

Why one YAML file per preset: a preset is something an operator reads before trusting it with a
cluster. One short file per deployment, named ``<model>.<device>.x<count>.<objective>``, can be
reviewed, diffed and copied on its own; the Python code only renders and checks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from omni_ext.presets.costs import Topology

PRESET_OBJECTIVES = ("latency", "throughput", "balanced")
#: Launch roles of a multi-host preset (``hosts > 1``): the head (the HTTP endpoint, the queue and
#: its own local replicas) and a headless replica host (vLLM-Omni 0.30's ``--headless``).
ROLES = ("head", "replica")
DEVICE_FAMILIES = ("910b", "cuda", "cpu")

_KEYS = {
    "name", "summary", "model", "device", "count", "objective", "topology", "engine", "env", "stage_env",
    "flags", "request_defaults", "executor", "scheduler", "additional_config", "launch_script", "notes", "hosts",
}
_REQUIRED = {"name", "summary", "model", "device", "count", "objective", "topology"}


class PresetError(ValueError):
    """A preset that cannot be loaded or rendered; the message says what to change."""


@dataclass(frozen=True)
class Preset:
    """One deployment recipe. See ``catalog/README.md`` for the meaning of each field."""

    name: str
    summary: str
    model: str
    device: str
    count: int
    objective: str
    topology: Topology
    #: Hosts the deployment spans. ``count`` and ``topology`` are per host: every host runs the same
    #: ``topology.replicas`` whole replicas (vLLM-Omni's multi-machine mode never splits a replica
    #: over hosts), one host is the head, the others are headless replica hosts.
    hosts: int = 1
    engine: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    stage_env: dict[str, str] = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    request_defaults: dict[str, Any] = field(default_factory=dict)
    executor: str | None = None
    scheduler: str | None = None
    additional_config: dict[str, Any] = field(default_factory=dict)
    launch_script: str | None = None
    notes: tuple[str, ...] = ()
    path: Path | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: Path | None = None) -> "Preset":
        where = f" in {path}" if path else ""
        if not isinstance(data, dict):
            raise PresetError(f"preset{where} must be a mapping")
        unknown = set(data) - _KEYS
        if unknown:
            raise PresetError(f"unknown preset key(s) {sorted(unknown)}{where}; allowed: {sorted(_KEYS)}")
        missing = _REQUIRED - set(data)
        if missing:
            raise PresetError(f"missing preset key(s) {sorted(missing)}{where}")
        try:
            topology = Topology.from_dict(data["topology"])
        except (TypeError, ValueError) as exc:
            raise PresetError(f"bad topology{where}: {exc}") from exc
        return cls(
            name=str(data["name"]),
            summary=str(data["summary"]),
            model=str(data["model"]),
            device=str(data["device"]),
            count=int(data["count"]),
            objective=str(data["objective"]),
            topology=topology,
            hosts=int(data.get("hosts") or 1),
            engine=dict(data.get("engine") or {}),
            env={str(k): str(v) for k, v in (data.get("env") or {}).items()},
            stage_env={str(k): str(v) for k, v in (data.get("stage_env") or {}).items()},
            flags=tuple(str(f) for f in (data.get("flags") or ())),
            request_defaults=dict(data.get("request_defaults") or {}),
            executor=data.get("executor"),
            scheduler=data.get("scheduler"),
            additional_config=dict(data.get("additional_config") or {}),
            launch_script=data.get("launch_script"),
            notes=tuple(str(n) for n in (data.get("notes") or ())),
            path=path,
        )

    @property
    def total_topology(self) -> Topology:
        """The whole deployment as one topology: ``hosts x topology.replicas`` replicas of the same shape
        (what throughput estimates count)."""
        from dataclasses import replace

        return replace(self.topology, replicas=self.topology.replicas * self.hosts)

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1

    def launch_scripts(self) -> dict[str | None, str]:
        """Script file name per launch role: ``{None: launch_script}`` for one host; for several,
        ``<stem>_head.sh`` and ``<stem>_replica.sh`` (one per role, each host runs its own)."""
        if not self.launch_script:
            return {}
        if not self.multi_host:
            return {None: self.launch_script}
        stem = self.launch_script[:-3] if self.launch_script.endswith(".sh") else self.launch_script
        return {role: f"{stem}_{role}.sh" for role in ROLES}

    def replace(self, **changes: Any) -> "Preset":
        from dataclasses import replace

        return replace(self, **changes)


def catalog_dir() -> Path:
    """Folder holding the packaged preset files."""
    return Path(str(resources.files("omni_ext.presets").joinpath("catalog")))


def load_preset_file(path: Path) -> Preset:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise PresetError(f"{path}: not valid YAML: {exc}") from exc
    preset = Preset.from_dict(data, path)
    if preset.name != path.stem:
        raise PresetError(f"{path}: name {preset.name!r} must equal the file name {path.stem!r}")
    return preset


def load_catalog(directory: Path | None = None) -> dict[str, Preset]:
    """All presets by name, sorted."""
    folder = directory or catalog_dir()
    presets = [load_preset_file(p) for p in sorted(folder.glob("*.yaml"))]
    return {p.name: p for p in presets}


def get_preset(name: str, directory: Path | None = None) -> Preset:
    """A catalog preset by name, or a preset file by path (``./my-preset.yaml``)."""
    if name.endswith((".yaml", ".yml")) and Path(name).is_file():
        return load_preset_file(Path(name))
    catalog = load_catalog(directory)
    if name in catalog:
        return catalog[name]
    close = [n for n in catalog if name in n] or sorted(catalog)[:10]
    raise PresetError(f"no preset named {name!r}; did you mean: {', '.join(close)}")
