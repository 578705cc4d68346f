"""What the current worker process is doing for the job it runs (set by the tuned worker loop).

``mode``: :attr:`JobMode.PAIR <omni_ext.scheduler.placement.JobMode>` (this rank is one of the two
CFG ranks of a request that runs both guidance branches), :attr:`JobMode.SINGLE` (the request runs
on this rank alone, no collectives), or ``"none"`` (no job, or not under the tuned executor:
pipelines behave exactly like vLLM-Omni's).
``owner``: whether this rank's output is the one returned to the engine (pipelines flip it when
they leave the final output on the other rank).
``tuned_worker``: this process is a TunedExecutor worker. Set by the worker before vLLM-Omni's
plugins load, so that omni-ext's activation there applies the ``tuned-worker`` patches
(:func:`omni_ext.patches.process_roles` reads it from this module, when it is imported).

Cancellation of a running job: when the engine aborts a request (``executor-abort-hook``), the
executor writes the job's sequence number into this rank's slot of a shared array
(``cancel_slots``, the "board": :func:`new_board`); the worker never waits for a message while it
computes. A "single" job stops at its next denoise step (:func:`check_step_cancel`); a "pair" job's
two ranks agree on the step at which both stop through the same board (:func:`pair_stop_now`),
without a collective and without reading anything back from the device.
"""

from __future__ import annotations

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
    cancel_slots: Any = None  # the shared board (new_board): cancel slots and the pairs' stop agreement
    tuned_worker: bool = False
    pair_step: int = 0  # CFG-parallel steps this rank has started in the current job


ROLE = Role()


def set_role(mode: str, cfg_rank: int = 0, cfg_size: int = 1, seq: int = 0) -> None:
    ROLE.mode = mode
    ROLE.cfg_rank = cfg_rank
    ROLE.cfg_size = cfg_size
    ROLE.owner = cfg_rank == 0
    ROLE.seq = seq
    ROLE.pair_step = 0


def pair_active() -> bool:
    return ROLE.mode == JobMode.PAIR and ROLE.cfg_size == 2


def reports_progress() -> bool | None:
    """Whether this rank reports step progress for its job (None: not under the tuned executor)."""
    if ROLE.mode == NO_JOB:
        return None
    return ROLE.mode == JobMode.SINGLE or ROLE.cfg_rank == 0


def local_cancel_flag() -> bool:
    """True when the executor asked this rank to stop the job it is running."""
    slots = ROLE.cancel_slots
    return bool(slots is not None and ROLE.seq and slots[ROLE.rank] == ROLE.seq)


def aborted(message: str = "Request cancelled at a denoise step") -> Exception:
    from vllm_omni.diffusion.data import DiffusionRequestAbortedError

    return DiffusionRequestAbortedError(message)


def check_step_cancel() -> None:
    """At a step boundary of a single-rank job: stop if cancelled (pair jobs: :func:`pair_stop_now`)."""
    if ROLE.mode == JobMode.SINGLE and local_cancel_flag():
        raise aborted()


# ---------------------------------------------------------------- the shared board
#: The board's sections, ``world`` cells each: CANCEL[r] is the job sequence number rank r must stop
#: (written by the executor); AT_SEQ[r]/AT[r]: the job and the CFG-parallel step rank r has last
#: passed the boundary of; STOP_SEQ[g]/STOP[g]: the job and the step at which the pair led by rank g
#: stops (written once per cancelled job, by whichever of its ranks decides first).
CANCEL, AT_SEQ, AT, STOP_SEQ, STOP = range(5)


def board_size(world: int) -> int:
    return 5 * world


def new_board(ctx: Any, world: int) -> Any:
    """The executor's shared board for ``world`` ranks: 64-bit cells in host shared memory with one
    process-shared lock (``ctx`` is the ``multiprocessing`` context the workers are spawned with)."""
    return ctx.Array("q", board_size(world), lock=True)


def pair_stop_now() -> bool:
    """At the boundary before this rank's next CFG-parallel step of a pair job: True when the pair
    stops here (the caller raises :func:`aborted`); both ranks then return True at the SAME step.

    Why not in the collective: the old way appended the cancel flag to the noise prediction each
    step and read the gathered flag back with ``.item()``: one host synchronization per step (the
    host could no longer queue the next step ahead, which ``TASK_QUEUE_ENABLE=2`` relies on) and a
    copy of the whole prediction. The two ranks of a pair are processes of one executor on one host,
    so they agree through the board instead; the step runs vLLM-Omni's own all-gather unchanged, and
    the per-step cost is one uncontended process-shared lock (no device work, no read-back).

    Agreement (proof). Let t be the index of the step this rank is about to start (it has started
    steps 0..t-1, so it has entered all-gathers 0..t-1). Under the board's lock the rank publishes
    ``AT = t`` for this job, then:

    - if the pair's stop step T is already set for this job, it follows it;
    - else if its own cancel slot holds this job, it sets ``T = max(t, a + 1)``, where ``a`` is the
      partner's published step for this job (``-1`` if it has published none yet);
    - else it runs step t.

    T is written once per job (later readers find it under the same lock), so both ranks use the
    same T. T is reachable by both: the deciding rank has t <= T. The partner's last critical
    section happened at its step ``a`` (or it has none), and it found no T there, so it runs step
    ``a`` and its next check is at step ``a + 1 <= T``, where it finds T. Neither rank ever checks at
    a step beyond T without having found T before, so each stops exactly at T (it runs steps
    t..T-1 first if it is behind), and both enter exactly the all-gathers 0..T-1: no rank waits in
    an all-gather its partner never enters. Nothing waits on the other rank's host: no deadlock,
    whatever the host or device skew between the ranks. Cancellation latency: the rank that is
    ahead stops at once; one that is behind runs until it catches up (at most its lag, usually 0
    or 1 step). If T is past the last step, the job simply ends on both ranks (the executor
    discards the result of a cancelled job).
    """
    board = ROLE.cancel_slots
    t = ROLE.pair_step
    ROLE.pair_step = t + 1
    if board is None or not ROLE.seq:
        return False
    world = len(board) // 5
    seq, me = ROLE.seq, ROLE.rank
    lead = me - ROLE.cfg_rank
    partner = lead + (1 - ROLE.cfg_rank)
    with board.get_lock():
        cells = board.get_obj()
        cells[AT_SEQ * world + me], cells[AT * world + me] = seq, t
        if cells[STOP_SEQ * world + lead] == seq:
            stop = cells[STOP * world + lead]
        elif cells[CANCEL * world + me] == seq:
            seen = cells[AT * world + partner] if cells[AT_SEQ * world + partner] == seq else -1
            stop = max(t, seen + 1)
            cells[STOP_SEQ * world + lead], cells[STOP * world + lead] = seq, stop
        else:
            return False
    if t > stop:  # impossible by the argument above; fail loudly rather than hang
        raise RuntimeError(f"omni-ext: CFG pair passed its stop step {stop} (at {t})")
    return t == stop
