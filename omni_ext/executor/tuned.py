"""``TunedExecutor``: CFG parallel end to end, real data parallel, no wasted rank, fast failure.

Selected with ``--distributed-executor-backend omni_ext.executor.TunedExecutor`` (or a deploy
YAML's ``distributed_executor_backend``); what it gives a user, its limits and its measured figures
are the README's "Tuned executor" section. It implements vLLM-Omni 0.30's ``DiffusionExecutor``
contract; the engine, scheduler, model runner, worker and pipelines are vLLM-Omni's own (the
pipelines as thin subclasses, :mod:`omni_ext.executor.pipelines`).

This module is the mechanism only. What it decides with it is pure code, documented where it is
done: which queued job starts first (:mod:`omni_ext.scheduler.admission`), on which ranks and in which
mode (:mod:`omni_ext.scheduler.placement`: pair, single rank, warm-up on every rank, ``cfg_mode``,
settling), what a job is expected to cost and its time limit (:mod:`omni_ext.scheduler.cost`),
whether a request runs CFG and its cost units (:mod:`omni_ext.models.families`); the options are
:mod:`omni_ext.scheduler.config`.

Processes. ``W = data_parallel_size x cfg_parallel_size x tensor_parallel_size x
sequence_parallel_size`` worker processes (:mod:`omni_ext.executor.worker`, started as
:mod:`omni_ext.executor.start` says), process ``p`` on local device ``p``, in one torch.distributed
world per CFG group (see "Failure and healing") with vLLM-Omni's own process groups. Placement sees *units*: the TP x Ulysses x Ring processes
of one CFG half, which always run a job together (:class:`~omni_ext.scheduler.placement.Units`: unit
``u`` is processes ``[u*n, (u+1)*n)``, vLLM-Omni's TP and SP groups); group ``g`` is units
``[g*cfg, g*cfg + cfg)``, whose processes form its world and vLLM-Omni's CFG group in it. A job placed on units is sent
to every process of them, and answered by the leader of the unit holding its output. vLLM-Omni's TP
layers and SP attention run unchanged inside a unit, in either job mode: a SINGLE job (both guidance
branches on one unit) never enters the CFG all-gather, only its unit's TP and SP collectives.
``data_parallel_size`` is the stage's (patch ``dp-world``) or ``omni_ext.data_parallel_size``.

Pipes and futures. ``execute_batch`` does not block the engine: it queues each scheduled request as
a job (a wave of compatible requests under ``--max-num-seqs`` as one batched job or several, as
:mod:`omni_ext.scheduler.batching` decides) and returns at once with an ``async_output_id``; the
engine waits on ``wait_output_ready``'s future outside its busy loop, so it schedules the next
request at once. What happens to a job
between the two, which job starts where and when, is the executor's :class:`RankQueue`
(:mod:`omni_ext.executor.ranks`); this class gives it the ranks' pipes (:mod:`omni_ext.executor.protocol`)
and one reader thread per rank that hands it their answers. A cancel reaches a running rank through
shared memory (:mod:`omni_ext.executor.role`), not the pipe.

Failure and healing. A monitor thread waits on the worker processes' sentinels; a watchdog thread
watches the running jobs' time limits. When a worker dies, the jobs running or paused on its CFG
group fail at once with an error naming the worker, the signal and each request; jobs on the other
groups and jobs still queued are untouched. A job past its time limit is first stopped at its next
denoise step through the cancel board (it fails with the watchdog's reason, nothing is killed); only
a job still running ``omni_ext.healing.grace_s`` later has its group's workers killed, as if one died.

The executor then replaces the workers of that group only and reloads the model there
(:meth:`TunedExecutor._heal`), while the other groups keep serving. That is possible because every
CFG group is a torch.distributed world of its own (cfg x tp x sp processes on a master port of its
own, exactly as vLLM-Omni starts a one-group server: ``data_parallel_size`` 1 inside it): neither
gloo nor HCCL/NCCL can take a new process into a live world, but a group's world can be made anew
while the others' stay. Nothing of a job ever crosses groups (the CFG all-gather, TP and SP are
inside a group; data parallelism is this executor's placement, not a collective), so one world per
group loses nothing, and a per-step collective of a pipeline reaches only its own group's ranks.
Each process still uses the device of its rank in the whole executor: on a card, a group's workers
see only their group's devices (the platform's visible-devices variable), as vLLM-Omni's one-group
server would. While a group is replaced, queued jobs start on the other groups; the executor's
healing record (:func:`omni_ext.progress.write_healing`) says "degraded", which ``/health`` reports
with 200. Only when no group can serve (one group, or all being replaced) does it say
"respawning", on which the API process answers 503 with a Retry-After instead of admitting work
(:mod:`omni_ext.healing`). After ``max_respawns`` respawns within ``window_s``
(:mod:`omni_ext.scheduler.respawn`) the executor gives up: it fails like vLLM-Omni's executor
(``check_health`` raises ``EngineDeadError``) and its record says "exhausted", on which the API
process exits non-zero, so that a supervisor restarts the server.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from typing import Any

from vllm.v1.engine.exceptions import EngineDeadError

from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.executor.abstract import DiffusionExecutor

from omni_ext import environment, progress
from omni_ext.executor import ascend, protocol, start
from omni_ext.executor.ranks import Job, RankQueue, resolve
from omni_ext.executor.role import new_board
from omni_ext.models import families
from omni_ext.platform import devices, threads
from omni_ext.scheduler import layout, placement
from omni_ext.scheduler.config import CfgMode, healing_config, omni_ext_section, scheduler_config
from omni_ext.scheduler.respawn import RespawnBudget, Watchdog, watchdog_action

logger = logging.getLogger("omni_ext.executor")

_READY_TIMEOUT_S = float(environment.value("OMNI_EXT_WORKER_READY_TIMEOUT_S"))
#: Held while a worker group is started: its environment is set in this process's ``os.environ``.
_STARTS = threading.Lock()
#: A job's message at least this large goes to the job's processes at once (TunedExecutor._post);
#: vLLM-Omni moves tensors above the same size through shared memory.
PARALLEL_SEND_BYTES = 1_000_000


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def data_parallel_size(od_config: Any) -> int:
    """The TunedExecutor's data-parallel groups: omni-ext's ``data_parallel_size``, else the stage's own."""
    pc = getattr(od_config, "parallel_config", None)
    own = omni_ext_section(getattr(od_config, "additional_config", None)).get("data_parallel_size")
    return int(own or 0) or int(getattr(pc, "data_parallel_size", 1) or 1)


