"""Large CPU buffers without a page fault per 4 KiB: huge pages, and freed buffers kept.

Huge pages. PyTorch's CPU allocator asks the kernel for 4 KiB pages, so the first touch of a
fresh large tensor faults once per 4 KiB, several times slower than numpy's buffers, which
ask for huge pages (docs/benchmarks.md, "Allocator"). PyTorch's own setting
``THP_MEM_ALLOC_ENABLE=1`` aligns large allocations to 2 MiB and advises transparent huge
pages, which brings torch's first touch to numpy's. It is read once, at the process's first
large allocation, so :func:`use_huge_pages` sets it when ``common`` is imported
(``common/__init__.py``), before any large tensor of code that imports ``common`` first; a
value the user set (``0`` included) is left as it is.

Huge pages do not replace the retained heap below: a buffer handed back to the OS is zeroed
by the kernel again when it returns, so a retained buffer stays cheaper to reuse (the same
table).

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap``
and returns it with ``munmap`` when freed. A training step allocates and frees the same
[N, D] activations every step, so each step pays page faults and kernel zeroing for all of them
again, a large share of a one-rank GCN epoch (docs/benchmarks.md, "Allocator").
Raising the mmap and trim thresholds makes such buffers come from, and go back to, the heap, so
later steps reuse the same pages. The price: the process keeps its peak heap size, and the
heap fragments: with every buffer up to 1 GiB retained, a one-rank epoch on a 1M-node graph
(3 layers, hidden 64) peaked far higher than with the cap below (bench/memory.py ogb). So only
buffers up to 16 MiB are retained; larger ones go back to the OS when freed. A larger cap
(64 MiB) holds every activation block of the 1M-node papers100M-format graph at 8 ranks, and
its fragmented heap then keeps much more per rank than with 16 MiB, for no faster
epochs (docs/benchmarks.md).

Giving freed buffers back needs the thresholds set too (``retain_freed_memory(False)``): left
alone, glibc raises its mmap threshold to the size of each mmapped buffer freed (up to 32 MiB),
so after the first epoch every buffer up to that size comes from the heap and stays there: at 8
ranks on R-MAT 16 (buffers of a few MiB) each rank then holds far more anonymous memory than
with the thresholds set. Setting the thresholds explicitly turns the adjustment off.

Only glibc (Linux) has ``mallopt``; elsewhere :func:`retain_freed_memory` does nothing. The
switch is the argument: the trainers pass their own flag down; nothing here reads the
environment.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"  # PyTorch's (c10's) switch for its CPU allocator

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_GLIBC_DEFAULT = 128 * 1024  # both thresholds' documented defaults
_RETAIN = 16 << 20  # buffers up to 16 MiB come from the heap (see the module docstring)


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


def use_huge_pages() -> bool:
    """Turn on PyTorch's transparent huge pages for large CPU buffers (``THP_MEM_ALLOC_ENABLE``)
    unless the environment already says (``0`` keeps them off); True when the setting is on.

    Process-wide, and effective only before the process's first large CPU allocation (torch
    reads the variable then); child processes inherit it.
    """
    os.environ.setdefault(HUGE_PAGES_ENV, "1")
    return os.environ[HUGE_PAGES_ENV] == "1"
