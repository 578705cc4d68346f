"""The generated reference pages (``docs/reference``) are what the code gives, and their tables cover
what the code reads.

Every page of :data:`omni_ext.reference.PAGES` is regenerated in memory and compared with the committed
file; the environment-variable table must name every ``OMNI_EXT_*`` string in ``omni_ext/``, and the
additional-config tables every key the ``omni_ext`` object's readers ask for. Pure: no server (the
supported-models page imports every pipeline class vLLM-Omni registers, ~12 s).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from omni_ext import reference

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "omni_ext"
DOCS = ROOT / reference.DEFAULT_DIR


@pytest.mark.parametrize("page", reference.PAGES, ids=lambda p: p.file)
def test_committed_reference_page_is_current(page: reference.Page) -> None:
    path = DOCS / page.file
    committed = path.read_text() if path.is_file() else ""
    assert committed == page.render(), f"{path.relative_to(ROOT)} is stale: regenerate it with `{reference.REGENERATE}`"


def test_cli_page_does_not_depend_on_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    wide = reference.cli()
    monkeypatch.setenv("COLUMNS", "40")
    assert reference.cli() == wide


def test_every_omni_ext_variable_in_the_code_is_in_the_table() -> None:
    """An ``OMNI_EXT_*`` string anywhere in the package's code (not its docstrings or comments) is a row of
    :data:`omni_ext.environment.ENV_VARS` or an ``omni_ext.api`` setting's variable; and every row of the
    table is named somewhere else in the code (a row nothing reads would document a variable that does nothing)."""
    from omni_ext.api.settings import SETTINGS
    from omni_ext.environment import ENV_VARS

    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"OMNI_EXT_[A-Z0-9_]+", node.value):
                found.setdefault(node.value, set()).add(str(path.relative_to(ROOT)))
    table = {v.name for v in ENV_VARS} | {s.env for s in SETTINGS}
    missing = {name: sorted(where) for name, where in found.items() if name not in table}
    assert not missing, f"OMNI_EXT_ variables read but not in omni_ext/environment.py ENV_VARS: {missing}"
    unread = [v.name for v in ENV_VARS if not found.get(v.name, set()) - {"omni_ext/environment.py"}]
    assert not unread, f"rows of ENV_VARS that no code names: {unread}"


#: The sections of the ``omni_ext`` object (``api``, ``scheduler``, ...).
SECTIONS = {path.removeprefix("omni_ext.") for path, _, _ in reference.sections() if path != "omni_ext"}


class _Recorder(dict):
    """An ``omni_ext`` object (or one of its sections) that records the path of every key read from it: a
    section's name answers with a recorder of its own."""

    def __init__(self, path: str, seen: set[str]) -> None:
        super().__init__()
        self.path, self.seen = path, seen

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(f"{self.path}.{key}")
        return _Recorder(f"{self.path}.{key}", self.seen) if key in SECTIONS else default


#: The modules that read the ``omni_ext`` object (call ``omni_ext_section``), each exercised below.
READERS = {"omni_ext/api/settings.py", "omni_ext/executor/tuned.py", "omni_ext/patches/dp_world.py",
           "omni_ext/scheduler/config.py", "omni_ext/scheduler/layout.py"}


def test_every_additional_config_key_the_code_reads_is_in_the_tables() -> None:
    from omni_ext.api.settings import load_settings
    from omni_ext.executor import start, tuned
    from omni_ext.patches.dp_world import requested_dp
    from omni_ext.scheduler.config import healing_config, omni_ext_section, scheduler_config
    from omni_ext.scheduler.layout import server_layout

    readers = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "omni_ext_section(" in p.read_text()}
    assert readers == READERS, "a module reads the omni_ext object: exercise it in this test and update READERS"
    seen: set[str] = set()
    additional = {"omni_ext": _Recorder("omni_ext", seen)}
    load_settings(SimpleNamespace(port=1, additional_config=additional), {})
    scheduler_config(additional)  # their keys are their dataclasses' fields: these only must not fail
    healing_config(additional)
    requested_dp(additional, None)
    start.start_method(omni_ext_section(additional), "cpu")
    server_layout(SimpleNamespace(additional_config=additional))
    tuned.data_parallel_size(SimpleNamespace(additional_config=additional))
    documented = {f"{path}.{row.key}" for path, _, rows in reference.sections() for row in rows}
    documented |= {f"omni_ext.{s}" for s in SECTIONS}
    assert seen - documented == set(), "keys read but not in the additional-config tables"
    assert {"omni_ext.api.ttl_s", "omni_ext.api.body_wait_s", "omni_ext.worker_start", "omni_ext.data_parallel_size"} <= seen


def test_an_options_dataclass_field_needs_its_docstring_paragraph() -> None:
    @dataclasses.dataclass(frozen=True)
    class Options:
        """``limit_s`` (5): how long."""

        limit_s: float = 5.0
        retries: int = 2

    with pytest.raises(ValueError, match="retries"):
        reference.dataclass_options(Options)
    Options.__doc__ = """``limit_s`` (5): how long.\n``retries`` (3): how often."""
    with pytest.raises(ValueError, match="says the default is 3"):
        reference.dataclass_options(Options)


def test_a_limit_needs_a_comment() -> None:
    """A constant shares the comment of the one on the line before it; one on its own needs its own."""
    source = "#: Steps.\nA = 1\nB = 2  # two\nC = 3\n"
    [(section, rows)] = reference.commented_constants(source, "m")
    assert [([name for name, _ in names], comment) for names, comment in rows] == [(["A"], "Steps."), (["B", "C"], "two")]
    with pytest.raises(ValueError, match="m.D has no comment"):
        reference.commented_constants(source + "\nD = 4\n", "m")
