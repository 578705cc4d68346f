"""The messages between the TunedExecutor and its worker processes, and how they travel.

One pipe per worker. The executor sends :class:`RunJob`, :class:`CallRpc` and :class:`Shutdown`;
a worker answers once at start-up (:class:`Ready` or :class:`StartFailed`), then one
:class:`JobDone` per job and one :class:`RpcResult` per call, in order.

Messages are pickled with the standard pickler and sent with ``send_bytes`` (:func:`send`), not
with ``Connection.send``'s ``ForkingPickler``: that one would turn an output tensor into a torch
shared-memory handle, which dies with the sending process; here tensors travel by value.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Union

from omni_ext.scheduler.placement import JobMode


# ---------------------------------------------------------------- executor -> worker
@dataclass(frozen=True)
class RunJob:
    """Run one request. ``mode`` is how this rank runs it (PAIR: one CFG branch of a group of
    ``cfg_size`` ranks; SINGLE: all of it alone); ``seq`` is what the executor writes into this
    rank's cancel slot to stop the job (:mod:`omni_ext.executor.role`)."""

    job_id: str
    req: Any
    mode: JobMode
    cfg_size: int
    seq: int


@dataclass(frozen=True)
class CallRpc:
    """Call a worker method (vLLM-Omni's ``collective_rpc``)."""

    rpc_id: str
    method: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Shutdown:
    """Leave the message loop and shut the worker down."""


# ---------------------------------------------------------------- worker -> executor
@dataclass(frozen=True)
class Ready:
    """The worker has built vLLM-Omni's worker (model loaded) and waits for messages."""

    rank: int
    pid: int


@dataclass(frozen=True)
class StartFailed:
    """The worker could not be built; ``error`` is the exception and its traceback."""

    rank: int
    error: str


@dataclass(frozen=True)
class JobDone:
    """A job finished on ``rank`` after ``seconds``. ``owner``: this rank holds the request's output
    (``out``; None on a pair job's other rank). An error output is reported by every rank."""

    job_id: str
    rank: int
    out: Any
    owner: bool
    seconds: float


@dataclass(frozen=True)
class RpcResult:
    """The answer of one :class:`CallRpc`: the method's result, or the error text when not ``ok``."""

    rpc_id: str
    rank: int
    ok: bool
    result: Any


Message = Union[RunJob, CallRpc, Shutdown, Ready, StartFailed, JobDone, RpcResult]


def send(conn: Any, msg: Message) -> None:
    """Send one message over a ``multiprocessing`` connection (tensors by value, see above)."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Any) -> Message:
    """Receive one message (blocks; ``EOFError``/``OSError`` when the other side is gone)."""
    return pickle.loads(conn.recv_bytes())
