"""common.alloc: the glibc allocator setting that keeps large freed buffers in the heap.

Measured, not asserted: a fresh process mallocs, touches and frees a block six times and
counts its minor page faults (``getrusage``) per round. Retained, only the first round faults
(later rounds reuse the heap pages); otherwise every round maps fresh pages and faults them all
again (a 12 MiB block: about 3072 faults of 4 KiB). Retained means at most the cap (16 MiB):
a 48 MiB block goes back to the OS even then. Left untouched, glibc raises its mmap threshold
to each freed mmapped block's size, up to 32 MiB, so that case uses 48 MiB, above it.
"""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
ROOT = Path(__file__).resolve().parents[2]
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_ON_REQUEST = THP.exists() and ("[madvise]" in THP.read_text() or "[always]" in THP.read_text())

PROBE = """
import ctypes, resource, sys
from common.alloc import retain_freed_memory
mode, size = sys.argv[1], int(sys.argv[2]) << 20
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
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(size)
    libc.memset(p, 1, size)  # touch every page
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, *faults)
"""


def _faults(mode: str, mib: int) -> tuple[str, list[int]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(mib)], capture_output=True,
                         text=True, env=env, check=True, timeout=60).stdout.split()
    return out[0], [int(v) for v in out[1:]]


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc-only")
@pytest.mark.parametrize("mode, mib, retained", [
    ("on", 12, True), ("on", 48, False), ("on-then-off", 12, False), ("untouched", 48, False)])
def test_freed_pages_are_reused_only_when_retained(mode, mib, retained):
    applied, faults = _faults(mode, mib)
    assert applied == ("None" if mode == "untouched" else "True")
    first, later = faults[0], faults[1:]
    assert first >= mib // 2, faults  # the first round faults its pages in (2 MiB pages at most)
    if retained:
        assert sum(later) <= first // 100, faults  # later rounds reuse the same pages
    else:
        assert min(later) >= first // 2, faults  # every round faults fresh pages


def test_non_glibc_is_a_no_op(monkeypatch):
    from common import alloc

    monkeypatch.setattr(alloc, "_libc", lambda: None)
    assert alloc.retain_freed_memory() is False
    assert alloc.retain_freed_memory(False) is False


@pytest.mark.parametrize("given, expect", [(None, "1"), ("0", "0"), ("1", "1")])
def test_importing_common_turns_on_huge_pages_unless_the_user_said(given, expect):
    """A fresh process that imports common has PyTorch's huge-page switch on before torch
    allocates anything; a value the user set is kept."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if given is not None:
        env["THP_MEM_ALLOC_ENABLE"] = given
    code = ("import os, resource, common, torch\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "torch.empty(8 << 20).fill_(1.0)  # 32 MiB, touched once\n"
            "faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n"
            "print(os.environ['THP_MEM_ALLOC_ENABLE'], common.alloc.use_huge_pages(), faults)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=str(ROOT)).stdout.split()
    assert out[:2] == [expect, str(expect == "1")]
    faults = int(out[2])
    # 32 MiB in 4 KiB pages: 8192 faults; in 2 MiB pages, 16 (plus the process's own). The
    # kernel must allow huge pages on request (sysfs: "madvise" or "always").
    if expect == "0":
        assert faults >= 8192
    elif THP_ON_REQUEST:
        assert faults < 2048, f"{faults} page faults for 32 MiB: huge pages not used"
