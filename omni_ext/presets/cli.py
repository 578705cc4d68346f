"""``omni-ext presets|plan|serve|doctor``: the launch-preset commands.

Why a separate module: :func:`add_subcommands` is the one call ``omni_ext/cli.py`` makes, so the
preset commands stay out of the foundation's parser code and nothing here imports vLLM unless a
command needs it (``serve`` only execs ``vllm-omni``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from omni_ext.presets.catalog import Preset, PresetError, get_preset, load_catalog
from omni_ext.presets.costs import load_cost_table
from omni_ext.presets.catalog import ROLES
from omni_ext.presets.render import (
    DEFAULT_MASTER_PORT,
    FORMATS,
    RenderOptions,
    format_cmd,
    format_rendered,
    parse_devices,
    render,
)

SCRIPTS_DIR_DEFAULT = "scripts/launch"


def _options(args: argparse.Namespace) -> RenderOptions:
    return RenderOptions(
        model=args.model,
        host=args.host,
        port=args.port,
        devices=parse_devices(args.devices) if args.devices else None,
        deploy_path=getattr(args, "deploy_path", None),
        role=getattr(args, "role", None),
        master_address=getattr(args, "master_address", None),
        master_port=getattr(args, "master_port", None) or DEFAULT_MASTER_PORT,
    )


def _print_warnings(preset: Preset) -> None:
    from omni_ext.presets.validate import require_valid

    for issue in require_valid(preset):
        print(f"warning: {issue.message}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------
# presets


def _cmd_list(args: argparse.Namespace) -> int:
    catalog = load_catalog()
    rows = [p for p in catalog.values()
            if (not args.model or p.model == args.model) and (not args.device or p.device == args.device)]
    if args.json:
        print(json.dumps([{"name": p.name, "model": p.model, "device": p.device, "count": p.count, "hosts": p.hosts,
                           "objective": p.objective, "topology": p.topology.as_dict(), "executor": _executor(p),
                           "launch_script": p.launch_script} for p in rows], indent=2))
        return 0
    width = max((len(p.name) for p in rows), default=10)
    print(f"{'NAME':<{width}}  {'DEVICES':>7}  {'EXECUTOR':<10}  TOPOLOGY")
    for p in rows:
        devices = f"{p.hosts}x{p.count}" if p.multi_host else str(p.count)
        per_host = " per host" if p.multi_host else ""
        print(f"{p.name:<{width}}  {devices:>7}  {_executor(p):<10}  {p.topology.describe()}{per_host}")
    tuned = sum(_executor(p) == "omni-ext" for p in rows)
    if tuned < len(rows):
        print(f"\n{tuned} of {len(rows)} presets run omni-ext's TunedExecutor; the others vLLM-Omni's own executor "
              "(`omni-ext presets show NAME`: its first note says why)")
    return 0


def _executor(preset) -> str:
    """Which executor a preset runs: omni-ext's TunedExecutor, or vLLM-Omni's own."""
    from omni_ext.presets.validate import TUNED_EXECUTOR

    return "omni-ext" if preset.executor == TUNED_EXECUTOR else "vLLM-Omni"


def _cmd_show(args: argparse.Namespace) -> int:
    from omni_ext.presets.planner import preset_estimate
    from omni_ext.presets.render import request_hint
    from omni_ext.presets.validate import check_preset

    preset = get_preset(args.name)
    costs = load_cost_table()
    if preset.path is not None:
        print(f"# {preset.path}")
        print(preset.path.read_text(encoding="utf-8").rstrip())
    device, est = preset_estimate(preset, costs)
    headline, *details = est.lines()
    print(f"\n# estimate on {device.label}: {headline}")
    for line in details:
        print(f"# {line}")
    for line in request_hint(preset, costs):
        print(f"# {line}")
    for issue in check_preset(preset, costs):
        print(f"# {issue}")
    return 0


def _role_args(args: argparse.Namespace) -> str:
    """The multi-host options of ``args`` as they must be repeated in a follow-up command."""
    if not getattr(args, "role", None):
        return ""
    return f" --role {args.role} --master-address {args.master_address}"


def _cmd_render(args: argparse.Namespace) -> int:
    preset = get_preset(args.name)
    _print_warnings(preset)
    rendered = render(preset, _options(args))
    sys.stdout.write(format_rendered(rendered, args.format))
    if args.format == "cmd" and rendered.deploy_path:
        print(f"# the command reads {rendered.deploy_path}: write it with "
              f"`omni-ext presets render {preset.name}{_role_args(args)} --format yaml > {rendered.deploy_path}`",
              file=sys.stderr)
    return 0


def script_text(preset: Preset, role: str | None = None) -> str:
    """The launch script for ``preset`` (and ``role``, on several hosts) as ``presets write-scripts``
    writes it: default options; the master address is the script's ``$MASTER_ADDR``."""
    opts = RenderOptions(role=role, master_address="$MASTER_ADDR" if role else None)
    return format_rendered(render(preset, opts), "script")


