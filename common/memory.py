"""Memory meters of this process: resident set size now, its peak, and a reset of the peak.

Linux reads ``/proc/self`` (``statm``, ``VmHWM``, ``clear_refs``); elsewhere the peak falls back
to ``getrusage`` (never reset) and the current size to 0. The trainers log the maximum over ranks
(``common.exchange.max_over_ranks``); ``bench/memory.py`` resets the peak before a measured step.
"""

from __future__ import annotations

import os
import sys

__all__ = ["peak_bytes", "reset_peak", "resident_bytes"]


def resident_bytes() -> int:
    """Current resident set size of this process (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_bytes() -> int:
    """Peak resident set size of this process since it started or since the last
    :func:`reset_peak` (Linux ``VmHWM``; elsewhere ``ru_maxrss``, never reset)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def reset_peak() -> bool:
    """Start a new peak for :func:`peak_bytes` at the current resident size (Linux: writes
    5 to ``/proc/self/clear_refs``); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
