"""Per-server state of omni-ext's routes: settings, the job store, running tasks, model facts.

Created once per API process when vLLM-Omni initialises its app state (see the ``openai-routes``
patch), which is also when jobs left queued/running by a previous process are marked failed and the
expiry sweeper starts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

from fastapi import Request

from omni_ext.api.errors import APIError
from omni_ext.api.jobs import Job, JobStore
from omni_ext.api.settings import ApiSettings, load_settings
from omni_ext.api.validation import ModelLimits, limits_for_model

logger = logging.getLogger("omni_ext.api")

# Native video defaults per pipeline class: what `seconds` and an omitted `size` map to.
VIDEO_DEFAULTS: dict[str, dict[str, int]] = {
    "WanPipeline": {"fps": 16, "width": 832, "height": 480, "num_frames": 81},
    "WanImageToVideoPipeline": {"fps": 16, "width": 832, "height": 480, "num_frames": 81},
}


@dataclass
class ApiState:
    settings: ApiSettings
    store: JobStore
    model_name: str
    model_path: str
    limits: ModelLimits
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    job_seconds: float | None = None  # EWMA of finished video jobs' run time, for queue estimates
    sweeper: asyncio.Task | None = None

    @property
    def media_dir(self) -> Path:
        return self.settings.media_dir

    def media_path(self, name: str) -> Path:
        return self.settings.media_dir / name

    def record_duration(self, seconds: float) -> None:
        self.job_seconds = seconds if self.job_seconds is None else 0.7 * self.job_seconds + 0.3 * seconds

    def remove_media(self, job: Job) -> None:
        for name in job.media.values():
            try:
                self.media_path(name).unlink()
            except FileNotFoundError:
                pass

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


def init_state(app_state: Any, args: Any) -> ApiState:
    """Create the state (idempotent): open the store, fail interrupted jobs, start the sweeper."""
    existing = getattr(app_state, "omni_ext", None)
    if isinstance(existing, ApiState):
        return existing
    settings = load_settings(args)
    settings.media_dir.mkdir(parents=True, exist_ok=True)
    store = JobStore(settings.db_path)
    failed = store.fail_interrupted()
    if failed:
        logger.warning("omni-ext: %d job(s) were queued or running when the server stopped; marked failed", len(failed))
    name, path = _served_model(app_state, args)
    state = ApiState(settings=settings, store=store, model_name=name, model_path=path, limits=limits_for_model(path))
    app_state.omni_ext = state
    logger.info("omni-ext API: jobs in %s, media in %s, ttl %ss", settings.db_path, settings.media_dir, settings.ttl_s)
    try:
        state.sweeper = asyncio.get_running_loop().create_task(state._sweep_forever())
    except RuntimeError:
        pass  # no loop (tests): the sweep runs on demand
    return state


def get_state(request: Request) -> ApiState:
    state = getattr(request.app.state, "omni_ext", None)
    if state is None:
        state = init_state(request.app.state, getattr(request.app.state, "args", None))
    return state


def engine_client(request: Request) -> Any:
    engine = getattr(request.app.state, "engine_client", None)
    if engine is None:
        raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "The engine is not ready.", code="engine_unavailable")
    return engine


def now() -> int:
    return int(time.time())