def _cmd_write_scripts(args: argparse.Namespace) -> int:
    out = Path(args.directory)
    stale = []
    scripts = [(preset, role, name) for preset in load_catalog().values() for role, name in preset.launch_scripts().items()]
    for preset, role, file_name in scripts:
        path = out / file_name
        text = script_text(preset, role)
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        stale.append(str(path))
        if not args.check:
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            path.chmod(0o755)
    if args.check and stale:
        print("out of date (run `omni-ext presets write-scripts`): " + ", ".join(stale), file=sys.stderr)
        return 1
    for path in stale:
        print(f"wrote {path}")
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    """Static rules, then the installed vLLM-Omni's own parser and config loader, for each preset."""
    from omni_ext.presets.doctor import Check, format_report
    from omni_ext.presets.installed import OmniValidator
    from omni_ext.presets.validate import require_valid

    presets = [get_preset(name) for name in args.names] if args.names else list(load_catalog().values())
    costs = load_cost_table()
    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout as it loads: keep the report (and --json) clean
        validator = OmniValidator()
    try:
        checks = [Check("pipeline registry", "fail", problem, "update omni_ext/models/families.py (topology)")
                  for problem in validator.registry_problems()]
        if not validator.hook_registered:
            checks.append(Check("plugin hook", "fail", "omni-ext's vllm.general_plugins hook did not register its "
                                "pipeline topologies: multi-replica Qwen-Image presets would not start",
                                "reinstall omni-ext so pip records its entry points: pip install -e ."))
        for preset in presets:
            # A multi-host preset is one command per role: each is parsed and resolved as that host would.
            for role in (ROLES if preset.multi_host else (None,)):
                label = f"{preset.name} --role {role}" if role else preset.name
                try:
                    require_valid(preset, costs)
                    model = args.model or validator.stub_model(costs.model(preset.model).pipeline_class)
                    opts = RenderOptions(model=model, role=role, master_address="127.0.0.1" if role else None)
                    summary = validator.validate(render(preset, opts), costs)
                except PresetError as exc:
                    checks.append(Check(label, "fail", str(exc)))
                else:
                    where = f" per host, {preset.hosts} hosts" if role else ""
                    checks.append(Check(label, "ok", f"{summary['channel']}: {preset.topology.describe()}{where}"))
    finally:
        validator.close()
    if args.json:
        print(json.dumps([c.as_dict() for c in checks], indent=2))
    else:
        print(format_report(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0


# ----------------------------------------------------------------------------------------------
# plan


def _matching_presets(model: str, family: str, count: int, topology: object, hosts: int = 1) -> list[str]:
    return [p.name for p in load_catalog().values()
            if p.model == model and p.device == family and p.count == count and p.topology == topology
            and p.hosts == hosts]


def _cmd_plan(args: argparse.Namespace) -> int:
    from omni_ext.presets.planner import plan
    from omni_ext.presets.shared import parse_size

    costs = load_cost_table()
    request = {}
    if args.size:
        request["width"], request["height"] = parse_size(args.size)
    if args.frames:
        request["num_frames"] = args.frames
    if args.steps:
        request["steps"] = args.steps
    use_cfg = {"auto": None, "on": True, "off": False}[args.cfg]
    result = plan(args.model, args.device, args.count, args.objective, requests_use_cfg=use_cfg,
                  request=request or None, costs=costs, hosts=args.hosts)
    device = costs.device(args.device)
    presets = (_matching_presets(result.model, device.family, args.count, result.topology, args.hosts)
               if result.feasible else [])
    if args.json:
        print(json.dumps({**result.as_dict(), "presets": presets}, indent=2))
        return 0 if result.feasible else 1
    spec = costs.model(result.model)
    hosts = f"{args.hosts} hosts x " if args.hosts > 1 else ""
    print(f"{spec.label} on {hosts}{args.count} x {device.label}, objective {args.objective}"
          f"{' (= balanced)' if args.objective == 'auto' else ''}")
    print(f"requests: {'with' if result.requests_use_cfg else 'without'} CFG")
    if not result.feasible:
        print("no topology: " + result.reasons[0])
        return 1
    topo = result.topology
    if args.hosts > 1:
        print(f"topology: {topo.describe()} per host  ({topo.devices} device(s) on each of {args.hosts} hosts, "
              f"{topo.ranks_per_replica} per replica)")
    else:
        print(f"topology: {topo.describe()}  ({topo.devices} device(s), {topo.ranks_per_replica} per replica)")
    print("why:")
    for line in result.reasons:
        print(f"  - {line}")
    print("estimate: " + "\n".join(result.estimate.lines() if result.estimate else ["none"]))
    if result.rank_memory_gb is not None and result.usable_memory_gb is not None:
        print(f"memory: {result.rank_memory_gb:.1f} GB per rank of {result.usable_memory_gb:.1f} GB usable (estimate)")
    if result.env:
        print("env: " + " ".join(f"{k}={v}" for k, v in result.env.items()))
    if presets and args.hosts > 1:
        print("preset: " + ", ".join(presets) + f"  (head: omni-ext serve --preset {presets[0]} --role head "
              f"--master-address ADDR --model PATH; every other host: the same with --role replica)")
    elif presets:
        print("preset: " + ", ".join(presets) + f"  (omni-ext serve --preset {presets[0]} --model PATH)")
    else:
        print("preset: none in the catalog for this model, device family and count")
    return 0


# ----------------------------------------------------------------------------------------------
# serve


def deploy_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "omni-ext" / "deploy"


def _cmd_serve(args: argparse.Namespace) -> int:
    from omni_ext.server_process import vllm_omni_exe

    preset = get_preset(args.preset)
    _print_warnings(preset)
    opts = _options(args)
    opts.executable = vllm_omni_exe() if not args.dry_run else "vllm-omni"
    rendered = render(preset, opts)
    if rendered.deploy is not None:
        path = Path(args.deploy_path) if args.deploy_path else deploy_cache_dir() / f"{preset.name}.yaml"
        rendered.deploy_path = str(path)
        rendered.flags[rendered.flags.index("--deploy-config") + 1] = str(path)
        text = format_rendered(rendered, "yaml")
        if not args.dry_run:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        print(f"# deploy config {path}:\n" + "".join(f"#   {line}\n" for line in text.splitlines() if not line.startswith("#")), end="")
    extra = list(args.extra or [])
    rendered.flags += extra[1:] if extra[:1] == ["--"] else extra
    print(format_cmd(rendered), end="", flush=True)
    if args.dry_run:
        return 0
    env = {**os.environ, **rendered.env}
    os.execvpe(rendered.argv[0], rendered.argv, env)
    return 0  # pragma: no cover - exec does not return


# ----------------------------------------------------------------------------------------------
# doctor


def _cmd_doctor(args: argparse.Namespace) -> int:
    from omni_ext.presets.doctor import collect_facts, format_report, run_checks

    preset = get_preset(args.preset) if args.preset else None
    checks = run_checks(collect_facts(), preset=preset, port=args.port, model=args.model)
    if args.json:
        print(json.dumps([c.as_dict() for c in checks], indent=2))
    else:
        print(format_report(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0


# ----------------------------------------------------------------------------------------------


def _launch_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    p.add_argument("--model", required=model_required, help="model path or hub id (default: the preset's hub id)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--devices", help="physical devices to use, e.g. 0-7 or 0,1,4,5 (sets the visible-devices variable)")
    p.add_argument("--deploy-path", help="where the deploy YAML is (cmd) or is written (serve)")
    p.add_argument("--role", choices=ROLES, help="multi-host presets: this host's role, head (the endpoint) or "
                                                 "replica (headless, every other host)")
    p.add_argument("--master-address", help="multi-host presets: the head host's address as every host reaches it")
    p.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT,
                   help=f"multi-host presets: the head's master port (default {DEFAULT_MASTER_PORT})")


def _guard(func):
    """Turn PresetError / KeyError from user input into one clear line and exit code 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (PresetError, KeyError) as exc:
            print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
            return 2

    return run


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register ``presets``, ``plan``, ``serve`` and ``doctor`` on omni-ext's top-level parser."""
    from omni_ext.presets.planner import OBJECTIVES

    p = sub.add_parser("presets", help="launch presets for vllm-omni serve (list, show, render, validate)")
    psub = p.add_subparsers(dest="presets_command", required=True)
    q = psub.add_parser("list", help="list the catalog")
    q.add_argument("--model", help="only this model (e.g. wan2.1-t2v-1.3b)")
    q.add_argument("--device", help="only this device family (910b, cuda, cpu)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_guard(_cmd_list))
    q = psub.add_parser("show", help="print a preset, its estimate and its checks")
    q.add_argument("name")
    q.set_defaults(func=_guard(_cmd_show))
    q = psub.add_parser("render", help="render a preset as a command, deploy YAML, environment or launch script")
    q.add_argument("name")
    _launch_args(q)
    q.add_argument("--format", choices=FORMATS, default="cmd")
    q.set_defaults(func=_guard(_cmd_render))
    q = psub.add_parser("validate", help="check presets with the installed vLLM-Omni's own parser and config loader "
                                          "(imports vLLM, ~15 s)")
    q.add_argument("names", nargs="*", help="presets or preset files (default: the whole catalog)")
    q.add_argument("--model", help="model folder to resolve with (default: a stub folder holding only model_index.json)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_guard(_cmd_validate))
    q = psub.add_parser("write-scripts", help="(re)generate the launch scripts of the presets that name one")
    q.add_argument("directory", nargs="?", default=SCRIPTS_DIR_DEFAULT)
    q.add_argument("--check", action="store_true", help="only report scripts that differ; exit 1 if any")
    q.set_defaults(func=_guard(_cmd_write_scripts))

    p = sub.add_parser("plan", help="choose replicas x CFG x Ulysses x TP for a model on N devices, with estimates")
    p.add_argument("--model", required=True, help="e.g. wan2.1-t2v-1.3b, wan2.1-t2v-14b, wan2.2-t2v-a14b, qwen-image")
    p.add_argument("--device", required=True, help="e.g. 910b3, 910b4, 4090, h100, cpu")
    p.add_argument("--count", type=int, required=True, help="number of devices (per host with --hosts)")
    p.add_argument("--hosts", type=int, default=1, help="hosts with --count devices each, one endpoint "
                                                        "(a head and headless replica hosts)")
    p.add_argument("--objective", choices=OBJECTIVES, default="auto")
    p.add_argument("--cfg", choices=("auto", "on", "off"), default="auto",
                   help="whether requests run CFG (auto: the model's default request; Qwen-Image only with negative_prompt)")
    p.add_argument("--size", help="request size WxH (default: the model's reference request)")
    p.add_argument("--frames", type=int, help="video frames per request")
    p.add_argument("--steps", type=int, help="denoising steps per request")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_guard(_cmd_plan))

    p = sub.add_parser("serve", help="run vllm-omni serve --omni with a preset's flags and environment")
    p.add_argument("--preset", required=True)
    _launch_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more vllm-omni serve flags")
    p.set_defaults(func=_guard(_cmd_serve))

    p = sub.add_parser("doctor", help="check this host for a preset: versions, CANN, devices, entry points, port")
    p.add_argument("--preset", help="preset to check the host against")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", help="model folder to check")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_guard(_cmd_doctor))

