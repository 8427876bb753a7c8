"""common.spawn: the driver/worker hand-off the benches and tests use."""

from __future__ import annotations

import pytest

from common.spawn import ranks_command, run_worker
from tests.distributed import needs_mpi

WORKER = '''
import os, sys
from common.spawn import print_result
assert sys.argv[1] == "--worker"
rank = int(os.environ.get("PMI_RANK", "0"))
if sys.argv[2] == "fail":
    sys.exit(3)
if rank == 0:
    print("progress line")
    print_result({"args": sys.argv[2:], "size": int(os.environ.get("PMI_SIZE", "1")),
                  "extra": os.environ.get("LAUNCH_TEST")})
'''


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def test_one_rank_runs_the_command_itself():
    assert ranks_command(1, ["python", "x.py"]) == ["python", "x.py"]


def test_result_comes_back_with_env(script, tmp_path):
    got = run_worker(script, 1, ["a", "b"], cwd=tmp_path, env={"LAUNCH_TEST": "yes"})
    assert got == {"args": ["a", "b"], "size": 1, "extra": "yes"}


@needs_mpi
def test_two_ranks_under_mpiexec(script, tmp_path):
    assert ranks_command(2, ["python"])[1:] == ["-n", "2", "python"]
    got = run_worker(script, 2, ["c"], cwd=tmp_path)
    assert got["size"] == 2 and got["args"] == ["c"]


def test_failed_worker_exits_the_driver_with_its_output(script, tmp_path):
    with pytest.raises(SystemExit) as e:
        run_worker(script, 1, ["fail"], cwd=tmp_path)
    assert "exit 3" in str(e.value)
