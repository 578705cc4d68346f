"""What the current worker process is doing for the job it runs (set by the tuned worker loop).

``mode``: :attr:`JobMode.PAIR <omni_ext.scheduler.placement.JobMode>` (this rank is in one of the
two CFG halves of a request that runs both guidance branches), :attr:`JobMode.SINGLE` (the request
runs on this rank's unit alone: no CFG collective; under sequence parallel the unit's processes
still run vLLM-Omni's SP collectives among themselves), or ``"none"`` (no job, or not under the
tuned executor: pipelines behave exactly like vLLM-Omni's).
``owner``: whether this rank's CFG half holds the output returned to the engine (pipelines flip it
when they leave the final output on the other half); of a unit, only its leader (``sp_rank`` 0)
sends it (:func:`answers_output`).
``tuned_worker``: this process is a TunedExecutor worker. Set by the worker before vLLM-Omni's
plugins load, so that omni-ext's activation there applies the ``tuned-worker`` patches
(:func:`omni_ext.patches.process_roles` reads it from this module, when it is imported).

Cancellation of a running job: when the engine aborts a request (``executor-abort-hook``), the
executor writes the job's sequence number into this rank's slot of a shared array
(``cancel_slots``, the "board": :func:`new_board`); the worker never waits for a message while it
computes. A job on one process stops at its next denoise step (:func:`check_step_cancel`); the
processes of a job on several (a CFG pair, a sequence-parallel unit, or both) agree on the step at
which all stop through the same board (:func:`stop_now`), without a collective and without reading
anything back from the device.

Pausing a running job (step-level preemption, :mod:`omni_ext.scheduler.preempt` decides whom): the
executor writes a pause token into the job's cells of the same board; its processes agree on a pause
step exactly as on a stop step (:func:`boundary`) and, at that step, call the job's
``pause_hook`` (set by the worker, :mod:`omni_ext.executor.worker`), which blocks the job's thread
until it is resumed. Every process of the job pauses before the same step, so none waits in a
collective another has not entered.
"""

from __future__ import annotations

import time

from dataclasses import dataclass
from typing import Any

from omni_ext.scheduler.placement import JobMode

#: ``Role.mode`` outside any job.
NO_JOB = "none"


@dataclass
class Role:
    mode: str = NO_JOB  # NO_JOB, JobMode.PAIR or JobMode.SINGLE
    cfg_rank: int = 0
    cfg_size: int = 1
    owner: bool = True
    rank: int = 0
    seq: int = 0
    cancel_slots: Any = None  # the shared board (new_board): cancel slots and the jobs' stop agreement
    tuned_worker: bool = False
    step: int = 0  # step boundaries this rank has passed in the current job (stop_now)
    ranks: tuple[int, ...] = ()  # every process of the current job, its lead first
    sp_rank: int = 0  # this process's rank in its unit (0: the unit's leader)
    pauses: int = 0  # times the current job has paused (its next pause is number pauses + 1)
    pause_hook: Any = None  # called at an agreed pause step; blocks until the job resumes (the worker's)
    paused_s: float = 0.0  # seconds the current job has spent paused (its step reports leave them out)


ROLE = Role()


def set_role(mode: str, cfg_rank: int = 0, cfg_size: int = 1, seq: int = 0, ranks: tuple[int, ...] = (),
             sp_rank: int = 0) -> None:
    """``ranks``: the job's processes; left empty for a CFG pair of single processes, the pair
    ``(rank - cfg_rank, rank - cfg_rank + 1)``."""
    ROLE.mode = mode
    ROLE.cfg_rank = cfg_rank
    ROLE.cfg_size = cfg_size
    ROLE.owner = cfg_rank == 0
    ROLE.seq = seq
    ROLE.step = 0
    ROLE.sp_rank = sp_rank
    ROLE.pauses = 0
    ROLE.paused_s = 0.0
    ROLE.pause_hook = None
    if not ranks and mode == JobMode.PAIR and cfg_size == 2:
        lead = ROLE.rank - cfg_rank
        ranks = (lead, lead + 1)
    ROLE.ranks = tuple(ranks) or (ROLE.rank,)


def pair_active() -> bool:
    return ROLE.mode == JobMode.PAIR and ROLE.cfg_size == 2


