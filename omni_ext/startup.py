"""Start-up checks for ``vllm-omni serve`` that fail fast with a message an operator can act on.

Stock vLLM-Omni treats a model path that does not exist as a Hugging Face repo id and dies ~30 s
later with ``HFValidationError: Repo id must be in the form 'repo_name'...`` (or an offline-mode
error) deep in a traceback. omni-ext's ``vllm.general_plugins`` hook runs in the serve process
while the CLI parser is being built, i.e. before any of that, and checks the model argument here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

_MODEL_FILES = ("model_index.json", "config.json")


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


def _looks_like_path(model: str) -> bool:
    # Hub ids are "name" or "org/name"; anything absolute, relative-dotted or deeper is a path.
    return model.startswith(("/", ".", "~")) or model.count("/") >= 2


def check_model(model: str) -> str | None:
    """A clear error message if ``model`` cannot be served from this host, else None."""
    path = Path(model).expanduser()
    if path.exists():
        if path.is_dir() and not any((path / f).exists() for f in _MODEL_FILES):
            return (
                f"model folder {path} has neither model_index.json (diffusers pipeline) nor config.json; "
                "point vllm-omni serve at the folder that contains them"
            )
        return None
    if _looks_like_path(model):
        return f"model path {model} does not exist (resolved to {path.absolute()})"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        try:
            from huggingface_hub import try_to_load_from_cache

            found = any(isinstance(try_to_load_from_cache(model, f), str) for f in _MODEL_FILES)
        except Exception:
            found = True  # cannot tell (unusual id form): let vLLM-Omni decide
        if not found:
            return (
                f"model {model} is neither a local folder nor in the Hugging Face cache, and HF_HUB_OFFLINE=1 "
                "forbids downloading it"
            )
    return None
