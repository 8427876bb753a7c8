"""A bench's child process and its own peak resident memory.

The peak is read with ``os.wait4`` on the one child: ``getrusage(RUSAGE_CHILDREN)`` gives the
largest of every child waited for so far (an earlier step's), and a child started by fork or
vfork and exec takes its parent's peak as its own, so a bench that measures a child's peak
holds no large data itself. Used by bench/memory.py, bench/scale.py and bench/products_scale.py.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def env() -> dict[str, str]:
    """This process's environment with the repository on ``PYTHONPATH`` (children import
    ``common``, ``plexus`` and ``tests`` from it)."""
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def wait_with_peak(proc: subprocess.Popen) -> tuple[int, int]:
    """(exit code, negative for a signal; peak resident bytes of ``proc`` and the processes
    it waited for) once ``proc`` ends; interrupted, ``proc`` is killed first, so that nothing
    is left running."""
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024


def run(cmd: Sequence[str], *, capture_output: bool = False
        ) -> tuple[subprocess.CompletedProcess, float, int]:
    """Run ``cmd`` from the repository root, its input closed: (its result, with its output
    as text where ``capture_output``; wall seconds; :func:`wait_with_peak`'s peak bytes).
    The output goes through temporary files, not pipes, which ``wait4`` would leave full."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(list(cmd), cwd=ROOT, env=env(), stdin=subprocess.DEVNULL,
                                stdout=out if capture_output else None,
                                stderr=err if capture_output else None, text=True)
        code, peak = wait_with_peak(proc)
        wall = time.perf_counter() - t
        got: list[str | None] = [None, None]
        if capture_output:
            for i, f in enumerate((out, err)):
                f.seek(0)
                got[i] = f.read()
    return subprocess.CompletedProcess(list(cmd), code, *got), wall, peak
