"""Real memory figures for the CPU platform, read from the kernel.

vLLM-Omni reports ``peak_memory_mb`` per request from ``max_memory_reserved()`` after calling
``reset_peak_memory_stats()``. On CPU the honest equivalents are the process's resident set (VmRSS)
and its high-water mark (VmHWM), which Linux lets a process reset by writing ``5`` to
``/proc/self/clear_refs``. Where that is not allowed we fall back to the current RSS, so a peak is
never reported below what is in use.
"""

from __future__ import annotations

import os
from pathlib import Path

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
