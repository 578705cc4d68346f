"""Patch bodies for ``step-progress`` and ``cancel-at-step`` (see the registry in ``omni_ext.patches``).

Denoise loops call ``pbar.update()`` once per step on every rank, which makes the progress bar the
one per-step hook shared by Wan and Qwen-Image. ``DiffusionModelRunner._execute_request_list`` is
wrapped to note which engine request ids the current batch belongs to, and
``ProgressBarMixin.progress_bar`` returns the usual bar wrapped so that each ``update()``

- on rank 0 records the step through ``omni_ext.progress.write_progress`` (step-progress);
- on every rank calls vLLM-Omni's own ``check_request_cancellation()`` (cancel-at-step), which is a
  no-op unless the pipeline opted into cooperative cancellation, and otherwise makes all ranks stop
  together at this step when the request was aborted (it is a collective across ranks);
- under omni-ext's TunedExecutor (which opts out of that), stops a cancelled single-rank job, and
  reports progress from the job's lead rank rather than global rank 0.

Nothing changes in the numerics or in what is logged.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

from omni_ext.patches import patch_attr, resolve

logger = logging.getLogger("omni_ext.patches")
_current = threading.local()


class _ReportingBar:
    """A progress bar proxy that reports every step to the API process."""

    def __init__(self, bar: Any, total: int, request_ids: list[str], report: bool) -> None:
        self._bar = bar
        self._total = int(total or 0)
        self._ids = request_ids if report else []
        self._done = 0
        self._t0 = time.time()
        # The TunedExecutor's start marker (its time and the job's mode) travels on in every report.
        from omni_ext.progress import read_marker

        marker = read_marker(self._ids[0]) if self._ids else None
        self._t_job, self._mode = marker if marker is not None else (None, None)

    def update(self, n: int = 1) -> Any:
        from vllm_omni.diffusion.cancellation import check_request_cancellation

        from omni_ext.progress import write_progress
        from omni_ext.executor.role import check_step_cancel

        from omni_ext.executor.role import ROLE

        self._done += int(n)
        if self._ids:
            # a job paused by step-level preemption: its loop (and the job) started later by the time
            # it was paused, so that the rate of its steps, what its remaining time is predicted from, leaves it out
            shift = ROLE.paused_s
            write_progress(self._ids, self._done, self._total, self._t0 + shift, self._mode,
                           None if self._t_job is None else self._t_job + shift)
        result = self._bar.update(n)
        check_request_cancellation()
        check_step_cancel()  # omni-ext's TunedExecutor: a cancelled single-rank job stops here
        return result

    def __enter__(self) -> "_ReportingBar":
        self._bar.__enter__()
        if self._ids:
            from omni_ext.progress import write_progress

            write_progress(self._ids, 0, self._total, self._t0, self._mode, self._t_job)
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._bar.__exit__(*exc)

    def __iter__(self):
        for item in self._bar:
            yield item
            self.update(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bar, name)


def current_requests() -> list[Any]:
    """The engine requests (not dummy runs) of the batch this thread runs now (empty outside one)."""
    return list(getattr(_current, "reqs", None) or [])


def apply() -> None:
    from vllm_omni.diffusion.models import progress_bar as pb
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    run = DiffusionModelRunner._execute_request_list

    @functools.wraps(run)
    def _execute_request_list(self, reqs, *args, **kwargs):
        _current.reqs = [r for r in reqs if not r.is_dummy_run()]
        _current.ids = [r.request_id for r in _current.reqs]
        try:
            return run(self, reqs, *args, **kwargs)
        finally:
            _current.ids = []
            _current.reqs = []

    patch_attr(DiffusionModelRunner, "_execute_request_list", _execute_request_list)

    bar = pb.ProgressBarMixin.progress_bar

    @functools.wraps(bar)
    def progress_bar(self, iterable=None, total=None):
        inner = bar(self, iterable=iterable, total=total)
        ids = list(getattr(_current, "ids", []) or [])
        logger.debug("step-progress: progress bar for %s (total=%s)", ids, total)
        if not ids:
            return inner
        from omni_ext.executor.role import reports_progress

        # Under omni-ext's TunedExecutor the job's lead rank reports (a data-parallel or
        # single-rank job may run on any rank); otherwise vLLM-Omni's rank 0.
        report = reports_progress()
        report = pb._is_rank_zero() if report is None else report
        return _ReportingBar(inner, total if total is not None else len(iterable), ids, report)

    patch_attr(pb.ProgressBarMixin, "progress_bar", progress_bar)


def apply_cancellation() -> None:
    """Opt the cancellable families' pipelines (Wan, Qwen-Image) into vLLM-Omni's cooperative
    cancellation, checked at every step: their denoise loops reach a step boundary through the
    progress bar on every rank (``omni_ext.models.families``)."""
    from omni_ext.models.families import cancellable_classes

    apply()  # the step boundary itself
    for qualname in cancellable_classes():
        resolve(qualname).supports_request_cancellation = True
