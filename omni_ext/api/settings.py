"""Settings of omni-ext's HTTP routes, read through vLLM-Omni's own configuration channel.

``vllm-omni serve MODEL --omni --additional-config '{"omni_ext": {"api": {...}}}'`` (or the same keys
in a deploy YAML), with environment variables as overrides for operators and tests:

| key                | env                        | default                                        |
|--------------------|----------------------------|------------------------------------------------|
| ``data_dir``       | ``OMNI_EXT_API_DATA_DIR``  | ``~/.cache/omni-ext/api/port-<port>``           |
| ``ttl_s``          | ``OMNI_EXT_API_TTL_S``     | 86400 (finished media kept one day; 0 = keep)  |
| ``max_upload_mb``  | ``OMNI_EXT_API_MAX_UPLOAD_MB`` | 32                                          |
| ``max_queued``     | ``OMNI_EXT_API_MAX_QUEUED``| 256 admitted (queued+running) jobs, then 429   |
| ``max_store_mb``   | ``OMNI_EXT_API_MAX_STORE_MB`` | 20480: media kept (expired first, then 507); 0 = no quota |
| ``drain_s``        | ``OMNI_EXT_API_DRAIN_S``   | 30: on SIGTERM, running jobs get this long to finish (queued ones are kept for the next start) |
| ``admin_keys``     | ``OMNI_EXT_API_ADMIN_KEYS`` (comma-separated) | none: keys that see every job (:mod:`omni_ext.api.tenants`) |
| ``max_body_memory_mb``, ``body_wait_s``, ``header_timeout_s``, ``body_timeout_s``, ``body_min_rate_kib_s`` | ``OMNI_EXT_API_<KEY>`` | request bodies in memory and slow clients: :mod:`omni_ext.api.bodies` |

``data_dir`` holds ``jobs.sqlite`` (job metadata) and ``media/`` (mp4, thumbnails, images). Keyed by
port by default so that two servers on one host never share (and never fail) each other's jobs,
while a restart on the same port finds its jobs again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_ext.api import limits
from omni_ext.api.bodies import BodyLimits, load_body_limits
from omni_ext.scheduler.config import omni_ext_section


@dataclass(frozen=True)
class ApiSettings:
    data_dir: Path
    ttl_s: int = 86400
    max_upload_bytes: int = limits.MAX_UPLOAD_MB * 2**20
    max_queued: int = 256
    #: bytes of finished media the store keeps (0: no quota); past it expired jobs go first, then 507
    max_store_bytes: int = 20 * 2**30
    #: seconds a SIGTERM leaves running jobs to finish before the server stops (:mod:`omni_ext.api.drain`)
    drain_s: float = 30.0
    #: admin entries as given (keys or ``sha256:<hex>``); checked against the server's keys at start-up
    admin_keys: tuple[str, ...] = ()
    bodies: BodyLimits = BodyLimits()  # request bodies in memory and slow clients (:mod:`omni_ext.api.bodies`)
    #: the server's address as its clients reach it (``https://gen.example.com/omni``, behind a proxy), the base
    #: of ``url`` image links; None: the address the request came to
    public_url: str | None = None

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
    upload_mb = float(env.get("OMNI_EXT_API_MAX_UPLOAD_MB") or cfg.get("max_upload_mb", limits.MAX_UPLOAD_MB))
    max_queued = int(env.get("OMNI_EXT_API_MAX_QUEUED") or cfg.get("max_queued", 256))
    store_mb = float(env.get("OMNI_EXT_API_MAX_STORE_MB") or cfg.get("max_store_mb", 20480))
    if store_mb < 0:
        raise ValueError(f"omni_ext.api.max_store_mb must be >= 0 (0: no quota), got {store_mb:g}")
    drain_s = float(env.get("OMNI_EXT_API_DRAIN_S") or cfg.get("drain_s", 30))
    if drain_s < 0:
        raise ValueError(f"omni_ext.api.drain_s must be >= 0, got {drain_s:g}")
    admins = env.get("OMNI_EXT_API_ADMIN_KEYS")
    admin_keys = admins.split(",") if admins else cfg.get("admin_keys", [])
    if isinstance(admin_keys, str) or not all(isinstance(k, str) for k in admin_keys):
        raise ValueError("omni_ext.api.admin_keys must be a list of keys (or sha256:<hex> of keys)")
    return ApiSettings(data_dir=data_dir, ttl_s=ttl, max_upload_bytes=int(upload_mb * 2**20), max_queued=max_queued,
                       max_store_bytes=int(store_mb * 2**20), drain_s=drain_s, admin_keys=tuple(k.strip() for k in admin_keys if k.strip()),
                       bodies=load_body_limits(cfg, env, int(upload_mb * 2**20)),
                       public_url=public_url(env.get("OMNI_EXT_API_PUBLIC_URL") or cfg.get("public_url")))


def public_url(value: Any) -> str | None:
    """``omni_ext.api.public_url`` checked: an absolute http(s) URL without query or fragment, its trailing
    slash dropped (links are ``<public_url>/v1/images/<id>/content``); None when not set."""
    if value in (None, ""):
        return None
    from urllib.parse import urlsplit

    parts = urlsplit(str(value)) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"omni_ext.api.public_url must be an absolute http(s) URL without query, got {value!r}")
    return str(value).rstrip("/")
