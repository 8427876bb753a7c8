"""common.alloc: the glibc allocator setting that keeps large freed buffers in the heap."""

import platform
import subprocess
import sys

import pytest

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

PROBE = """
import ctypes, sys, time
import numpy as np
from common.alloc import retain_freed_memory
applied = retain_freed_memory() if sys.argv[1] == "on" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
addrs = set()
for _ in range(5):  # 64 MiB blocks: mmap'ed by default, heap-served once retained
    p = libc.malloc(64 << 20)
    addrs.add(p)
    libc.free(p)
print(applied, len(addrs))
"""


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc-only")
@pytest.mark.parametrize("mode", ["on", "off"])
def test_large_freed_blocks_are_reused_only_when_retained(mode):
    import os

    env = {**os.environ, "HPC_RETAIN_FREED_MEMORY": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         env=env, check=True).stdout.split()
    assert out[0] == str(mode == "on")
    if mode == "on":
        assert out[1] == "1"  # the same heap block every time


def test_opt_out_by_environment(monkeypatch):
    from common.alloc import retain_freed_memory

    monkeypatch.setenv("HPC_RETAIN_FREED_MEMORY", "0")
    assert retain_freed_memory() is False
