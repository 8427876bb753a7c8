"""Every collective and autograd pair against its serial equivalent on 2, 4 and 8 ranks, over
several grids per launch (lopsided ones included), on both transports (gloo, MPI)."""

import pytest

from tests.common.collective_checks import check_grid
from tests.distributed import COMMS, run_ranks


def _check_grids(ctx, grids):
    return {g: check_grid(ctx, g) for g in grids}


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("world, grids", [
    (2, ["2x1x1", "1x2x1", "1x1x2", "data=2", "col=2"]),
    (4, ["2x2x1", "1x1x4", "4x1x1", "data=1,depth=2,row=1,col=2"]),
    (8, ["1x2x4", "4x1x2", "2x2x2", "data=2,depth=1,row=2,col=2"]),
])
def test_collectives_match_serial(world, grids, comm):
    results = run_ranks(_check_grids, world, grids, comm=comm)
    failures = [f"rank {r}: {f}"
                for r, res in enumerate(results) for fs in res.values() for f in fs]
    assert not failures, "\n".join(failures)
    assert all(set(res) == set(grids) for res in results)
