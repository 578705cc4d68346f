"""The import graph of ``omni_ext/``, read from the source: which modules import each other in a circle.

Every ``import`` and ``from ... import`` counts, at module level (``TYPE_CHECKING`` blocks included)
and inside functions: a lazy import that closes a circle still makes the modules one knot for a
reader. Pure: reads files, imports nothing from omni_ext.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "omni_ext"


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's ``__init__``)."""
    out = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def imported_modules(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that the module ``name`` imports anywhere in ``source``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import mod`` imports the module pkg.mod (the package's ``__init__`` runs first for
            # any submodule, as a parent, not as an import of the package's own); ``from mod import name``
            # imports mod.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = module_files(root, package)
    known = set(modules)
    return {name: imported_modules(name, path.read_text(encoding="utf-8"), is_package, known)
            for name, (path, is_package) in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return sorted(out)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_reader_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Module-level, lazy (in a function), relative and ``from pkg import mod`` imports are edges; a
    circle through a lazy import is found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import x\n")
    (pkg / "c.py").write_text("import pkg.a\nx = 1\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n")
    (pkg / "e.py").write_text("from pkg import a, VERSION\n")
    g = import_graph(tmp_path, "pkg")
    assert g["pkg.a"] == {"pkg.sub.b"}
    assert g["pkg.sub.b"] == {"pkg.c"}
    assert g["pkg.d"] == {"pkg.a"}
    assert g["pkg.e"] == {"pkg", "pkg.a"}
    assert cycles(g) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_graph_reads_the_package(graph: dict[str, set[str]]) -> None:
    assert "omni_ext.presets.render" in graph["omni_ext.presets.validate"]
    assert "omni_ext.models.families" in graph["omni_ext.presets.shared"]


def test_presets_modules_import_no_circle(graph: dict[str, set[str]]) -> None:
    """The planner, the renderer and the checker share :mod:`omni_ext.presets.shared` instead of each other."""
    knots = [c for c in cycles(graph) if any(m.startswith("omni_ext.presets") for m in c)]
    assert knots == []


def test_api_imports_nothing_from_patches(graph: dict[str, set[str]]) -> None:
    edges = sorted((a, b) for a, deps in graph.items() if a.startswith("omni_ext.api")
                   for b in deps if b.startswith("omni_ext.patches"))
    assert edges == []


def test_no_module_of_the_package_imports_itself_in_a_circle(graph: dict[str, set[str]]) -> None:
    """Issue 16's rule for the whole package, not only presets/: no modules import each other in a
    circle, directly or through others (a submodule import does not count as importing its package)."""
    assert cycles(graph) == []
