"""Real launchers: mpiexec (mpich + mpi4py) and torchrun start the same code; a wrong grid is
reported on every rank with a non-zero exit and no hang; single-process start-up works."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.dist import detect_launcher, first_slurm_host

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
CHECKS = ["-m", "tests.common.collective_checks"]


def _run(cmd, timeout=180):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
def test_mpiexec_four_ranks():
    r = _run([MPIEXEC, "-n", "4", sys.executable, *CHECKS, "--grid", "1x2x2"])
    assert r.returncode == 0, r.stdout + r.stderr
    # mpiexec merges the ranks' stdout, so lines may run together: count in the whole text
    assert r.stdout.count("launcher=mpiexec OK 0 failures") == 4, r.stdout


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
def test_mpiexec_wrong_grid_fails_on_every_rank():
    r = _run([MPIEXEC, "-n", "4", sys.executable, *CHECKS, "--grid", "2x2x2"], timeout=120)
    assert r.returncode != 0
    msg = "grid x=2 * y=2 * z=2 = 8 ranks, but 4 processes were launched"
    # mpiexec merges the ranks' stderr, so lines may run together: search the whole text
    ranks = set(re.findall(r"\[rank (\d+)\] error: " + re.escape(msg), r.stderr))
    assert ranks == {"0", "1", "2", "3"}, r.stderr


def test_torchrun_two_ranks():
    r = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", "2", *CHECKS, "--grid", "data=2"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("launcher=torchrun OK 0 failures") == 2, r.stdout


def test_single_process():
    r = _run([sys.executable, *CHECKS, "--grid", "1x1x1"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0/1 launcher=single OK" in r.stdout
    bad = _run([sys.executable, *CHECKS, "--grid", "1x2x1"])
    assert bad.returncode != 0
    assert "grid x=1 * y=2 * z=1 = 2 ranks, but 1 processes were launched" in bad.stderr


def test_launcher_detection():
    assert detect_launcher({}) == "single"
    assert detect_launcher({"PMI_SIZE": "4", "PMI_RANK": "0"}) == "mpiexec"
    assert detect_launcher({"OMPI_COMM_WORLD_SIZE": "2"}) == "mpiexec"
    assert detect_launcher({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h",
                            "MASTER_PORT": "1"}) == "torchrun"
    slurm = {"SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8"}
    assert detect_launcher(slurm) == "srun"
    # an sbatch shell (no job step) running one process is not an srun launch
    assert detect_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) == "single"
    assert first_slurm_host("nid[001-004,010],gpu7") == "nid001"
    assert first_slurm_host("node17") == "node17"
    assert first_slurm_host("a[7,9]") == "a7"
