"""Signed, expiring ``url`` image links.

An ``<img src>`` (the playground's, a chat UI's, a browser's) cannot send ``Authorization: Bearer``,
so on a keyed server a plain link answers 401. With ``omni_ext.api.signed_url_ttl_s`` set, a ``url``
link carries ``expires`` (Unix seconds) and ``signature`` (HMAC-SHA256 of the path and the expiry
under a secret kept in the server's data directory, so a restart keeps its links working). Such a
link is a capability, like an S3 presigned URL: whoever holds it gets that one image, with or
without a key, until it expires. Nothing else is reachable with it: only an image's ``content``
path is ever signed or accepted, and the key check of vLLM's middleware stays on for every other path.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path
from urllib.parse import parse_qs, urlencode

#: The only paths a signature opens (an image id is ``img_`` and 32 hex digits, see omni_ext.api.images).
SIGNABLE = re.compile(r"^/v1/images/img_[0-9a-f]{32}/content$")
KEY_FILE = "url-signing.key"


def load_secret(data_dir: Path) -> bytes:
    """The server's signing secret: 32 random bytes in ``data_dir``, made on the first start (mode 0600)."""
    path = Path(data_dir) / KEY_FILE
    try:
        secret = path.read_bytes()
        if len(secret) >= 32:
            return secret
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret := secrets.token_bytes(32))
    return secret


def signature(secret: bytes, path: str, expires: int) -> str:
    return hmac.new(secret, f"{path}\n{expires}".encode(), hashlib.sha256).hexdigest()


def link_query(secret: bytes, path: str, now: float, ttl_s: int) -> str:
    """The query string that lets ``path`` be fetched without a key for ``ttl_s`` seconds from ``now``."""
    expires = int(now) + int(ttl_s)
    return urlencode({"expires": expires, "signature": signature(secret, path, expires)})


def verify(secret: bytes | None, path: str, query: str, now: float) -> bool:
    """Whether ``query`` signs ``path`` (a signable path) and has not expired at ``now``."""
    if secret is None or not SIGNABLE.match(path):
        return False
    q = parse_qs(query)
    expires, sig = q.get("expires", [""])[0], q.get("signature", [""])[0]
    if not expires.isdigit() or not sig or int(expires) < now:
        return False
    return hmac.compare_digest(signature(secret, path, int(expires)), sig)
