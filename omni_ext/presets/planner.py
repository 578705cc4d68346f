"""Choose a topology (replicas x CFG x Ulysses x TP) for a model on N devices and estimate its cost.

Why: the launch mistakes users make are topology mistakes (TP for a DiT on NPU, "DP" that makes every
rank compute the same request, CFG parallel for requests that run no CFG). The rules here are the
ones the measurements support:

* CFG 2 only when the requests run CFG (otherwise the second rank idles);
* never TP for a DiT unless the weights do not fit one device (TP2 = 1.12x on 910B, MindIE-SD);
* replicas (deploy-YAML ``num_replicas``), not intra-engine DP, for throughput;
* the estimate starts from a measured anchor and lists every extrapolation step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from omni_ext.presets.catalog import Preset
from omni_ext.presets.costs import Anchor, CostTable, DeviceSpec, Figure, ModelSpec, Topology, load_cost_table
from omni_ext.presets.shared import planner_request, requests_use_cfg, tuned_refusal

OBJECTIVES = ("latency", "throughput", "balanced", "auto")
_AXES = (("cfg", "cfg"), ("u", "ulysses"), ("r", "ring"), ("tp", "tp"))
_TIE = {"latency": 0.02, "throughput": 0.02, "balanced": 0.05}


@dataclass
class Estimate:
    """Latency of one request (seconds) and steady-state throughput (requests per hour)."""

    latency_s: float | None
    throughput_per_hour: float | None
    basis: list[str] = field(default_factory=list)
    extrapolated: list[str] = field(default_factory=list)

    @property
    def measured(self) -> bool:
        return self.latency_s is not None and not self.extrapolated

    def lines(self) -> list[str]:
        """The estimate as ``plan`` and ``presets show`` print it: a headline, then where each part came from.

        The headline says ``[measured]`` only when no step was extrapolated, so a user can tell a
        measurement from a guess at a glance.
        """
        if self.latency_s is None:
            return ["none (" + "; ".join(self.extrapolated) + ")"]
        tag = "measured" if self.measured else "EXTRAPOLATED"
        return [f"{self.latency_s:.0f} s per request, {self.throughput_per_hour or 0:.1f} requests/hour [{tag}]",
                *(f"  from: {line}" for line in self.basis),
                *(f"  extrapolated: {line}" for line in self.extrapolated)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "latency_s": None if self.latency_s is None else round(self.latency_s, 1),
            "throughput_per_hour": None if self.throughput_per_hour is None else round(self.throughput_per_hour, 1),
            "measured": self.measured,
            "basis": self.basis,
            "extrapolated": self.extrapolated,
        }


@dataclass
class Plan:
    model: str
    device: str
    count: int
    objective: str
    requests_use_cfg: bool
    topology: Topology | None
    estimate: Estimate | None
    reasons: list[str]
    rank_memory_gb: float | None
    usable_memory_gb: float | None
    env: dict[str, str]
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    #: Hosts with ``count`` devices each; ``topology`` is per host (every host runs the same replicas).
    hosts: int = 1
    #: One host's groups as ``"replicas"`` or ``"dp-groups"`` (one TunedExecutor with data_parallel_size);
    #: None where the TunedExecutor does not apply or there is one group.
    layout: str | None = None

    @property
    def feasible(self) -> bool:
        return self.topology is not None

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "count": self.count,
            "objective": self.objective,
            "requests_use_cfg": self.requests_use_cfg,
            "feasible": self.feasible,
            "topology": None if self.topology is None else self.topology.as_dict(),
            "estimate": None if self.estimate is None else self.estimate.as_dict(),
            "reasons": self.reasons,
            "rank_memory_gb": None if self.rank_memory_gb is None else round(self.rank_memory_gb, 1),
            "usable_memory_gb": None if self.usable_memory_gb is None else round(self.usable_memory_gb, 1),
            "env": self.env,
            "alternatives": self.alternatives,
            "hosts": self.hosts,
            "layout": self.layout,
        }


# ----------------------------------------------------------------------------------------------
# speed-ups


def _axes(topo: Topology) -> dict[str, int]:
    return {short: getattr(topo, attr) for short, attr in _AXES if getattr(topo, attr) > 1}


def _parse_signature(sig: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in sig.split("."):
        for short, _ in sorted(_AXES, key=lambda a: -len(a[0])):
            if part.startswith(short) and part[len(short):].isdigit():
                out[short] = int(part[len(short):])
                break
        else:
            raise ValueError(f"bad speed-up signature {sig!r}")
    return out


def _axis_speedup(table: dict[str, Figure], short: str, degree: int) -> tuple[float, str, bool]:
    """Speed-up of one parallel axis alone: measured at degree 2, power-law beyond."""
    two = table.get(f"{short}2") or (table.get("u2") if short == "r" else None)
    if two is None:
        return 1.0, f"{short}{degree}: no measurement on this device family; assumed no speed-up", False
    stand_in = " (Ulysses figure used for Ring)" if short == "r" and f"{short}2" not in table else ""
    if degree == 2:
        return two.value, f"{short}2 = {two.value:g}x ({two.source}){stand_in}", two.measured and not stand_in
    value = degree * (two.value / 2.0) ** math.log2(degree)
    return value, f"{short}{degree} = {value:.2f}x, extended from {short}2 = {two.value:g}x ({two.source}){stand_in}", False


def speedup(costs: CostTable, family: str, topo: Topology) -> tuple[float, list[str], bool]:
    """End-to-end speed-up of ``topo`` over one device: (value, notes, measured)."""
    want = _axes(topo)
    if not want:
        return 1.0, [], True
    table = costs.speedups.get(family, {})
    best_key, best_axes = None, {}
    for key in table:
        axes = _parse_signature(key)
        if all(want.get(a) == d for a, d in axes.items()) and len(axes) > len(best_axes):
            best_key, best_axes = key, axes
    value, notes = 1.0, []
    measured = True
    if best_key is not None:
        fig = table[best_key]
        value *= fig.value
        notes.append(f"{best_key} = {fig.value:g}x ({fig.source})")
        measured = fig.measured
    rest = {a: d for a, d in want.items() if a not in best_axes}
    for short, degree in rest.items():
        v, note, m = _axis_speedup(table, short, degree)
        value *= v
        notes.append(note)
        measured = measured and m
    if len(notes) > 1:
        measured = False  # a product of separately measured factors is itself an extrapolation
    return value, notes, measured


# ----------------------------------------------------------------------------------------------
# latency estimate


def _anchors_for(costs: CostTable, model: str, device: str) -> list[Anchor]:
    return [a for a in costs.anchors if a.model == model and a.device == device]


def _device_ratio(costs: CostTable, target: str, source: str) -> tuple[float, str] | None:
    """Latency ratio target/source from a model measured on both at one device."""
    for model in costs.models:
        a = [x for x in _anchors_for(costs, model, target) if x.topology.signature() == "single"]
        b = [x for x in _anchors_for(costs, model, source) if x.topology.signature() == "single"]
        if a and b:
            return a[0].latency_s / b[0].latency_s, f"{model}: {a[0].latency_s:g} s on {target} vs {b[0].latency_s:g} s on {source}"
    return None


def _siblings(costs: CostTable, model: ModelSpec) -> list[tuple[str, float, str]]:
    """Models whose measurements stand for ``model``: itself, then those marked ``cost_like`` either way."""
    out = [(model.key, 1.0, "")]
    if model.cost_like:
        out.append((model.cost_like["model"], float(model.cost_like.get("factor", 1.0)), model.cost_like.get("why", "")))
    for other in costs.models.values():
        if other.cost_like and other.cost_like["model"] == model.key:
            out.append((other.key, 1.0 / float(other.cost_like.get("factor", 1.0)), other.cost_like.get("why", "")))
    return out


def _find_anchors(costs: CostTable, model: ModelSpec, device: DeviceSpec, est: Estimate) -> tuple[list[Anchor], float]:
    """Anchors to start from, and the factor that maps them to (model, device).

    Preference: this model on this device; a same-cost sibling model on this device; either on a
    device of the same speed; finally another device scaled by a ratio measured on some model.
    """
    siblings = _siblings(costs, model)

    def note_sibling(key: str, why: str) -> None:
        if key != model.key:
            est.extrapolated.append(f"model: no {model.label} measurement here; costed like {key} ({why})")

    for dev, speed_note in ((device.key, None), (device.speed_like, f"speed assumed equal to {device.speed_like}")):
        if dev is None:
            continue
        for key, factor, why in siblings:
            anchors = _anchors_for(costs, key, dev)
            if anchors:
                note_sibling(key, why)
                if speed_note:
                    est.extrapolated.append(f"device: no {device.label} measurement; {speed_note}")
                return anchors, factor
    target = device.speed_like or device.key
    for key, factor, why in siblings:
        for source in sorted({a.device for a in costs.anchors if a.model == key}):
            ratio = _device_ratio(costs, target, source)
            if ratio is not None:
                note_sibling(key, why)
                est.extrapolated.append(f"device: no {device.label} measurement; scaled from {source} by {ratio[0]:.2f} ({ratio[1]})")
                return _anchors_for(costs, key, source), factor * ratio[0]
    return [], 1.0


def _request_factor(model: ModelSpec, request: dict[str, Any] | None, est: Estimate) -> float:
    if not request:
        return 1.0
    factor = 1.0
    steps = int(request.get("steps", model.reference["steps"]))
    if steps != model.reference["steps"]:
        factor *= steps / float(model.reference["steps"])
        est.extrapolated.append(f"request: {steps} steps scaled linearly from {model.reference['steps']}")
    r = model.tokens(request) / model.tokens(model.reference)
    if abs(r - 1.0) > 1e-9:
        f = model.attention_share
        shape = (1 - f) * r + f * r * r
        factor *= shape
        est.extrapolated.append(
            f"request: {r:.2f}x the reference tokens; cost scaled by {shape:.2f} (attention share {f:g}, from the architecture)"
        )
    return factor


def estimate(
    model: ModelSpec,
    device: DeviceSpec,
    topo: Topology,
    *,
    requests_use_cfg: bool | None = None,
    request: dict[str, Any] | None = None,
    costs: CostTable | None = None,
) -> Estimate:
    """Latency and throughput of ``topo``; ``basis`` names the anchors, ``extrapolated`` every leap."""
    costs = costs or load_cost_table()
    use_cfg = model.uses_cfg if requests_use_cfg is None else requests_use_cfg
    est = Estimate(None, None)
    anchors, factor = _find_anchors(costs, model, device, est)
    if not anchors:
        est.extrapolated.append(f"no measurement of {model.label} (or a model costed like it) on any comparable device")
        return est
    family = device.family
    exact = [a for a in anchors if a.topology.signature() == topo.signature()]
    if exact:
        anchor = exact[0]
        latency = anchor.latency_s
        est.basis.append(f"{anchor.latency_s:g} s at {anchor.topology.signature()} on {anchor.device} ({anchor.source})")
    else:
        singles = [a for a in anchors if a.topology.signature() == "single"]
        anchor = (singles or anchors)[0]
        s_from, _, _ = speedup(costs, family, anchor.topology)
        s_to, notes, _ = speedup(costs, family, topo)
        latency = anchor.latency_s * s_from / s_to
        est.basis.append(f"{anchor.latency_s:g} s at {anchor.topology.signature()} on {anchor.device} ({anchor.source})")
        est.extrapolated.append(f"topology: {topo.signature()} not measured; speed-up {s_to / s_from:.2f}x from: " + "; ".join(notes))
    anchor_cfg = model.uses_cfg if anchor.cfg_on is None else anchor.cfg_on
    if anchor_cfg != use_cfg:
        scale = 2.0 if use_cfg else 0.5
        factor *= scale
        est.extrapolated.append(
            f"cfg: anchor ran {'with' if anchor_cfg else 'without'} CFG, requests run {'with' if use_cfg else 'without'}: "
            f"x{scale:g} transformer passes per step"
        )
    latency *= factor * _request_factor(model, request, est)
    rep = costs.replica_factor(family, topo.replicas)
    est.latency_s = latency
    est.throughput_per_hour = topo.replicas * rep.value * 3600.0 / latency
    if topo.replicas > 1:
        note = f"{topo.replicas} replicas at {rep.value:g} efficiency ({rep.source})"
        # Only a replica figure measured on this device family is a measurement for this estimate.
        on_family = family in costs.replica_efficiency and rep.measured
        (est.basis if on_family else est.extrapolated).append(f"throughput: {note}")
    return est



def preset_estimate(preset: Preset, costs: CostTable | None = None) -> tuple[DeviceSpec, Estimate]:
    """The planner's estimate for ``preset`` on its family's reference device, with its own request."""
    costs = costs or load_cost_table()
    device = costs.reference_device(preset.device)
    # Every host's replicas serve requests: throughput counts them all; latency is one replica's.
    est = estimate(costs.model(preset.model), device, preset.total_topology, requests_use_cfg=requests_use_cfg(preset, costs),
                   request=planner_request(preset), costs=costs)
    return device, est

# ----------------------------------------------------------------------------------------------
# topology choice


def _tp_needed(costs: CostTable, model: ModelSpec, device: DeviceSpec, count: int) -> int | None:
    usable = costs.usable_memory_gb(device)
    for tp in (1, 2, 4, 8):
        if tp > count:
            return None
        if usable is None or model.rank_memory_gb(tp) <= usable:
            return tp
    return None


def _ulysses_options(costs: CostTable, model: ModelSpec, family: str) -> list[int]:
    if "u2" not in costs.speedups.get(family, {}):
        return [1]
    return [d for d in (1, 2, 4, 8) if model.heads % d == 0]


def _better(objective: str, a: tuple[Topology, Estimate], b: tuple[Topology, Estimate]) -> bool:
    """Is candidate ``a`` better than ``b`` for ``objective``?"""
    la, lb = a[1].latency_s or math.inf, b[1].latency_s or math.inf
    ta, tb = a[1].throughput_per_hour or 0.0, b[1].throughput_per_hour or 0.0
    tie = _TIE[objective]
    if objective == "latency":
        if abs(la - lb) > tie * min(la, lb):
            return la < lb
        return ta > tb
    if abs(ta - tb) > tie * max(ta, tb):
        return ta > tb
    return la < lb


def _fmt_s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def plan(
    model_name: str,
    device_name: str,
    count: int,
    objective: str = "auto",
    *,
    requests_use_cfg: bool | None = None,
    request: dict[str, Any] | None = None,
    costs: CostTable | None = None,
    hosts: int = 1,
) -> Plan:
    """Pick the topology for ``objective`` and explain each axis in one line.

    With ``hosts > 1`` the topology is per host (``count`` devices each): vLLM-Omni 0.30's
    multi-machine mode runs whole replicas on each host behind one head, so a request never spans
    hosts; the choice is the one-host choice, and throughput counts every host's replicas.
    """
    costs = costs or load_cost_table()
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}")
    if count < 1:
        raise ValueError("count must be >= 1")
    if hosts < 1:
        raise ValueError("hosts must be >= 1")
    goal = "balanced" if objective == "auto" else objective
    model = costs.model(model_name)
    device = costs.device(device_name)
    family = device.family
    use_cfg = model.uses_cfg if requests_use_cfg is None else requests_use_cfg
    usable = costs.usable_memory_gb(device)
    tp = _tp_needed(costs, model, device, count)
    reasons: list[str] = []
    if tp is None:
        biggest = max(t for t in (1, 2, 4, 8) if t <= count)
        reasons.append(
            f"does not fit: {model.rank_memory_gb(biggest):.1f} GB per rank even with TP {biggest} > {usable:.1f} GB usable "
            f"on {device.label}; use more devices, a larger device, or vLLM-Omni offload (--enable-layerwise-offload)"
        )
        return Plan(model.key, device.key, count, objective, use_cfg, None, None, reasons,
                    model.rank_memory_gb(biggest), usable, {}, hosts=hosts)

    candidates: list[tuple[Topology, Estimate]] = []
    for cfg in ((1, 2) if use_cfg else (1,)):
        for u in _ulysses_options(costs, model, family):
            group = cfg * u * tp
            if group > count:
                continue
            topo = Topology(replicas=count // group, cfg=cfg, ulysses=u, tp=tp)
            everywhere = Topology(replicas=hosts * topo.replicas, cfg=cfg, ulysses=u, tp=tp)
            candidates.append((topo, estimate(model, device, everywhere, requests_use_cfg=use_cfg, request=request,
                                              costs=costs)))
    best = candidates[0]
    for cand in candidates[1:]:
        if _better(goal, cand, best):
            best = cand
    topo, est = best
    reasons.extend(_explain(costs, model, device, count, goal, use_cfg, topo, est, candidates))
    layout = _layout(costs, model, topo, reasons)
    if hosts > 1:
        reasons.append(_hosts_line(hosts, topo))
    env = costs.timeout_env(est.latency_s)
    alternatives = [
        {"topology": t.as_dict(), "latency_s": None if e.latency_s is None else round(e.latency_s, 1),
         "throughput_per_hour": None if e.throughput_per_hour is None else round(e.throughput_per_hour, 1)}
        for t, e in candidates if t != topo
    ]
    return Plan(model.key, device.key, count, objective, use_cfg, topo, est, reasons,
                model.rank_memory_gb(tp), usable, env, alternatives, hosts=hosts, layout=layout)


def _layout(costs: CostTable, model: ModelSpec, topo: Topology, reasons: list[str]) -> str | None:
    """Where omni-ext's TunedExecutor runs the topology: say so, and for several groups on one host, say
    whether they are replicas or one executor's data-parallel groups and why (``one_host_layout``)."""
    refusal = tuned_refusal(model, topo)
    if refusal is not None:
        reasons.append(f"Executor: vLLM-Omni's own; omni-ext's TunedExecutor does not apply: {refusal}")
        return None
    if topo.replicas == 1:
        reasons.append("Executor: omni-ext's TunedExecutor (--distributed-executor-backend "
                       "omni_ext.executor.TunedExecutor): its scheduler orders the queue and a CFG-free request "
                       "takes one rank of a CFG group")
        return None
    choice = costs.one_host_layout
    reasons.append(f"Executor: omni-ext's TunedExecutor; {choice.why(topo.replicas)}")
    return choice.choice


