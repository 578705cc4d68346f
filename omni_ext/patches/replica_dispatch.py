"""Patch body for ``replica-dispatch`` (see the registry in ``omni_ext.patches``): hooks the head's
queue (:mod:`omni_ext.dispatch.replicas`, where the why and the how are written) into vLLM-Omni's
``StagePool`` and ``Orchestrator``.

Each wrapper hands the event to the pool's dispatcher and otherwise runs vLLM-Omni's method: a
request arrives (``submit_initial``: queued instead of bound on arrival), finishes or is aborted
(``release_binding``, ``abort_requests``), a replica leaves (``evict_replica``, ``invalidate_addr``)
or joins (``add_client``), and the orchestrator starts (``run``: it fails what cannot be placed).
A pool without a dispatcher (one replica slot, not a multi-machine head), a batch and a warm-up
request go vLLM-Omni's way.
"""

from __future__ import annotations

from omni_ext.dispatch.replicas import DISPATCH, attached, orchestrator_runs
from omni_ext.patches import patch_attr

#: vLLM-Omni's warm-up requests never reach a pool, but if one does it goes the stock way.
WARM_UP_PREFIX = "dummy_req_id"


def apply() -> None:
    from vllm_omni.engine.orchestrator import Orchestrator
    from vllm_omni.engine.stage_pool import StagePool
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    original_submit = StagePool.submit_initial

    async def submit_initial(self, request_id, req_state, request, *, prompt_text=None, affinity_request_id=None,
                             submit_kwargs=None, params_override=None):
        d = DISPATCH.dispatcher_of(self)
        if d is None or isinstance(request, list) or str(request_id).startswith(WARM_UP_PREFIX):
            return await original_submit(self, request_id, req_state, request, prompt_text=prompt_text,
                                         affinity_request_id=affinity_request_id, submit_kwargs=submit_kwargs,
                                         params_override=params_override)
        params = params_override if params_override is not None else req_state.sampling_params_list[self.stage_id]
        params = OmniDiffusionSamplingParams.from_params(params)
        kwargs = dict(submit_kwargs or {})
        sender = getattr(request, "payload_sender_info", None)
        if sender is not None:
            kwargs.setdefault("payload_sender_info", sender)
        if affinity_request_id is not None:
            if d.attach_companion(affinity_request_id, (request_id, request, params, kwargs)):
                return -1
            return await original_submit(self, request_id, req_state, request, prompt_text=prompt_text,
                                         affinity_request_id=affinity_request_id, submit_kwargs=submit_kwargs,
                                         params_override=params_override)
        return d.submit(request_id, request, params, kwargs)

    original_release = StagePool.release_binding

    def release_binding(self, request_id):
        original_release(self, request_id)
        d = attached(self)
        if d is not None:
            d.release(request_id)

    original_abort = StagePool.abort_requests

    async def abort_requests(self, request_ids):
        d = attached(self)
        if d is not None:
            d.forget(list(request_ids))
        return await original_abort(self, request_ids)

    original_evict = StagePool.evict_replica

    def evict_replica(self, replica_id):
        d = attached(self)
        if d is not None:
            d.lose_replica(replica_id)
        return original_evict(self, replica_id)

    original_invalidate = StagePool.invalidate_addr

    def invalidate_addr(self, input_addr):
        d = attached(self)
        if d is not None:
            d.lose_address(input_addr)
        return original_invalidate(self, input_addr)

    original_add = StagePool.add_client

    def add_client(self, input_addr, client, *, replica_id=None):
        rid = original_add(self, input_addr, client, replica_id=replica_id)
        d = DISPATCH.dispatcher_of(self) if self.stage_type == "diffusion" else None
        if d is not None:
            d.joined(rid)
        return rid

    original_run = Orchestrator.run

    async def run(self):
        orchestrator_runs(self)
        return await original_run(self)

    patch_attr(StagePool, "submit_initial", submit_initial)
    patch_attr(StagePool, "release_binding", release_binding)
    patch_attr(StagePool, "abort_requests", abort_requests)
    patch_attr(StagePool, "evict_replica", evict_replica)
    patch_attr(StagePool, "invalidate_addr", invalidate_addr)
    patch_attr(StagePool, "add_client", add_client)
    patch_attr(Orchestrator, "run", run)
