"""Accepted requests kept on disk until their job ends, so that a restart loses no accepted job.

A ``POST /v1/videos`` that answered 200 has promised a video. Its parsed body (fields and uploaded
files, reference images included) is written here before the answer, fsynced, and removed when the
job ends (completed, failed, deleted). At the next start the server re-reads every request still here
whose job was queued and runs it again under the same id, through the same checks as the first time
(:func:`omni_ext.api.intake.build_video_request`), with the seed the first parse drew, so its output is
what a fresh server gives for that request.

Layout: ``<data_dir>/requests/<job id>/`` holds ``body.json`` (the fields, and for each uploaded part
its field, file name, content type and blob name) and one ``<n>.bin`` per part; ``body.json`` is
written last, so a directory without it is a write that never finished and is dropped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path

from omni_ext.api.intake import Body
from omni_ext.api.media import write_atomic

logger = logging.getLogger("omni_ext.api")

MANIFEST = "body.json"


class RequestArchive:
    def __init__(self, root: Path) -> None:
        self.root = root

    def _dir(self, job_id: str) -> Path:
        return self.root / job_id

    def save(self, job_id: str, body: Body) -> None:
        """Keep ``body`` for ``job_id`` (raises ``OSError`` when the disk refuses it: the caller refuses the job)."""
        where = self._dir(job_id)
        where.mkdir(parents=True, exist_ok=True)
        parts = []
        for field_name in sorted(set(body.files) | set(body.file_lists)):
            for filename, ctype, data in body.parts(field_name):
                blob = f"{len(parts)}.bin"
                write_atomic(where / blob, data)
                parts.append({"field": field_name, "filename": filename, "content_type": ctype, "blob": blob})
        write_atomic(where / MANIFEST, json.dumps({"fields": body.fields, "parts": parts}).encode())

    def load(self, job_id: str) -> Body | None:
        """The body kept for ``job_id``, or None (none kept, or a write that never finished)."""
        where = self._dir(job_id)
        try:
            manifest = json.loads((where / MANIFEST).read_text())
            files: dict[str, tuple[str, str, bytes]] = {}
            lists: dict[str, list[tuple[str, str, bytes]]] = {}
            for part in manifest["parts"]:
                item = (part["filename"], part["content_type"], (where / part["blob"]).read_bytes())
                files[part["field"]] = item
                lists.setdefault(part["field"], []).append(item)
            return Body(fields=manifest["fields"], files=files, file_lists=lists)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if where.exists():
                logger.warning("omni-ext: the kept request of %s cannot be read (%s); it is dropped", job_id, exc)
            return None

    def remove(self, job_id: str) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self._dir(job_id))

    def ids(self) -> set[str]:
        """The job ids with a kept request."""
        try:
            return {p.name for p in self.root.iterdir() if p.is_dir()}
        except OSError:
            return set()
