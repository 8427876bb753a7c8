"""The README's "Using the shared core from your own code" example is a real script
(tests/common/core_snippet.py): run as an outside script (its own directory, no PYTHONPATH)
on 4 ranks under mpiexec and torchrun and alone, it prints the right numbers and exits 0
without calling any shutdown (the core cleans up by itself); under mpiexec its axis groups
are MPI groups."""

import re
import shutil
from pathlib import Path

import pytest

from tests.distributed import ROOT, launch

SNIPPET = Path(__file__).with_name("core_snippet.py")
# 2x2x1: the x group of rank 0 is ranks {0, 2} (sum 2); the y group {0, 1} sends back
# 2 x (rank + 1) = 2 per element; alone: nothing to add, gradient 1
EXPECTED = {4: "grid 2x2x1: x-sum 2, gradient [2.0, 2.0]",
            1: "grid 1x1x1: x-sum 0, gradient [1.0, 1.0]"}


def _run(tmp_path: Path, launcher: str, ranks: int):
    script = tmp_path / "core_snippet.py"
    shutil.copy(SNIPPET, script)
    r = launch([str(script)], ranks=ranks, launcher=launcher, cwd=tmp_path, pythonpath=None,
               timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "terminate called" not in r.stderr, r.stderr
    assert r.stdout.count(EXPECTED[ranks]) == 1, r.stdout
    if ranks > 1:  # the stats table: one all-reduce over x, the pair's two collectives over y
        for axis, op in (("x", "all_reduce"), ("y", "all_gather"), ("y", "reduce_scatter")):
            assert re.search(rf"^{axis}\s+{op}\s+1\s", r.stdout, re.M), r.stdout


@pytest.mark.slow
def test_snippet_under_mpiexec(tmp_path):
    _run(tmp_path, "mpiexec", 4)


@pytest.mark.slow
def test_snippet_under_torchrun(tmp_path):
    _run(tmp_path, "torchrun", 4)


def test_snippet_alone(tmp_path):
    _run(tmp_path, "single", 1)


@pytest.mark.slow
def test_snippet_groups_get_the_mpi_transport_under_mpiexec(tmp_path):
    """The groups made as the README makes them carry an MPI communicator under mpiexec, so
    CPU tensors take MPI, not gloo (the slow path, :mod:`common.mpi`)."""
    script = tmp_path / "core_snippet.py"
    script.write_text(SNIPPET.read_text() + (
        "\nfrom common.mpi import MPIGroup\n"
        "mpi = sorted(n for n, g in groups.items() if g.size > 1 and isinstance(g.mpi, MPIGroup))\n"
        "# one write per line, so the two ranks' lines cannot interleave inside a line\n"
        "print(f'rank {ctx.rank} comm {ctx.comm} mpi groups {mpi}', flush=True)\n"))
    r = launch([str(script)], ranks=2, launcher="mpiexec", cwd=tmp_path, pythonpath=None,
               timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "grid 2x1x1: x-sum 1, gradient [1.0, 1.0]" in r.stdout, r.stdout
    for rank in (0, 1):  # 2x1x1: x is the one group of two ranks
        assert f"rank {rank} comm mpi mpi groups ['x']" in r.stdout, r.stdout


def _snippet_body() -> str:
    """The script without its module docstring: what the README shows."""
    text = SNIPPET.read_text()
    return text[text.index('"""', 3) + 3:].strip()


README = (ROOT / "README.md").read_text()


def test_readme_shows_the_snippet():
    block = README.split("<!-- core-snippet -->", 1)[1].split("<!-- /core-snippet -->", 1)[0]
    code = re.search(r"```python\n(.*?)```", block, re.S)
    assert code is not None, "no ```python block between the core-snippet markers"
    assert code.group(1).strip() == _snippet_body()


OLD_CALL = """
import torch
from common import ProcessGrid, collectives, init_distributed
ctx = init_distributed(device="cpu")
grid = ProcessGrid.plexus(1, ctx.world_size, 1)
groups = grid.create_groups(ctx.rank)  # the first README's call
t = torch.full((3,), float(ctx.rank + 1))
print(f"rank {ctx.rank} y-sum {collectives.all_reduce(t, groups['y'])[0].item():g}")
"""


@pytest.mark.slow
def test_the_first_readmes_group_call_still_works_and_names_the_new_one(tmp_path):
    """``grid.create_groups(ctx.rank)`` from outside code of the first releases, under mpiexec
    -n 2: it runs (gloo groups, as then) and warns with the call that replaces it."""
    script = tmp_path / "old_call.py"
    script.write_text(OLD_CALL)
    r = launch([str(script)], ranks=2, launcher="mpiexec", cwd=tmp_path, pythonpath=None,
               timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0 y-sum 3" in r.stdout and "rank 1 y-sum 3" in r.stdout, r.stdout
    assert r.stderr.count("DeprecationWarning: ProcessGrid.create_groups(rank) without "
                          "transport= is deprecated") == 2, r.stderr
    assert "call ctx.create_groups(grid)" in r.stderr
