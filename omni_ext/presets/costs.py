"""The cost table (``costs.yaml``) as typed objects.

Why a data file: every estimate the planner prints must be traceable to a published or
user-reported measurement. Keeping the numbers and their sources in one human-readable file lets a
reviewer check them without reading code, and lets new measurements be added without code changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from omni_ext.models.families import FAMILIES, CfgRule, ModelFamily, family_of
from omni_ext.scheduler.layout import Parallel


@dataclass(frozen=True)
class Topology(Parallel):
    """How one deployment uses its devices: ``replicas`` engines, each ``cfg x ulysses x ring x tp``
    ranks (the parallel sizes of one replica: :class:`omni_ext.scheduler.layout.Parallel`)."""

    replicas: int = 1

    @property
    def ranks_per_replica(self) -> int:
        return self.cfg * self.ulysses * self.ring * self.tp

    @property
    def devices(self) -> int:
        return self.replicas * self.ranks_per_replica

    def signature(self) -> str:
        """Latency-relevant key such as ``cfg2.u4`` (``single`` for one rank); replicas excluded."""
        parts = [f"{name}{deg}" for name, deg in (("cfg", self.cfg), ("u", self.ulysses), ("r", self.ring), ("tp", self.tp)) if deg > 1]
        return ".".join(parts) or "single"

    def describe(self) -> str:
        text = f"{self.replicas} replica{'s' if self.replicas != 1 else ''} x CFG {self.cfg} x Ulysses {self.ulysses}"
        if self.ring > 1:
            text += f" x Ring {self.ring}"
        text += f" x TP {self.tp}"
        if self.vae_patch > 1:
            text += f" (+ VAE patch parallel {self.vae_patch})"
        return text

    def as_dict(self) -> dict[str, int]:
        return {"replicas": self.replicas, "cfg": self.cfg, "ulysses": self.ulysses, "ring": self.ring, "tp": self.tp, "vae_patch": self.vae_patch}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "Topology":
        data = dict(data or {})
        unknown = set(data) - set(cls().as_dict())
        if unknown:
            raise ValueError(f"unknown topology key(s) {sorted(unknown)}; allowed: {sorted(cls().as_dict())}")
        return cls(**{k: int(v) for k, v in data.items()})


@dataclass(frozen=True)
class Figure:
    """One number with where it came from."""

    value: float
    source: str
    measured: bool = True


@dataclass(frozen=True)
class ModelSpec:
    key: str
    label: str
    hf_id: str | None
    pipeline_class: str
    kind: str  # "video" | "image"
    dit_gb: float
    other_gb: float
    activation_gb: float
    heads: int
    uses_cfg: bool
    attention_share: float
    reference: dict[str, Any]
    cost_like: dict[str, Any] | None = None

    @property
    def family(self) -> ModelFamily | None:
        """The family-table entry of ``pipeline_class``: what omni-ext knows about the pipeline, kept in one place."""
        return family_of(self.pipeline_class)

    @property
    def cfg_rule(self) -> CfgRule:
        """How a request decides whether it runs CFG (``"qwen-image"``: only with a negative prompt)."""
        family = self.family
        return family.cfg_rule if family is not None else "always"

    def rank_memory_gb(self, tp: int) -> float:
        """Memory one rank holds: the transformer split by TP, the rest replicated."""
        return self.dit_gb / max(1, tp) + self.other_gb + self.activation_gb

    def tokens(self, request: dict[str, Any]) -> float:
        """Latent tokens of a request (fields it leaves out: the reference request's), by the family
        table's formula (:meth:`ModelFamily.latent_tokens`; a model without a family counts like Wan)."""
        width = float(request.get("width", self.reference["width"]))
        height = float(request.get("height", self.reference["height"]))
        frames = request.get("num_frames", self.reference["num_frames"]) if self.kind == "video" else 1
        return (self.family or FAMILIES[0]).latent_tokens(width, height, frames)


@dataclass(frozen=True)
class DeviceSpec:
    key: str
    family: str
    memory_gb: float | None
    label: str
    speed_like: str | None = None


@dataclass(frozen=True)
class Anchor:
    model: str
    device: str
    topology: Topology
    latency_s: float
    cfg_on: bool | None
    source: str


@dataclass(frozen=True)
class LayoutChoice:
    """N replicas or one TunedExecutor with N data-parallel groups, on one host (``one_host_layout``).

    Why a table entry and not a rule in code: the choice must follow figures measured on a real host
    (``omni-ext bench serving``); until both are there the ``default`` stands, for ``reason``.
    """

    source: str
    replicas_per_hour: float | None
    dp_groups_per_hour: float | None
    default: str = "replicas"
    reason: str = ""
    tie: float = 0.02

    @property
    def measured(self) -> bool:
        return self.replicas_per_hour is not None and self.dp_groups_per_hour is not None

    @property
    def choice(self) -> str:
        """``"replicas"`` or ``"dp-groups"``: the measured winner (replicas within ``tie``), else ``default``."""
        if not self.measured:
            return self.default
        assert self.replicas_per_hour is not None and self.dp_groups_per_hour is not None
        if self.dp_groups_per_hour > self.replicas_per_hour * (1.0 + self.tie):
            return "dp-groups"
        return "replicas"

    def why(self, groups: int) -> str:
        """The planner's one line: which layout, the figures (or that they are a placeholder) and the reason."""
        if self.measured:
            figures = (f"measured {self.replicas_per_hour:g}/h as replicas vs {self.dp_groups_per_hour:g}/h as "
                       f"data-parallel groups ({self.source})")
        else:
            figures = f"not measured yet: PLACEHOLDER for {self.source}, so the default stands"
        if self.choice == "replicas":
            head = (f"{groups} replicas, each its own TunedExecutor, not one TunedExecutor with data_parallel_size "
                    f"{groups}")
        else:
            head = f"one TunedExecutor with data_parallel_size {groups}, not {groups} replicas"
        return f"{head}: {figures}; {self.reason}"


_NO_LAYOUT = LayoutChoice(source="no one_host_layout entry in costs.yaml", replicas_per_hour=None,
                          dp_groups_per_hour=None, reason="replicas isolate failures")


@dataclass(frozen=True)
class CostTable:
    memory_headroom: float
    timeouts: dict[str, Any]
    families: dict[str, dict[str, Any]]
    devices: dict[str, DeviceSpec]
    device_aliases: dict[str, str]
    models: dict[str, ModelSpec]
    anchors: tuple[Anchor, ...]
    speedups: dict[str, dict[str, Figure]]
    replica_efficiency: dict[str, dict[int, Figure]] = field(default_factory=dict)
    one_host_layout: LayoutChoice = _NO_LAYOUT

    def device(self, name: str) -> DeviceSpec:
        key = self.device_aliases.get(str(name).lower(), str(name).lower())
        if key not in self.devices:
            raise KeyError(f"unknown device {name!r}; known: {', '.join(sorted(self.devices))} (aliases: {', '.join(sorted(self.device_aliases))})")
        return self.devices[key]

    def model(self, name: str) -> ModelSpec:
        if name not in self.models:
            raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(self.models))}")
        return self.models[name]

    def platform(self, family: str) -> str:
        return str(self.families[family]["platform"])

    def reference_device(self, family: str) -> DeviceSpec:
        return self.devices[self.families[family]["reference_device"]]

    def usable_memory_gb(self, device: DeviceSpec) -> float | None:
        return None if device.memory_gb is None else device.memory_gb * self.memory_headroom

    def replica_factor(self, family: str, replicas: int) -> Figure:
        """Throughput efficiency of ``replicas`` engines (1.0 for one)."""
        if replicas <= 1:
            return Figure(1.0, "one replica")
        table = self.replica_efficiency.get(family) or self.replica_efficiency["default"]
        if replicas in table:
            return table[replicas]
        known = max(k for k in table if k <= replicas) if any(k <= replicas for k in table) else min(table)
        base = table[known]
        return Figure(base.value, f"{base.source}; {replicas} replicas extended from {known}", measured=False)

    def timeout_env(self, latency_s: float | None) -> dict[str, str]:
        """The timeout variables to raise for a request of ``latency_s`` (empty when the default is enough)."""
        if latency_s is None:
            return {}
        t = self.timeouts
        if latency_s <= t["raise_above"] * t["default_s"]:
            return {}
        step = int(t["round_to"])
        value = int(math.ceil(latency_s * float(t["factor"]) / step) * step)
        return {name: str(max(value, int(t["default_s"]))) for name in t["variables"]}


