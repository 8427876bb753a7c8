"""Smoke test of bench/collectives.py: two MPI ranks, 1 KiB .. 64 KiB, a few iterations."""

import math
import re

import pytest

from tests.distributed import ROOT, launch

SCRIPT = ROOT / "bench" / "collectives.py"
OPS = ("all_reduce", "all_gather", "reduce_scatter")
SIZES = ("1 KiB", "4 KiB", "16 KiB", "64 KiB")
# size, iters, ours us, ours busbw, MPI us, MPI busbw, ours/MPI, extra us, reused us, target
ROW = re.compile(r"^\s*(\d+ [KM]?i?B)\s+(\d+)" + r"\s+([0-9.eE+-]+|inf|nan)" * 7
                 + r"\s+(met|MISSED)\s*$")


@pytest.mark.slow
def test_bench_collectives_two_ranks(tmp_path):
    csv_path = tmp_path / "rows.csv"
    r = launch([str(SCRIPT), "--max-size", "64K", "--iters", "3", "--warmup", "1",
                "--repeats", "1", "--csv", str(csv_path)], ranks=2, launcher="mpiexec",
               timeout=60)
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
    assert "ours (MPI transport) vs MPICH" in r.stdout
    assert "checks OK" in r.stdout
    assert len(csv_path.read_text().splitlines()) == 1 + len(OPS) * len(SIZES)
