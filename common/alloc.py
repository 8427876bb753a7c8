"""Keep large freed CPU buffers in the process instead of handing them back to the OS.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap``
and returns it with ``munmap`` when freed. A training step allocates and frees the same
[N, D] activations every step, so each step pays page faults and kernel zeroing for all of them
again: about a third of a one-rank GCN epoch on the 200K-node bench graph (1.07 -> 0.71 s).
Raising the mmap and trim thresholds makes such buffers come from, and go back to, the heap, so
later steps reuse the same pages. The price: the process keeps its peak heap size, and the
heap fragments: with every buffer up to 1 GiB retained, a one-rank epoch on a 1M-node graph
(3 layers, hidden 64) peaked at 9.9 GiB resident instead of 5.9 (bench/memory.py ogb). So
only buffers up to 64 MiB are retained (the 200K-node bench graph's activations, where the
page faults cost the most relative to the work); larger ones go back to the OS when freed.

Only glibc (Linux) has ``mallopt``; elsewhere :func:`retain_freed_memory` does nothing. The
switch is the argument: the trainers pass their own flag down; nothing here reads the
environment.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_GLIBC_DEFAULT = 128 * 1024  # both thresholds' documented defaults
_RETAIN = 64 << 20  # buffers up to 64 MiB come from the heap (see the module docstring)


def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def retain_freed_memory(enable: bool = True) -> bool:
    """Make large freed buffers stay in the heap (``enable``) or restore glibc's defaults.

    Process-wide (it sets the C allocator's thresholds). Returns True when the setting was
    applied (glibc only).
    """
    libc = _libc()
    if libc is None:
        return False
    value = _RETAIN if enable else _GLIBC_DEFAULT
    ok = libc.mallopt(_M_MMAP_THRESHOLD, value) == 1
    return libc.mallopt(_M_TRIM_THRESHOLD, value) == 1 and ok
