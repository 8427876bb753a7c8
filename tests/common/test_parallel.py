"""common.parallel: one ParallelState, built once (create: the context's groups, with the MPI
transport under mpiexec; single: one process; for_rank: a caller's rank and transport)."""

import pytest

from common.grid import AXONN_AXES, ProcessGrid
from common.parallel import ParallelState
from tests.distributed import needs_mpi, run_ranks


def test_single_needs_no_process_group():
    p = ParallelState.single(ProcessGrid.axonn(1, 1, 1, 1), [*AXONN_AXES, ("data", "depth")])
    assert set(p.groups) == {"data", "depth", "row", "col", "data+depth"}
    assert all(g.size == 1 and g.group is None for g in p.groups.values())
    assert p.rank == 0 and p.is_main and p.world_size == 1 and p.device.type == "cpu"
    assert p.transport is None and p.ctx is None
    with pytest.raises(ValueError, match="needs a 1-rank grid; grid 2x1x1 has 2 ranks"):
        ParallelState.single(ProcessGrid.plexus(2, 1, 1))


def test_for_rank_checks_the_grid_against_the_processes():
    p = ParallelState.for_rank(ProcessGrid.plexus(1, 1, 1), 0, transport=None)
    assert set(p.groups) == {"x", "y", "z"}
    with pytest.raises(ValueError, match=r"= 4 ranks, but 1 processes were launched"):
        ParallelState.for_rank(ProcessGrid.plexus(2, 2, 1), 0, transport=None)


def _created(ctx):
    p = ParallelState.create(ctx, ProcessGrid.plexus(1, 1, 2))
    return {"rank": p.rank, "z": (p.groups["z"].size, p.groups["z"].rank),
            "mpi": p.groups["z"].mpi is not None, "transport": p.transport is ctx.transport,
            "ctx": p.ctx is ctx}


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("comm", ["torch", "mpi"])
def test_create_takes_the_contexts_transport(comm):
    """Under mpiexec every group gets an MPI communicator (the fast path); over gloo none."""
    for rank, out in enumerate(run_ranks(_created, 2, comm=comm)):
        assert out == {"rank": rank, "z": (2, rank), "mpi": comm == "mpi",
                       "transport": True, "ctx": True}
