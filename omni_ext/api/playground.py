"""The playground: a page at ``/playground`` (``/`` redirects there) to try the server in a browser,
and the one read-only route it needs beyond the public API, ``GET /v1/omni_ext/info``.

The page is three static files shipped in the package (``omni_ext/api/static/``), no build step
and nothing fetched from elsewhere. It talks to the public routes exactly as the OpenAI SDK does,
with the API key the user typed (kept in the tab's session storage, sent as a Bearer header), so the
page itself is public and holds no secret; ``/v1/omni_ext/info`` is under ``/v1`` and so behind
``--api-key`` like every other route. A strict Content-Security-Policy (scripts, styles, fetches
from this origin only; media from ``blob:`` object URLs) backs up the page's rule of rendering every
string as text.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from omni_ext.api import bodies, limits
from omni_ext.scheduler.layout import TUNED_EXECUTOR
from omni_ext.api.state import get_state, native_video_defaults, served_layout

PATH = "/playground"
INFO_PATH = "/v1/omni_ext/info"
#: name -> media type of the files under ``omni_ext/api/static`` that the page is made of.
FILES = {"playground.html": "text/html; charset=utf-8", "playground.js": "text/javascript; charset=utf-8",
         "playground.css": "text/css; charset=utf-8"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; media-src 'self' blob:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}


@functools.cache
def static_file(name: str) -> bytes:
    return resources.files("omni_ext.api").joinpath("static", name).read_bytes()


def size_choices(width: int, height: int, multiple: int) -> list[str]:
    """The sizes the page offers for a model whose native size is ``width`` x ``height`` and whose
    sides must be multiples of ``multiple`` (0: unknown, 16 assumed): the native size first, then
    its transpose, the native aspect at 1/2, 1/4 and 1/8, and squares of 2-16 multiples (small sizes
    are what a CPU or a quick look can afford). Every entry passes the server's size check."""
    m = multiple or 16

    def fit(v: float) -> int:
        return max(m, int(round(v / m)) * m)

    out = [(width, height), (height, width)]
    out += [(fit(width / k), fit(height / k)) for k in (2, 4, 8)]
    out += [(m * k, m * k) for k in (16, 8, 4, 2) if m * k <= max(width, height)]
    seen: list[str] = []
    for w, h in out:
        size = f"{w}x{h}"
        if size not in seen and w * h <= limits.MAX_PIXELS:
            seen.append(size)
    return seen


def server_info(state: Any, app_state: Any) -> dict[str, Any]:
    """What the page shows of the server: the model, what it makes and its native shape, the bounds
    of the form's fields, the layout and the queue. Read from the API state; nothing is decided here."""
    lim = state.limits
    family = lim.family
    is_video = lim.is_video
    if is_video:
        native = dict(state.video.defaults if state.video is not None else native_video_defaults(lim))
    else:
        native = {"width": family.native.width, "height": family.native.height} if family else {}
    if family is not None:
        native["steps"] = family.native.steps
    layout, why = served_layout(app_state, getattr(app_state, "args", None), lim.pipeline)
    sizes = size_choices(native["width"], native["height"], lim.spatial_multiple) if "width" in native else []
    return {
        "object": "omni_ext.info",
        "model": state.model_name,
        "pipeline": lim.pipeline,
        "family": family.name if family else None,
        "kind": "video" if is_video else "image",
        "native": native,
        "sizes": sizes,
        "spatial_multiple": lim.spatial_multiple,
        "guidance": {"field": "true_cfg_scale" if family is not None and family.cfg_rule == "qwen-image"
                     else "guidance_scale", "default": family.default_guidance if family else None},
        "limits": {"min_steps": max(limits.MIN_STEPS, lim.min_steps),
                   "max_steps": limits.MAX_VIDEO_STEPS if is_video else limits.MAX_STEPS,
                   "max_guidance": limits.MAX_VIDEO_GUIDANCE if is_video else None,
                   "max_seconds": limits.MAX_SECONDS, "max_frames": limits.MAX_FRAMES,
                   "max_outputs": limits.MAX_OUTPUTS, "max_seed": limits.MAX_SEED,
                   "max_prompt_chars": limits.MAX_PROMPT_CHARS,
                   "max_prompt_tokens": state.prompt_tokens.bound if state.prompt_tokens else None,
                   "min_priority": limits.MIN_PRIORITY, "max_priority": limits.MAX_PRIORITY},
        "layout": {"executor": TUNED_EXECUTOR if layout.tuned else "vLLM-Omni", "cfg_parallel_size": layout.cfg,
                   "data_parallel_size": layout.dp, "replicas": layout.replicas, "cfg_mode": state.queue.config.cfg_mode,
                   "priorities": layout.tuned, "max_wait_s": state.queue.config.max_wait_s, "why": why},
        "queue": state.queue.summary(),
        # request bodies in memory and slow clients: the bounds and what they refused (omni_ext.api.bodies)
        "bodies": bodies.info(app_state, state.settings.bodies, state.settings.max_upload_bytes),
        "public_url": state.settings.public_url,
        # streamed generations show previews decoded by the worker (omni_ext.partials)
        "partial_images": bool(family is not None and family.partial_images and not is_video),
    }


def _file(name: str) -> Response:
    return Response(static_file(name), media_type=FILES[name], headers=HEADERS)


async def page(request: Request) -> Response:
    return _file("playground.html")


async def script(request: Request) -> Response:
    return _file("playground.js")


async def style(request: Request) -> Response:
    return _file("playground.css")


async def root(request: Request) -> Response:
    return RedirectResponse(PATH, status_code=307)


async def info(request: Request) -> JSONResponse:
    state = get_state(request)
    body = server_info(state, request.app.state)
    # what the caller's key may see (omni_ext.api.tenants): its own jobs, or every job (admin / no keys)
    body["access"] = {"api_keys": state.tenancy.keyed, "sees": "all" if state.tenant(request).admin else "own"}
    quota = state.settings.max_store_bytes
    body["store"] = {"ttl_s": state.settings.ttl_s, "max_store_mb": round(quota / 2**20, 3) if quota else None,
                     "used_mb": round(state.media_bytes / 2**20, 3)}
    return JSONResponse(body)


def install(router: APIRouter) -> None:
    """Add the page, its files, the info route, and ``GET /`` -> the page. vLLM and vLLM-Omni 0.30 serve
    nothing at ``/``, and Starlette takes the first route that matches, so a ``/`` the app registered
    before this router still wins."""
    for path, endpoint in ((PATH, page), (f"{PATH}/playground.js", script), (f"{PATH}/playground.css", style),
                           ("/", root)):
        router.add_api_route(path, endpoint, methods=["GET"], include_in_schema=False)
    router.add_api_route(INFO_PATH, info, methods=["GET"], name="omni_ext_info")
