"""common.alloc: the glibc allocator setting that keeps large freed buffers in the heap.

Measured, not asserted: a fresh process mallocs, touches and frees a 48 MiB block six times and
counts its minor page faults (``getrusage``) per round. Retained, only the first round faults
(later rounds reuse the heap pages); otherwise every round maps fresh pages and faults them all
again (about 48 MiB / 4 KiB = 12288 faults).
"""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import ctypes, resource, sys
from common.alloc import retain_freed_memory
mode = sys.argv[1]
applied = None
if mode in ("on", "on-then-off"):
    applied = retain_freed_memory(True)
if mode == "on-then-off":
    applied = retain_freed_memory(False) and applied
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size = 48 << 20  # above glibc's default mmap threshold (at most 32 MiB), below ours
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(size)
    libc.memset(p, 1, size)  # touch every page
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, *faults)
"""


def _faults(mode: str) -> tuple[str, list[int]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         env=env, check=True, timeout=60).stdout.split()
    return out[0], [int(v) for v in out[1:]]


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc-only")
@pytest.mark.parametrize("mode, retained", [("on", True), ("on-then-off", False),
                                            ("untouched", False)])
def test_freed_pages_are_reused_only_when_retained(mode, retained):
    applied, faults = _faults(mode)
    assert applied == ("None" if mode == "untouched" else "True")
    first, later = faults[0], faults[1:]
    assert first >= (64 << 20) // (2 << 20), faults  # the first round faults its pages in
    if retained:
        assert sum(later) <= first // 100, faults  # later rounds reuse the same pages
    else:
        assert min(later) >= first // 2, faults  # every round faults fresh pages


def test_non_glibc_is_a_no_op(monkeypatch):
    from common import alloc

    monkeypatch.setattr(alloc, "_libc", lambda: None)
    assert alloc.retain_freed_memory() is False
    assert alloc.retain_freed_memory(False) is False