def reports_progress() -> bool | None:
    """Whether this rank reports step progress for its job (None: not under the tuned executor): the
    leader of the job's first unit."""
    if ROLE.mode == NO_JOB:
        return None
    return ROLE.sp_rank == 0 and (ROLE.mode == JobMode.SINGLE or ROLE.cfg_rank == 0)


def answers_output() -> bool:
    """Whether this process sends the job's output: the leader of the unit whose CFG half holds it
    (every process of a unit computes the same output: vLLM-Omni's SP gathers each transformer
    output on all of them)."""
    return ROLE.owner and ROLE.sp_rank == 0


def local_cancel_flag() -> bool:
    """True when the executor asked this rank to stop the job it is running."""
    slots = ROLE.cancel_slots
    return bool(slots is not None and ROLE.seq and slots[ROLE.rank] == ROLE.seq)


def aborted(message: str = "Request cancelled at a denoise step") -> Exception:
    from vllm_omni.diffusion.data import DiffusionRequestAbortedError

    return DiffusionRequestAbortedError(message)


def check_step_cancel() -> None:
    """At a step boundary of a SINGLE job: stop if cancelled, pause if asked (pair jobs:
    :func:`stop_now` before each CFG-parallel step). A job on one process decides alone; on a
    sequence-parallel unit its processes agree on the step first (:func:`boundary`): one that
    stopped or paused alone would leave the others waiting in the next step's SP all-to-all."""
    if ROLE.mode != JobMode.SINGLE:
        return
    if stop_now():
        if len(ROLE.ranks) > 1:
            raise aborted("Request cancelled at a denoise step (every process of its unit stopped together)")
        raise aborted()


# ---------------------------------------------------------------- the shared board
#: The board's sections, ``world`` cells each: CANCEL[r] is the job sequence number rank r must stop
#: (written by the executor); AT_SEQ[r]/AT[r]: the job and the step boundary rank r has last
#: passed; STOP_SEQ[g]/STOP[g]: the job and the step at which the job led by rank g stops (written
#: once per cancelled job, by whichever of its ranks decides first).
#: PAUSE[r]: the pause token (:func:`pause_token`) rank r must pause its job for (written by the
#: executor, 0 when none); PTOKEN[g]/PSTEP[g]: the token and the step at which the job led by rank g
#: pauses (written once per pause, like STOP).
CANCEL, AT_SEQ, AT, STOP_SEQ, STOP, PAUSE, PTOKEN, PSTEP = range(8)
SECTIONS = 8

#: What a process does at a step boundary (:func:`boundary`).
RUN, HALT, PAUSED = "run", "stop", "pause"


def board_size(world: int) -> int:
    return SECTIONS * world


def pause_token(seq: int, number: int) -> int:
    """The board's value for the ``number``-th pause (1, 2, ...) of job ``seq``: each pause of a job is
    agreed on afresh, and a token already used can never match again."""
    return seq * 1024 + number


def new_board(ctx: Any, world: int) -> Any:
    """The executor's shared board for ``world`` ranks: 64-bit cells in host shared memory with one
    process-shared lock (``ctx`` is the ``multiprocessing`` context the workers are spawned with)."""
    return ctx.Array("q", board_size(world), lock=True)


def stop_now() -> bool:
    """At the boundary before this rank's next step of a job: True when the job stops here (the
    caller raises :func:`aborted`). When the job pauses here, this returns only once it was resumed
    (``pause_hook``), and False: the job goes on with this step (or stops, when the hook raises)."""
    what = boundary()
    if what == PAUSED:
        pause_here()
    return what == HALT


def pause_here() -> None:
    """The agreed pause step is reached: count it and block in the worker's hook until resumed (the
    hook raises :func:`aborted` when the paused job was cancelled instead). Without a hook (not a
    tuned worker: the unit tests), the job simply goes on."""
    ROLE.pauses += 1
    hook = ROLE.pause_hook
    if hook is not None:
        t0 = time.monotonic()
        hook()  # restores this job's ROLE before it returns
        ROLE.paused_s += time.monotonic() - t0


