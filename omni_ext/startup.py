"""The model-argument rules, shared by ``vllm-omni serve`` start-up and ``omni-ext doctor``.

Stock vLLM-Omni treats a model path that does not exist as a Hugging Face repo id and dies ~30 s
later with ``HFValidationError: Repo id must be in the form 'repo_name'...`` (or an offline-mode
error) deep in a traceback. omni-ext's ``vllm.general_plugins`` hook runs in the serve process
while the CLI parser is being built, i.e. before any of that, and checks the model argument here
(:func:`check_model`). ``omni-ext doctor --model`` applies the same rules (:func:`inspect_model`)
and adds the preset's pipeline class, so the two can never disagree about what is servable.

The rules, in order:

1. An existing folder needs ``model_index.json`` (a diffusers pipeline; its ``_class_name`` is
   read) or ``config.json`` (a transformers-style model). An existing file is left to vLLM.
2. A missing argument that looks like a path (``/...``, ``./...``, ``~...``, or more than one
   ``/``) is an error: Hugging Face ids are ``name`` or ``org/name``.
3. Anything else is a Hub id. With ``HF_HUB_OFFLINE=1`` it must be in the local Hugging Face
   cache; otherwise vLLM-Omni downloads it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_MODEL_FILES = ("model_index.json", "config.json")

#: ``(repo_id, filename) -> local path or None``; the default reads the Hugging Face cache.
CacheLookup = Callable[[str, str], "str | None"]


@dataclass(frozen=True)
class ModelInfo:
    """What the rules found out about one model argument."""

    model: str
    problem: str | None = None  # why it cannot be served from this host; None: servable as far as we can tell
    fix: str | None = None
    local: bool = False  # a folder or file on this host
    pipeline_class: str | None = None  # ``_class_name`` of its model_index.json, when one could be read
    note: str = ""  # what it is, for a report


def serve_model_arg(argv: Sequence[str]) -> str | None:
    """The model of a ``vllm-omni serve MODEL --omni`` command line, or None if this is not one."""
    args = list(argv[1:])
    if "--omni" not in args or "serve" not in args:
        return None
    i = args.index("serve")
    rest = args[i + 1 :]
    if rest and not rest[0].startswith("-"):
        return rest[0]
    for j, a in enumerate(rest):
        if a == "--model" and j + 1 < len(rest):
            return rest[j + 1]
        if a.startswith("--model="):
            return a.split("=", 1)[1]
    return None


def check_serve_options(argv: Sequence[str]) -> str | None:
    """What is wrong with omni-ext's options in a ``vllm-omni serve ... --omni`` command line
    (``--additional-config '{"omni_ext": {"scheduler": ...}}'``), or None.

    Checked before the model loads, so a typo fails in a second on every server, not only once the
    TunedExecutor starts (or at the first request on a server without it)."""
    from omni_ext.scheduler.config import scheduler_config

    args = list(argv[1:])
    if "--omni" not in args or "serve" not in args:
        return None
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--additional-config"]
    values += [a.split("=", 1)[1] for a in args if a.startswith("--additional-config=")]
    for raw in values:
        try:
            scheduler_config(raw)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError too
            return f"invalid --additional-config: {exc}"
    return None


def _looks_like_path(model: str) -> bool:
    # Hub ids are "name" or "org/name"; anything absolute, relative-dotted or deeper is a path.
    return model.startswith(("/", ".", "~")) or model.count("/") >= 2


def _offline(env: Mapping[str, str]) -> bool:
    return env.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def _hf_cache_lookup(repo_id: str, filename: str) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename)
    return found if isinstance(found, str) else None


def _pipeline_class(index: Path, model: str, local: bool) -> ModelInfo:
    """A model whose ``model_index.json`` is ``index``: its pipeline class, or why the file is unusable."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return ModelInfo(model, f"{index} is not readable JSON ({exc})", "restore the model's model_index.json",
                         local=local)
    cls = data.get("_class_name") if isinstance(data, dict) else None
    return ModelInfo(model, local=local, pipeline_class=cls if isinstance(cls, str) else None,
                     note=f"diffusers pipeline {cls}" if cls else "diffusers pipeline")


def _local(model: str, path: Path) -> ModelInfo:
    if not path.is_dir():
        return ModelInfo(model, local=True, note="a single file (vLLM decides whether it can load it)")
    if (path / "model_index.json").is_file():
        return _pipeline_class(path / "model_index.json", model, local=True)
    if (path / "config.json").exists():
        return ModelInfo(model, local=True, note="transformers-style model (config.json, no model_index.json)")
    return ModelInfo(
        model,
        f"model folder {path} has neither model_index.json (diffusers pipeline) nor config.json; "
        "point vllm-omni serve at the folder that contains them",
        "pass the folder that holds model_index.json",
        local=True,
    )


def _hub(model: str, env: Mapping[str, str], lookup: CacheLookup) -> ModelInfo:
    if not _offline(env):
        return ModelInfo(model, note="not a local folder; vLLM-Omni will fetch it from the Hugging Face hub")
    try:
        found = {name: lookup(model, name) for name in _MODEL_FILES}
    except Exception:  # cannot tell (unusual id form): let vLLM-Omni decide
        return ModelInfo(model, note="a Hugging Face id (whether it is cached could not be told)")
    if found["model_index.json"]:
        return _pipeline_class(Path(found["model_index.json"]), model, local=False)
    if found["config.json"]:
        return ModelInfo(model, note="in the Hugging Face cache (config.json)")
    return ModelInfo(
        model,
        f"model {model} is neither a local folder nor in the Hugging Face cache, and HF_HUB_OFFLINE=1 "
        "forbids downloading it",
        "pass a local model folder, or download it first (huggingface-cli download MODEL) without HF_HUB_OFFLINE",
    )


def inspect_model(model: str, env: Mapping[str, str] | None = None, cache_lookup: CacheLookup | None = None) -> ModelInfo:
    """Apply the module's rules to ``model`` (``env`` defaults to this process's environment)."""
    env = os.environ if env is None else env
    path = Path(model).expanduser()
    if path.exists():
        return _local(model, path)
    if _looks_like_path(model):
        return ModelInfo(model, f"model path {model} does not exist (resolved to {path.absolute()})",
                         "pass the folder that holds model_index.json")
    return _hub(model, env, cache_lookup or _hf_cache_lookup)


def check_model(model: str) -> str | None:
    """A clear error message if ``model`` cannot be served from this host, else None."""
    return inspect_model(model).problem
