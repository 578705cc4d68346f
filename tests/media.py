"""Decoding helpers for tests: what a client would do with the bytes the server sends."""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np


def decode_mp4(data: bytes) -> tuple[int, int, int]:
    """(frames, width, height) of an mp4, decoded fully with the bundled ffmpeg."""
    import imageio_ffmpeg

    assert data[4:8] == b"ftyp", f"not an mp4 (starts {data[:16]!r})"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "v.mp4"
        path.write_bytes(data)
        reader = imageio_ffmpeg.read_frames(str(path))
        meta = next(reader)
        frames = sum(1 for _ in reader)
    width, height = meta["size"]
    return frames, width, height


def decode_png(data: bytes) -> np.ndarray:
    from PIL import Image

    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    img = Image.open(io.BytesIO(data))
    img.load()
    return np.asarray(img)