def boundary() -> str:
    """At the boundary before this rank's next step of a job: HALT when the job stops here (the
    caller raises :func:`aborted`), PAUSED when it pauses here (:func:`pause_here`), else RUN; on a
    job of several processes (a CFG pair, a sequence-parallel unit, both) all of them return HALT
    (or PAUSED) at the SAME step. Every process of the job calls it at the same boundaries (they run
    the same code; a pair before each CFG-parallel step, a SINGLE job at each progress-bar step,
    :func:`check_step_cancel`). A job on one process decides alone (the same code, no other process).

    Agreement (proof). Let t be the index of the step this rank is about to start (it has started
    steps 0..t-1, so it has entered the collectives of steps 0..t-1). Under the board's lock the
    rank publishes ``AT = t`` for this job, then:

    - if the job's stop step T is already set, it follows it;
    - else if its own cancel slot holds this job, it sets ``T = max(t, a + 1)``, where ``a`` is the
      highest step any other process of the job has published for it (``-1`` if none has yet);
    - else it runs step t.

    T is written once per job (later readers find it under the same lock), so every process uses
    the same T. T is reachable by all: the deciding rank has t <= T. Each other process's last
    critical section happened at its step ``a_i <= a`` (or it has none), and it found no T there,
    so it runs step ``a_i`` and its next check is at step ``a_i + 1 <= T``, where it finds T. No
    process ever checks at a step beyond T without having found T before, so each stops exactly at
    T (it runs steps up to T-1 first if it is behind), and all enter exactly the collectives of
    steps 0..T-1: none waits in a collective another never enters. Nothing waits on another
    process's host: no deadlock, whatever the host or device skew. Cancellation latency: the process
    that is ahead stops at once; one that is behind runs until it catches up (at most its lag,
    usually 0 or 1 step). If T is past the last step, the job simply ends everywhere (the executor
    discards the result of a cancelled job).

    Why not in the collective: the old way appended the cancel flag to the noise prediction each
    step and read the gathered flag back with ``.item()``: one host synchronization per step (the
    host could no longer queue the next step ahead, which ``TASK_QUEUE_ENABLE=2`` relies on) and a
    copy of the whole prediction. The processes of a job belong to one executor on one host, so
    they agree through the board instead; the step runs vLLM-Omni's own collectives unchanged, and
    the per-step cost is one uncontended process-shared lock (no device work, no read-back).

    Pausing is agreed the same way, on its own cells: the executor writes the token of the job's next
    pause (:func:`pause_token`: job and pause number) into each of its processes' PAUSE cells; the
    first process to see it sets the pause step ``P = max(t, a + 1)`` under the token, the others
    follow it, by the argument above. Each pause has a token of its own (every process counts the
    same pauses), so a job may pause again later; the executor may withdraw a request (PAUSE set to
    0) at any time: either no process has agreed on it yet (none pauses) or one has (all do). A stop
    agreed for the same step wins over a pause.
    """
    board = ROLE.cancel_slots
    t = ROLE.step
    ROLE.step = t + 1
    if board is None or not ROLE.seq:
        return RUN
    world = len(board) // SECTIONS
    seq, me = ROLE.seq, ROLE.rank
    ranks = ROLE.ranks or (me,)
    lead = ranks[0]
    token = pause_token(seq, ROLE.pauses + 1)
    stop = pause = None
    with board.get_lock():
        cells = board.get_obj()
        cells[AT_SEQ * world + me], cells[AT * world + me] = seq, t
        asked_stop = cells[STOP_SEQ * world + lead] != seq and cells[CANCEL * world + me] == seq
        asked_pause = cells[PTOKEN * world + lead] != token and cells[PAUSE * world + me] == token
        if asked_stop or asked_pause:
            seen = max((cells[AT * world + r] for r in ranks if r != me and cells[AT_SEQ * world + r] == seq), default=-1)
        if cells[STOP_SEQ * world + lead] == seq:
            stop = cells[STOP * world + lead]
        elif asked_stop:
            stop = max(t, seen + 1)
            cells[STOP_SEQ * world + lead], cells[STOP * world + lead] = seq, stop
        if cells[PTOKEN * world + lead] == token:
            pause = cells[PSTEP * world + lead]
        elif asked_pause:
            pause = max(t, seen + 1)
            cells[PTOKEN * world + lead], cells[PSTEP * world + lead] = token, pause
    for agreed, what in ((stop, HALT), (pause, PAUSED)):
        if agreed is not None:
            if t > agreed:  # impossible by the argument above; fail loudly rather than hang
                raise RuntimeError(f"omni-ext: a job's process passed its {what} step {agreed} (at {t})")
            if t == agreed:
                return what
    return RUN
