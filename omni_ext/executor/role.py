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
(``cancel_slots``); the worker never waits for a message while it computes. A
"single" job stops at its next denoise step (:func:`check_step_cancel`); a "pair" job's two ranks
see each other's flag inside the per-step all-gather of the noise prediction
(:func:`local_cancel_flag`), so both stop at the same step and no rank waits on a gone partner.
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
    cancel_slots: Any = None  # multiprocessing shared array of job sequence numbers, one per rank
    tuned_worker: bool = False


ROLE = Role()


def set_role(mode: str, cfg_rank: int = 0, cfg_size: int = 1, seq: int = 0) -> None:
    ROLE.mode = mode
    ROLE.cfg_rank = cfg_rank
    ROLE.cfg_size = cfg_size
    ROLE.owner = cfg_rank == 0
    ROLE.seq = seq


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
    """At a step boundary of a single-rank job: stop if cancelled (pair jobs decide in the all-gather)."""
    if ROLE.mode == JobMode.SINGLE and local_cancel_flag():
        raise aborted()
