"""The site's reference pages, generated from the code so that they cannot drift from it.

``python -m omni_ext.reference [DOCS_DIR]`` writes every page of :data:`PAGES` (default
``docs/reference``); ``tests/test_reference_docs.py`` regenerates each one and fails when the
committed file differs. Each page reads the one place its subject is declared: the environment
variables' table (:mod:`omni_ext.environment`), the ``omni_ext`` options (:func:`sections`), the
request bounds (:mod:`omni_ext.api.limits`, a comment on every constant), the patch registry
(:mod:`omni_ext.patches`), the argparse parser (:func:`omni_ext.cli.build_parser`), the model
matrix (:mod:`omni_ext.models.matrix`) and the request schemas (:mod:`omni_ext.api.schemas`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import json
import re
import sys
import tokenize
import typing
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Literal

from omni_ext import REGENERATE_DOCS as REGENERATE

DEFAULT_DIR = "docs/reference"
#: Columns of the ``omni-ext --help`` tree: fixed, so that the page does not depend on the terminal.
CLI_WIDTH = 100


def _header(title: str, source: str) -> list[str]:
    return [f"# {title}", "",
            f"Generated from {source} by `{REGENERATE}`; do not edit it by hand: `tests/test_reference_docs.py` "
            "fails when it differs from what the code gives.", ""]


def _md(text: str) -> str:
    """Docstring or comment text (reStructuredText roles and literals) as one line of Markdown, safe in a
    table cell: ``|`` escaped, and ``<`` outside code spans too, so that ``<id>`` is not read as HTML."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", " ".join(text.split()).replace("``", "`"))
    parts = text.split("`")
    parts[::2] = [p.replace("<", "&lt;") for p in parts[::2]]
    return "`".join(parts).replace("|", "\\|")


def _table(titles: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    return ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles),
            *("| " + " | ".join(row) + " |" for row in rows), ""]


def _value(value: Any) -> str:
    """A default as a reader writes it in JSON (``unset`` for none)."""
    return "unset" if value is None else f"`{json.dumps(list(value) if isinstance(value, tuple) else value)}`"


# ---- environment variables -----------------------------------------------------------------------
def environment() -> str:
    from omni_ext.api.settings import SETTINGS
    from omni_ext.environment import ENV_VARS

    def default(value: str | None) -> str:
        return "unset" if value is None else "empty" if value == "" else f"`{value}`"

    lines = [*_header("Environment variables", "`omni_ext/environment.py` and the `omni_ext.api` settings"),
             "Every `OMNI_EXT_*` variable omni-ext reads. vLLM and vLLM-Omni read their own (`VLLM_*`, "
             "`OMP_NUM_THREADS`, `CUDA_VISIBLE_DEVICES`, ...), which their documentation lists.", "",
             "## For operators", ""]
    lines += _table(("variable", "default", "meaning"),
                    [(f"`{v.name}`", default(v.default), _md(v.meaning)) for v in ENV_VARS if not v.internal])
    lines += ["## Overrides of `omni_ext.api` settings", "",
              "Each wins over its key of `--additional-config`; the key's meaning and default are on "
              "[Additional config](additional-config.md).", ""]
    lines += _table(("variable", "overrides"), [(f"`{s.env}`", f"`omni_ext.api.{s.key}`") for s in SETTINGS])
    lines += ["## Set by omni-ext", "",
              "omni-ext sets these for its own child processes: listed so that none is a mystery in a process's "
              "environment, not to be set by hand.", ""]
    lines += _table(("variable", "meaning"), [(f"`{v.name}`", _md(v.meaning)) for v in ENV_VARS if v.internal])
    return "\n".join(lines)


