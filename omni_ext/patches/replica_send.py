"""Patch body for ``replica-send-nonblocking`` (see the registry in ``omni_ext.patches``).

The head talks to each diffusion replica over a ZMQ PUSH socket it binds; the replica connects.
``StageDiffusionClient`` sends on it with a *blocking* ``send`` from the orchestrator's event loop.
When a headless replica dies, ZMQ drops its connection, the PUSH socket has no peer left, and the
next blocking send waits for one forever: the orchestrator's loop stops, so every later request
hangs, heartbeats and membership changes are never acted on, and ``/health`` keeps answering 200
(measured on loopback, ``shared/research/multi-host-cpu.md``). A local replica is caught earlier by
its process monitor; a remote one has none.

The fix: the client's request socket sends without blocking. When ZMQ cannot queue the message
(no connected peer, or its queue is full), it waits for the socket to become writable for at most
:data:`SEND_WAIT_MS`, then raises :class:`ReplicaUnreachable`, an ``EngineDeadError``: the same error
a dead local replica raises, which vLLM-Omni (and omni-ext's dispatcher) already handle by failing
or re-sending that request and leaving the replica out. Aborts and shutdown messages to an
unreachable replica are dropped with a warning instead of raising: there is nothing left to stop.
"""

from __future__ import annotations

import logging
from typing import Any

from omni_ext.patches import patch_attr

logger = logging.getLogger("omni_ext.patches")

#: How long a send waits for a replica's socket to become writable before giving up on it.
SEND_WAIT_MS = 500


def _unreachable_error() -> type[Exception]:
    from vllm.v1.engine.exceptions import EngineDeadError

    class ReplicaUnreachable(EngineDeadError):
        """No connected replica behind a head-side request socket (omni-ext's ``replica-send-nonblocking``)."""

    return ReplicaUnreachable


class NonBlockingSocket:
    """A ZMQ socket whose ``send`` never blocks longer than :data:`SEND_WAIT_MS` (all else delegated)."""

    def __init__(self, sock: Any, label: str, error: type[Exception]) -> None:
        self._sock = sock
        self._label = label
        self._error = error

    def send(self, data: Any, flags: int = 0, *args: Any, **kwargs: Any) -> Any:
        import zmq

        try:
            return self._sock.send(data, flags | zmq.NOBLOCK, *args, **kwargs)
        except zmq.Again:
            pass
        if self._sock.poll(SEND_WAIT_MS, zmq.POLLOUT):
            try:
                return self._sock.send(data, flags | zmq.NOBLOCK, *args, **kwargs)
            except zmq.Again:
                pass
        raise self._error(f"{self._label}: no connected replica (its process or host is gone); "
                          f"message not sent after {SEND_WAIT_MS} ms")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def apply() -> None:
    from vllm_omni.diffusion.stage_diffusion_client import StageDiffusionClient

    error = _unreachable_error()
    original_connect = StageDiffusionClient._connect_transport

    def _connect_transport(self, request_address, response_address):
        original_connect(self, request_address, response_address)
        label = f"stage-{getattr(self, 'stage_id', '?')} replica {getattr(self, 'replica_id', '?')} ({request_address})"
        self._request_socket = NonBlockingSocket(self._request_socket, label, error)

    original_abort = StageDiffusionClient.abort_requests_async

    async def abort_requests_async(self, request_ids):
        try:
            return await original_abort(self, request_ids)
        except error as exc:
            logger.warning("omni-ext: abort of %s not delivered: %s", list(request_ids), exc)
            return None

    patch_attr(StageDiffusionClient, "_connect_transport", _connect_transport)
    patch_attr(StageDiffusionClient, "abort_requests_async", abort_requests_async)
