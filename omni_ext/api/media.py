"""Encoding and storing media off the event loop.

vLLM-Omni 0.30 encodes MP4s synchronously on the API event loop, so while a few videos finish at
once every other request (including cheap status polls) waits. Here all encoding runs in a small
thread pool (PyAV/ffmpeg and PIL release the GIL for the heavy parts), and files are written
atomically (temp file + rename) so a crash never leaves a half-written video that looks complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_POOL = ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2)), thread_name_prefix="omni-ext-encode")

IMAGE_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, lambda: fn(*args, **kwargs))


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file and a rename; a failed write (a full disk)
    removes its temp file, so it leaves neither a half file nor the space it took. The file and the
    rename are on disk (fsynced) before this returns, so a job that reads "completed" keeps its media
    across a power loss."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # the rename itself (not every file system lets a directory be opened)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


#: What :func:`write_atomic` names its temp files (``.NAME.tmp``).
TMP_SUFFIX = ".tmp"


def stored_bytes(directory: Path) -> int:
    """The bytes of the files in ``directory`` (its media; no sub-directories): the store's use at start-up."""
    total = 0
    for entry in os.scandir(directory) if directory.is_dir() else ():
        with contextlib.suppress(OSError):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def remove_orphans(directory: Path) -> list[str]:
    """Remove the temp files a killed process left in ``directory`` (a write that never reached its rename);
    returns their names. Called at start-up, before any write of this process."""
    removed = []
    for tmp in directory.glob(f".*{TMP_SUFFIX}") if directory.is_dir() else ():
        with contextlib.suppress(OSError):
            tmp.unlink()
            removed.append(tmp.name)
    return removed


def encode_image(img: Any, fmt: str = "png", compression: int | None = None) -> bytes:
    """A PIL image as png/jpeg/webp bytes (``compression`` 0-100 as in OpenAI's API: 100 = best)."""
    buf = io.BytesIO()
    if fmt == "jpeg":
        img = img.convert("RGB")
        img.save(buf, format="JPEG", quality=compression if compression is not None else 95)
    elif fmt == "webp":
        img.save(buf, format="WEBP", quality=compression if compression is not None else 90)
    else:
        img.save(buf, format="PNG")
    return buf.getvalue()


def image_size(data: bytes) -> str:
    """``WxH`` of an encoded image (its header only)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return f"{img.width}x{img.height}"


#: OpenAI's ``variant=spritesheet``: at most this many evenly spaced frames, in rows of this many, each
#: at most this wide (height in proportion), as one JPEG.
SPRITE_FRAMES, SPRITE_COLUMNS, SPRITE_WIDTH = 8, 4, 256


def mp4_spritesheet(mp4: bytes, frames: int = SPRITE_FRAMES, columns: int = SPRITE_COLUMNS,
                    width: int = SPRITE_WIDTH) -> bytes:
    """Evenly spaced frames of an mp4 (its first and last among them) in a grid, as one JPEG. Each frame
    is scaled down as it is decoded, so a long video costs its decode, not its frames in memory."""
    import av
    from PIL import Image

    tiles = []
    with av.open(io.BytesIO(mp4)) as container:
        for frame in container.decode(video=0):
            img = frame.to_image()
            if img.width > width:
                img = img.resize((width, max(1, round(img.height * width / img.width))))
            tiles.append(img)
    if not tiles:
        raise ValueError("video has no frames")
    k = min(frames, len(tiles))
    picked = [tiles[round(i * (len(tiles) - 1) / (k - 1))] if k > 1 else tiles[0] for i in range(k)]
    cols = min(columns, k)
    rows = -(-k // cols)
    w, h = picked[0].size
    sheet = Image.new("RGB", (cols * w, rows * h))
    for i, tile in enumerate(picked):
        sheet.paste(tile.convert("RGB"), ((i % cols) * w, (i // cols) * h))
    return encode_image(sheet, "jpeg", 85)


def mp4_thumbnail(mp4: bytes, fmt: str = "webp") -> bytes:
    """The first frame of an mp4 as an image (OpenAI's ``variant=thumbnail``)."""
    import av

    with av.open(io.BytesIO(mp4)) as container:
        for frame in container.decode(video=0):
            return encode_image(frame.to_image(), fmt)
    raise ValueError("video has no frames")
