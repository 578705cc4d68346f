"""Patch body for ``async-output-no-accelerator`` (see the registry in ``omni_ext.patches``).

Mirrors ``patches/0001-worker-async-output-without-accelerator.diff``: with no accelerator there is
no device-to-host copy to overlap, so the output is packed into shared memory synchronously.
With an accelerator the original method runs unchanged.
"""

from __future__ import annotations

import logging

import torch

from omni_ext.patches import patch_attr

logger = logging.getLogger("omni_ext.patches")


def _cpu_output_loop(self) -> None:
    """The worker's async-output loop for hosts without an accelerator."""
    from vllm_omni.diffusion.ipc import pack_diffusion_output_shm
    from vllm_omni.diffusion.worker import diffusion_worker as dw

    while True:
        item = self._async_output_queue.get()
        if item is None:
            break
        output, async_output_id, _device_event = item
        try:
            pack_diffusion_output_shm(output)
            msg = dw.AsyncDiffusionOutput(
                kind=dw.AsyncOutputKind.OUTPUT_READY, async_output_id=async_output_id, output=output
            )
        except Exception:
            logger.exception("Output packing failed for id '%s'; sending error", async_output_id)
            msg = dw.AsyncDiffusionOutput(
                kind=dw.AsyncOutputKind.OUTPUT_READY,
                async_output_id=async_output_id,
                error="Output SHM packing failed",
            )
        try:
            self._enqueue_result(msg)
        finally:
            with self._async_output_done:
                self._async_output_pending = max(0, self._async_output_pending - 1)
                self._async_output_done.notify_all()


def apply() -> None:
    from vllm_omni.diffusion.worker.diffusion_worker import WorkerProc

    original = WorkerProc._async_output_loop

    def _async_output_loop(self) -> None:
        if torch.accelerator.current_accelerator() is None:
            return _cpu_output_loop(self)
        return original(self)

    _async_output_loop.__doc__ = original.__doc__
    patch_attr(WorkerProc, "_async_output_loop", _async_output_loop)
