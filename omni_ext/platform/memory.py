"""Real memory figures for the CPU platform, read from the kernel.

vLLM-Omni reports ``peak_memory_mb`` per request from ``max_memory_reserved()`` after calling
``reset_peak_memory_stats()``. On CPU the honest equivalents are the process's resident set (VmRSS)
and its high-water mark (VmHWM), which Linux lets a process reset by writing ``5`` to
``/proc/self/clear_refs``. Where that is not allowed we fall back to the current RSS, so a peak is
never reported below what is in use.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

logger = logging.getLogger("omni_ext.platform")

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes() -> int:
    """Current resident set size of this process."""
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil

    return int(psutil.Process(os.getpid()).memory_info().rss)


def peak_rss_bytes() -> int:
    """Peak resident set size since start or since the last :func:`reset_peak`."""
    kib = _status_kib("VmHWM")
    return max(kib * 1024 if kib is not None else 0, rss_bytes())


def reset_peak() -> bool:
    """Reset the kernel's RSS high-water mark for this process; False if not permitted."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory: the CPU platform's "device" memory."""
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


#: glibc ``mallopt`` parameters (malloc.h) and the values :func:`keep_freed_heap` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
TRIM_THRESHOLD = 256 << 20  # freed memory kept at the top of a heap before it goes back to the kernel
MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its dynamic threshold: smaller blocks come from a heap
_kept: bool | None = None


def keep_freed_heap() -> bool:
    """Keep freed heap memory in this process instead of returning it to the kernel after every tensor.

    Why: glibc serves a block above its mmap threshold (128 KiB at start) with a fresh ``mmap`` and
    gives a heap's freed top back to the kernel; it raises the threshold as such blocks are freed, so
    a loop that runs in the main thread soon allocates from warm pages. A thread other than the main
    one allocates from an arena of its own, whose heap is trimmed as its tensors are freed, so each of
    its tensors faults its pages in again. The TunedExecutor runs each job in a thread of its own (so
    that it can pause at a step, :mod:`omni_ext.executor.worker`), and omni-ext's routes encode in a
    thread pool. Measured on the CPU host (2026-12-07): the tiny Wan's text encoder took 48-63 ms per
    prompt in a fresh thread against 21-28 ms in the main thread, 22-25 ms in a fresh thread with
    these settings. Fixed thresholds (which also stop glibc's dynamic ones) keep up to
    :data:`TRIM_THRESHOLD` freed at a heap's top and take blocks under :data:`MMAP_THRESHOLD` from a
    heap; a process holds at most its peak, as before, and gives back less of it.

    Once per process (idempotent, logged once); False where the C library has no ``mallopt`` (not
    glibc) or refuses."""
    global _kept
    if _kept is not None:
        return _kept
    try:
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        _kept = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (AttributeError, OSError):
        _kept = False
    if _kept:
        logger.info("omni-ext: malloc keeps freed memory (trim threshold %d MiB, mmap threshold %d MiB): jobs "
                    "and encodes run in threads, whose arenas would otherwise fault every tensor in again",
                    TRIM_THRESHOLD >> 20, MMAP_THRESHOLD >> 20)
    else:
        logger.info("omni-ext: malloc thresholds left as they are (no glibc mallopt here)")
    return _kept
