"""Patch body for ``executor-abort-hook`` (see the registry in ``omni_ext.patches``).

vLLM-Omni 0.30's ``DiffusionEngine`` hands a request to an executor that answers asynchronously
(``async_output_id``) and marks it finished at once; a later ``abort()`` of that request only
touches the engine's scheduler (which no longer holds it) and its cooperative-cancellation signal
(already released at hand-over). The executor is never told, so the request runs to the end and
holds its workers. The fix: after the stock abort, pass the request ids to the executor when it
has an ``abort_requests`` method (omni-ext's TunedExecutor does; vLLM-Omni's own executors do not,
so for them nothing changes).
"""

from __future__ import annotations

import logging

from omni_ext.patches import patch_attr

logger = logging.getLogger("omni_ext.patches")


def apply() -> None:
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

    original = DiffusionEngine.abort

    def abort(self, request_id, *args, **kwargs):
        result = original(self, request_id, *args, **kwargs)
        hook = getattr(getattr(self, "executor", None), "abort_requests", None)
        if hook is not None:
            ids = [request_id] if isinstance(request_id, str) else list(request_id)
            try:
                hook(ids)
            except Exception:  # the stock abort already happened; never fail it
                logger.exception("omni-ext: executor abort hook failed for %s", ids)
        return result

    patch_attr(DiffusionEngine, "abort", abort)
