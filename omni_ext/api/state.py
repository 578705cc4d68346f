"""Per-server state of omni-ext's routes: settings, the job store, running tasks, model facts, and
the account of admitted jobs (:class:`~omni_ext.api.queue.RequestQueue`).

Created once per API process, and only there, when vLLM-Omni initialises its app state (the
``openai-routes`` patch calls :func:`init_state`), which is also when jobs left running by a previous
process are marked failed (the queued ones it kept run again: :mod:`omni_ext.api.drain`), the store's use
is counted for its quota, the expiry sweeper starts, the scheduler's options are read (a
bad one stops the server there) and given to this process's dispatch to replicas (which the
start-up hook passes in), and vLLM-Omni's video handler and the request defaults it implies are
resolved (:class:`VideoBackend`). No request does start-up work: one that comes before (or
without) it is answered 503 (:func:`get_state`, :func:`video_state`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from pathlib import Path
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from omni_ext.api import media
from omni_ext.api.errors import APIError, StorageError, bad_request, not_found, retry_headers, storage
from omni_ext.api.intake import ID_RE, ModelLimits
from omni_ext.api import signed, tokens
from omni_ext.api.jobs import Job, JobStore
from omni_ext.api.tokens import PromptTokens
from omni_ext.scheduler.layout import ServerLayout, diffusion_stage, pause_refusal, server_layout
from omni_ext.api.queue import Admitted, RequestQueue
from omni_ext.api.archive import RequestArchive
from omni_ext.api.settings import ApiSettings, load_settings
from omni_ext.api.tenants import Tenancy, Tenant, tenancy
from omni_ext.api.validation import limits_for_model
from omni_ext.scheduler.config import scheduler_config

if TYPE_CHECKING:
    from fastapi import Request

    from omni_ext.dispatch.replicas import ReplicaDispatch

logger = logging.getLogger("omni_ext.api")

VIDEO_FIELDS = ("width", "height", "num_frames", "fps")
#: What a create gets while the server drains: long enough for a supervisor to start the next process.
DRAIN_RETRY_S = 10.0
MAX_REQUEST_OWNERS = 100_000  # engine request ids remembered for the placement journal (~10 MB)
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
    #: the served model's other names (``--served-model-name a b``: ``b``), accepted in ``model`` too
    model_aliases: tuple[str, ...] = ()
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    #: The admission handles of running async video jobs, by job id: ``DELETE`` has only the id, and
    #: reports the cancellation through the job's handle (its task reports the rest of its life).
    admitted: dict[str, Admitted] = field(default_factory=dict)
    queue: RequestQueue = field(default_factory=RequestQueue)
    sweeper: asyncio.Task | None = None
    resumer: asyncio.Task | None = None  # the jobs accepted before a restart, queued again (omni_ext.api.drain)
    video: VideoBackend | None = None  # resolved at start-up; None: this server has no video handler
    tenancy: Tenancy = field(default_factory=Tenancy)
    #: accepted requests kept until their job ends (:mod:`omni_ext.api.archive`); set by :func:`init_state`
    archive: RequestArchive = None  # type: ignore[assignment]
    #: a SIGTERM stopped admission (:mod:`omni_ext.api.drain`); the jobs the drain stopped, by id
    draining: bool = False
    parked: set[str] = field(default_factory=set)
    #: bytes of media in ``media_dir``: counted at start-up, then kept by :meth:`write_media` and :meth:`remove_files`
    media_bytes: int = 0
    #: the bytes of the last result stored per kind (``video``: mp4 + thumbnail; ``image``: one image), what
    #: admission expects the next one to need
    result_bytes: dict[str, int] = field(default_factory=dict)
    #: the served model's tokenizer, counting prompts against MAX_PROMPT_TOKENS (None: characters only)
    prompt_tokens: PromptTokens | None = None
    #: the owner of each engine request id these routes sent (for the placement journal's filter), newest
    #: last, at most ``MAX_REQUEST_OWNERS``
    request_owners: OrderedDict[str, str | None] = field(default_factory=OrderedDict)

    #: the secret of signed ``url`` links (:mod:`omni_ext.api.signed`); None: links need the key
    url_secret: bytes | None = None

    def __post_init__(self) -> None:
        if self.archive is None:
            self.archive = RequestArchive(self.settings.data_dir / "requests")
        if self.settings.signed_url_ttl_s and self.url_secret is None:
            self.url_secret = signed.load_secret(self.settings.data_dir)

    def signed_link(self, path: str) -> str:
        """``path`` with the query that opens it without a key, when links are signed; else ``path``."""
        if self.url_secret is None:
            return path
        return f"{path}?{signed.link_query(self.url_secret, path, time.time(), self.settings.signed_url_ttl_s)}"

    def signed_request(self, path: str, query: str) -> bool:
        """Whether a request for ``path`` carries a valid, unexpired signature for it."""
        return signed.verify(self.url_secret, path, query, time.time())

    def tenant(self, request: Request) -> Tenant:
        """The caller of ``request`` (:mod:`omni_ext.api.tenants`), as omni-ext's route resolved it before the
        endpoint ran (:class:`omni_ext.api.routes.ErrorRoute`), else resolved now."""
        resolved = getattr(request.state, "omni_ext_tenant", None)
        return resolved if resolved is not None else self.tenancy.tenant(request.headers.get("authorization"))

    def own_request(self, request_id: str, tenant: Tenant) -> None:
        """Record that ``tenant`` sent the engine request ``request_id``."""
        self.request_owners[request_id] = tenant.owner
        while len(self.request_owners) > MAX_REQUEST_OWNERS:
            self.request_owners.popitem(last=False)

    def sees_request(self, tenant: Tenant, request_id: str) -> bool:
        """Whether ``tenant`` sent ``request_id`` (an engine id may carry vLLM's ``-<suffix>``): an async
        video's owner is its job's, a synchronous request's was recorded when it was sent
        (:meth:`own_request`); an id these routes did not send (vLLM-Omni's own routes, the warm-up) is
        an admin's only."""
        if tenant.admin:
            return True
        for rid in (request_id, request_id.rpartition("-")[0]):
            if rid in self.request_owners:
                return tenant.sees(self.request_owners[rid])
            if ID_RE.match(rid) and rid.startswith("video_") and not rid.startswith("video_sync"):
                job = self.store.get(rid)
                if job is not None:
                    return tenant.sees(job.owner)
        return False

    def media_path(self, name: str) -> Path:
        return self.settings.media_dir / name

    def find_job(self, kind: str, ident: str, tenant: Tenant) -> Job:
        """The ``kind`` job (``video``/``image``) with id ``ident``: 400 for a malformed id, 404 if unknown or
        not ``tenant``'s."""
        if not ID_RE.match(ident):
            raise bad_request(f"Invalid {kind} id.", f"{kind}_id", "invalid_id")
        job = self.store.get(ident)
        if job is None or job.kind != kind or not tenant.sees(job.owner):
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
            path = self.media_path(name)
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                logger.warning("omni-ext: could not remove media file %s: %s", name, exc)
                continue
            self.media_bytes = max(0, self.media_bytes - size)

    def store_full(self, size: int = 1) -> bool:
        """Whether ``size`` more bytes of media would pass the store quota (``max_store_mb``; 0: never)."""
        quota = self.settings.max_store_bytes
        return bool(quota) and self.media_bytes + size > quota

    def ensure_room(self, size: int = 1) -> None:
        """Make room for ``size`` bytes of media under the quota: expired jobs go first (oldest expiry
        first); 507 ``storage_full`` when live results alone fill it. Called before a job that stores its
        result is admitted (nothing is generated for a result with no room) and before each write."""
        if not self.store_full(size):
            return
        self.sweep_expired()
        if self.store_full(size):
            quota = self.settings.max_store_bytes
            raise StorageError(HTTPStatus.INSUFFICIENT_STORAGE,
                               f"The server's result store is full: {self.media_bytes / 2**20:.1f} MiB of live results "
                               f"against its quota of {quota / 2**20:.0f} MiB (omni_ext.api.max_store_mb); retry once "
                               "results expire (ttl_s) or are deleted.", code="storage_full")

    def admit_result(self, kind: str, count: int = 1) -> None:
        """Before a job that stores ``count`` results of ``kind`` is admitted: room for them, as large as the
        last one stored (507 ``storage_full`` otherwise, before any work)."""
        self.ensure_room(max(1, self.result_bytes.get(kind, 1) * count))

    async def write_media(self, name: str, data: bytes) -> None:
        """Store one media file (fsynced, atomic) within the quota; a :class:`StorageError` otherwise."""
        self.ensure_room(len(data))
        path = self.media_path(name)
        with storage(f"writing {name}"):
            await media.off_loop(media.write_atomic, path, data)
        self.media_bytes += len(data)

    def sweep_expired(self) -> int:
        """Remove the finished jobs whose TTL is up, completed and failed alike: media and record (a GET
        then answers 404 like any unknown id)."""
        expired = self.store.expired()
        for job in expired:
            self.remove_media(job)
            with contextlib.suppress(sqlite3.Error):  # a database that refuses now: the next sweep retries
                self.store.delete(job.id)
        if expired:
            logger.info("omni-ext: removed %d expired job(s) with their media (%.1f MiB stored now)", len(expired),
                        self.media_bytes / 2**20)
        return len(expired)

    async def _sweep_forever(self) -> None:
        period = max(5.0, min(300.0, self.settings.ttl_s / 4 if self.settings.ttl_s else 300.0))
        while True:
            try:
                await media.off_loop(self.sweep_expired)
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


def _served_model(app_state: Any, args: Any) -> tuple[str, str, tuple[str, ...]]:
    """The served model's name (the first of ``--served-model-name``, else its path), its path, and its
    other served names (vLLM takes several: ``--served-model-name sora-2 wan2.1`` serves under OpenAI's
    name too), each of which a request's ``model`` may give."""
    engine = getattr(app_state, "engine_client", None)
    path = str(getattr(engine, "model", None) or getattr(args, "model", None) or getattr(args, "model_tag", "") or "")
    names = [path]
    serving_models = getattr(app_state, "openai_serving_models", None)
    base = getattr(serving_models, "base_model_paths", None) if serving_models else None
    if base:
        names = [b.name for b in base]
    elif getattr(args, "served_model_name", None):
        served = args.served_model_name
        names = list(served) if isinstance(served, (list, tuple)) else [served]
    return names[0], path, tuple(n for n in names[1:] if n != names[0])


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
    backend = getattr(args, "cache_backend", None)
    if config.preempt and layout.tuned and pause_refusal(limits.pipeline, backend) is not None:
        config = replace(config, preempt=False)  # the executor will not pause: start predictions count no pauses
    queue = RequestQueue(config, layout.slots(config.cfg_mode, limits.pipeline), tuned=layout.tuned, model=model_name,
                         max_jobs=max_jobs, cfg_size=layout.cfg, cfg_mode=layout.cfg_mode(config.cfg_mode, limits.pipeline),
                         **replicas)
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
    from omni_ext.platform.memory import keep_freed_heap

    keep_freed_heap()  # the routes encode in a thread pool (omni_ext.api.media), on arenas glibc would trim
    settings = load_settings(args)
    name, path, aliases = _served_model(app_state, args)
    limits = limits_for_model(path, served_class(app_state))
    limits_for_model(path)  # the request-validation patch's look-up, read now rather than on the first request
    queue = request_queue(app_state, args, limits, name, settings.max_queued, dispatch)
    settings.media_dir.mkdir(parents=True, exist_ok=True)
    orphans = media.remove_orphans(settings.media_dir)
    if orphans:
        logger.warning("omni-ext: removed %d unfinished media file(s) left by a stopped server", len(orphans))
    store = JobStore(settings.db_path)
    archive = RequestArchive(settings.data_dir / "requests")
    failed = store.fail_interrupted(ttl_s=settings.ttl_s, kept=archive.ids())
    waiting = {j.id for j in store.queued("video")}
    for stale in archive.ids() - waiting:  # a job that ended as the process stopped, before its request went
        archive.remove(stale)
    if failed:
        logger.warning("omni-ext: %d job(s) were queued or running when the server stopped; marked failed", len(failed))
    state = ApiState(settings=settings, store=store, model_name=name, model_path=path, model_aliases=aliases,
                     limits=limits, queue=queue,
                     prompt_tokens=tokens.load(path),
                     tenancy=tenancy(args, settings.admin_keys), media_bytes=media.stored_bytes(settings.media_dir),
                     archive=archive)
    try:
        state.video = resolve_video_backend(app_state, limits)
    except APIError as exc:  # no video handler on this server: /v1/videos answers 503 video_unavailable
        logger.warning("omni-ext API: video generation unavailable: %s", exc.message)
    app_state.omni_ext = state
    logger.info("omni-ext API: jobs in %s, media in %s (%.1f MiB, quota %s), ttl %ss", settings.db_path, settings.media_dir,
                state.media_bytes / 2**20, f"{settings.max_store_bytes / 2**20:.0f} MiB" if settings.max_store_bytes
                else "none", settings.ttl_s)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return state  # no loop (tests): the sweep runs on demand, nothing drains or resumes
    state.sweeper = loop.create_task(state._sweep_forever())
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


def video_state(request: Request, *, stores: bool = True) -> tuple[ApiState, VideoBackend, Tenant]:
    """What a video create needs before it reads its body: :func:`get_state`, the :class:`VideoBackend`
    resolved at start-up (503 ``video_unavailable`` on a server without one), the caller
    (:mod:`omni_ext.api.tenants`); 503 ``server_draining`` once a SIGTERM stopped admission
    (:mod:`omni_ext.api.drain`), and when the job ``stores`` its result, 507 ``storage_full`` if live
    results fill the store's quota."""
    state = admitting_state(request)
    if state.video is None:
        raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, VIDEO_UNAVAILABLE, code="video_unavailable")
    if stores:
        state.admit_result("video")
    return state, state.video, state.tenant(request)


def admitting_state(request: Request) -> ApiState:
    """:func:`get_state`, or 503 ``server_draining`` (with Retry-After) once a SIGTERM stopped admission."""
    state = get_state(request)
    if state.draining:
        raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "The server is shutting down and takes no new requests; send "
                       "it again in a moment (to this server once it is back, or to another).", code="server_draining",
                       headers=retry_headers(DRAIN_RETRY_S))
    return state


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
