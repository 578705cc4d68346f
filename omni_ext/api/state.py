"""Per-server state of omni-ext's routes: settings, the job store, running tasks, model facts, and
the account of admitted jobs (:class:`~omni_ext.api.queue.RequestQueue`).

Created once per API process, and only there, when vLLM-Omni initialises its app state (the
``openai-routes`` patch calls :func:`init_state`), which is also when jobs left queued/running by a
previous process are marked failed, the expiry sweeper starts, the scheduler's options are read (a
bad one stops the server there) and given to this process's dispatch to replicas (which the
start-up hook passes in), and vLLM-Omni's video handler and the request defaults it implies are
resolved (:class:`VideoBackend`). No request does start-up work: one that comes before (or
without) it is answered 503 (:func:`get_state`, :func:`video_state`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from pathlib import Path
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from omni_ext.api import media
from omni_ext.api.errors import APIError, bad_request, not_found, storage
from omni_ext.api.intake import ID_RE, ModelLimits
from omni_ext.api.jobs import Job, JobStore
from omni_ext.scheduler.layout import ServerLayout, diffusion_stage, server_layout
from omni_ext.api.queue import Admitted, RequestQueue
from omni_ext.api.settings import ApiSettings, load_settings
from omni_ext.api.validation import limits_for_model
from omni_ext.scheduler.config import scheduler_config

if TYPE_CHECKING:
    from fastapi import Request

    from omni_ext.dispatch.replicas import ReplicaDispatch

logger = logging.getLogger("omni_ext.api")

VIDEO_FIELDS = ("width", "height", "num_frames", "fps")
VIDEO_UNAVAILABLE = "Video generation is not available on this server."


@dataclass(frozen=True)
class VideoBackend:
    """vLLM-Omni's video handler, and what a video request that names no size or length gets."""

    handler: Any
    #: ``width``/``height``/``num_frames``/``fps``: the operator's configured defaults (deploy YAML,
    #: ``--default-sampling-params``; a preset's) over the model family's native shape.
    defaults: dict[str, int]


@dataclass
class ApiState:
    settings: ApiSettings
    store: JobStore
    model_name: str
    model_path: str
    limits: ModelLimits
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    #: The admission handles of running async video jobs, by job id: ``DELETE`` has only the id, and
    #: reports the cancellation through the job's handle (its task reports the rest of its life).
    admitted: dict[str, Admitted] = field(default_factory=dict)
    queue: RequestQueue = field(default_factory=RequestQueue)
    sweeper: asyncio.Task | None = None
    video: VideoBackend | None = None  # resolved at start-up; None: this server has no video handler

    def media_path(self, name: str) -> Path:
        return self.settings.media_dir / name

    def find_job(self, kind: str, ident: str) -> Job:
        """The ``kind`` job (``video``/``image``) with id ``ident``: 400 for a malformed id, 404 if unknown."""
        if not ID_RE.match(ident):
            raise bad_request(f"Invalid {kind} id.", f"{kind}_id", "invalid_id")
        job = self.store.get(ident)
        if job is None or job.kind != kind:
            raise not_found(kind, ident)
        return job

    async def read_media(self, job: Job, variant: str, subject: str) -> bytes:
        """A finished job's stored file, read off the event loop; 404 once expired or removed.

        ``subject`` starts the error message (``"The content of video X"``, ``"Image X"``).
        """
        name = job.media.get(variant)
        param = f"{job.kind}_id"
        if not name:
            raise APIError(HTTPStatus.NOT_FOUND, f"{subject} has expired.", param=param, code=f"{job.kind}_expired")
        with storage(f"reading {name}"):  # another OSError (an unreadable media directory): 500 storage_error
            try:
                return await media.off_loop(self.media_path(name).read_bytes)
            except FileNotFoundError:
                raise APIError(HTTPStatus.NOT_FOUND, f"{subject} is no longer stored.", param=param,
                               code=f"{job.kind}_content_missing") from None

    def remove_media(self, job: Job) -> None:
        self.remove_files(job.media.values())

    def remove_files(self, names: Iterable[str]) -> None:
        """Remove media files (missing ones, or a media directory that is not one, are no error)."""
        for name in names:
            try:
                self.media_path(name).unlink(missing_ok=True)
            except OSError as exc:
                logger.warning("omni-ext: could not remove media file %s: %s", name, exc)

    async def sweep_expired(self) -> int:
        expired = self.store.expired()
        for job in expired:
            self.remove_media(job)
            job.media = {}
            job.meta["expired"] = True
            self.store.save(job)
        if expired:
            logger.info("omni-ext: removed media of %d expired job(s)", len(expired))
        return len(expired)

    async def _sweep_forever(self) -> None:
        period = max(5.0, min(300.0, self.settings.ttl_s / 4 if self.settings.ttl_s else 300.0))
        while True:
            try:
                await self.sweep_expired()
            except Exception:
                logger.exception("omni-ext: expiry sweep failed")
            await asyncio.sleep(period)


