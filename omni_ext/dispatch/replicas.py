"""The head's queue in front of a diffusion stage's replicas: requests wait here and are bound to a
replica when it can start them.

vLLM-Omni 0.30's ``StagePool.submit_initial`` picks a replica on arrival (round robin in one
server, the coordinator's load balancer on a multi-machine head) and sends the request at once;
nothing else decides. With the ``replica-dispatch`` patch (:mod:`omni_ext.patches.replica_dispatch`,
which only hooks this in), a diffusion stage with more than one replica slot, or any multi-machine
head, queues the request in a :class:`Dispatcher` on its pool instead. The decisions are
:mod:`omni_ext.scheduler.replicas` (pure); what happens here is the mechanism:

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

One :class:`ReplicaDispatch` per process (:data:`DISPATCH`) holds the settings and every live
dispatcher; the API's start-up hook configures it and hands it to the API's account, which reads
:meth:`ReplicaDispatch.capacity` (for admission) and :meth:`ReplicaDispatch.bound_since` from it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from omni_ext import progress
from omni_ext.scheduler import replicas as policy
from omni_ext.scheduler.config import SchedulerConfig
from omni_ext.models.families import request_cost
from omni_ext.scheduler.cost import CostModel
from omni_ext.scheduler.priority import WAITED_ARG, request_deadline_s, request_priority
from omni_ext.scheduler.queue import Entry, JobQueue

logger = logging.getLogger("omni_ext.dispatch")

#: A request that finds no live replica for this long fails (vLLM-Omni's own pick waits 10 s).
NO_REPLICA_GRACE_S = 10.0
#: While requests wait and no replica has a free slot, membership is looked at this often.
RETRY_INTERVAL_S = 0.25
#: A replica whose send failed is left out for this long unless it registers again first.
SUSPECT_S = 30.0

#: omni-ext's attributes on vLLM-Omni's ``StagePool`` (its dispatcher, the orchestrator that fails its requests).
_DISPATCHER_ATTR = "_omni_ext_dispatcher"
_ORCHESTRATOR_ATTR = "_omni_ext_orchestrator"


@dataclass
class DispatchSettings:
    """What the API process tells the dispatch at start-up (:meth:`ReplicaDispatch.configure`): slots
    per replica (from the stage's layout), the served pipeline class (for cost units) and the
    scheduler's options."""

    slots_per_replica: int = 1
    pipeline: str | None = None
    config: SchedulerConfig = field(default_factory=SchedulerConfig)


class ReplicaDispatch:
    """This process's dispatch: its settings and every live :class:`Dispatcher` (one per diffusion
    pool that dispatches). Dispatchers run on the orchestrator's loop, the API reads on its own: the
    list is guarded by a lock."""

    def __init__(self) -> None:
        self.settings = DispatchSettings()
        self._dispatchers: list[Dispatcher] = []
        self._lock = threading.Lock()

    def configure(self, slots_per_replica: int, pipeline: str | None, config: SchedulerConfig) -> None:
        """Set the dispatch settings of this process (the API process calls this once at start-up)."""
        self.settings.slots_per_replica = max(1, int(slots_per_replica))
        self.settings.pipeline = pipeline
        self.settings.config = config
        for d in self._live():
            d.queue.config = config
            if d.cost.seed is None:
                d.cost.seed = config.seconds_per_unit

    def capacity(self) -> int | None:
        """Jobs the live replicas of this process's dispatching pool run at once; None without one."""
        ds = self._live()
        if not ds:
            return None
        return sum(len(d.live_ids()) for d in ds) * self.settings.slots_per_replica

    def bound_since(self, job_id: str) -> float | None:
        """Unix time at which an engine request of ``job_id`` (``<job id>-<hex>`` or the id itself) was
        bound to a replica, i.e. started there; None while it waits on the head or when unknown."""
        for d in self._live():
            for e in d.queue.running():
                if e.id == job_id or e.id.startswith(job_id + "-"):
                    return e.payload.bound_wall
        return None

    def dispatcher_of(self, pool: Any) -> Dispatcher | None:
        """The pool's dispatcher (made on first use): a diffusion pool with several replica slots, or
        any multi-machine head; None for any other pool."""
        existing = attached(pool)
        if existing is not None:
            return existing
        if pool.stage_type != "diffusion" or not (pool.is_distributed or pool.num_replicas > 1):
            return None
        d = Dispatcher(pool, self)
        setattr(pool, _DISPATCHER_ATTR, d)
        return d

    def _live(self) -> list[Dispatcher]:
        with self._lock:
            return list(self._dispatchers)

    def _add(self, d: Dispatcher) -> None:
        with self._lock:
            self._dispatchers.append(d)

    def _remove(self, d: Dispatcher) -> None:
        with self._lock:
            if d in self._dispatchers:
                self._dispatchers.remove(d)


def attached(pool: Any) -> Dispatcher | None:
    """The pool's dispatcher if it has one already (never makes one)."""
    return pool.__dict__.get(_DISPATCHER_ATTR)


def orchestrator_runs(orchestrator: Any) -> None:
    """The orchestrator starts: its pools' dispatchers fail requests through it."""
    for pool in orchestrator.stage_pools:
        setattr(pool, _ORCHESTRATOR_ATTR, orchestrator)


@dataclass
class _Pending:
    """What the dispatch keeps of a request beside its queue entry: what it sends to the replica."""

    request_id: str
    request: Any
    params: Any
    submit_kwargs: dict[str, Any]
    companions: list[tuple[str, Any, Any, dict[str, Any]]] = field(default_factory=list)
    resent: bool = False
    bound_wall: float | None = None  # unix time it was bound to a replica (it runs there from then on)


class Dispatcher:
    """The head-side queue of one diffusion ``StagePool`` (see the module docstring)."""

    def __init__(self, pool: Any, owner: ReplicaDispatch) -> None:
        self.pool = pool
        self.owner = owner
        # Queued: waiting here; running: bound to a replica (``where``) until released.
        self.queue: JobQueue[_Pending] = JobQueue(self.settings.config)
        self.speed: dict[int, float] = {}
        self.suspect: dict[int, float] = {}  # replica -> monotonic time its send failed
        self.timer: asyncio.TimerHandle | None = None
        self.no_replica_since: float | None = None
        self.live_seen: tuple[int, ...] = ()
        owner._add(self)
        lb = getattr(pool, "_lb", None)
        logger.info(
            "omni-ext dispatch: stage-%s %s: requests wait here and are bound to a replica when one can start them "
            "(order %s, earliest predicted finish)%s; OMNI_EXT_DISABLE_PATCHES=replica-dispatch restores vLLM-Omni's",
            pool.stage_id, "on a multi-machine head" if pool.is_distributed else f"with {pool.num_replicas} replicas",
            self.settings.config.order,
            f", instead of the head's {type(lb).__name__}" if lb is not None else ", instead of round robin on arrival")

    @property
    def settings(self) -> DispatchSettings:
        return self.owner.settings

    def close(self) -> None:
        """Stop counting this pool in :meth:`ReplicaDispatch.capacity` (its server is shutting down; tests)."""
        if self.timer is not None:
            self.timer.cancel()
        self.owner._remove(self)

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

    @property
    def cost(self) -> CostModel:
        return self.queue.cost

    def waiting(self) -> int:
        return len(self.queue.queued())

    def _loads(self, live: list[int], now: float) -> list[policy.ReplicaLoad]:
        loads = {r: policy.ReplicaLoad(r, self.settings.slots_per_replica, speed=self.speed.get(r, 1.0)) for r in live}
        for e in self.queue.running():
            if e.where in loads:
                left = self.queue.remaining(e, now)
                loads[e.where].running.append((left if left is not None else e.units) * loads[e.where].speed)
        return list(loads.values())

    # ---- queue --------------------------------------------------------------------------
    def submit(self, request_id: str, request: Any, params: Any, submit_kwargs: dict[str, Any]) -> int:
        """Queue a new request and bind what can start: the replica it was bound to at once, else -1."""
        pipeline = self.settings.pipeline
        rc = request_cost(pipeline, request, params)
        self.queue.submit(request_id, _Pending(request_id, request, params, submit_kwargs),
                          priority=request_priority(request_id, params), arrival=time.monotonic(), key=rc.key, units=rc.units,
                          deadline_s=request_deadline_s(request_id, params), n_steps=rc.steps)
        logger.debug("omni-ext dispatch: queued %s (%d waiting)", request_id, self.waiting())
        self.pump()
        entry = self.queue.get(request_id)
        return entry.where if entry is not None and entry.running else -1

    def attach_companion(self, parent_id: str, companion: tuple[str, Any, Any, dict[str, Any]]) -> bool:
        """A CFG companion of a queued request waits with it (stock rule: it runs where its parent runs)."""
        parent = self.queue.get(parent_id)
        if parent is None or parent.running:
            return False
        parent.payload.companions.append(companion)
        return True

    def pump(self) -> None:
        """Bind and send every queued request that can start now (runs on the orchestrator's loop)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.waiting():
            return
        now = time.monotonic()
        live = self.live_ids()
        if tuple(live) != self.live_seen:
            logger.info("omni-ext dispatch: stage-%s live replicas %s (%d slot(s) each)", self.pool.stage_id, live,
                        self.settings.slots_per_replica)
            self.live_seen = tuple(live)
        if not live:
            self.no_replica_since = self.no_replica_since or now
            if now - self.no_replica_since >= NO_REPLICA_GRACE_S:
                for e in self.queue.queued():
                    self.queue.abort(e.id)
                    self._spawn(self._fail(e.payload, f"no live replica for {NO_REPLICA_GRACE_S:g} s"))
                return
            self._again(RETRY_INTERVAL_S)
            return
        self.no_replica_since = None
        loads = self._loads(live, now)
        tickets = [self.queue.price(e) for e in self.queue.queued()]
        hold = policy.settling(tickets, loads, now, self.settings.config.settle_s)
        if hold > 0:
            self._again(hold)
            return
        for request_id, replica in policy.plan(tickets, loads, now, self.settings.config):
            entry = self._bind(request_id, replica, now)
            self._spawn(self._send(entry.payload, replica, entry.ticket.arrival))
        if self.waiting():
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

    def _bind(self, request_id: str, replica: int, now: float) -> Entry[_Pending]:
        pool = self.pool
        entry = self.queue.start(request_id, now, replica)
        p, base = entry.payload, entry.predicted_s
        p.bound_wall = time.time()
        ids = [p.request_id, *(c[0] for c in p.companions)]
        if pool.is_distributed:
            addr = pool._client_input_addr(pool.clients[replica])
            for rid in ids:
                pool._affinity[rid] = addr
        else:
            for rid in ids:
                pool._request_bindings[rid] = replica
        logger.info("omni-ext dispatch: %s -> stage-%s replica %d (priority %d, %.0f units, predicted %s, %d waiting)",
                    p.request_id, pool.stage_id, replica, entry.ticket.priority, entry.units,
                    f"{base * self.speed.get(replica, 1.0):.1f} s" if base is not None else "unknown", self.waiting())
        progress.record_placement("bind", p.request_id, stage=pool.stage_id, replica=replica)
        return entry

    async def _send(self, p: _Pending, replica: int, arrival: float) -> None:
        pool = self.pool
        # The replica's executor counts the wait from the arrival here (aging; no second settle).
        waited = max(0.0, time.monotonic() - arrival)
        for params in [p.params, *(c[2] for c in p.companions)]:
            params.extra_args = {**(getattr(params, "extra_args", None) or {}), WAITED_ARG: round(waited, 3)}
        try:
            client = pool._diffusion_client(replica)
            await client.add_request_async(p.request_id, p.request, p.params, **p.submit_kwargs)
            for rid, request, params, kwargs in p.companions:
                await client.add_request_async(rid, request, params, **kwargs)
        except Exception as exc:  # EngineDeadError, StageUnavailableError, ReplicaUnreachable, zmq errors
            entry = self.queue.abort(p.request_id)
            for rid in [p.request_id, *(c[0] for c in p.companions)]:
                pool._request_bindings.pop(rid, None)
                pool._affinity.pop(rid, None)
            self.suspect[replica] = time.monotonic()
            if not p.resent:
                p.resent = True
                logger.warning("omni-ext dispatch: sending %s to stage-%s replica %d failed (%s); it had not started, "
                               "re-sending it once to another replica", p.request_id, pool.stage_id, replica, exc)
                if entry is not None:
                    self.queue.add(entry, front=True)
                self.pump()
                return
            await self._fail(p, f"sending it to replica {replica} failed twice: {exc}")

    async def _fail(self, p: _Pending, why: str) -> None:
        logger.error("omni-ext dispatch: request %s failed: %s", p.request_id, why)
        orch = getattr(self.pool, _ORCHESTRATOR_ATTR, None)
        if orch is None:
            logger.error("omni-ext dispatch: no orchestrator known to fail %s", p.request_id)
            return
        await orch._fail_request_dead_stage(p.request_id, self.pool.stage_id)

    # ---- completions and losses -----------------------------------------------------------
    def release(self, request_id: str) -> None:
        """``release_binding``: the request finished, failed or was aborted; its slot is free."""
        entry = self.queue.get(request_id)
        if entry is None:
            pass
        elif not entry.running:
            self.queue.abort(request_id)
            logger.info("omni-ext dispatch: %s left the queue before it started", request_id)
        else:
            learns, base, replica = entry.learns, entry.predicted_s, entry.where
            seconds = self.queue.finish(request_id, time.monotonic())
            if learns and seconds is not None:
                self.speed[replica] = policy.updated_speed(self.speed.get(replica, 1.0), base, seconds)
        if (entry is not None and entry.running) or self.waiting():
            try:
                asyncio.get_running_loop().call_soon(self.pump)
            except RuntimeError:
                pass

    def forget(self, request_ids: list[str]) -> None:
        """Aborted requests: out of the queue, and their times teach nothing."""
        for rid in request_ids:
            entry = self.queue.get(rid)
            if entry is not None and not entry.running:
                self.queue.abort(rid)
            else:
                self.queue.forget(rid)

    def lose_replica(self, replica: int | None) -> None:
        """A replica died or left: the jobs bound there are failed by vLLM-Omni's own clean-up and
        teach nothing; the queue goes to the others."""
        if replica is None:
            return
        for e in self.queue.running():
            if e.where == replica:
                self.queue.forget(e.id)
        self.speed.pop(replica, None)

    def lose_address(self, input_addr: str) -> None:
        """``invalidate_addr``: the replica at that address went away (see :meth:`lose_replica`)."""
        self.lose_replica(self.pool._addr_to_replica_id.get(input_addr))

    def joined(self, replica: int) -> None:
        self.suspect.pop(replica, None)
        try:
            asyncio.get_running_loop().call_soon(self.pump)
        except RuntimeError:
            pass


#: The dispatch of this process (the patch makes its dispatchers; the API's start-up hook configures it).
DISPATCH = ReplicaDispatch()
