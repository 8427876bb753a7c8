"""Spawn several ranks of a Python command from a driver process (benches, calibration, tests).

``mpiexec`` is preferred: the one beside ``sys.executable`` (the mpich wheel's, in a virtual
environment), else the system's on ``PATH`` (a cluster's MPI). Drivers that measure something in
worker processes hand results back as one line ``RESULT {json}`` on the worker's stdout
(:func:`print_result`, :func:`run_worker`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RESULT_PREFIX = "RESULT "


def find_mpiexec() -> str | None:
    """The ``mpiexec`` beside ``sys.executable``, else the one on ``PATH``, else None."""
    return (shutil.which("mpiexec", path=str(Path(sys.executable).parent))
            or shutil.which("mpiexec"))


def ranks_command(ranks: int, cmd: Sequence[str]) -> list[str]:
    """``cmd`` itself for one rank, else ``cmd`` under ``mpiexec -n ranks``.

    Raises:
        FileNotFoundError: more than one rank and no ``mpiexec`` (``pip install mpich``, or
            load the cluster's MPI module).
    """
    if ranks <= 1:
        return list(cmd)
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise FileNotFoundError("no mpiexec beside this Python or on PATH: pip install mpich "
                                "(a workstation) or load the cluster's MPI")
    return [mpiexec, "-n", str(ranks), *cmd]


def print_result(result: Mapping[str, Any]) -> None:
    """Hand ``result`` to the driver's :func:`run_worker` (call on one rank)."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_worker(script: str | Path, ranks: int, worker_args: Sequence[str], *,
               cwd: str | Path | None = None, env: Mapping[str, str] | None = None
               ) -> dict[str, Any]:
    """Run ``python SCRIPT --worker ARGS`` on ``ranks`` ranks and return the last
    ``RESULT`` line's object; exits the driver with the workers' output when they fail.

    Args:
        script: the driver's own file, which runs its worker when given ``--worker``.
        cwd: working directory; ``PYTHONPATH`` gets it, so the repository imports.
        env: extra environment variables for the workers.
    """
    cmd = ranks_command(ranks, [sys.executable, str(script), "--worker", *worker_args])
    print("$ " + " ".join(cmd), flush=True)
    extra = {"PYTHONPATH": str(cwd)} if cwd is not None else {}
    r = subprocess.run(cmd, cwd=cwd, env={**os.environ, **extra, **(env or {})},
                       stdin=subprocess.DEVNULL, capture_output=True, text=True)
    lines = [x for x in r.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
    if r.returncode or not lines:
        sys.exit(f"worker failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix(RESULT_PREFIX))