def executor_path(od_config: Any) -> tuple[str, str]:
    """:func:`omni_ext.models.decisions.executor_path` for the model and layout of ``od_config``."""
    from omni_ext.models import decisions, registry

    arch = getattr(od_config, "model_class_name", None)
    return decisions.executor_path(registry.facts_of(arch) if arch else None, families.family_of(arch),
                                   dp=data_parallel_size(od_config),
                                   max_num_seqs=int(getattr(od_config, "max_num_seqs", 1) or 1))


def group_env(worker_env: dict[str, str], platform: Any, ranks: tuple[int, ...], world: int,
              ascend_args: dict[str, Any] | None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """What the workers of the group of ``ranks`` get in their environment on top of the executor's: only
    the group's devices visible (:func:`omni_ext.platform.devices.group_devices_env`), the server's
    worker count (CPU threads, :mod:`omni_ext.platform.threads`), and on Ascend the variables of
    :func:`omni_ext.executor.ascend.ascend_worker_env` worked out for those devices (``ascend_args``),
    so that a mode-only ``CPU_AFFINITY_CONF`` gives each card of the group its own cores, not the
    first cards' cores again."""
    env = os.environ if environ is None else environ
    visible = devices.group_devices_env(platform, ranks, env)
    out = dict(worker_env)
    if ascend_args is not None:
        out.update(ascend.ascend_worker_env({**env, **visible}, **ascend_args))
    out.update(visible)
    out[threads.HOST_WORKERS_ENV] = str(world)
    return out


class TunedExecutor(DiffusionExecutor):
    uses_multiproc: bool = True

    def __new__(cls, od_config: Any = None, *args: Any, **kwargs: Any) -> Any:
        """vLLM-Omni's own executor where omni-ext has nothing to add for the served model, or would lose
        something vLLM-Omni gives (:func:`omni_ext.models.decisions.executor_path`: no tuned pipeline and
        one data-parallel group; a pipeline with step cancellation or request batching): built and
        returned here, so the engine holds it instead (Python then skips this class's ``__init__``), and
        the model runs exactly as without omni-ext."""
        path, why = executor_path(od_config) if od_config is not None else ("tuned", "")
        if path != "stock":
            return super().__new__(cls)
        od_config.distributed_executor_backend = None
        stock = DiffusionExecutor.get_class(od_config)
        logger.info("omni-ext TunedExecutor: %s runs on vLLM-Omni's own executor (%s): %s",
                    getattr(od_config, "model_class_name", None), stock.__name__, why)
        return stock(od_config)

    # ------------------------------------------------------------------ set-up
    def _init_executor(self) -> None:
        from vllm_omni.platforms import current_omni_platform

        cfg = self.od_config
        pc = cfg.parallel_config
        refusal = layout.tuned_refusal(layout.Parallel(
            cfg=int(pc.cfg_parallel_size or 1), tp=int(getattr(pc, "tensor_parallel_size", 1) or 1),
            ulysses=int(getattr(pc, "ulysses_degree", 1) or 1), ring=int(getattr(pc, "ring_degree", 1) or 1),
            pp=int(getattr(pc, "pipeline_parallel_size", 1) or 1),
            vae_patch=int(getattr(pc, "vae_patch_parallel_size", 1) or 1), hsdp=bool(getattr(pc, "use_hsdp", False)),
            step_execution=bool(getattr(cfg, "step_execution", False))))
        if refusal is not None:
            raise ValueError(refusal.message())
        self.cfg_size = int(pc.cfg_parallel_size or 1)
        # The processes of one unit: TP x (Ulysses x Ring, or vLLM-Omni's all-gather degree), its TP and
        # SP groups (vLLM-Omni orders ranks tp-sp-pp-cfg-dp: a unit's processes are contiguous).
        self.tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        self.units = placement.Units(self.tp * int(getattr(pc, "sequence_parallel_size", 1) or 1))
        additional = getattr(cfg, "additional_config", None)
        try:
            self.sched = scheduler_config(additional, getattr(cfg, "cache_backend", None))
            self.healing = healing_config(additional)
        except ValueError as exc:
            raise ValueError(f"omni-ext TunedExecutor: {exc}") from None
        # The registered patch dp-world has already made omni-ext's data_parallel_size the stage's
        # own, so vLLM-Omni's start-up counted, split and checked devices for this whole world; the
        # check below is the executor's own (rank r uses local device r), for a start-up without it.
        dp = data_parallel_size(cfg)
        world = dp * self.cfg_size * self.units.size
        visible, source = devices.visible_devices(current_omni_platform)
        if world > visible:
            sp = f" x tensor x sequence parallel {self.units.size}" if self.units.size > 1 else ""
            raise ValueError(
                f"omni-ext TunedExecutor: data_parallel_size {dp} x cfg_parallel_size {self.cfg_size}{sp} needs "
                f"{world} devices (one per rank), but {visible} are visible ({source})."
            )
        pc.data_parallel_size = dp
        pc.world_size = world
        cfg.num_gpus = world
        self.dp = dp
        self.world = world
        self.layout = placement.Layout.regular(dp, self.cfg_size)
        self.model_arch = getattr(cfg, "model_class_name", None)
        family = families.family_of(self.model_arch)
        # A request may use part of a CFG group only where omni-ext's tuned pipeline runs (it keeps a
        # one-rank job out of the group's collectives and runs both guidance branches there); any
        # other model's requests take the whole group, as under vLLM-Omni's own executor, and its
        # warm-up is an ordinary request.
        self._tuned_model = family is not None and family.splits_cfg_groups
        self.cfg_mode = self.sched.cfg_mode if self._tuned_model else CfgMode.PAIR

        # vLLM-Omni's engine waits at most VLLM_OMNI_ASYNC_OUTPUT_TIMEOUT (600 s) for an async output;
        # here a request may queue behind others and long videos take longer, and this executor
        # enforces its own cost-based limits, so lift that fixed cap unless the operator set it.
        os.environ.setdefault("VLLM_OMNI_ASYNC_OUTPUT_TIMEOUT", "86400")

        device_type = self.device_type = getattr(current_omni_platform, "device_type", "cpu")
        worker_env: dict[str, str] = {}
        self._ascend_args: dict[str, int] | None = None
        if device_type == "npu":
            self._ascend_args = dict(num_groups=dp, group_size=self.cfg_size, unit_size=self.units.size,
                                     unit_domains=(self.tp > 1) + (self.units.size > self.tp))
            worker_env = ascend.ascend_worker_env(**self._ascend_args)
        expected = ascend.collective_backend(device_type)
        backend = getattr(current_omni_platform, "dist_backend", expected)
        if device_type in ("npu", "cuda", "cpu") and backend != expected:
            raise RuntimeError(f"omni-ext TunedExecutor: platform {device_type} uses {backend!r}, expected {expected!r}.")
        self.worker_env = worker_env
        try:
            self.start_method = start.start_method(omni_ext_section(additional), device_type)
        except ValueError as exc:
            raise ValueError(f"omni-ext TunedExecutor: {exc}") from None

        self._closed = False
        self._failed = False
        self._failure: str | None = None
        self._callbacks: list = []
        self._rpc_replies: dict[str, dict[int, tuple[bool, Any]]] = {}
        self._gens = [0] * dp  # each group's worker generation: a monitor of an older one ends quietly
        self._expected: set[int] = set()  # ranks stopped on purpose, or whose death is reported
        self._respawning: set[int] = set()  # the groups whose workers are being replaced now
        self._budget = RespawnBudget(self.healing)
        self._counts = {"worker_deaths": 0, "respawns": 0, "watchdog_stops": 0, "watchdog_kills": 0}
        self._start_s = 0.0  # how long the last worker set took to start (the API's Retry-After while respawning)
        self._state: dict[str, Any] = {}
        self._record()
        self._launch_workers()
        self.ranks = RankQueue(
            self.layout, self.sched, model_arch=self.model_arch, tuned_model=self._tuned_model, cfg_mode=self.cfg_mode,
            send=self._post, cancel_slots=self._cancel_slots, small_warmup=device_type == "cpu", units=self.units,
            preempt_refusal=self._preempt_refusal(), batch_key=self._batch_key(),
            engine_settles=int(getattr(cfg, "max_num_seqs", 1) or 1) > 1
            and float(getattr(cfg, "request_batch_max_wait_ms", 0) or 0) > 0,
        )
        self._lock = self.ranks.lock
        self._start_threads()
        threading.Thread(target=self._watchdog, daemon=True, name="omni-ext-watchdog").start()
        logger.info(
            "omni-ext TunedExecutor: %d worker(s), %d group(s) %s of cfg %d x tp*sp %d, backend %s, scheduler "
            "cfg_mode=%s order=%s%s%s, workers started by %s",
            world, dp, [list(self.units.expand(g)) for g in self.layout.groups], self.cfg_size,
            self.units.size, backend, self.cfg_mode, self.sched.order,
            "" if self.cfg_mode == self.sched.cfg_mode else f" (configured {self.sched.cfg_mode}: no tuned pipeline)",
            f", worker env {worker_env}" if worker_env else "",
            self.start_method,
        )

    def _preempt_refusal(self) -> str | None:
        """Why this executor's jobs cannot be paused exactly (:func:`omni_ext.scheduler.layout.pause_refusal`)."""
        from omni_ext.scheduler.layout import pause_refusal

        return pause_refusal(self.model_arch, getattr(self.od_config, "cache_backend", None))

    def _batch_key(self) -> Any:
        """What makes requests of one wave batchable (request batching), or None where this server
        never batches: ``--max-num-seqs`` 1, or a pipeline without a request-batch forward (vLLM-Omni's
        ``supports_request_batch``). The key is vLLM-Omni's own: its request scheduler puts only
        requests with equal keys into one wave."""
        from omni_ext.models import registry

        if int(getattr(self.od_config, "max_num_seqs", 1) or 1) <= 1:
            return None
        facts = registry.facts_of(self.model_arch) if self.model_arch else None
        if facts is None or not facts.request_batch:
            logger.info("omni-ext: %s has no request-batch forward; each request of a wave runs as its own job",
                        self.model_arch)
            return None
        from vllm_omni.diffusion.sched.request_scheduler import build_request_batch_sampling_params_key

        return build_request_batch_sampling_params_key

    def _start_threads(self, groups: list[int] | None = None) -> None:
        """A reader per rank and a monitor per group, for the current workers of ``groups`` (default: all)."""
        for g in range(self.dp) if groups is None else groups:
            ranks = self._group_ranks(g)
            for r in ranks:
                self._readers[r] = threading.Thread(target=self._reader, args=(r, self._conns[r]), daemon=True,
                                                    name=f"omni-ext-reader-{r}")
                self._readers[r].start()
            threading.Thread(target=self._monitor, args=(g, self._gens[g], {r: self._procs[r] for r in ranks}),
                             daemon=True, name=f"omni-ext-monitor-{g}.{self._gens[g]}").start()

    def _group_ranks(self, g: int) -> tuple[int, ...]:
        """The worker processes of group ``g``: one torch.distributed world (module docstring)."""
        return self.units.expand(self.layout.groups[g])

    def _launch_workers(self) -> None:
        """Start every group's workers (start-up); a group's alone is started again by :meth:`_respawn`."""
        from vllm.v1.executor.multiproc_executor import set_multiprocessing_worker_envs

        t0 = time.monotonic()
        set_multiprocessing_worker_envs()
        with _environ(self.worker_env):
            self._ctx = start.worker_context(self.start_method)
        # One slot per rank: the sequence number of the job that rank must stop (shared memory, so
        # a cancel reaches a rank in the middle of its forward without any message), and the cells
        # in which the processes of a job agree on its stop step (omni_ext.executor.role.stop_now).
        # Cells hold job sequence numbers and pause tokens, which never repeat: a respawned group
        # uses its ranks' cells as they are.
        self._cancel_slots = new_board(self._ctx, self.world)
        self._procs: list = [None] * self.world
        self._conns: list = [None] * self.world
        self._readers: list = [None] * self.world
        self._send_locks = [threading.Lock() for _ in range(self.world)]
        self._last_wire: tuple[protocol.RunJob, bytes] | None = None  # see _wire
        self._pids: dict[int, int] = {}
        self._group_cfgs: dict[int, Any] = {}  # each group's vLLM-Omni config (its world, its master port)
        try:
            for g in range(self.dp):
                self._start_group(g, first=True)
            for g in range(self.dp):
                self._wait_ready(g)
        except BaseException:
            self._kill_workers()
            raise
        self._start_s = time.monotonic() - t0

    def _start_group(self, g: int, first: bool = False) -> None:
        """Start the worker processes of group ``g`` as a world of their own: vLLM-Omni's worker sees a
        one-group server (``data_parallel_size`` 1, ``num_gpus`` = the group's processes, a master port
        of the group's own, rank = the process's place in the group) and, on a card, only the group's
        devices, so that its rank-``i`` device is the executor's rank ``base + i`` device."""
        import copy

        from vllm.utils.network_utils import get_open_port
        from vllm_omni.platforms import current_omni_platform

        from omni_ext.executor.worker import worker_main

        ranks = self._group_ranks(g)
        cfg = copy.copy(self.od_config)
        cfg.parallel_config = pc = copy.copy(self.od_config.parallel_config)
        pc.data_parallel_size, pc.world_size = 1, len(ranks)
        cfg.num_gpus = len(ranks)
        children = []
        with _STARTS:  # os.environ is the process's: one group's start at a time (respawns run in threads)
            taken = {getattr(c, "master_port", None) for c in self._group_cfgs.values()}
            port = self.od_config.master_port if first and g == 0 else None
            while port is None or port in taken:
                port = cfg.settle_port(get_open_port(), port_inc=37)
            cfg.master_port = port
            self._group_cfgs[g] = cfg
            env = group_env(self.worker_env, current_omni_platform, ranks, self.world, self._ascend_args)
            with _environ(env):
                for i, rank in enumerate(ranks):
                    parent, child = self._ctx.Pipe(duplex=True)
                    proc = self._ctx.Process(
                        target=worker_main,
                        args=(rank, cfg, child, self._cancel_slots, start.worker_environ(), i),
                        name=f"DiffusionWorker-{rank}",
                        daemon=True,
                    )
                    proc.start()
                    self._procs[rank] = proc
                    self._conns[rank] = parent
                    children.append(child)
        for child in children:
            child.close()

    def _wait_ready(self, g: int) -> None:
        for rank in self._group_ranks(g):
            conn = self._conns[rank]
            deadline = time.monotonic() + _READY_TIMEOUT_S
            while not conn.poll(1.0):
                if not self._procs[rank].is_alive():
                    raise RuntimeError(
                        f"omni-ext: diffusion worker {rank} exited during start-up (exitcode {self._procs[rank].exitcode})"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"omni-ext: diffusion worker {rank} not ready after {_READY_TIMEOUT_S:.0f} s")
            msg = protocol.recv(conn)
            if not isinstance(msg, protocol.Ready):
                raise RuntimeError(f"omni-ext: diffusion worker {rank} failed to start: {getattr(msg, 'error', msg)}")
            self._pids[rank] = msg.pid

    # ------------------------------------------------------------------ contract
    @property
    def is_dead(self) -> bool:
        return self._closed or self._failed

    def register_failure_callback(self, callback) -> None:
        self._callbacks.append(callback)

    def _ensure_alive(self) -> None:
        if self._failed:
            raise EngineDeadError(self._failure or "omni-ext TunedExecutor failed")
        if self._closed:
            raise RuntimeError("omni-ext TunedExecutor is shut down")

    def execute_request(self, scheduler_output) -> Any:
        return self.execute_batch(scheduler_output)

    def execute_batch(self, scheduler_output) -> Any:
        from vllm_omni.diffusion.worker.utils import BatchRunnerOutput, RunnerOutput

        self._ensure_alive()
        new = scheduler_output.scheduled_new_reqs
        out_ids = self.ranks.submit_wave([(nr.request_id, nr.req) for nr in new])
        return BatchRunnerOutput.from_list([
            RunnerOutput(request_id=nr.request_id, step_index=None, finished=True, result=None, async_output_id=out_id)
            for nr, out_id in zip(new, out_ids)
        ])

    def execute_step(self, scheduler_output) -> Any:
        """Never reached: vLLM-Omni calls it only under ``--step-execution``, a layout that
        :meth:`_init_executor` refuses at start-up (:func:`omni_ext.scheduler.layout.tuned_refusal`).
        The base class declares it abstract, so it is here to say that, should a vLLM-Omni release
        call it another way."""
        raise RuntimeError(layout.tuned_refusal(layout.Parallel(step_execution=True)).message())

    def wait_output_ready(self, async_output_id: str) -> concurrent.futures.Future:
        job = self.ranks.take_output(async_output_id)
        if job is None:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.set_result(DiffusionOutput(error=f"omni-ext: unknown or already collected output {async_output_id}"))
            return fut
        return job.future

    def drop_output(self, async_output_id: str) -> None:
        self.ranks.drop_output(async_output_id)

    def abort_requests(self, request_ids) -> None:
        """Stop these requests, queued or running (called by the ``executor-abort-hook`` patch when
        the engine aborts them, e.g. on ``DELETE /v1/videos/{id}``).

        vLLM-Omni's engine hands a request to an async executor and forgets it; its own abort then
        never reaches the executor, and the request would run to the end."""
        self.ranks.abort(request_ids)

    def describe_pending_state(self, async_output_id: str | None = None) -> str:
        return f"async_output_id={async_output_id} {self.ranks.describe()}"

    def check_health(self) -> None:
        self._ensure_alive()
        for rank, proc in enumerate(self._procs):  # a group being replaced: its ranks are expected
            if not proc.is_alive() and rank not in self._expected:
                self._on_worker_death([rank])
                self._ensure_alive()

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        unique_reply_rank: int | None = None,
        exec_all_ranks: bool = False,
    ) -> Any:
        """Control-plane RPC: waits until no request runs (nothing new starts meanwhile), then calls
        ``method`` on every rank (or only on ``unique_reply_rank`` unless ``exec_all_ranks``)."""
        self._ensure_alive()
        deadline = None if timeout is None else time.monotonic() + timeout
        ranks = list(range(self.world)) if (unique_reply_rank is None or exec_all_ranks) else [unique_reply_rank]
        rpc_id = f"rpc-{self.ranks.next_id()}"
        rq = self.ranks
        with self._lock:
            rq.hold += 1
            try:
                while not rq.idle():
                    self._ensure_alive()
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"RPC call to {method} timed out waiting for running requests.")
                    self._lock.wait(timeout=0.5 if left is None else min(0.5, left))
                self._rpc_replies[rpc_id] = {}
                for r in ranks:
                    rq.busy[r] = rpc_id
                    self._post(r, protocol.CallRpc(rpc_id, method, args, kwargs or {}))
                while len(self._rpc_replies[rpc_id]) < len(ranks):
                    self._ensure_alive()
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"RPC call to {method} timed out.")
                    self._lock.wait(timeout=0.5 if left is None else min(0.5, left))
                replies = self._rpc_replies.pop(rpc_id)
            finally:
                rq.hold -= 1
                rq.dispatch()
        failed = {r: v for r, (ok, v) in replies.items() if not ok}
        if failed:
            raise RuntimeError(f"RPC '{method}' failed on worker rank(s): {failed}")
        if unique_reply_rank is not None:
            return replies[unique_reply_rank][1]
        return [replies[r][1] for r in ranks]

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for job in self.ranks.drain():
            resolve(job, DiffusionOutput(error="omni-ext TunedExecutor shut down"))
        for rank in range(self.world):
            with contextlib.suppress(Exception):
                self._post(rank, protocol.Shutdown())
        deadline = time.monotonic() + 10
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill_workers()
        # The workers are gone: each reader reads what is still in its pipe (freeing the shared
        # memory of any last output) and stops at end of file; only then are the pipes closed.
        for reader in getattr(self, "_readers", []):
            if reader is not None and reader is not threading.current_thread():
                reader.join(max(0.5, deadline + 5 - time.monotonic()))
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.close()

    def _post(self, rank: int, msg: protocol.Message) -> None:
        """Send ``msg`` down ``rank``'s pipe, in order with the rank's other messages.

        A job's :class:`~omni_ext.executor.protocol.RunJob` goes to every process of the job: it is
        pickled once, and a large one reaches the job's processes at the same time (each but the
        last is written from a thread that holds that rank's send lock, taken here, so the order per
        rank holds). An Edit-Plus request carries its 12.6 MB reference: one pipe after the other
        started the job's second process 20-25 ms after the first, a wait its first step absorbed."""
        data = self._wire(rank, msg)
        lock = self._send_locks[rank]
        lock.acquire()
        try:
            conn = self._conns[rank]
            if isinstance(msg, protocol.RunJob) and len(data) >= PARALLEL_SEND_BYTES and rank != msg.ranks[-1]:
                threading.Thread(target=self._send_held, args=(rank, conn, data, lock), daemon=True,
                                 name=f"omni-ext-send-{rank}").start()
                lock = None  # the thread releases it
                return
            conn.send_bytes(data)
        finally:
            if lock is not None:
                lock.release()

    def _wire(self, rank: int, msg: protocol.Message) -> bytes:
        """``msg``'s bytes; a job's RunJob is pickled for its first process and kept for the others
        (RankQueue sends them in ``msg.ranks`` order, under its lock), then dropped."""
        if not isinstance(msg, protocol.RunJob) or len(msg.ranks) < 2 or rank not in msg.ranks:
            return protocol.encode(msg)
        last = self._last_wire
        data = last[1] if last is not None and last[0] is msg else protocol.encode(msg)
        self._last_wire = None if rank == msg.ranks[-1] else (msg, data)
        return data

    @staticmethod
    def _send_held(rank: int, conn: Any, data: bytes, lock: threading.Lock) -> None:
        try:
            conn.send_bytes(data)
        except Exception as exc:  # a dead pipe: the monitor reports the death
            logger.error("omni-ext: could not send a job to worker %d: %s", rank, exc)
        finally:
            lock.release()

    # ------------------------------------------------------------------ threads
    def _reader(self, rank: int, conn: Any) -> None:
        while True:
            try:
                msg = protocol.recv(conn)
            except (EOFError, OSError):
                return
            except Exception:
                logger.exception("omni-ext: bad message from worker %d", rank)
                continue
            if isinstance(msg, protocol.JobDone):
                self.ranks.answer(rank, msg)
            elif isinstance(msg, protocol.Paused):
                self.ranks.on_paused(rank, msg)
            elif isinstance(msg, protocol.RpcResult):
                self._on_rpc_result(rank, msg)

    def _on_rpc_result(self, rank: int, reply: protocol.RpcResult) -> None:
        with self._lock:
            if self.ranks.busy.get(rank) == reply.rpc_id:
                self.ranks.busy[rank] = None
            if reply.rpc_id in self._rpc_replies:
                self._rpc_replies[reply.rpc_id][rank] = (reply.ok, reply.result)
            self._lock.notify_all()

    def _monitor(self, g: int, gen: int, procs: dict[int, Any]) -> None:
        """Wait on the sentinels of group ``g``'s workers of generation ``gen``; report each death that
        was not asked for."""
        sentinels = {p.sentinel: r for r, p in procs.items()}
        while sentinels:
            try:
                ready = multiprocessing.connection.wait(list(sentinels))
            except OSError:
                return
            if self._closed or gen != self._gens[g]:
                return
            dead = [sentinels.pop(s) for s in ready]
            with self._lock:
                dead = [r for r in dead if r not in self._expected]
            if dead:
                self._on_worker_death(dead)

    def _watchdog(self) -> None:
        """A job past its time limit is stopped at its next step (it fails, nothing is killed); one that
        has not stopped ``grace_s`` later has its group's workers killed and replaced (:meth:`_heal`)."""
        while not (self._closed or self._failed):
            time.sleep(1.0)
            now = time.monotonic()
            for job in self.ranks.late(now):
                action = watchdog_action(now, job.deadline, job.stop_asked, self.healing.grace_s)
                limit = f"{(job.deadline or now) - (job.started or now):.0f} s"
                if action is Watchdog.STOP:
                    self._counts["watchdog_stops"] += 1
                    self._record()
                    self.ranks.stop_late(job, (
                        f"omni-ext: request {job.request_id} exceeded its time limit of {limit} on worker(s) "
                        f"{list(job.ranks)} and was stopped by the watchdog (the limit is 10x its expected cost, at "
                        "least 120 s; OMNI_EXT_JOB_TIMEOUT_FACTOR, OMNI_EXT_JOB_TIMEOUT_MIN_S or OMNI_EXT_JOB_TIMEOUT_S "
                        "change it)"), now)
                elif action is Watchdog.KILL:
                    self._counts["watchdog_kills"] += 1
                    self._heal(list(job.ranks), (
                        f"omni-ext: request {job.request_id} did not stop within {self.healing.grace_s:g} s after "
                        f"passing its time limit of {limit}; the watchdog killed worker(s) {list(job.ranks)}"))
                    break

    def _on_worker_death(self, ranks: list[int]) -> None:
        """Report the deaths of ``ranks`` once: the monitor and :meth:`check_health` (``/health``) can both
        see the same death before :meth:`_heal` has marked its group."""
        with self._lock:
            ranks = [r for r in ranks if r not in self._expected]
            self._expected.update(ranks)
        if not ranks:
            return
        details = []
        for r in ranks:
            p = self._procs[r]
            p.join(1.0)  # its sentinel fired: reap it so that the exit code/signal is known
            code = p.exitcode
            if code is not None and code < 0:
                try:
                    how = signal.Signals(-code).name
                except ValueError:
                    how = f"signal {-code}"
            else:
                how = f"exit code {code}"
            details.append(f"{p.name} (rank {r}, pid {p.pid}) died with {how}")
        self._counts["worker_deaths"] += len(ranks)
        self._heal(ranks, "omni-ext: diffusion worker " + "; ".join(details))

    def _heal(self, ranks: list[int], reason: str) -> None:
        """Fail the jobs on the groups of ``ranks`` with ``reason`` and replace those groups' workers
        (module docstring), or give up once the respawn budget is spent. Called from the monitor or the
        watchdog; each replacement runs in a thread of its own, and the other groups keep serving."""
        procs = self.ranks.group_of(ranks)
        groups = sorted({g for g in range(self.dp) if set(self._group_ranks(g)) & set(procs)})
        with self._lock:
            if self._closed or self._failed:
                return
            self._expected.update(procs)  # the rest of the group is stopped on purpose
            new = [g for g in groups if g not in self._respawning]
            now = time.monotonic()
            allowed = all([self._budget.allow(now) for _ in new])
            if allowed:
                self._respawning.update(new)
        logger.error("%s", reason)
        self.ranks.fail_on(procs, reason)
        self._kill_workers([self._procs[r] for r in procs])  # a rank may hang in a collective with a dead one
        if not allowed:
            self._fail(f"{reason}; {self._budget.refusal(time.monotonic())}", exhausted=True)
            return
        self._counts["respawns"] += len(new)
        self._record(reason)
        for g in new:
            threading.Thread(target=self._respawn, args=(g, reason), daemon=True, name=f"omni-ext-respawn-{g}").start()

    def _respawn(self, g: int, reason: str) -> None:
        """Start group ``g``'s workers anew (the old ones are killed) and serve on it again."""
        t0 = time.monotonic()
        ranks = self._group_ranks(g)
        with self._lock:
            if self._closed:
                return
            self._gens[g] += 1
        logger.warning("omni-ext TunedExecutor: replacing the %d worker(s) of group %d (ranks %s) and reloading the "
                       "model while %d other group(s) serve (%s)", len(ranks), g, list(ranks),
                       self.dp - len(self._respawning), reason)
        self._kill_workers([self._procs[r] for r in ranks])
        for r in ranks:
            reader = self._readers[r]
            if reader is not None:
                reader.join(5.0)
            with contextlib.suppress(Exception):
                self._conns[r].close()
        try:
            self._start_group(g)
            self._wait_ready(g)
        except BaseException as exc:
            self._fail(f"{reason}; the replacement workers of group {g} did not start: {exc}", exhausted=True)
            return
        if self._closed:  # shut down meanwhile
            self._kill_workers([self._procs[r] for r in ranks])
            return
        self._start_s = time.monotonic() - t0
        with self._lock:
            self._expected.difference_update(ranks)
            self._start_threads([g])
            self._respawning.discard(g)
            self.ranks.respawned(ranks)
        self._record()
        logger.warning("omni-ext TunedExecutor: group %d serving again after %.1f s with new workers %s", g,
                       time.monotonic() - t0, [self._pids[r] for r in ranks])

    def _record(self, reason: str | None = None, exhausted: bool = False) -> None:
        """This executor's healing record for the API process (:func:`omni_ext.progress.write_healing`):
        its state ("serving"; "degraded" while some groups are replaced and others serve; "respawning"
        while no group can serve; "exhausted" once it gave up), why (``reason``: the latest respawn's,
        kept while the state lasts) and since when, the groups being replaced, and the counts."""
        down = len(self._respawning)
        if exhausted or self._state.get("state") == "exhausted":
            state = "exhausted"
        else:
            state = "serving" if not down else "respawning" if down >= self.dp else "degraded"
        if state != self._state.get("state") or (reason is not None and not exhausted):
            kept = self._state.get("reason", "") if reason is None else reason
            self._state = {"state": state, "reason": "" if state == "serving" else kept, "since": time.time()}
        elif exhausted and reason is not None:
            self._state["reason"] = reason
        progress.write_healing({**self._state, "start_s": self._start_s, "counts": dict(self._counts),
                                "groups": self.dp, "groups_respawning": down})

    def _fail(self, reason: str, culprit: Job | None = None, exhausted: bool = False) -> None:
        with self._lock:
            if self._failed or self._closed:
                return
            self._failed = True
            self._failure = reason
        logger.error("%s", reason)
        for job in self.ranks.drain():
            msg = reason if job is culprit else f"{reason} (request {job.request_id} was queued or running)"
            resolve(job, DiffusionOutput(error=msg))
        self._kill_workers()
        if exhausted:
            self._record(reason, exhausted=True)
        for cb in self._callbacks:
            try:
                cb()
            except Exception:
                logger.exception("failure callback raised")

    def _kill_workers(self, procs: list | None = None) -> None:
        """Stop ``procs`` (default: every worker) with SIGKILL. The graceful stop is the ``Shutdown`` message,
        which :meth:`shutdown` and :meth:`_respawn` send first; a SIGTERM would be ignored, since a worker
        outlives stop signals while its executor lives (:func:`omni_ext.executor.worker.worker_main`, for the
        drain on SIGTERM), and what is left here is a failed group, a rank that may hang in a collective with
        a dead one, or a worker that did not stop."""
        alive = [p for p in (getattr(self, "_procs", []) if procs is None else procs) if p.is_alive()]
        for p in alive:
            with contextlib.suppress(Exception):
                p.kill()
        deadline = time.monotonic() + 5.0
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