# ---- the video backend ----------------------------------------------------------------------
def native_video_defaults(limits: ModelLimits) -> dict[str, int]:
    """The model family's native video shape (``seconds`` and an omitted ``size`` map to it); {} if unknown."""
    family = limits.family
    if family is None or not family.is_video:
        return {}
    native = {name: getattr(family.native, name) for name in VIDEO_FIELDS}
    return {name: value for name, value in native.items() if value is not None}


def configured_defaults(handler: Any) -> dict[str, int]:
    """Video fields the operator configured as server defaults (deploy YAML / --default-sampling-params).

    Read through vLLM-Omni's private ``_resolve_default_sampling_params`` (the defaults its own route
    applies), once per server.
    """
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    try:
        configured = handler._resolve_default_sampling_params()
    except Exception:
        return {}
    blank = OmniDiffusionSamplingParams()
    return {k: getattr(configured, k) for k in VIDEO_FIELDS
            if getattr(configured, k, None) is not None and getattr(configured, k) != getattr(blank, k)}


def resolve_video_backend(app_state: Any, limits: ModelLimits) -> VideoBackend:
    """vLLM-Omni's video handler, given its stage configs, with the defaults it implies (raises 503 if not ready)."""
    require_engine(app_state)
    handler = getattr(app_state, "openai_serving_video", None)
    if handler is None or not hasattr(handler, "_run_and_extract"):
        raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, VIDEO_UNAVAILABLE, code="video_unavailable")
    stage_configs = getattr(app_state, "stage_configs", None)
    if stage_configs and hasattr(handler, "set_stage_configs_if_missing"):
        handler.set_stage_configs_if_missing(stage_configs)
    return VideoBackend(handler=handler, defaults={**native_video_defaults(limits), **configured_defaults(handler)})


def _served_model(app_state: Any, args: Any) -> tuple[str, str]:
    engine = getattr(app_state, "engine_client", None)
    path = str(getattr(engine, "model", None) or getattr(args, "model", None) or getattr(args, "model_tag", "") or "")
    name = path
    serving_models = getattr(app_state, "openai_serving_models", None)
    base = getattr(serving_models, "base_model_paths", None) if serving_models else None
    if base:
        name = base[0].name
    elif getattr(args, "served_model_name", None):
        served = args.served_model_name
        name = served[0] if isinstance(served, (list, tuple)) else served
    return name, path


def served_class(app_state: Any) -> str | None:
    """The pipeline class vLLM-Omni's diffusion stage runs (its resolved ``model_class_name``), or None
    where the stage configs do not say (then ``model_index.json`` decides)."""
    stage = diffusion_stage(getattr(app_state, "stage_configs", None))
    name = getattr(getattr(stage, "diffusion_config", None), "model_class_name", None)
    return name if isinstance(name, str) and name else None


def served_layout(app_state: Any, args: Any, pipeline: str | None) -> tuple[ServerLayout, str]:
    """The server's layout as its engine really runs the model, and why: a TunedExecutor that hands the
    model to vLLM-Omni's own executor (:func:`omni_ext.models.decisions.executor_path`, the same rule
    the executor applies) counts as vLLM-Omni's executor here."""
    from omni_ext.models import decisions, registry
    from omni_ext.models.families import family_of

    layout = server_layout(args, getattr(app_state, "stage_configs", None))
    if not layout.tuned:
        return layout, "vLLM-Omni's own executor (--distributed-executor-backend)"
    path, why = decisions.executor_path(registry.facts_of(pipeline) if pipeline else None, family_of(pipeline),
                                        dp=layout.dp, max_num_seqs=layout.max_num_seqs)
    return (replace(layout, executor=None) if path == "stock" else layout), why


