"""Who may see a job: the API key that created it.

vLLM authenticates (``--api-key`` takes several keys; ``VLLM_API_KEY`` is its fallback) but a job, an
image and a request id had no owner, so any key holder could list every prompt, download every video
and delete every job. omni-ext authorizes on top: whatever a key creates is owned by that key, stored
as the SHA-256 of the key (never the key), and another key gets 404 (the same answer as an id that
does not exist, so ids are not disclosed) on GET, content, thumbnail and DELETE, and does not see it in
a list or in ``/v1/omni_ext/placements``.

Admin keys (``--additional-config '{"omni_ext": {"api": {"admin_keys": [...]}}}'``, or
``OMNI_EXT_API_ADMIN_KEYS`` comma-separated) see and manage every job. An entry is a key or
``sha256:<hex>`` of one, so a deploy file need not hold the key itself; each must also be one of
``--api-key``'s keys, since vLLM's middleware, not omni-ext, lets a request in.

With no key configured the server is single-tenant: every caller is an admin, as before.

Pure: no FastAPI or vLLM-Omni import.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_HEX = re.compile(r"^[0-9a-f]{64}$")
SHA_PREFIX = "sha256:"


def key_hash(key: str) -> str:
    """The stored owner of what ``key`` creates: SHA-256 hex of the key's UTF-8 bytes (as vLLM hashes it)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def bearer(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (vLLM's parsing), or None."""
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    return key if scheme.lower() == "bearer" else None


def admin_hashes(entries: Iterable[str]) -> frozenset[str]:
    """Admin entries (keys, or ``sha256:<hex>``) as owner hashes; a malformed hash is a start-up error."""
    out = set()
    for entry in entries:
        entry = entry.strip()
        if not entry:
            continue
        if entry.startswith(SHA_PREFIX):
            digest = entry[len(SHA_PREFIX):].lower()
            if not _HEX.match(digest):
                raise ValueError(f"omni_ext.api.admin_keys: {entry[:16]}... is not sha256: and 64 hex digits")
            out.add(digest)
        else:
            out.add(key_hash(entry))
    return frozenset(out)


@dataclass(frozen=True)
class Tenant:
    """The caller: ``owner`` (its key's hash; None on a server without keys) and whether it sees all."""

    owner: str | None
    admin: bool

    def sees(self, owner: str | None) -> bool:
        """Whether this caller may see and manage what ``owner`` created."""
        return self.admin or (owner is not None and owner == self.owner)

    @property
    def scope(self) -> str | None:
        """The owner a list is restricted to, or None for every job ("" matches no job: a caller without an
        owner on a keyed server sees nothing)."""
        return None if self.admin else (self.owner or "")


SINGLE_TENANT = Tenant(owner=None, admin=True)


@dataclass(frozen=True)
class Tenancy:
    """The server's rule: ``keyed`` when vLLM checks keys; ``admins``: the admin keys' hashes."""

    keyed: bool = False
    admins: frozenset[str] = frozenset()

    def tenant(self, authorization: str | None) -> Tenant:
        if not self.keyed:
            return SINGLE_TENANT
        key = bearer(authorization)
        if key is None:  # vLLM's middleware lets no such request reach a /v1 route; never an owner
            return Tenant(owner=None, admin=False)
        owner = key_hash(key)
        return Tenant(owner=owner, admin=owner in self.admins)


def server_keys(args: Any, environ: Mapping[str, str] | None = None) -> list[str]:
    """The keys vLLM's middleware accepts, by its own rule: ``--api-key`` over ``VLLM_API_KEY``."""
    env = os.environ if environ is None else environ
    keys = getattr(args, "api_key", None) or [env.get("VLLM_API_KEY")]
    if isinstance(keys, str):
        keys = [keys]
    return [k for k in keys if k]


def tenancy(args: Any, admin_entries: Iterable[str], environ: Mapping[str, str] | None = None) -> Tenancy:
    """The rule for a server started with ``args``. An admin entry that is not one of the server's keys is
    a start-up error: vLLM would refuse that key, and the operator would find out on the first call."""
    keys = server_keys(args, environ)
    admins = admin_hashes(admin_entries)
    if admins and not keys:
        raise ValueError("omni_ext.api.admin_keys is set but the server has no --api-key: with no key every "
                         "caller already sees every job")
    unknown = admins - {key_hash(k) for k in keys}
    if unknown:
        raise ValueError(f"omni_ext.api.admin_keys: {len(unknown)} entry(ies) match none of --api-key's keys "
                         "(an admin key must also be one of the server's keys)")
    return Tenancy(keyed=bool(keys), admins=admins)