# ---- additional config ---------------------------------------------------------------------------
def _json_type(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(_value(a) for a in args)
    if type(None) in args:
        return " or ".join(_json_type(a) for a in args if a is not type(None)) + " or null"
    if isinstance(hint, type) and issubclass(hint, Enum):
        return "one of " + ", ".join(_value(m.value) for m in hint)
    return {bool: "boolean", int: "integer", float: "number", str: "string"}[hint]


#: Defaults a docstring writes in Python or JSON spelling, beside JSON numbers and strings.
_LITERALS = {"None": None, "true": True, "false": False}


def dataclass_options(cls: type) -> tuple[Any, ...]:
    """The options of an options dataclass as :class:`~omni_ext.scheduler.config.Option` rows: type and
    default from its fields, meaning from its docstring's paragraph ````key`` (default): ...``. A
    ``ValueError`` when a field has no paragraph, or when the paragraph's default is not the field's."""
    from omni_ext.scheduler.config import Option

    doc = inspect.cleandoc(cls.__doc__ or "")
    found = re.finditer(r"^``(\w+)`` \(([^)]*)\): (.*?)(?=^``\w+`` \(|\Z)", doc, re.M | re.S)
    paragraphs = {m[1]: (m[2], m[3]) for m in found}
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.name not in paragraphs:
            raise ValueError(f"{cls.__name__}.{f.name}: its docstring has no paragraph ``{f.name}`` (default): ...")
        said, meaning = paragraphs[f.name]
        head, _, more = said.partition(": ")
        stated = _LITERALS[head] if head in _LITERALS else json.loads(head)
        if stated != f.default:
            raise ValueError(f"{cls.__name__}.{f.name}: its docstring says the default is {head}, the field {f.default!r}")
        meaning = meaning[0].upper() + meaning[1:]
        if more:
            meaning = f"{'Unset' if f.default is None else 'Default'}: {more}. {meaning}"
        rows.append(Option(f.name, _json_type(hints[f.name]), f.default, meaning))
    return tuple(rows)


def sections() -> tuple[tuple[str, str, tuple[Any, ...]], ...]:
    """``(path, where its keys are declared, its rows)`` of the ``omni_ext`` object's own keys and of each of
    its sections: every key ``--additional-config`` gives omni-ext."""
    from omni_ext.api.settings import SETTINGS
    from omni_ext.scheduler.config import OPTIONS, HealingConfig, SchedulerConfig

    return (("omni_ext", "`omni_ext/scheduler/config.py` `OPTIONS`", OPTIONS),
            ("omni_ext.api", "`omni_ext/api/settings.py` `SETTINGS`", SETTINGS),
            ("omni_ext.scheduler", "`omni_ext/scheduler/config.py` `SchedulerConfig`", dataclass_options(SchedulerConfig)),
            ("omni_ext.healing", "`omni_ext/scheduler/config.py` `HealingConfig`", dataclass_options(HealingConfig)))


def additional_config() -> str:
    lines = [*_header("Additional config", "the option tables and dataclasses named below"),
             "omni-ext's options travel in vLLM-Omni's own `--additional-config` (or a deploy YAML stage's "
             "`additional_config:`), under the key `omni_ext`:", "",
             "```bash",
             "vllm-omni serve MODEL --omni --additional-config \\",
             "  '{\"omni_ext\": {\"data_parallel_size\": 2, \"scheduler\": {\"order\": \"slo\"}, \"api\": {\"ttl_s\": 3600}}}'",
             "```", "",
             "An unknown key of `omni_ext.scheduler` or `omni_ext.healing`, or a value of the wrong type, stops the "
             "server at start-up.", ""]
    for path, source, rows in sections():
        env = any(getattr(r, "env", None) for r in rows)
        lines += [f"## `{path}`", "", f"Declared in {source}.", ""]
        lines += _table(("key", "type", "default", "meaning") + (("environment variable",) if env else ()),
                        [(f"`{r.key}`", r.type, _value(r.default), _md(r.meaning)) + ((f"`{r.env}`",) if env else ())
                         for r in rows])
    return "\n".join(lines)


# ---- request limits ------------------------------------------------------------------------------
def commented_constants(source: str, module: str) -> list[tuple[str, list[tuple[list[tuple[str, ast.expr]], str]]]]:
    """``[(section, [([(name, value node)], comment)])]`` of the ``source`` of a module of constants. A
    constant's comment is its own (``#:`` lines above it, or a trailing ``#``), or else that of the
    constant on the line before it, whose row it joins; a section starts at a ``# ---- Title: text`` line.
    A ``ValueError`` for a constant with no comment at all: each one says what it bounds."""
    lines = source.splitlines()
    comments = {t.start[0]: t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT}
    sections: list[tuple[str, list[tuple[list[tuple[str, ast.expr]], str]]]] = [("", [])]
    last = 0
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.isupper()):
            continue
        sections += [(comments[ln].strip("#- "), []) for ln in range(last + 1, node.lineno)
                     if comments.get(ln, "").startswith("# ----")]
        above, ln = [], node.lineno - 1
        while comments.get(ln, "").startswith("#:"):
            above.insert(0, comments[ln][2:].strip())
            ln -= 1
        code_line = not lines[node.end_lineno - 1].lstrip().startswith("#")
        own = " ".join(above) or (comments.get(node.end_lineno, "").lstrip("# ") if code_line else "")
        rows, entry = sections[-1][1], (node.targets[0].id, node.value)
        if own:
            rows.append(([entry], own))
        elif rows and last == node.lineno - 1:
            rows[-1][0].append(entry)
        else:
            raise ValueError(f"{module}.{entry[0]} has no comment: say what it bounds")
        last = node.end_lineno
    return sections


def _doc_markdown(module: Any) -> list[str]:
    """A module's docstring as Markdown paragraphs (a paragraph of ``- `` lines as a list)."""
    out = []
    for para in inspect.getdoc(module).split("\n\n"):
        if para.startswith("- "):
            out += ["- " + _md(item) for item in re.split(r"^- ", para, flags=re.M) if item.strip()]
        else:
            out.append(_md(para))
        out.append("")
    return out


