"""The messages between the TunedExecutor and its worker processes, and how they travel.

One pipe per worker. The executor sends :class:`RunJob`, :class:`ResumeJob`, :class:`CallRpc` and
:class:`Shutdown`; a worker answers once at start-up (:class:`Ready` or :class:`StartFailed`), then
one :class:`JobDone` per job, one :class:`Paused` each time a job pauses (the executor asked through
the shared board, :mod:`omni_ext.executor.role`) and one :class:`RpcResult` per call, in order.

Messages are pickled with the standard pickler and sent with ``send_bytes`` (:func:`send`), not
with ``Connection.send``'s ``ForkingPickler`` (that one would turn a tensor into a torch
shared-memory handle, which dies with the sending process).

A job's output never crosses the pipe as a tensor: pickle rebuilds a tensor on the device it was
saved from, so a device tensor would open a device context in the engine process (the API server
itself with one replica) for every worker's card, and fail there when the card is full. The worker
copies the output to host memory and into POSIX shared memory with vLLM-Omni's own transfer
(:func:`output_to_shared_memory`, the ``pack_diffusion_output_shm`` of vLLM-Omni's worker); only
the segments' names travel in the :class:`JobDone`, and the executor's reader thread copies them out
and unlinks them (:func:`output_from_shared_memory`). :func:`send` refuses a ``JobDone`` that holds a
tensor or pickles to more than :data:`MAX_JOB_DONE_BYTES` (:class:`TransferRefused`).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import Any, Union

from omni_ext.scheduler.placement import JobMode


# ---------------------------------------------------------------- executor -> worker
@dataclass(frozen=True)
class RunJob:
    """Run one request (``req``), or one batched forward of several (``req`` a list: request
    batching). ``mode`` is how this rank runs it (PAIR: one CFG branch of a group of ``cfg_size``
    units; SINGLE: all of it on its unit alone); ``seq`` is what the executor writes into this rank's
    cancel slot to stop the job (:mod:`omni_ext.executor.role`); ``ranks``: every worker process the
    job runs on (they agree on a cancel step), ``unit_size``: processes per unit
    (:class:`~omni_ext.scheduler.placement.Units`, the sequence-parallel size)."""

    job_id: str
    req: Any
    mode: JobMode
    cfg_size: int
    seq: int
    ranks: tuple[int, ...] = ()
    unit_size: int = 1


@dataclass(frozen=True)
class ResumeJob:
    """Resume the paused job ``job_id`` on this rank (it answers later with ``Paused`` or ``JobDone``);
    ``drop``: it was cancelled while paused, unwind it instead (its memory is freed; ``JobDone`` aborted)."""

    job_id: str
    drop: bool = False


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
    (``out``; None on a pair job's other rank; a list, one per request, for a batched job). An error
    output is reported by every rank."""

    job_id: str
    rank: int
    out: Any
    owner: bool
    seconds: float
    #: ``time.monotonic()`` in the worker when it began this run of the job and when its output was
    #: computed (before the move to shared memory). The clock is the host's, the same in every process,
    #: so the executor times the hops around the pipeline with them (:func:`~omni_ext.executor.ranks.hops`).
    began: float = 0.0
    ended: float = 0.0


@dataclass(frozen=True)
class Paused:
    """The job paused on ``rank`` before its step boundary ``step`` and waits in worker memory; the
    rank is free for another job until a :class:`ResumeJob`."""

    job_id: str
    rank: int
    step: int


@dataclass(frozen=True)
class RpcResult:
    """The answer of one :class:`CallRpc`: the method's result, or the error text when not ``ok``."""

    rpc_id: str
    rank: int
    ok: bool
    result: Any


Message = Union[RunJob, ResumeJob, CallRpc, Shutdown, Ready, StartFailed, JobDone, Paused, RpcResult]


#: A pickled :class:`JobDone` above this many bytes is refused: outputs travel through shared memory,
#: the message carries only their names, the output's small fields and an error text.
MAX_JOB_DONE_BYTES = 256 * 1024

#: The output fields vLLM-Omni's ``unpack_diffusion_output_shm`` restores: every tensor or array in
#: them travels through shared memory (vLLM-Omni's worker moves only those above 1 MB; here the
#: small ones too, so that the pipe never carries a tensor).
SHM_FIELDS = ("output", "media", "trajectory_latents", "trajectory_timesteps", "trajectory_log_probs")


class TransferRefused(ValueError):
    """A :class:`JobDone` that would carry a tensor, or too many bytes, through the pipe."""


class _JobDonePickler(pickle.Pickler):
    def reducer_override(self, obj):
        import torch

        if isinstance(obj, torch.Tensor):
            raise TransferRefused(
                f"a {obj.device.type} tensor {tuple(obj.shape)} in a job's result would cross the pipe; "
                "outputs travel through shared memory (protocol.output_to_shared_memory)"
            )
        return NotImplemented


def _rebuild_tensor(raw: bytearray, shape: tuple[int, ...], dtype: str) -> Any:
    import torch

    if not raw:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    if not isinstance(raw, bytearray):  # a writable tensor, as the one sent
        raw = bytearray(raw)
    return torch.frombuffer(raw, dtype=torch.uint8).view(getattr(torch, dtype)).view(shape)


