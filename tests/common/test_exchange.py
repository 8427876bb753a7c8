"""common.exchange: a flag, a few numbers and pickled objects made the same on every rank,
over torch.distributed and over the MPI transport (blocking and polite waits) alike, and the
one-process answers without a process group."""

import pytest
import torch.distributed as dist

from common.exchange import (
    all_gather_object,
    any_rank,
    barrier,
    broadcast_object,
    max_over_ranks,
    rank_and_size,
)
from common.mpi import MPITransport
from tests.distributed import needs_mpi, run_ranks


def _exchanges(group, transport, rank):
    """Every exchange of this module once, on ``group`` (None: the world over gloo)."""
    barrier(group)
    return {"broadcast": broadcast_object({"from": rank, "x": [1.5]} if rank == 0 else None,
                                          group),
            # pickles of other lengths on each rank
            "gather": all_gather_object(("r", rank, "y" * 1000 * rank), group),
            "max": max_over_ranks([float(rank), -float(rank), 1.5], transport=transport),
            "any": (any_rank(rank == 1, transport=transport), any_rank(False, transport=transport)),
            "rank": rank_and_size(group)}


def _every_transport(ctx):
    """The exchanges over gloo, then over the MPI transport with each kind of wait."""
    out = {"gloo": _exchanges(None, None, ctx.rank)}
    for polite in ("none", "all"):
        t = MPITransport(polite=polite)
        try:
            out[f"mpi, polite={polite}"] = _exchanges(t, t, ctx.rank)
        finally:
            t.close()
    return out


@needs_mpi
@pytest.mark.slow
def test_exchanges_over_mpi_equal_those_over_gloo():
    results = run_ranks(_every_transport, 2, comm="mpi")
    for rank, by_transport in enumerate(results):
        want = {"broadcast": {"from": 0, "x": [1.5]},
                "gather": [("r", r, "y" * 1000 * r) for r in range(2)],
                "max": [1.0, 0.0, 1.5], "any": (True, False), "rank": (rank, 2)}
        assert list(by_transport) == ["gloo", "mpi, polite=none", "mpi, polite=all"]
        for name, got in by_transport.items():
            assert got == want, f"rank {rank}, {name}"


def test_one_process_answers_without_a_process_group():
    assert not dist.is_initialized()
    barrier()
    assert broadcast_object({"a": 1}) == {"a": 1}
    assert all_gather_object([2]) == [[2]]
    assert max_over_ranks([3, -1.5]) == [3.0, -1.5]
    assert any_rank(True) and not any_rank(False)
    assert rank_and_size() == (0, 1)
