"""Patch body for ``replica-dispatch`` (see the registry in ``omni_ext.patches``): the head keeps the
queue and binds each diffusion request to a replica when it can start there.

vLLM-Omni 0.30's ``StagePool.submit_initial`` picks a replica on arrival (round robin in one
server, the coordinator's load balancer on a multi-machine head) and sends the request at once;
nothing else decides. With this patch, a diffusion stage with more than one replica slot, or any
multi-machine head, queues the request in a :class:`Dispatcher` on its pool instead. The decisions
are :mod:`omni_ext.scheduler.replicas` (pure); what happens here is the mechanism:

- **when**: a request arrives, a request finishes or is aborted (``release_binding`` /
  ``abort_requests``), a replica joins (``add_client``), a settle hold ends, or a replica comes
  back UP on the coordinator (a short timer while requests wait and no replica is free);
- **bind**: vLLM-Omni's own binding tables (``_request_bindings`` in one server, ``_affinity`` on a
  head), so its abort routing, CFG-companion affinity, sticky binding and replica-loss clean-up work
  unchanged; companions of a queued request wait with it and follow it;
- **send**: ``add_request_async`` on the chosen replica's client. A send that fails (the replica
  died, or its host went away: see ``replica-send-nonblocking``) marks the replica suspect and puts
  the request back at the front of the queue once (it had not started); a second failure fails it
  with vLLM-Omni's own "no live replica" error, as does a request that finds no live replica for
  :data:`NO_REPLICA_GRACE_S`;
- **learn**: the time from bind to release of every request that finished teaches a cost model
  (seconds per cost unit per shape class) and each replica's speed factor; aborted requests and
  those lost with a replica teach nothing.

The API process reads :func:`capacity` (live replicas x slots per replica, for admission) and
:func:`bound_since` (when a job was bound: it runs from then on) from here.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from omni_ext.models import families
from omni_ext.patches import patch_attr
from omni_ext.scheduler import replicas as policy
from omni_ext.scheduler.config import SchedulerConfig
from omni_ext.scheduler.cost import CostModel, remaining_s, request_shape
from omni_ext.scheduler.order import WAITED_ARG, Ticket, request_priority

logger = logging.getLogger("omni_ext.dispatch")

#: vLLM-Omni's warm-up requests never reach a pool, but if one does it goes the stock way.
WARM_UP_PREFIX = "dummy_req_id"
#: A request that finds no live replica for this long fails (vLLM-Omni's own pick waits 10 s).
NO_REPLICA_GRACE_S = 10.0
#: While requests wait and no replica has a free slot, membership is looked at this often.
RETRY_INTERVAL_S = 0.25
#: A replica whose send failed is left out for this long unless it registers again first.
SUSPECT_S = 30.0


@dataclass
class DispatchSettings:
    """What the API process tells the dispatcher at start-up (:func:`configure`): slots per replica
    (from the stage's layout), the served pipeline class (for cost units) and the scheduler's options."""

    slots_per_replica: int = 1
    pipeline: str | None = None
    config: SchedulerConfig = field(default_factory=SchedulerConfig)


SETTINGS = DispatchSettings()
#: Every live dispatcher of this process (one per diffusion pool that dispatches).
_DISPATCHERS: list[Dispatcher] = []
_LOCK = threading.Lock()


def configure(slots_per_replica: int, pipeline: str | None, config: SchedulerConfig) -> None:
    """Set the dispatch settings of this process (the API process calls this once at start-up)."""
    SETTINGS.slots_per_replica = max(1, int(slots_per_replica))
    SETTINGS.pipeline = pipeline
    SETTINGS.config = config
    for d in list(_DISPATCHERS):
        if d.cost.seed is None:
            d.cost.seed = config.seconds_per_unit


def capacity() -> int | None:
    """Jobs the live replicas of this process's dispatching pool run at once; None without one."""
    with _LOCK:
        ds = list(_DISPATCHERS)
    if not ds:
        return None
    return sum(len(d.live_ids()) for d in ds) * SETTINGS.slots_per_replica


def bound_since(job_id: str) -> float | None:
    """Unix time at which an engine request of ``job_id`` (``<job id>-<hex>`` or the id itself) was
    bound to a replica, i.e. started there; None while it waits on the head or when unknown."""
    with _LOCK:
        ds = list(_DISPATCHERS)
    for d in ds:
        for rid, b in list(d.bound.items()):
            if rid == job_id or rid.startswith(job_id + "-"):
                return b.wall
    return None


@dataclass
class _Pending:
    request_id: str
    request: Any
    params: Any
    submit_kwargs: dict[str, Any]
    ticket: Ticket
    key: str
    units: float
    companions: list[tuple[str, Any, Any, dict[str, Any]]] = field(default_factory=list)
    resent: bool = False


@dataclass
class _Bound:
    pending: _Pending
    replica: int
    since: float  # monotonic
    wall: float
    base_s: float | None  # predicted seconds before the replica's speed factor


class Dispatcher:
    """The head-side queue of one diffusion ``StagePool`` (see the module docstring)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.pending: dict[str, _Pending] = {}
        self.bound: dict[str, _Bound] = {}
        self.speed: dict[int, float] = {}
        self.suspect: dict[int, float] = {}  # replica -> monotonic time its send failed
        self.lost: set[str] = set()
        self.cost = CostModel(SETTINGS.config.seconds_per_unit)
        self.timer: asyncio.TimerHandle | None = None
        self.no_replica_since: float | None = None
        self.live_seen: tuple[int, ...] = ()
        with _LOCK:
            _DISPATCHERS.append(self)
        lb = getattr(pool, "_lb", None)
        logger.info(
            "omni-ext dispatch: stage-%s %s: requests wait here and are bound to a replica when one can start them "
            "(order %s, earliest predicted finish)%s; OMNI_EXT_DISABLE_PATCHES=replica-dispatch restores vLLM-Omni's",
            pool.stage_id, "on a multi-machine head" if pool.is_distributed else f"with {pool.num_replicas} replicas",
            SETTINGS.config.order,
            f", instead of the head's {type(lb).__name__}" if lb is not None else ", instead of round robin on arrival")

    def close(self) -> None:
        """Stop counting this pool in :func:`capacity` (its server is shutting down; tests)."""
        if self.timer is not None:
            self.timer.cancel()
        with _LOCK:
            if self in _DISPATCHERS:
                _DISPATCHERS.remove(self)

    # ---- replicas -----------------------------------------------------------------------
    def live_ids(self) -> list[int]:
        """Replicas that can take work: attached and available (and UP on a multi-machine head),
        less those whose last send failed within :data:`SUSPECT_S`."""
        pool = self.pool
        if pool.is_distributed:
            ids = [rid for _rep, rid in pool._collect_serviceable_replicas()]
        else:
            ids = [r for r in pool.live_replica_ids() if pool.is_replica_available(r)]
        now = time.monotonic()
        return [r for r in ids if now - self.suspect.get(r, -1e18) > SUSPECT_S]

    def _loads(self, live: list[int], now: float) -> list[policy.ReplicaLoad]:
        loads = {r: policy.ReplicaLoad(r, SETTINGS.slots_per_replica, speed=self.speed.get(r, 1.0)) for r in live}
        for b in self.bound.values():
            if b.replica in loads:
                left = remaining_s(b.base_s, now - b.since) if b.base_s is not None else b.pending.units
                loads[b.replica].running.append((left or 0.0) * loads[b.replica].speed)
        return list(loads.values())

    # ---- queue --------------------------------------------------------------------------
    def enqueue(self, p: _Pending) -> None:
        self.pending[p.request_id] = p
        logger.debug("omni-ext dispatch: queued %s (%d waiting)", p.request_id, len(self.pending))

    def attach_companion(self, parent_id: str, companion: tuple[str, Any, Any, dict[str, Any]]) -> bool:
        """A CFG companion of a queued request waits with it (stock rule: it runs where its parent runs)."""
        parent = self.pending.get(parent_id)
        if parent is None:
            return False
        parent.companions.append(companion)
        return True

    def _refresh(self, p: _Pending) -> Ticket:
        return p.ticket.price(self.cost.predict_s(p.key, p.units), p.units)

    def pump(self) -> None:
        """Bind and send every queued request that can start now (runs on the orchestrator's loop)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.pending:
            return
        now = time.monotonic()
        live = self.live_ids()
        if tuple(live) != self.live_seen:
            logger.info("omni-ext dispatch: stage-%s live replicas %s (%d slot(s) each)", self.pool.stage_id, live,
                        SETTINGS.slots_per_replica)
            self.live_seen = tuple(live)
        if not live:
            self.no_replica_since = self.no_replica_since or now
            if now - self.no_replica_since >= NO_REPLICA_GRACE_S:
                for p in list(self.pending.values()):
                    self.pending.pop(p.request_id, None)
                    self._spawn(self._fail(p, f"no live replica for {NO_REPLICA_GRACE_S:g} s"))
                return
            self._again(RETRY_INTERVAL_S)
            return
        self.no_replica_since = None
        loads = self._loads(live, now)
        tickets = [self._refresh(p) for p in self.pending.values()]
        hold = policy.settling(tickets, loads, now, SETTINGS.config.settle_s)
        if hold > 0:
            self._again(hold)
            return
        for request_id, replica in policy.plan(tickets, loads, now, SETTINGS.config):
            p = self.pending.pop(request_id)
            self._bind(p, replica, now)
            self._spawn(self._send(p, replica))
        if self.pending:
            self._again(RETRY_INTERVAL_S)

    def _again(self, delay: float) -> None:
        try:
            self.timer = asyncio.get_running_loop().call_later(max(0.001, delay), self.pump)
        except RuntimeError:
            self.timer = None

    @staticmethod
    def _spawn(coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                               or logger.error("omni-ext dispatch task failed", exc_info=t.exception()))

    def _bind(self, p: _Pending, replica: int, now: float) -> None:
        pool = self.pool
        base = self.cost.predict_s(p.key, p.units)
        self.bound[p.request_id] = _Bound(p, replica, now, time.time(), base)
        ids = [p.request_id, *(c[0] for c in p.companions)]
        if pool.is_distributed:
            addr = pool._client_input_addr(pool.clients[replica])
            for rid in ids:
                pool._affinity[rid] = addr
        else:
            for rid in ids:
                pool._request_bindings[rid] = replica
        logger.info("omni-ext dispatch: %s -> stage-%s replica %d (priority %d, %.0f units, predicted %s, %d waiting)",
                    p.request_id, pool.stage_id, replica, p.ticket.priority, p.units,
                    f"{base * self.speed.get(replica, 1.0):.1f} s" if base is not None else "unknown", len(self.pending))

    async def _send(self, p: _Pending, replica: int) -> None:
        pool = self.pool
        # The replica's executor counts the wait from the arrival here (aging; no second settle).
        waited = max(0.0, time.monotonic() - p.ticket.arrival)
        for params in [p.params, *(c[2] for c in p.companions)]:
            params.extra_args = {**(getattr(params, "extra_args", None) or {}), WAITED_ARG: round(waited, 3)}
        try:
            client = pool._diffusion_client(replica)
            await client.add_request_async(p.request_id, p.request, p.params, **p.submit_kwargs)
            for rid, request, params, kwargs in p.companions:
                await client.add_request_async(rid, request, params, **kwargs)
        except Exception as exc:  # EngineDeadError, StageUnavailableError, ReplicaUnreachable, zmq errors
            self.bound.pop(p.request_id, None)
            for rid in [p.request_id, *(c[0] for c in p.companions)]:
                pool._request_bindings.pop(rid, None)
                pool._affinity.pop(rid, None)
            self.suspect[replica] = time.monotonic()
            if not p.resent:
                p.resent = True
                logger.warning("omni-ext dispatch: sending %s to stage-%s replica %d failed (%s); it had not started, "
                               "re-sending it once to another replica", p.request_id, pool.stage_id, replica, exc)
                self.pending = {p.request_id: p, **self.pending}
                self.pump()
                return
            await self._fail(p, f"sending it to replica {replica} failed twice: {exc}")

    async def _fail(self, p: _Pending, why: str) -> None:
        logger.error("omni-ext dispatch: request %s failed: %s", p.request_id, why)
        orch = getattr(self.pool, "_omni_ext_orchestrator", None)
        if orch is None:
            logger.error("omni-ext dispatch: no orchestrator known to fail %s", p.request_id)
            return
        await orch._fail_request_dead_stage(p.request_id, self.pool.stage_id)

    # ---- completions and losses -----------------------------------------------------------
    def release(self, request_id: str) -> None:
        """``release_binding``: the request finished, failed or was aborted; its slot is free."""
        if self.pending.pop(request_id, None) is not None:
            logger.info("omni-ext dispatch: %s left the queue before it started", request_id)
        b = self.bound.pop(request_id, None)
        if b is not None and request_id not in self.lost:
            seconds = time.monotonic() - b.since
            self.speed[b.replica] = policy.updated_speed(self.speed.get(b.replica, 1.0), b.base_s, seconds)
            self.cost.observe(b.pending.key, b.pending.units, seconds)
        self.lost.discard(request_id)
        if b is not None or self.pending:
            try:
                asyncio.get_running_loop().call_soon(self.pump)
            except RuntimeError:
                pass

    def forget(self, request_ids: list[str]) -> None:
        """Aborted requests: out of the queue, and their times teach nothing."""
        for rid in request_ids:
            self.pending.pop(rid, None)
            if rid in self.bound:
                self.lost.add(rid)

    def lose_replica(self, replica: int | None) -> None:
        """A replica died or left: the jobs bound there are failed by vLLM-Omni's own clean-up and
        teach nothing; the queue goes to the others."""
        if replica is None:
            return
        for rid, b in self.bound.items():
            if b.replica == replica:
                self.lost.add(rid)
        self.speed.pop(replica, None)

    def joined(self, replica: int) -> None:
        self.suspect.pop(replica, None)
        try:
            asyncio.get_running_loop().call_soon(self.pump)
        except RuntimeError:
            pass


# ---- the patch ------------------------------------------------------------------------------
def dispatcher_of(pool: Any) -> Dispatcher | None:
    """The pool's dispatcher: a diffusion pool with several replica slots, or any multi-machine head."""
    existing = pool.__dict__.get("_omni_ext_dispatcher")
    if existing is not None:
        return existing
    if pool.stage_type != "diffusion" or not (pool.is_distributed or pool.num_replicas > 1):
        return None
    d = Dispatcher(pool)
    pool._omni_ext_dispatcher = d
    return d


def _pending(request_id: str, request: Any, params: Any, submit_kwargs: dict[str, Any]) -> _Pending:
    pipeline = SETTINGS.pipeline
    cfg = families.needs_cfg(pipeline, request, params)
    key, _steps = request_shape(pipeline, params, cfg)
    units = families.cost_units(pipeline, params, cfg)
    ticket = Ticket(request_id, request_priority(request_id, params), time.monotonic(), units)
    return _Pending(request_id, request, params, submit_kwargs, ticket, key, units)


def apply() -> None:
    from vllm_omni.engine.orchestrator import Orchestrator
    from vllm_omni.engine.stage_pool import StagePool
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    original_submit = StagePool.submit_initial

    async def submit_initial(self, request_id, req_state, request, *, prompt_text=None, affinity_request_id=None,
                             submit_kwargs=None, params_override=None):
        d = dispatcher_of(self)
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
        d.enqueue(_pending(request_id, request, params, kwargs))
        d.pump()
        bound = d.bound.get(request_id)
        return bound.replica if bound is not None else -1

    original_release = StagePool.release_binding

    def release_binding(self, request_id):
        original_release(self, request_id)
        d = self.__dict__.get("_omni_ext_dispatcher")
        if d is not None:
            d.release(request_id)

    original_abort = StagePool.abort_requests

    async def abort_requests(self, request_ids):
        d = self.__dict__.get("_omni_ext_dispatcher")
        if d is not None:
            d.forget(list(request_ids))
        return await original_abort(self, request_ids)

    original_evict = StagePool.evict_replica

    def evict_replica(self, replica_id):
        d = self.__dict__.get("_omni_ext_dispatcher")
        if d is not None:
            d.lose_replica(replica_id)
        return original_evict(self, replica_id)

    original_invalidate = StagePool.invalidate_addr

    def invalidate_addr(self, input_addr):
        d = self.__dict__.get("_omni_ext_dispatcher")
        if d is not None:
            d.lose_replica(self._addr_to_replica_id.get(input_addr))
        return original_invalidate(self, input_addr)

    original_add = StagePool.add_client

    def add_client(self, input_addr, client, *, replica_id=None):
        rid = original_add(self, input_addr, client, replica_id=replica_id)
        d = dispatcher_of(self) if self.stage_type == "diffusion" else None
        if d is not None:
            d.joined(rid)
        return rid

    original_run = Orchestrator.run

    async def run(self):
        for pool in self.stage_pools:
            pool._omni_ext_orchestrator = self
        return await original_run(self)

    patch_attr(StagePool, "submit_initial", submit_initial)
    patch_attr(StagePool, "release_binding", release_binding)
    patch_attr(StagePool, "abort_requests", abort_requests)
    patch_attr(StagePool, "evict_replica", evict_replica)
    patch_attr(StagePool, "invalidate_addr", invalidate_addr)
    patch_attr(StagePool, "add_client", add_client)
    patch_attr(Orchestrator, "run", run)