def _reduce_tensor(tensor: Any) -> Any:
    """A host tensor as its raw bytes (a pickle-5 buffer) with shape and dtype.

    ``torch.Tensor.__reduce_ex__`` goes through ``torch.serialization``: an image-conditioned request
    (an edit's or image-to-video's 12.6 MB reference) took 10-12 ms to pickle and 3-20 ms to unpickle
    on each rank, against about 1.5 ms each this way (vLLM's ``MessageQueue``, the pipe of vLLM-Omni's
    executor, reduces tensors the same way). Device, sparse or grad-tracking tensors keep torch's own."""
    import torch

    if tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.requires_grad:
        try:
            raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        except RuntimeError:  # e.g. a conjugate view: no aliasing byte view
            pass
        else:
            return _rebuild_tensor, (pickle.PickleBuffer(raw), tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
    return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


_DISPATCH: dict | None = None


def _dispatch_table() -> dict:
    global _DISPATCH
    if _DISPATCH is None:
        import copyreg

        import torch

        _DISPATCH = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}
    return _DISPATCH


def encode(msg: Message) -> bytes | memoryview:
    """The bytes :func:`send` sends (a :class:`JobDone` is checked, see the module docstring; the
    tensors a job's request carries travel as raw bytes, :func:`_reduce_tensor`)."""
    if not isinstance(msg, JobDone):
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = _dispatch_table()
        pickler.dump(msg)
        return buf.getbuffer()  # no copy of a large request's bytes
    buf = io.BytesIO()
    _JobDonePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(msg)
    if buf.tell() > MAX_JOB_DONE_BYTES:
        raise TransferRefused(f"a job's result pickles to {buf.tell()} bytes (limit {MAX_JOB_DONE_BYTES})")
    return buf.getvalue()


def send(conn: Any, msg: Message) -> None:
    """Send one message over a ``multiprocessing`` connection (:class:`TransferRefused`: nothing sent)."""
    conn.send_bytes(encode(msg))


def recv(conn: Any) -> Message:
    """Receive one message (blocks; ``EOFError``/``OSError`` when the other side is gone)."""
    return pickle.loads(conn.recv_bytes())


# ---------------------------------------------------------------- outputs through shared memory
def output_to_shared_memory(out: Any) -> Any:
    """Worker side: move every tensor/array of ``out``'s :data:`SHM_FIELDS` into POSIX shared
    memory (a device tensor is copied to the host first), in place; returns ``out``.

    vLLM-Omni's ``pack_diffusion_output_shm`` moves what is above its threshold (failure-atomic);
    the rest goes through the same segment format (``_tensor_to_shm``/``_ndarray_to_shm``). On any
    failure every segment made here is unlinked before the exception propagates."""
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.ipc import _unlink_shm_handles, pack_diffusion_output_shm

    if isinstance(out, list):  # a batched job's outputs, one per request
        done: list = []
        try:
            for item in out:
                done.append(output_to_shared_memory(item))
        except BaseException:
            for item in done:
                output_from_shared_memory(item)
            raise
        return out
    if not isinstance(out, DiffusionOutput):
        return out
    pack_diffusion_output_shm(out)
    created: list[dict] = []
    try:
        rest = {name: _small_to_shm(getattr(out, name, None), created) for name in SHM_FIELDS}
    except BaseException:
        _unlink_shm_handles(created)
        output_from_shared_memory(out)  # frees what vLLM-Omni's packing made
        raise
    for name, value in rest.items():
        setattr(out, name, value)
    return out


def _small_to_shm(val: Any, created: list) -> Any:
    import numpy as np
    import torch
    from vllm_omni.diffusion.ipc import _ndarray_to_shm, _tensor_to_shm

    if isinstance(val, torch.Tensor):
        return _tensor_to_shm(val, created=created) if val.numel() else val
    if isinstance(val, np.ndarray):
        return _ndarray_to_shm(val, created=created) if val.nbytes and not val.dtype.hasobject else val
    if isinstance(val, dict):
        if val.get("__tensor_shm__") or val.get("__ndarray_shm__"):
            return val
        return {k: _small_to_shm(v, created) for k, v in val.items()}
    if isinstance(val, (list, tuple)):
        return type(val)(_small_to_shm(v, created) for v in val)
    return val


def output_from_shared_memory(out: Any) -> Any:
    """Executor side: copy ``out``'s shared-memory segments back into tensors/arrays and unlink
    them (vLLM-Omni's ``unpack_diffusion_output_shm``). Also the way to free the segments of an
    output nobody will read: after this call none is left in ``/dev/shm``."""
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.ipc import unpack_diffusion_output_shm

    if isinstance(out, list):  # a batched job's outputs: every one is read (and unlinked), also after a failure
        errors = []
        for item in out:
            try:
                output_from_shared_memory(item)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return out
    if isinstance(out, DiffusionOutput):
        unpack_diffusion_output_shm(out)
    return out
