"""The Ascend stack paired with each vLLM release, and the CANN version installed on this host.

Why: on Ascend, vLLM, vllm-ascend and CANN come as one release train. vllm-ascend X.Y plugs into
vLLM X.Y's internal API only and is built against one CANN release; a mismatch surfaces as import
errors or missing NPU operators far from the cause. The pairing is data (``ascend_stack.yaml``)
so that ``omni-ext doctor`` checks exactly what the README tells users to install.

CANN records its version in ``<toolkit>/<arch>-linux/ascend_toolkit_install.info`` (a
``version=...`` line). The toolkit is where ``set_env.sh`` points ``ASCEND_TOOLKIT_HOME`` /
``ASCEND_HOME_PATH`` once sourced, else at the default install paths
(``/usr/local/Ascend/ascend-toolkit/latest``, or ``/usr/local/Ascend/cann`` in the newer layout).
Nothing here imports torch_npu or vLLM.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import yaml

#: The package indexes of vllm-ascend's own pip install guide (docs/source/getting_started/installation/
#: install_vllm_ascend.inc.md in the 0.30.0rc2 sdist): PyTorch's CPU wheels, so that pip cannot pull a
#: CUDA torch over the NPU stack, and Huawei's mirror for torch-npu and the Ascend packages.
ASCEND_PIP_INDEXES = ("https://download.pytorch.org/whl/cpu/", "https://mirrors.huaweicloud.com/ascend/repos/pypi")


def pip_index_args() -> str:
    return " ".join(f"--extra-index-url {url}" for url in ASCEND_PIP_INDEXES)


CANN_INFO = "ascend_toolkit_install.info"
CANN_ENV_VARS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
CANN_DEFAULT_ROOTS = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")


@dataclass(frozen=True)
class AscendStack:
    """One published pairing: ``vllm_ascend`` for vLLM ``vllm`` (matched by major.minor), built on CANN
    ``cann``, with ``torch``/``torch_npu`` where ``source`` (the file and release it was read from) names them."""

    vllm: str
    vllm_ascend: str
    cann: str
    source: str
    torch: str | None = None
    torch_npu: str | None = None

    def describe(self) -> str:
        torch = f", torch {self.torch} + torch-npu {self.torch_npu}" if self.torch_npu else ""
        return f"vLLM {self.vllm} + vllm-ascend {self.vllm_ascend} + CANN {self.cann}{torch}"


def minor_of(version: str | None) -> tuple[int, int] | None:
    """``"0.30.0rc1"`` -> ``(0, 30)``; also CANN's ``"8.0.RC2"`` -> ``(8, 0)``; None when unreadable."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def same_release(a: str, b: str) -> bool:
    """Whether two version strings name one release (``9.2.1`` == ``9.2.1``; ``0.30.0rc1`` != ``0.30.0``)."""
    return a.strip().lower().lstrip("v") == b.strip().lower().lstrip("v")


@lru_cache(maxsize=1)
def load_stacks() -> tuple[AscendStack, ...]:
    """The packaged ``ascend_stack.yaml`` rows."""
    text = resources.files("omni_ext.presets").joinpath("ascend_stack.yaml").read_text(encoding="utf-8")
    return tuple(AscendStack(**{k: str(v).strip() for k, v in row.items() if v is not None})
                 for row in yaml.safe_load(text)["pairings"])


def stacks_for(vllm_version: str | None, stacks: Sequence[AscendStack] | None = None) -> tuple[AscendStack, ...]:
    """Every known pairing for ``vllm_version``'s major.minor release (the installable one first)."""
    minor = minor_of(vllm_version)
    return tuple(s for s in (stacks or load_stacks()) if minor is not None and minor_of(s.vllm) == minor)


def stack_for(vllm_version: str | None, stacks: Sequence[AscendStack] | None = None) -> AscendStack | None:
    """The pairing to install for ``vllm_version``'s major.minor release (the first row), or None."""
    return next(iter(stacks_for(vllm_version, stacks)), None)


def matching_stack(vllm_version: str | None, vllm_ascend: str | None,
                   stacks: Sequence[AscendStack] | None = None) -> AscendStack | None:
    """The known pairing of this vLLM release whose vllm-ascend is exactly ``vllm_ascend``, or None."""
    return next((s for s in stacks_for(vllm_version, stacks)
                 if vllm_ascend is not None and same_release(vllm_ascend, s.vllm_ascend)), None)


def _info_version(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip().lower() == "version" and value.strip():
            return value.strip()
    return None


def find_cann_version(env: Mapping[str, str], roots: Sequence[str] = CANN_DEFAULT_ROOTS) -> tuple[str, str] | None:
    """``(version, info file)`` of the first CANN toolkit found: the sourced one first, then the defaults."""
    candidates = [env[var] for var in CANN_ENV_VARS if env.get(var)] + list(roots)
    for root in dict.fromkeys(candidates):
        base = Path(root)
        for info in [*sorted(base.glob(f"*-linux/{CANN_INFO}")), base / CANN_INFO]:
            version = _info_version(info)
            if version:
                return version, str(info)
    return None
