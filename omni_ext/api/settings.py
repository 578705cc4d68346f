"""Settings of omni-ext's HTTP routes, read through vLLM-Omni's own configuration channel.

``vllm-omni serve MODEL --omni --additional-config '{"omni_ext": {"api": {...}}}'`` (or the same keys
in a deploy YAML), with environment variables as overrides for operators and tests:

| key                | env                        | default                                        |
|--------------------|----------------------------|------------------------------------------------|
| ``data_dir``       | ``OMNI_EXT_API_DATA_DIR``  | ``~/.cache/omni-ext/api/port-<port>``           |
| ``ttl_s``          | ``OMNI_EXT_API_TTL_S``     | 86400 (finished media kept one day; 0 = keep)  |
| ``max_upload_mb``  | ``OMNI_EXT_API_MAX_UPLOAD_MB`` | 32                                          |
| ``max_queued``     | ``OMNI_EXT_API_MAX_QUEUED``| 256 admitted (queued+running) jobs, then 429   |

``data_dir`` holds ``jobs.sqlite`` (job metadata) and ``media/`` (mp4, thumbnails, images). Keyed by
port by default so that two servers on one host never share (and never fail) each other's jobs,
while a restart on the same port finds its jobs again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_ext.scheduler.config import omni_ext_section


@dataclass(frozen=True)
class ApiSettings:
    data_dir: Path
    ttl_s: int = 86400
    max_upload_bytes: int = 32 * 2**20
    max_queued: int = 256

    @property
    def db_path(self) -> Path:
        return self.data_dir / "jobs.sqlite"

    @property
    def media_dir(self) -> Path:
        return self.data_dir / "media"


def _api_section(args: Any) -> dict[str, Any]:
    """``omni_ext.api`` of the server's ``--additional-config`` (or the ``omni_ext`` object itself
    when it has no ``api`` key)."""
    section = omni_ext_section(getattr(args, "additional_config", None))
    api = section.get("api", section)
    return api if isinstance(api, dict) else {}


def load_settings(args: Any, environ: dict[str, str] | None = None) -> ApiSettings:
    env = os.environ if environ is None else environ
    cfg = _api_section(args)
    port = getattr(args, "port", None) or 8000
    default_dir = Path.home() / ".cache" / "omni-ext" / "api" / f"port-{port}"
    data_dir = Path(env.get("OMNI_EXT_API_DATA_DIR") or cfg.get("data_dir") or default_dir).expanduser()
    ttl = int(env.get("OMNI_EXT_API_TTL_S") or cfg.get("ttl_s", 86400))
    upload_mb = float(env.get("OMNI_EXT_API_MAX_UPLOAD_MB") or cfg.get("max_upload_mb", 32))
    max_queued = int(env.get("OMNI_EXT_API_MAX_QUEUED") or cfg.get("max_queued", 256))
    return ApiSettings(data_dir=data_dir, ttl_s=ttl, max_upload_bytes=int(upload_mb * 2**20), max_queued=max_queued)