def _figure(data: dict[str, Any]) -> Figure:
    return Figure(float(data["value"]), str(data["source"]), bool(data.get("measured", True)))


def parse_cost_table(raw: dict[str, Any]) -> CostTable:
    """Build a :class:`CostTable` from the YAML mapping (raises on a malformed table)."""
    # Keys such as 4090 parse as YAML integers; names are strings everywhere else.
    devices = {str(k): DeviceSpec(key=str(k), **{**v, "speed_like": v.get("speed_like")}) for k, v in raw["devices"].items()}
    models = {k: ModelSpec(key=k, **v) for k, v in raw["models"].items()}
    anchors = []
    for row in raw["anchors"]:
        row = dict(row, device=str(row["device"]))
        topo = Topology.from_dict({k: row.pop(k) for k in ("cfg", "ulysses", "ring", "tp") if k in row})
        anchors.append(Anchor(topology=topo, **row))
    for a in anchors:
        if a.model not in models or a.device not in devices:
            raise ValueError(f"anchor names unknown model/device: {a.model}/{a.device}")
    speedups = {fam: {sig: _figure(fig) for sig, fig in table.items()} for fam, table in raw["speedups"].items()}
    replica = {fam: {int(n): _figure(fig) for n, fig in table.items()} for fam, table in raw["replica_efficiency"].items()}
    return CostTable(
        memory_headroom=float(raw["memory_headroom"]),
        timeouts=dict(raw["timeouts"]),
        families=dict(raw["families"]),
        devices=devices,
        device_aliases={str(k).lower(): str(v) for k, v in raw.get("device_aliases", {}).items()},
        models=models,
        anchors=tuple(anchors),
        speedups=speedups,
        replica_efficiency=replica,
        one_host_layout=_layout(raw.get("one_host_layout")),
    )


def _layout(data: dict[str, Any] | None) -> LayoutChoice:
    if not data:
        return _NO_LAYOUT
    rate = lambda key: None if data.get(key) is None else float(data[key])  # noqa: E731
    choice = LayoutChoice(source=str(data["source"]), replicas_per_hour=rate("replicas_per_hour"),
                          dp_groups_per_hour=rate("dp_groups_per_hour"), default=str(data.get("default", "replicas")),
                          reason=str(data.get("reason", "")))
    if choice.default not in ("replicas", "dp-groups"):
        raise ValueError(f"one_host_layout.default must be replicas or dp-groups, got {choice.default!r}")
    return choice


@lru_cache(maxsize=1)
def load_cost_table() -> CostTable:
    """The packaged ``costs.yaml``."""
    text = resources.files("omni_ext.presets").joinpath("costs.yaml").read_text(encoding="utf-8")
    return parse_cost_table(yaml.safe_load(text))
