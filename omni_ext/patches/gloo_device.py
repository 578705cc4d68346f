"""Patch body for ``gloo-shared-device`` (see the registry in ``omni_ext.patches``).

Every gloo process group that torch builds with default options gets its own transport device, and
every gloo TCP device runs its own event-loop thread (``gloo_tcp_loop``) that wakes from
``epoll_wait`` every 10 ms whether or not anything is sent. A vLLM-Omni 0.30 diffusion worker
creates about 19 such groups (WORLD plus a device group and a CPU group per parallel dimension,
including size-1 groups), so an idle worker wakes ~1,900 times a second and spends 3-4 % of a core
doing nothing. Two busy workers on a two-core host lose that time from their denoise loops, and a
CFG pair, which meets at an all-gather every step, loses it twice (a preempted rank stalls its
partner).

gloo supports many contexts on one device, and torch accepts the devices through
``ProcessGroupGloo._Options``. The patch makes torch's c10d build every gloo group of this process
on one shared device (per ``GLOO_SOCKET_IFNAME`` interface, as stock), so there is one loop thread
per process. Nothing else changes: rank, size, timeout and the per-group worker threads are as
stock, and each group still has its own options object (torch writes the group name into it).

Only the name ``ProcessGroupGloo`` in ``torch.distributed.distributed_c10d`` (what
``_new_process_group_helper`` calls) is replaced, by a stand-in that builds real
``ProcessGroupGloo`` objects and answers ``isinstance``/``issubclass`` and attribute lookups for
the real class, so torch's own type checks see no difference.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Any

from omni_ext.patches import is_patched, patch_attr

logger = logging.getLogger("omni_ext.patches")

_lock = threading.Lock()
_devices: list[Any] = []


def shared_devices(base: Any) -> list[Any]:
    """This process's gloo devices, created on first use: one per ``GLOO_SOCKET_IFNAME`` interface
    (comma separated, as torch reads it), else torch's default device."""
    with _lock:
        if not _devices:
            names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
            if names:
                _devices.extend(base.create_device(interface=n) for n in names)
            else:
                _devices.append(base.create_default_device())
        return list(_devices)


def _make_stand_in(base: type) -> type:
    class _Meta(type):
        def __call__(cls, store, rank, size, timeout: Any = datetime.timedelta(seconds=1800)):
            if isinstance(timeout, base._Options):  # options given explicitly: leave them alone
                return base(store, rank, size, timeout)
            devices = shared_devices(base)
            opts = base._Options()
            opts._devices = devices
            opts._threads = 2 * len(devices)  # as torch's own constructor
            opts._timeout = timeout
            return base(store, rank, size, opts)

        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, base)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, base)

        def __getattr__(cls, name: str) -> Any:
            return getattr(base, name)

    class ProcessGroupGloo(metaclass=_Meta):
        """Builds torch's ProcessGroupGloo on this process's shared gloo device (omni-ext patch)."""

    ProcessGroupGloo.__wrapped__ = base  # type: ignore[attr-defined]
    return ProcessGroupGloo


def apply() -> None:
    from torch.distributed import distributed_c10d as c10d

    base = getattr(c10d, "ProcessGroupGloo", None)
    if base is None or is_patched(base):
        return  # torch without gloo, or already patched
    if not (hasattr(base, "_Options") and hasattr(base, "create_default_device")):
        logger.warning("omni-ext patch gloo-shared-device: this torch has no ProcessGroupGloo._Options; not applied")
        return
    patch_attr(c10d, "ProcessGroupGloo", _make_stand_in(base))
