"""Smoke test of bench/collectives.py: two MPI ranks, 1 KiB .. 64 KiB, a few iterations."""

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "collectives.py"
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
OPS = ("all_reduce", "all_gather", "reduce_scatter")
SIZES = ("1 KiB", "4 KiB", "16 KiB", "64 KiB")
# size, iters, ours us, ours busbw, MPI us, MPI busbw, ours/MPI
ROW = re.compile(r"^\s*(\d+ [KM]?i?B)\s+(\d+)" + r"\s+([0-9.eE+-]+|inf|nan)" * 5 + r"\s*$")


@pytest.mark.slow
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec next to sys.executable (pip install mpich)")
def test_bench_collectives_two_ranks(tmp_path):
    csv_path = tmp_path / "rows.csv"
    cmd = [MPIEXEC, "-n", "2", sys.executable, str(SCRIPT), "--max-size", "64K",
           "--iters", "3", "--warmup", "1", "--repeats", "1", "--csv", str(csv_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr

    tables: dict[str, dict[str, float]] = {}
    op = None
    for line in r.stdout.splitlines():
        if line.startswith("# "):
            op = line[2:].split(",")[0]
            tables[op] = {}
        elif (m := ROW.match(line)) and op is not None:
            tables[op][m.group(1)] = float(m.group(7))
    assert sorted(tables) == sorted(OPS), r.stdout
    for op, rows in tables.items():
        assert tuple(rows) == SIZES, (op, r.stdout)
        for size, ratio in rows.items():
            assert math.isfinite(ratio) and ratio > 0, (op, size, ratio)
    assert "checks OK" in r.stdout
    assert len(csv_path.read_text().splitlines()) == 1 + len(OPS) * len(SIZES)
