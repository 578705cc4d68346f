"""Patch body for ``tuned-worker-skip-empty-kv-receive`` (see the registry in ``omni_ext.patches``).

Applied only in the processes of omni-ext's TunedExecutor (role ``tuned-worker``). vLLM-Omni 0.30's
``DiffusionModelRunner`` keeps an ``OmniKVTransferManager`` even when no KV connector is configured,
and before every request it runs the manager's distributed receive, which broadcasts an empty
payload over the WORLD group. Under vLLM-Omni's own executors every rank runs every request, so the
broadcast only costs time; under the tuned executor ranks run *different* requests (data parallel,
one-rank CFG-free jobs), and that broadcast would block a rank until some other rank happens to
start a request. The runner's own "no manager" path is exactly the no-connector behaviour minus the
broadcast, so with nothing to receive the manager is dropped right after ``__init__``.
"""

from __future__ import annotations

import logging

from omni_ext.patches import patch_attr

logger = logging.getLogger("omni_ext.patches")


def nothing_to_receive(manager) -> bool:
    """True when the KV manager has no connector and expects no cache (its receive is a no-op)."""
    cfg = getattr(manager, "config", None)
    if manager is None or cfg is None:
        return False
    return not (getattr(cfg, "need_recv_cache", False) or getattr(cfg, "connector_config", None))


def apply() -> None:
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    original = DiffusionModelRunner.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if nothing_to_receive(getattr(self, "kv_transfer_manager", None)):
            self.kv_transfer_manager = None
            logger.info("omni-ext: no KV connector; the per-request empty KV broadcast is skipped")

    patch_attr(DiffusionModelRunner, "__init__", __init__)
