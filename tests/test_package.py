"""The package as a user gets it: ``python -m build`` makes an sdist and a wheel (built from that sdist) that
pass ``twine check --strict``, and the wheel, installed into a fresh venv, carries the plugin.

Why: the rest of the suite runs against the editable checkout, where a data file left out of the
package data, a broken entry point or a version read from the wrong place goes unnoticed until
someone installs the wheel. The installed copy is checked from outside the repository (``python -I``,
cwd in a temporary directory), so nothing can be found in the checkout instead.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import omni_ext

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

pytestmark = pytest.mark.spawns

REPO = Path(__file__).resolve().parents[1]

# Run by the fresh venv's python: what the installed distribution declares and ships.
INSPECT = """
import hashlib, json, sys
from importlib import metadata, resources
from pathlib import Path

import omni_ext

dist = metadata.distribution("omni-ext")
root = resources.files("omni_ext")
data = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in Path(str(root)).rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")}
eps = [[ep.group, ep.name, ep.value] for ep in dist.entry_points]
loaded = [ep.value for ep in dist.entry_points if ep.group != "console_scripts" and callable(ep.load())]
print(json.dumps({"file": omni_ext.__file__, "version": omni_ext.__version__, "dist_version": dist.version,
                  "copies": len(list(metadata.distributions(name="omni-ext"))), "entry_points": eps,
                  "loaded": loaded, "data": data, "playground": (root / "api/static/playground.html").read_text()[:200]}))
"""


def _run(*cmd: str, cwd: Path) -> str:
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, f"{' '.join(cmd)} exited {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def _declared_entry_points() -> set[tuple[str, str, str]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    groups = {"console_scripts": project["scripts"], **project["entry-points"]}
    return {(group, name, value) for group, eps in groups.items() for name, value in eps.items()}


def _repo_data_files() -> dict[str, str]:
    """Every non-Python file of the package in the checkout (tracked or new, not ignored), with its hash."""
    listed = _run("git", "ls-files", "--cached", "--others", "--exclude-standard", "omni_ext", cwd=REPO).split()
    return {str(Path(f).relative_to("omni_ext")): hashlib.sha256((REPO / f).read_bytes()).hexdigest()
            for f in listed if not f.endswith(".py") and (REPO / f).is_file()}


def test_built_wheel_installs_and_carries_the_plugin(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    # --no-isolation: the venv's setuptools, no index needed; the wheel is built from the sdist.
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(REPO), cwd=tmp_path)
    version = omni_ext.__version__
    wheel, sdist = dist / f"omni_ext-{version}-py3-none-any.whl", dist / f"omni_ext-{version}.tar.gz"
    assert sorted(dist.iterdir()) == sorted([wheel, sdist])
    _run(sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist), cwd=tmp_path)

    with zipfile.ZipFile(wheel) as whl:
        info = f"omni_ext-{version}.dist-info"
        assert f"{info}/licenses/LICENSE" in whl.namelist()
        meta = whl.read(f"{info}/METADATA").decode()
    assert f"Version: {version}\n" in meta and "License-Expression: Apache-2.0\n" in meta
    with tarfile.open(sdist) as tar:
        names = set(tar.getnames())
    assert {f"omni_ext-{version}/{f}" for f in ("LICENSE", "README.md", "pyproject.toml")} <= names

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv), cwd=tmp_path)
    _run(sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(venv / "bin/python"),
         "install", "-q", "--no-deps", str(wheel), cwd=tmp_path)
    got = json.loads(_run(str(venv / "bin/python"), "-I", "-c", INSPECT, cwd=tmp_path))

    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert Path(got["file"]) == site / "omni_ext" / "__init__.py"
    assert got["version"] == got["dist_version"] == version and got["copies"] == 1
    assert {tuple(ep) for ep in got["entry_points"]} == _declared_entry_points()
    assert {g for g, _, _ in _declared_entry_points()} >= {
        "vllm_omni.platform_plugins", "vllm_omni.general_plugins", "vllm.general_plugins"}
    assert len(got["loaded"]) == 3, got["loaded"]
    assert (venv / "bin" / "omni-ext").is_file()
    expected = _repo_data_files()
    assert {"py.typed", "presets/ascend_stack.yaml", "presets/costs.yaml", "api/static/playground.html",
            "api/static/playground.js", "api/static/playground.css"} <= set(expected)
    assert got["data"] == expected
    assert "<" in got["playground"]
