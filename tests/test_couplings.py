"""The couplings list: every private vLLM-Omni name omni-ext relies on still exists, where declared.

A vLLM-Omni release that renames one of them fails here, by name, instead of a request at run time.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from omni_ext import patches as reg
from omni_ext.patches.couplings import COUPLINGS, KINDS, Coupling, problem

ROOT = Path(__file__).resolve().parents[1]


def _ids(c: Coupling) -> str:
    return f"{c.kind}:{c.name.rpartition(':')[2]}"


@pytest.mark.parametrize("coupling", COUPLINGS, ids=_ids)
def test_coupling_holds_in_installed_vllm_omni(coupling: Coupling) -> None:
    why = problem(coupling)
    assert why is None, f"{why}\n  used in {coupling.used_in} for: {coupling.why}"


@pytest.mark.parametrize("coupling", COUPLINGS, ids=_ids)
def test_coupling_is_still_used_where_declared(coupling: Coupling) -> None:
    for module in coupling.modules:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, f"{module} does not exist"
        assert coupling.text in Path(spec.origin).read_text(), (
            f"{module} no longer mentions {coupling.text!r}: update used_in (or drop the entry) for {coupling.name}"
        )


def test_entries_are_complete_and_unique() -> None:
    version = reg.omni_version()
    assert version
    for c in COUPLINGS:
        assert c.kind in KINDS, c
        assert ":" in c.name and c.name.startswith(("vllm_omni.", "vllm.")), c.name  # vLLM: where vLLM-Omni serves through it
        assert c.why and all(m.startswith("omni_ext.") for m in c.modules), c.name
        assert c.applies_to(version), f"{c.name}: checked for {c.versions}, installed {version}"
        assert bool(c.value) == (c.kind in ("constant", "call")), c.name
    keys = [(c.name, c.kind) for c in COUPLINGS]
    assert len(keys) == len(set(keys))


def _private_vllm_omni_imports() -> set[tuple[str, str]]:
    """``(module, name)`` for every ``from vllm_omni... import _name`` in omni-ext's source."""
    found = set()
    for path in (ROOT / "omni_ext").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm_omni"):
                found |= {(node.module, a.name) for a in node.names if a.name.startswith("_")}
    return found


def test_every_private_vllm_omni_import_is_declared() -> None:
    declared = {tuple(c.name.split(":", 1)) for c in COUPLINGS}
    undeclared = _private_vllm_omni_imports() - declared
    assert not undeclared, f"declare these in omni_ext/patches/couplings.py: {sorted(undeclared)}"


_BROKEN = {
    "module gone": replace(COUPLINGS[0], name="vllm_omni.no_such_module:f", kind="function"),
    "function gone": Coupling("vllm_omni.diffusion.distributed.cfg_parallel:_no_such", "function", "x", "omni_ext.x"),
    "attribute gone": Coupling(
        "vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2:Wan22Pipeline._no_such", "attribute", "x", "omni_ext.x"
    ),
    "constant changed": Coupling("vllm_omni.diffusion.request:DUMMY_DIFFUSION_REQUEST_ID", "constant", "x", "omni_ext.x",
                                 value="warmup"),
    "call gone": Coupling("vllm_omni.diffusion.request:OmniDiffusionRequest", "call", "x", "omni_ext.x",
                          value="self.no_such_call("),
    "parameter gone": Coupling(
        "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image:QwenImagePipeline._decode_latents", "method", "x",
        "omni_ext.x", params=("latents", "no_such_param"),
    ),
    "not callable": Coupling("vllm_omni.diffusion.request:DUMMY_DIFFUSION_REQUEST_ID", "function", "x", "omni_ext.x"),
}


@pytest.mark.parametrize("case", sorted(_BROKEN))
def test_a_broken_coupling_is_reported(case: str) -> None:
    assert problem(_BROKEN[case])
