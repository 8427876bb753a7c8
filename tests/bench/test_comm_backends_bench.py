"""Smoke test of bench/comm_backends.py: make train's job on both transports and on 1 rank,
two epochs each; the losses must agree between transports (the bench exits 1 otherwise)."""

import pytest

from tests.distributed import ROOT, launch, needs_mpi

SCRIPT = ROOT / "bench" / "comm_backends.py"


@needs_mpi
@pytest.mark.slow
def test_bench_comm_backends_planted():
    r = launch([str(SCRIPT), "--jobs", "planted", "--epochs", "3"], launcher="single",
               timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for label in ("planted torch ", "planted mpi ", "planted one rank ",
                  "planted torch / mpi time =", "planted 4 ranks (mpi) / 1 rank epoch time ="):
        assert label in r.stdout, (label, r.stdout)
