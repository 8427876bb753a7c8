"""The overlapped aggregation (plexus.ops.BlockedAggregation, PlexusGCN ``overlap``).

The blocked path with overlap against the same blocks without it: loss, logits, every
gradient and the bytes moved bit for bit, on the issue's three 8-rank grids (gloo) and on a
lopsided 4-rank grid over the MPI transport (its communication thread runs the async
collectives), for GCN and for GraphSAGE with batch norm and residual connections. The
exposed communication the stats report never exceeds the total, and on the synchronous path
equals it. Parallel == serial with overlap on (the default on multi-rank grids) is
tests/plexus/test_model.py's test_plexus_equals_serial.
"""

import pytest
import torch

from common.comm_stats import CommStats
from common.grid import ProcessGrid
from plexus.data.memory import InMemorySource
from plexus.layout import layer_widths, roles
from plexus.loss import sharded_cross_entropy
from plexus.model import PlexusGCN
from tests.distributed import needs_mpi, run_ranks
from tests.plexus.data.shards import model_source, small_graph

HIDDEN = 6
# (model, layers, trainable features, norm, residual, dropout)
CASES = [("gcn", 3, True, "none", False, 0.0), ("sage", 4, False, "batch", True, 0.5)]


def _one(ctx, grid_text: str, case, overlap: bool) -> dict:
    graph = small_graph()
    kind, num_layers, learn, norm, residual, dropout = case
    grid = ProcessGrid.parse(grid_text)
    groups = ctx.create_groups(grid)
    widths = layer_widths(graph.num_features, HIDDEN, num_layers, graph.num_classes)
    source = model_source(graph, kind)
    shard = source.shard(grid.shape, grid.coords(ctx.rank), widths)
    model = PlexusGCN(shard, groups, model=kind, learn_features=learn, seed=5, bias=True,
                      norm=norm, residual=residual, dropout=dropout, overlap=overlap,
                      aggregation_blocks=4)
    assert model.plan.overlap is overlap and model.plan.aggregation_blocks == 4
    stats = CommStats()
    logits = model(stats, step=2)
    o_ax, _, p_ax = roles(num_layers - 1)
    loss = sharded_cross_entropy(logits, model.output_rows(shard.labels),
                                 model.output_rows(shard.masks["train"]),
                                 num_classes=graph.num_classes,
                                 count=shard.split_counts["train"],
                                 group_o=groups[o_ax], group_p=groups[p_ax], stats=stats)
    loss.backward()
    return {"loss": loss.detach(), "logits": logits.detach(),
            "grads": {n: t.grad.clone() for n, t, _, _ in model.sharded_state()
                      if t.grad is not None},
            "bytes": stats.total_bytes, "seconds": stats.total_seconds,
            "exposed": stats.exposed_seconds}


def _on_and_blocked(ctx, grids):
    return [{"case": (g, case), "on": _one(ctx, g, case, True),
             "blocked": _one(ctx, g, case, False)} for g in grids for case in CASES]


def _assert_bit_identical(results):
    for per_rank in results:
        for r in per_rank:
            tag = f"{r['case']}"
            on, off = r["on"], r["blocked"]
            assert torch.equal(on["loss"], off["loss"]), tag
            assert torch.equal(on["logits"], off["logits"]), tag
            assert sorted(on["grads"]) == sorted(off["grads"]) and on["grads"], tag
            for name, want in off["grads"].items():
                assert torch.equal(on["grads"][name], want), f"{tag}: grad of {name} differs"
            assert on["bytes"] == off["bytes"] > 0, tag
            # synchronous collectives: the compute waits for all of them
            assert off["exposed"] == pytest.approx(off["seconds"]), tag
            assert 0 <= on["exposed"] <= on["seconds"] + 1e-9, tag


@pytest.mark.slow
@pytest.mark.parametrize("world, grids, comm", [
    (8, ["1x2x4", "4x1x2", "2x2x2"], "torch"),
    pytest.param(4, ["2x1x2"], "mpi", marks=needs_mpi),
])
def test_overlap_equals_blocked_without_overlap(world, grids, comm):
    _assert_bit_identical(run_ranks(_on_and_blocked, world, grids, comm=comm))


def _unblocked_vs_blocked(ctx):
    """On 2-rank groups (a sum of two floats is the same in any order) the blocked layer gives
    the unblocked layer's bits too: the numba kernels keep each row's terms in order."""
    out = {}
    for blocks in (1, 4):
        graph = small_graph()
        grid = ProcessGrid.parse("2x1x1")
        groups = ctx.create_groups(grid)
        widths = layer_widths(graph.num_features, HIDDEN, 3, graph.num_classes)
        shard = InMemorySource(graph, seed=11).shard(grid.shape, grid.coords(ctx.rank), widths)
        model = PlexusGCN(shard, groups, learn_features=True, seed=5, overlap=blocks > 1,
                          aggregation_blocks=blocks)
        model().sum().backward()
        out[blocks] = [t.grad.clone() for _, t, _, _ in model.sharded_state()]
    return all(torch.equal(a, b) for a, b in zip(out[1], out[4], strict=True))


@pytest.mark.slow
def test_blocked_equals_unblocked_on_two_ranks():
    assert all(run_ranks(_unblocked_vs_blocked, 2))


def test_overlap_is_on_by_default_only_where_there_is_communication():
    graph = small_graph()
    widths = layer_widths(graph.num_features, HIDDEN, 2, graph.num_classes)
    grid = ProcessGrid.parse("1x1x1")
    shard = InMemorySource(graph).shard(grid.shape, grid.coords(0), widths)
    from common.grid import AxisGroup

    groups = {ax: AxisGroup(ax, None, 1, 0, (0,)) for ax in "xyz"}
    model = PlexusGCN(shard, groups)
    assert not model.plan.overlap and model.plan.aggregation_blocks == 1
    from common.perf.gcn import overlap_pays

    assert overlap_pays({"x": 2, "y": 1, "z": 1}) and not overlap_pays({"x": 1, "y": 1, "z": 1})
    assert not overlap_pays({"x": 2, "y": 1, "z": 1}, False)
    # one core per rank: the communication thread would take the compute's core
    assert not overlap_pays({"x": 2, "y": 1, "z": 1}, comm_offloaded=False)
    assert overlap_pays({"x": 2, "y": 1, "z": 1}, True, comm_offloaded=False)


def test_comm_offloaded_counts_cores_per_rank(monkeypatch):
    from common import parallel as par
    from common.perf.gcn import comm_offloaded
    from common.perf.machine import load_profile

    state = par.ParallelState.single(ProcessGrid.parse("1x1x1"))
    monkeypatch.setattr(par, "cores_available", lambda: 2)
    assert state.comm_offloaded()  # one rank, two cores
    monkeypatch.setattr(par, "cores_available", lambda: 1)
    assert not state.comm_offloaded()
    gpu, cpu = load_profile("perlmutter-a100"), load_profile("local-cpu")
    assert comm_offloaded(gpu, 4) and comm_offloaded(cpu, 1) and not comm_offloaded(cpu, 2)
