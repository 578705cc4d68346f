"""Patch body for ``openai-routes`` (see the registry in ``omni_ext.patches``).

Runs in the API process from the ``vllm.general_plugins`` hook, i.e. while ``vllm-omni serve``
builds its CLI parser, before ``omni_run_server_worker`` includes vLLM-Omni's module-level router
into the app. It swaps vLLM-Omni's video/image routes on that router for omni-ext's, puts a
dispatcher in front of ``/v1/images/edits`` and one in front of ``/v1/images/generations`` (vLLM-Omni's
route for multi-stage models), puts :func:`omni_ext.healing.health_route` in front of its ``/health``, and wraps ``omni_init_app_state`` so omni-ext's job
store opens (and fails interrupted jobs) and the healing watch starts (:func:`omni_ext.healing.watch`)
when the server starts, not on the first request. That is
where the API gets this process's dispatch to replicas (:data:`omni_ext.dispatch.replicas.DISPATCH`):
the API holds it and reads its live capacity and binding times from it.
"""

from __future__ import annotations

import functools

from omni_ext.patches import is_patched, mark, patch_attr


def apply() -> None:
    from vllm_omni.entrypoints.openai import api_server
    from vllm_omni.entrypoints.serve.utils.routes import _remove_route_from_router

    from omni_ext import healing
    from omni_ext.api import drain
    from omni_ext.api.routes import REPLACED_ROUTES, build_router
    from omni_ext.api.state import init_state
    from omni_ext.dispatch.replicas import DISPATCH

    router = api_server.router
    if is_patched(router):
        return
    def stock(path: str) -> object:
        return next((r for r in router.routes if getattr(r, "path", None) == path and "POST" in getattr(r, "methods", ())),
                    None)

    stock_generations = stock("/v1/images/generations")  # kept for multi-stage models (routes.GenerationsDispatch)
    for path, methods in REPLACED_ROUTES:
        _remove_route_from_router(router, path, set(methods))
    stock_edits = stock("/v1/images/edits")
    if stock_edits is not None:
        _remove_route_from_router(router, "/v1/images/edits", {"POST"})
    router.include_router(build_router(getattr(stock_edits, "app", None), getattr(stock_generations, "app", None)))
    stock_health = next((r for r in router.routes if getattr(r, "path", None) == "/health"), None)
    if stock_health is not None:  # answers "respawning" while the TunedExecutor replaces its workers
        _remove_route_from_router(router, "/health", {"GET"})
        router.add_api_route("/health", healing.health_route(stock_health.endpoint), methods=["GET"],
                             include_in_schema=False)
    mark(router)

    original_init = api_server.omni_init_app_state

    @functools.wraps(original_init)
    async def omni_init_app_state(engine_client, state, args, *a, **kw):
        result = await original_init(engine_client, state, args, *a, **kw)
        drain.start(init_state(state, args, DISPATCH), state)
        healing.watch()
        return result

    patch_attr(api_server, "omni_init_app_state", omni_init_app_state)
