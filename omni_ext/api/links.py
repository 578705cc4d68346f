"""The absolute base of the links the API hands out (``url`` images), as the client reaches the server.

Behind a reverse proxy the address a request came to (``request.base_url``) is the proxy's upstream,
not what the client can open. In order:

1. ``omni_ext.api.public_url``, when set: the operator says where the server is reached;
2. the proxy's own account, only from a peer listed in ``omni_ext.api.trusted_proxies``: RFC 7239's
   ``Forwarded`` (its first element's ``proto`` and ``host``), else ``X-Forwarded-Proto`` /
   ``X-Forwarded-Host`` (their first values, the client-facing hop), and ``X-Forwarded-Prefix`` for a
   server mounted under a path. A header from any other peer is ignored: anyone can send one, and a
   link built from it would point the client elsewhere;
3. the address the request came to.

Pure functions of the settings, the peer and the headers (unit-tested); the routes call :func:`base`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from typing import Any

#: A host as a proxy may forward it: a name or an IPv4 address with an optional port, or a bracketed IPv6 one.
_HOST = re.compile(r"^(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::\d{1,5})?$")
#: A path prefix: segments of URL-safe characters.
_PREFIX = re.compile(r"^(?:/[A-Za-z0-9._~!$&'()*+,;=:@%-]+)*/?$")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def trusted_networks(value: Any) -> tuple[Network, ...]:
    """``omni_ext.api.trusted_proxies`` checked: addresses or CIDR networks (a list, or a comma-separated
    string as the environment variable gives it); a ``ValueError`` naming a bad one."""
    items: Iterable[Any] = value.split(",") if isinstance(value, str) else (value or ())
    out = []
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        try:
            out.append(ipaddress.ip_network(text, strict=False))
        except ValueError:
            raise ValueError(f"omni_ext.api.trusted_proxies: {text!r} is not an IP address or network") from None
    return tuple(out)


def is_trusted(peer: str | None, networks: tuple[Network, ...]) -> bool:
    if not peer or not networks:
        return False
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return any(address in net for net in networks)


def _first(value: str | None) -> str | None:
    first = (value or "").split(",")[0].strip()
    return first or None


def _forwarded(value: str | None) -> dict[str, str]:
    """The first element of an RFC 7239 ``Forwarded`` header: its ``proto`` and ``host`` (quotes removed)."""
    out: dict[str, str] = {}
    for pair in (_first(value) or "").split(";"):
        name, _, val = pair.partition("=")
        name = name.strip().lower()
        if name in ("proto", "host") and val.strip():
            out[name] = val.strip().strip('"')
    return out


def forwarded_base(headers: Mapping[str, str]) -> str | None:
    """The client-facing base a proxy reports (None: the headers name no valid host)."""
    fwd = _forwarded(headers.get("forwarded"))
    proto = (fwd.get("proto") or _first(headers.get("x-forwarded-proto")) or "").lower()
    host = fwd.get("host") or _first(headers.get("x-forwarded-host"))
    if not host or not _HOST.match(host):
        return None
    if proto not in ("http", "https"):
        proto = "http"
    prefix = _first(headers.get("x-forwarded-prefix")) or ""
    if not _PREFIX.match(prefix):
        prefix = ""
    return f"{proto}://{host}{prefix.rstrip('/')}"


def link_base(public_url: str | None, networks: tuple[Network, ...], peer: str | None,
              headers: Mapping[str, str], request_base: str) -> str:
    """The base of a link, by the rules of the module docstring (no trailing slash)."""
    if public_url:
        return public_url
    if is_trusted(peer, networks):
        forwarded = forwarded_base(headers)
        if forwarded:
            return forwarded
    return request_base.rstrip("/")


def base(request: Any, settings: Any) -> str:
    """:func:`link_base` of a Starlette request under the API's settings."""
    client = getattr(request, "client", None)
    return link_base(settings.public_url, settings.trusted_proxies, getattr(client, "host", None), request.headers,
                     str(request.base_url))