def _hosts_line(hosts: int, topo: Topology) -> str:
    total = hosts * topo.replicas
    return (f"Hosts {hosts}: one endpoint, the head (--stage-id 0, {topo.replicas} local replica(s)), and {hosts - 1} "
            f"headless replica host(s) (--headless, {topo.replicas} each): {total} replicas; the head keeps the queue "
            f"and binds each request to a replica when it can start there, and a lost host fails only its own jobs; "
            f"a replica never spans hosts, so latency is one host's and throughput {hosts}x")


def _explain(
    costs: CostTable,
    model: ModelSpec,
    device: DeviceSpec,
    count: int,
    goal: str,
    use_cfg: bool,
    topo: Topology,
    est: Estimate,
    candidates: list[tuple[Topology, Estimate]],
) -> list[str]:
    """One line per axis saying why it has the value it has."""
    table = costs.speedups.get(device.family, {})
    lines: list[str] = []

    def other(**change: int) -> tuple[Topology, Estimate] | None:
        for t, e in candidates:
            if all(getattr(t, k) == v for k, v in change.items()) and t != topo:
                return t, e
        return None

    def compare(alt: tuple[Topology, Estimate] | None) -> str:
        if alt is None:
            return ""
        t, e = alt
        return (f" ({t.describe()}: {_fmt_s(e.latency_s)} per request, {e.throughput_per_hour or 0:.1f}/h "
                f"vs {_fmt_s(est.latency_s)}, {est.throughput_per_hour or 0:.1f}/h)")

    # CFG
    if not use_cfg:
        hint = " (send negative_prompt and plan with --cfg on to use CFG parallel)" if model.cfg_rule == "qwen-image" else ""
        lines.append(f"CFG 1: the requests run no CFG, so CFG parallel would leave its second device idle{hint}")
    elif topo.cfg == 2:
        fig = table.get("cfg2")
        src = f"{fig.value:g}x, {fig.source}" if fig else "no measurement on this family"
        lines.append(f"CFG 2: the requests run CFG (two passes per step); one pass per device ({src}){compare(other(cfg=1, ulysses=topo.ulysses))}")
    elif other(cfg=2) is None:
        lines.append(f"CFG 1: the requests run CFG, but CFG parallel needs {2 * topo.tp} devices per replica "
                     f"and there are {count}")
    else:
        lines.append(f"CFG 1: the requests run CFG, but for {goal} the devices do better elsewhere{compare(other(cfg=2))}")
    # Ulysses
    if topo.ulysses > 1:
        lines.append(f"Ulysses {topo.ulysses}: splits each pass's sequence over {topo.ulysses} devices "
                     f"(all-to-all in attention only){compare(other(cfg=topo.cfg, ulysses=1))}")
    else:
        bigger = other(cfg=topo.cfg, ulysses=2)
        if bigger is None and model.heads % 2:
            lines.append(f"Ulysses 1: {model.heads} attention heads do not split over 2 devices")
        elif bigger is None and "u2" not in table:
            lines.append("Ulysses 1: no Ulysses measurement on this device family")
        elif bigger is None:
            lines.append("Ulysses 1: no devices left for sequence parallelism")
        else:
            lines.append(f"Ulysses 1: sequence parallelism does not pay off for {goal}{compare(bigger)}")
    # TP
    usable = costs.usable_memory_gb(device)
    if topo.tp > 1:
        lines.append(f"TP {topo.tp}: required to fit: {model.rank_memory_gb(1):.1f} GB per rank without TP > {usable:.1f} GB usable; "
                     f"{model.rank_memory_gb(topo.tp):.1f} GB with TP {topo.tp} (TP costs per-layer all-reduce, used only to fit)")
    else:
        mem = f"{model.rank_memory_gb(1):.1f} GB per rank" + (f" of {usable:.1f} GB usable" if usable else "")
        lines.append(f"TP 1: the weights fit one device ({mem}); TP on a DiT adds per-layer all-reduce "
                     f"(TP2 = 1.12x on 910B, MindIE-SD; no gain for Qwen-Image-2512, vllm-omni #3188)")
    # replicas
    if topo.replicas > 1:
        rep = costs.replica_factor(device.family, topo.replicas)
        lines.append(f"Replicas {topo.replicas}: independent engines (deploy YAML num_replicas, never --data-parallel-size) "
                     f"serve {topo.replicas} requests at once, {topo.replicas * rep.value:.2f}x throughput")
    else:
        lines.append(f"Replicas 1: all {topo.ranks_per_replica} device(s) work on each request")
    idle = count - topo.devices
    if idle:
        lines.append(f"{idle} device(s) left idle: no topology here uses them ({topo.ranks_per_replica} per replica)")
    return lines
