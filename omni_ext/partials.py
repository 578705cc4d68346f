"""Partial images of a streamed image generation or edit: which steps, and how they reach the API.

OpenAI's ``stream=true`` with ``partial_images`` (0-3) sends a few previews while an image is made.
Here a preview is the image the denoise loop would end on if it stopped now: the model's estimate
of the clean latents at a step (flow matching: ``x0 = x_t - sigma_t * v``), decoded by the VAE on
the worker that holds the latents (``partial-images`` patch, :mod:`omni_ext.patches.partial_images`).
A request asks for them through its sampling parameters' ``extra_args[KEY]``; its previews are
decoded after the evenly spaced steps :func:`partial_steps` picks, each written as a PNG file into the
progress directory's :data:`DIR` (``<engine request id>.<index>.png``, atomically), where the API
process that streams the request picks them up (:func:`read_new`) and removes them when it ends
(:func:`clear`). Like step progress (:mod:`omni_ext.progress`), this works for inline,
multi-process and replica layouts on one host.

Pure functions and file handling only: no vLLM import, so both sides and the tests use it.
"""

from __future__ import annotations

import contextvars
import os
from pathlib import Path

from omni_ext.progress import progress_dir

#: The sampling parameters' ``extra_args`` key that asks a worker for this many partial images.
KEY = "omni_ext_partial_images"
#: The partial images an edit asks for, set by omni-ext's edit route around its call of vLLM-Omni's edit
#: endpoint, whose engine call carries it (``edit-partial-images`` patch).
REQUESTED: contextvars.ContextVar[int] = contextvars.ContextVar("omni_ext_partial_images", default=0)
#: OpenAI's bound on ``partial_images``.
MAX_PARTIALS = 3
#: The progress directory's sub-directory of partial images (a leading dot: no job id matches it).
DIR = ".partials"


def partial_steps(total_steps: int, count: int) -> tuple[int, ...]:
    """The steps (1-based: after the step-th denoise step) whose estimate becomes a partial image:
    ``count`` evenly spaced over the loop, never the last step (that is the final image), so a
    loop of few steps gives fewer (OpenAI's API also promises at most ``count``). 8 steps, 3
    partials: after steps 2, 4 and 6."""
    if count <= 0 or total_steps < 2:
        return ()
    count = min(count, MAX_PARTIALS)
    return tuple(sorted({min(total_steps - 1, max(1, round((j + 1) * total_steps / (count + 1))))
                         for j in range(count)}))


def wanted(extra_args: object) -> int:
    """How many partial images a request's ``extra_args`` asks for (0: none, or a malformed value)."""
    if not isinstance(extra_args, dict):
        return 0
    value = extra_args.get(KEY)
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return max(0, min(MAX_PARTIALS, value))


def _root(create: bool = False) -> Path | None:
    base = progress_dir()
    if base is None:
        return None
    root = base / DIR
    if create:
        root.mkdir(parents=True, exist_ok=True)
    return root


def _safe(request_id: str) -> bool:
    return bool(request_id) and "/" not in request_id and not request_id.startswith(".")


def write(request_id: str, index: int, png: bytes) -> bool:
    """Worker side: partial image ``index`` of an engine request, as PNG bytes (best effort: False
    when there is no progress directory or the write fails; generation goes on either way)."""
    root = _root(create=True)
    if root is None or not _safe(request_id):
        return False
    tmp = root / f".{request_id}.{index}.tmp"
    try:
        tmp.write_bytes(png)
        os.replace(tmp, root / f"{request_id}.{index}.png")
    except OSError:
        return False
    return True


def _files(root: Path, request_id: str) -> list[tuple[int, Path]]:
    """The partial image files of ``request_id``'s engine requests (``request_id`` or ``request_id-<suffix>``)."""
    out = []
    for path in root.glob(f"{request_id}*.png"):
        rid, _, index = path.stem.rpartition(".")
        if index.isdigit() and (rid == request_id or rid.startswith(request_id + "-")):
            out.append((int(index), path))
    return sorted(out)


def read_new(request_id: str, seen: set[int]) -> list[tuple[int, bytes]]:
    """API side: the partial images of ``request_id`` not in ``seen`` yet, in index order; adds them to ``seen``."""
    root = _root()
    if root is None or not _safe(request_id):
        return []
    found: list[tuple[int, bytes]] = []
    for index, path in _files(root, request_id):
        if index in seen:
            continue
        try:
            found.append((index, path.read_bytes()))
        except OSError:
            continue
    seen.update(i for i, _ in found)
    return found


def clear(request_id: str) -> None:
    """Remove every partial image file of ``request_id`` (its stream ended, or never started)."""
    root = _root()
    if root is None or not _safe(request_id):
        return
    for _, path in _files(root, request_id):
        try:
            path.unlink()
        except OSError:
            pass
