"""omni-ext's HTTP routes, assembled into one router for vLLM-Omni's API server.

Errors: every route here uses :class:`ErrorRoute`, which turns :class:`APIError` (and anything
unexpected) into an OpenAI-style JSON error instead of relying on app-level exception handlers,
so the behaviour does not depend on what vLLM or vLLM-Omni register on the app.
"""

from __future__ import annotations

import logging

from http import HTTPStatus
from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from omni_ext.api.gate import BodyGate
from omni_ext.api.disconnect import CLIENT_CLOSED, ClientGone
from omni_ext.api.errors import APIError
from omni_ext.api.intake import ID_RE

logger = logging.getLogger("omni_ext.api")

# (path, methods) of vLLM-Omni 0.30 routes that omni-ext replaces.
REPLACED_ROUTES: tuple[tuple[str, frozenset[str]], ...] = (
    ("/v1/videos", frozenset({"POST", "GET"})),
    ("/v1/videos/sync", frozenset({"POST"})),
    ("/v1/videos/{video_id}", frozenset({"GET", "DELETE"})),
    ("/v1/videos/{video_id}/content", frozenset({"GET"})),
    ("/v1/images/generations", frozenset({"POST"})),
)
#: The routes that take a body, behind a :class:`~omni_ext.api.gate.BodyGate` (memory budget, slow clients).
BODY_PATHS = ("/v1/videos", "/v1/videos/sync", "/v1/images/generations", "/v1/images/edits")


def settings_of(app_state: Any) -> Any:
    """The API's settings from the app's state (503 before start-up), for :class:`BodyGate`."""
    from omni_ext.api.state import state_of

    return state_of(app_state).settings


class ErrorRoute(APIRoute):
    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        if path in BODY_PATHS and "POST" in self.methods:  # also the copies FastAPI's include_router makes
            self.app = BodyGate(self.app, settings_of)

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            try:
                api = getattr(request.app.state, "omni_ext", None)
                if api is not None:  # who calls, resolved once, as authentication is (omni_ext.api.tenants)
                    request.state.omni_ext_tenant = api.tenancy.tenant(request.headers.get("authorization"))
                return await handler(request)
            except APIError as exc:
                return exc.response()
            except ClientGone:
                return Response(status_code=CLIENT_CLOSED)
            except Exception as exc:
                if getattr(exc, "status_code", None) and 400 <= exc.status_code < 500:  # FastAPI/Starlette HTTPException
                    return APIError(exc.status_code, str(getattr(exc, "detail", exc))).response()
                logger.exception("omni-ext route %s failed", request.url.path)
                return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"Internal error: {exc}", code="internal_error").response()

        return run


def build_router(stock_edits_app: Any = None, stock_generations_app: Any = None) -> APIRouter:
    """omni-ext's routes; ``stock_edits_app`` is vLLM-Omni's /v1/images/edits endpoint (kept for models that
    edit), ``stock_generations_app`` its /v1/images/generations endpoint (kept for multi-stage models)."""
    from starlette.routing import Route

    from omni_ext.api import images, placements, playground, videos

    router = APIRouter(route_class=ErrorRoute)
    for sub in (videos.router, images.router):
        for route in sub.routes:
            assert isinstance(route, APIRoute)
            router.add_api_route(route.path, route.endpoint, methods=list(route.methods), name=route.name,
                                 include_in_schema=True, response_class=JSONResponse,
                                 openapi_extra=route.openapi_extra)
    if stock_generations_app is not None:  # in front of omni-ext's route (which stays for the OpenAPI schema)
        ours = next(r for r in router.routes if getattr(r, "path", None) == "/v1/images/generations")
        router.routes.insert(0, Route("/v1/images/generations", GenerationsDispatch(ours.app, stock_generations_app),
                                      methods=["POST"], include_in_schema=False))
    router.routes.append(Route("/v1/images/edits", BodyGate(EditsDispatch(stock_edits_app), settings_of),
                               methods=["POST"]))
    playground.install(router)
    placements.install(router)
    for kind in ("videos", "images"):  # after the real routes: anything else under them is a clean 400/404
        router.add_api_route(f"/v1/{kind}/{{rest:path}}", _unknown_path, methods=["GET", "POST", "DELETE"],
                             include_in_schema=False)
    return router


async def _unknown_path(request: Request, rest: str) -> JSONResponse:
    first = rest.split("/", 1)[0]
    if not ID_RE.match(first):
        raise APIError(HTTPStatus.BAD_REQUEST, "Invalid id in path.", param="id", code="invalid_id")
    raise APIError(HTTPStatus.NOT_FOUND, f"No route for {request.method} {request.url.path}.", code="not_found")


class GenerationsDispatch:
    """ASGI endpoint for ``POST /v1/images/generations``: omni-ext's route for a model served as one
    diffusion stage; vLLM-Omni's own route for a multi-stage pipeline (an AR stage before the diffusion
    one: BAGEL, HunyuanImage-3, GLM-Image ...), which it builds through its chat handler and which
    omni-ext's single-stage call cannot run. Decided per request from the served stages, as vLLM-Omni's
    route decides it."""

    def __init__(self, ours: Any, stock_app: Any) -> None:
        self.ours, self.stock_app = ours, stock_app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        stages = getattr(scope["app"].state, "stage_configs", None) or ()
        await (self.stock_app if len(stages) > 1 else self.ours)(scope, receive, send)


class EditsDispatch:
    """ASGI endpoint for ``POST /v1/images/edits``: omni-ext's intake and answer around vLLM-Omni's edit
    endpoint (:mod:`omni_ext.api.edits`) for models that take a reference image (vLLM-Omni's own
    metadata and class flags: Qwen-Image-Edit, FLUX.2, OmniGen2, LongCat-Image-Edit ...), a clear
    OpenAI-style 400 for those that cannot (instead of a confusing engine error)."""

    def __init__(self, stock_app: Any) -> None:
        self.stock_app = stock_app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from omni_ext.api.edits import edit_images
        from omni_ext.api.state import state_of

        try:
            state = state_of(scope["app"].state)
            if not (state.limits.image_input and self.stock_app is not None):
                raise APIError(HTTPStatus.BAD_REQUEST, f"The served model ({state.limits.pipeline or 'unknown'}) "
                               "does not support image edits; use /v1/images/generations.", param="image",
                               code="unsupported_model")
            response = await edit_images(scope, receive, self.stock_app)
        except APIError as err:  # 503 before start-up, 400, 404, 413, 429, 500 ...
            response = err.response()
        except ClientDisconnect:
            return
        except ClientGone:
            response = Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            logger.exception("omni-ext route /v1/images/edits failed")
            response = APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"Internal error: {exc}", code="internal_error").response()
        await response(scope, receive, send)