def request_queue(app_state: Any, args: Any, limits: ModelLimits, model_name: str, max_jobs: int,
                  dispatch: ReplicaDispatch | None = None) -> RequestQueue:
    """The server's :class:`RequestQueue`, from its layout and ``omni_ext.scheduler`` options (a
    ``ValueError`` naming the bad option otherwise). ``dispatch``: this process's dispatch to
    replicas, configured here (slots per replica, pipeline, options), whose live capacity and binding
    times the queue reads."""
    layout, _ = served_layout(app_state, args, limits.pipeline)
    try:
        config = scheduler_config(layout.additional_config, getattr(args, "cache_backend", None))
    except ValueError as exc:
        raise ValueError(f"omni-ext: invalid --additional-config: {exc}") from None
    replicas: dict[str, Any] = {}
    if dispatch is not None:
        dispatch.configure(layout.replica_slots(config.cfg_mode, limits.pipeline), limits.pipeline, config)
        replicas = {"live_slots": dispatch.capacity, "bound_since": dispatch.bound_since}
    queue = RequestQueue(config, layout.slots(config.cfg_mode, limits.pipeline), tuned=layout.tuned, model=model_name,
                         max_jobs=max_jobs, cfg_size=layout.cfg, cfg_mode=layout.cfg_mode(config.cfg_mode, limits.pipeline),
                         **replicas)
    backend = getattr(args, "cache_backend", None)
    logger.info("omni-ext scheduler (API): %d slot(s) (%s executor), max_wait_s=%g, seed %s s/unit%s%s", queue.slots,
                "TunedExecutor" if layout.tuned else "vLLM-Omni's", config.max_wait_s, config.seconds_per_unit,
                f" (for cache backend {backend})" if backend not in (None, "", "none") else "",
                "" if layout.tuned else "; priorities are not applied by vLLM-Omni's executor (first come, first served)")
    return queue


def init_state(app_state: Any, args: Any, dispatch: ReplicaDispatch | None = None) -> ApiState:
    """Create the state (idempotent): read the options, open the store, fail interrupted jobs, start the
    sweeper. ``dispatch``: this process's dispatch to replicas (the start-up hook passes it)."""
    existing = getattr(app_state, "omni_ext", None)
    if isinstance(existing, ApiState):
        return existing
    settings = load_settings(args)
    name, path = _served_model(app_state, args)
    limits = limits_for_model(path, served_class(app_state))
    limits_for_model(path)  # the request-validation patch's look-up, read now rather than on the first request
    queue = request_queue(app_state, args, limits, name, settings.max_queued, dispatch)
    settings.media_dir.mkdir(parents=True, exist_ok=True)
    orphans = media.remove_orphans(settings.media_dir)
    if orphans:
        logger.warning("omni-ext: removed %d unfinished media file(s) left by a stopped server", len(orphans))
    store = JobStore(settings.db_path)
    failed = store.fail_interrupted()
    if failed:
        logger.warning("omni-ext: %d job(s) were queued or running when the server stopped; marked failed", len(failed))
    state = ApiState(settings=settings, store=store, model_name=name, model_path=path, limits=limits, queue=queue)
    try:
        state.video = resolve_video_backend(app_state, limits)
    except APIError as exc:  # no video handler on this server: /v1/videos answers 503 video_unavailable
        logger.warning("omni-ext API: video generation unavailable: %s", exc.message)
    app_state.omni_ext = state
    logger.info("omni-ext API: jobs in %s, media in %s, ttl %ss", settings.db_path, settings.media_dir, settings.ttl_s)
    try:
        state.sweeper = asyncio.get_running_loop().create_task(state._sweep_forever())
    except RuntimeError:
        pass  # no loop (tests): the sweep runs on demand
    return state


def get_state(request: Request) -> ApiState:
    """This server's :class:`ApiState`; 503 ``engine_unavailable`` before the start-up hook created it."""
    return state_of(request.app.state)


def state_of(app_state: Any) -> ApiState:
    """:func:`get_state` from the app's state (an ASGI endpoint has no :class:`Request`)."""
    state = getattr(app_state, "omni_ext", None)
    if state is None:
        raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "The server is not ready yet.", code="engine_unavailable")
    return state


def video_state(request: Request) -> tuple[ApiState, VideoBackend]:
    """:func:`get_state` and the :class:`VideoBackend` resolved at start-up; 503 ``video_unavailable``
    on a server without one."""
    state = get_state(request)
    if state.video is None:
        raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, VIDEO_UNAVAILABLE, code="video_unavailable")
    return state, state.video


def engine_client(request: Request) -> Any:
    """vLLM-Omni's engine client; 503 ``engine_unavailable`` while the server is not ready."""
    return require_engine(request.app.state)


async def abort(request: Request, request_id: str) -> None:
    """Stop an engine request now (queued or running); a failure is logged, never raised, since the
    caller forgets the job either way."""
    try:
        await engine_client(request).abort(request_id)
    except Exception:
        logger.warning("omni-ext: abort of %s in the engine failed", request_id, exc_info=True)


def require_engine(app_state: Any) -> Any:
    engine = getattr(app_state, "engine_client", None)
    if engine is None:
        raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "The engine is not ready.", code="engine_unavailable")
    return engine


def now() -> int:
    return int(time.time())