def request_limits() -> str:
    from omni_ext.api import limits

    source = inspect.getsource(limits)

    def value(name: str, node: ast.expr) -> str:
        src = ast.get_source_segment(source, node)
        try:
            ast.literal_eval(node)
            return f"`{src}`"
        except ValueError:
            return f"`{src}` = `{getattr(limits, name)!r}`"

    lines = [*_header("Request limits", "`omni_ext/api/limits.py`"), *_doc_markdown(limits),
             "The limits a server sets for itself (upload size, request bodies in memory, slow clients, admitted "
             "jobs, stored media) are `omni_ext.api` settings: [Additional config](additional-config.md).", ""]
    for title, rows in commented_constants(source, limits.__name__):
        heading, _, text = title.partition(": ")
        lines += [f"## {heading or 'Request fields'}", ""] + ([_md(text[0].upper() + text[1:]) + ".", ""] if text else [])
        lines += _table(("constant", "value", "meaning"),
                        [(", ".join(f"`{n}`" for n, _ in entries), ", ".join(value(n, v) for n, v in entries),
                          _md(comment[0].upper() + comment[1:]))
                         for entries, comment in rows])
    return "\n".join(lines)


# ---- patches -------------------------------------------------------------------------------------
#: Fields of a :class:`~omni_ext.patches.Patch` that are names, paths or versions: shown as code.
_CODE_FIELDS = {"versions", "where", "diff", "test", "apply"}


def patches() -> str:
    from omni_ext import patches as registry
    from omni_ext.patches import couplings

    lines = [*_header("Patches", "the registry (`omni_ext/patches/__init__.py`, `omni_ext/patches/couplings.py`)"),
             *_doc_markdown(registry)]
    lines += _table(("patch", "where", "vLLM-Omni", "diff"), [(f"[{p.name}](#{p.name})", f"`{p.where}`", f"`{p.versions}`",
                                                               f"`{p.diff}`") for p in registry.PATCHES])
    for p in registry.PATCHES:
        lines += [f"## {p.name}", "", "- **target**: " + ", ".join(f"`{t}`" for t in p.targets)]
        for f in dataclasses.fields(registry.Patch):
            value = getattr(p, f.name)
            if f.name not in ("name", "target") and value:
                lines.append(f"- **{f.name}**: " + (f"`{value}`" if f.name in _CODE_FIELDS else _md(value)))
        lines.append("")
    lines += ["## Couplings", "", *_doc_markdown(couplings)]
    lines += _table(("name", "kind", "vLLM-Omni", "used in", "why"),
                    [(f"`{c.name}`", c.kind, f"`{c.versions}`", ", ".join(f"`{m}`" for m in c.modules), _md(c.why))
                     for c in couplings.COUPLINGS])
    return "\n".join(lines)


# ---- the command line ----------------------------------------------------------------------------
def _parsers(parser: argparse.ArgumentParser) -> Any:
    """``parser`` and every subcommand's parser under it, depth first (an alias's parser once)."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _parsers(sub)


def cli() -> str:
    from omni_ext.cli import build_parser

    lines = [*_header("Command line", "the argparse parser (`omni_ext/cli.py` `build_parser`)"),
             f"`omni-ext --help` and the help of every subcommand, at {CLI_WIDTH} columns.", ""]
    for parser in _parsers(build_parser()):
        parser.formatter_class = functools.partial(parser.formatter_class, width=CLI_WIDTH)
        lines += [f"## {parser.prog}", "", "```text", parser.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


# ---- pages with a generator of their own ---------------------------------------------------------
def models() -> str:
    import contextlib

    from omni_ext.models import matrix
    from omni_ext.patches import omni_version

    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout as it loads
        return matrix.markdown_page(matrix.decisions(), omni_version())


def api_fields() -> str:
    from omni_ext.api.schemas import fields_markdown

    return fields_markdown()


# ---- the pages -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Page:
    file: str
    title: str
    about: str
    render: Callable[[], str]


def index() -> str:
    lines = ["# Reference", "",
             f"Generated from the code by `{REGENERATE}` (which writes every page of this section); "
             "`tests/test_reference_docs.py` fails when a page differs from what the code gives.", ""]
    lines += _table(("page", "what it lists"), [(f"[{p.title}]({p.file})", p.about) for p in PAGES if p.render is not index])
    return "\n".join(lines)


PAGES: tuple[Page, ...] = (
    Page("index.md", "Reference", "these pages", index),
    Page("environment.md", "Environment variables", "every `OMNI_EXT_*` variable, its default and meaning", environment),
    Page("additional-config.md", "Additional config",
         "every `omni_ext.*` key of `--additional-config`: type, default, meaning", additional_config),
    Page("request-limits.md", "Request limits", "the bounds on every request field", request_limits),
    Page("patches.md", "Patches", "the runtime patches to vLLM-Omni, and the private names omni-ext relies on",
         patches),
    Page("cli.md", "Command line", "the `omni-ext --help` tree", cli),
    Page("models.md", "Supported models", "omni-ext's path for every pipeline class vLLM-Omni registers", models),
    Page("api-fields.md", "Request fields", "every field of `/v1/videos` and `/v1/images/generations`", api_fields),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description="Write the reference pages generated from the code.")
    parser.add_argument("docs_dir", nargs="?", default=DEFAULT_DIR, help=f"where to write them (default: {DEFAULT_DIR})")
    out = Path(parser.parse_args(argv).docs_dir)
    out.mkdir(parents=True, exist_ok=True)
    for page in PAGES:
        (out / page.file).write_text(page.render())
        print(out / page.file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
