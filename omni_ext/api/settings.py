"""Settings of omni-ext's HTTP routes, read through vLLM-Omni's own configuration channel.

``vllm-omni serve MODEL --omni --additional-config '{"omni_ext": {"api": {...}}}'`` (or the same keys
in a deploy YAML), with environment variables as overrides for operators and tests: every key, its
variable and its default is a row of :data:`SETTINGS` (the reference page
``docs/reference/additional-config.md`` is generated from them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_ext.api import bodies, limits, links
from omni_ext.api.bodies import BodyLimits, load_body_limits
from omni_ext.scheduler.config import Option, omni_ext_section

#: Every key of ``omni_ext.api``; its environment variable, when set, wins over it.
SETTINGS: tuple[Option, ...] = (
    Option("data_dir", "string (a path)", None,
           "Holds `jobs.sqlite` (job metadata) and `media/` (videos, thumbnails, images). Default "
           "`~/.cache/omni-ext/api/port-<port>`: keyed by port, so that two servers on one host never share "
           "each other's jobs, while a restart on the same port finds its jobs again.", "OMNI_EXT_API_DATA_DIR"),
    Option("ttl_s", "integer", 86400, "Seconds a finished job's media are kept. 0: kept for ever.",
           "OMNI_EXT_API_TTL_S"),
    Option("max_upload_mb", "number", limits.MAX_UPLOAD_MB,
           "MiB of one request body; past it, 413 before the rest is read.", "OMNI_EXT_API_MAX_UPLOAD_MB"),
    Option("max_queued", "integer", 256, "Admitted (queued and running) jobs; past it, 429.",
           "OMNI_EXT_API_MAX_QUEUED"),
    Option("max_store_mb", "number", 20480,
           "MiB of finished media kept: past it expired jobs go first, then new results are refused with 507. "
           "0: no quota.", "OMNI_EXT_API_MAX_STORE_MB"),
    Option("drain_s", "number", 30.0,
           "Seconds a SIGTERM leaves running jobs to finish before the server stops; queued jobs are kept for "
           "the next start.", "OMNI_EXT_API_DRAIN_S"),
    Option("admin_keys", "list of strings", (),
           "API keys (or `sha256:<hex>` of keys) that see and manage every job; the variable is "
           "comma-separated.", "OMNI_EXT_API_ADMIN_KEYS"),
    Option("public_url", "string (an http(s) URL)", None,
           "The server's address as its clients reach it (behind a proxy), the base of `url` image links; "
           "unset: the address the request came to.", "OMNI_EXT_API_PUBLIC_URL"),
    Option("trusted_proxies", "list of strings (IP addresses or networks)", (),
           "Peers (a reverse proxy) whose `Forwarded` or `X-Forwarded-Proto`/`-Host`/`-Prefix` headers set the "
           "base of `url` image links when `public_url` is unset (omni_ext.api.links); headers from any other "
           "peer are ignored. The variable is comma-separated.", "OMNI_EXT_API_TRUSTED_PROXIES"),
    Option("signed_url_ttl_s", "integer", 0,
           "Seconds a `url` image link works without the API key (a signed, expiring link an `<img>` tag can "
           "load; omni_ext.api.signed). 0: a link needs the key like every other path.",
           "OMNI_EXT_API_SIGNED_URL_TTL_S"),
    *bodies.SETTINGS,
)
_SETTING: dict[str, Option] = {s.key: s for s in SETTINGS}


@dataclass(frozen=True)
class ApiSettings:
    data_dir: Path
    ttl_s: int = _SETTING["ttl_s"].default
    max_upload_bytes: int = _SETTING["max_upload_mb"].default * 2**20
    max_queued: int = _SETTING["max_queued"].default
    #: bytes of finished media the store keeps (0: no quota); past it expired jobs go first, then 507
    max_store_bytes: int = _SETTING["max_store_mb"].default * 2**20
    #: seconds a SIGTERM leaves running jobs to finish before the server stops (:mod:`omni_ext.api.drain`)
    drain_s: float = _SETTING["drain_s"].default
    #: admin entries as given (keys or ``sha256:<hex>``); checked against the server's keys at start-up
    admin_keys: tuple[str, ...] = ()
    bodies: BodyLimits = BodyLimits()  # request bodies in memory and slow clients (:mod:`omni_ext.api.bodies`)
    #: the server's address as its clients reach it (``https://gen.example.com/omni``, behind a proxy), the base
    #: of ``url`` image links; None: the address the request came to
    public_url: str | None = None
    #: seconds a ``url`` image link works without the key (:mod:`omni_ext.api.signed`); 0: never
    signed_url_ttl_s: int = 0
    #: peers whose forwarded headers set the base of links when ``public_url`` is unset (:mod:`omni_ext.api.links`)
    trusted_proxies: tuple[Any, ...] = ()

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

    def value(key: str) -> Any:
        setting = _SETTING[key]
        return env.get(setting.env) or cfg.get(key, setting.default)

    port = getattr(args, "port", None) or 8000
    default_dir = Path.home() / ".cache" / "omni-ext" / "api" / f"port-{port}"
    data_dir = Path(value("data_dir") or default_dir).expanduser()
    ttl = int(value("ttl_s"))
    upload_mb = float(value("max_upload_mb"))
    max_queued = int(value("max_queued"))
    store_mb = float(value("max_store_mb"))
    if store_mb < 0:
        raise ValueError(f"omni_ext.api.max_store_mb must be >= 0 (0: no quota), got {store_mb:g}")
    drain_s = float(value("drain_s"))
    if drain_s < 0:
        raise ValueError(f"omni_ext.api.drain_s must be >= 0, got {drain_s:g}")
    signed_ttl = int(value("signed_url_ttl_s"))
    if signed_ttl < 0:
        raise ValueError(f"omni_ext.api.signed_url_ttl_s must be >= 0 (0: links need the key), got {signed_ttl}")
    admins = env.get(_SETTING["admin_keys"].env)
    admin_keys = admins.split(",") if admins else value("admin_keys")
    if isinstance(admin_keys, str) or not all(isinstance(k, str) for k in admin_keys):
        raise ValueError("omni_ext.api.admin_keys must be a list of keys (or sha256:<hex> of keys)")
    return ApiSettings(data_dir=data_dir, ttl_s=ttl, max_upload_bytes=int(upload_mb * 2**20), max_queued=max_queued,
                       max_store_bytes=int(store_mb * 2**20), drain_s=drain_s, admin_keys=tuple(k.strip() for k in admin_keys if k.strip()),
                       bodies=load_body_limits(cfg, env, int(upload_mb * 2**20)),
                       public_url=public_url(value("public_url")), signed_url_ttl_s=signed_ttl,
                       trusted_proxies=links.trusted_networks(value("trusted_proxies")))


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
