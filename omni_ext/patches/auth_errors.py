"""Patch body for ``openai-auth-errors`` (see the registry in ``omni_ext.patches``).

vLLM's ``--api-key`` middleware rejects with ``{"error": "Unauthorized"}``, which OpenAI SDKs
cannot read (``error.message`` is missing). Same check, same status (401), OpenAI-shaped body.
A signed image link (:mod:`omni_ext.api.signed`) passes without a key: the hook only asks the API
state, which checks the signature (the route checks it again).
"""

from __future__ import annotations

from omni_ext.patches import patch_attr


def apply() -> None:
    from starlette.datastructures import Headers
    from starlette.responses import JSONResponse
    from vllm.entrypoints.serve.middleware import authenticate as auth

    cls = auth.AuthenticationMiddleware

    def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return self.app(scope, receive, send)
        url_path = scope["path"].removeprefix(scope.get("root_path", ""))
        if (url_path.startswith(auth.GUARDED_PREFIX) and not self.verify_token(Headers(scope=scope))
                and not _signed(scope, url_path)):
            body = {"error": {"message": "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                              "type": "authentication_error", "param": None, "code": "invalid_api_key"}}
            return JSONResponse(body, status_code=401)(scope, receive, send)
        return self.app(scope, receive, send)

    patch_attr(cls, "__call__", __call__)


def _signed(scope, url_path: str) -> bool:
    """A signed image link (omni_ext.api.signed) is let in without a key; the route checks it again."""
    from omni_ext.api.signed import SIGNABLE

    app = scope.get("app")
    if app is None or not SIGNABLE.match(url_path):
        return False
    try:
        from omni_ext.api.state import state_of

        return state_of(app.state).signed_request(url_path, scope.get("query_string", b"").decode("latin-1"))
    except Exception:  # before start-up (no state yet): the key is needed
        return False
