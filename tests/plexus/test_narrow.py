"""The narrowed aggregation (plexus.ops.BlockedAggregation's ``narrow``): where the messages of
the all-reduce over O are bf16, H comes back in bf16 and its gradient is summed in bf16, with
no float32 copy of either.

- On 2 and 3 ranks, over gloo and over MPI, in one row block and in four (with and without
  overlap): the narrowed H is bit for bit the float32 H of the same messages (a sum of bf16
  messages is bf16 values), and dF bit for bit the one the float32 H's gradient gives (autograd
  rounds the gradient to H's dtype as the wire rounds each rank's message). The bytes moved are
  the same; the narrowed H owns half the bytes.
- In place, a bf16 tensor is its own message: common.collectives.all_reduce over a bf16 wire
  gives it the bits the float32 copy of it gets.
- common.dense.mm of a bf16 ``a`` is bit for bit that of ``a.float()``, and into a bf16
  ``out`` bit for bit the float32 product rounded, on oneDNN and on torch's path.
- A model whose O axis has ranks keeps the narrowed H (bf16) for ``dW``, and the planner's
  phases follow it (tests/plexus/test_precision.py checks the bits against the serial model and
  the bytes against the planner on every grid).
"""

import pytest
import torch

from common import collectives as coll
from common import dense
from common.comm_stats import CommStats
from common.grid import ProcessGrid
from plexus import ops
from plexus.data.memory import InMemorySource
from plexus.layout import layer_widths
from tests.distributed import needs_mpi, run_ranks
from tests.plexus.data.shards import small_graph

WIDTH = 5


def _aggregate(ctx, grid_text: str, blocks: int, overlap: bool) -> list[dict]:
    grid = ProcessGrid.parse(grid_text)
    groups = ctx.create_groups(grid)
    graph = small_graph()
    widths = layer_widths(graph.num_features, WIDTH, 2, graph.num_classes)
    shard = InMemorySource(graph, seed=3).shard(grid.shape, grid.coords(ctx.rank), widths)
    blk = shard.adj[0]
    group = groups["x"].on_wire(torch.bfloat16)  # layer 0's O axis
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    f = torch.randn(blk.a.shape[1], WIDTH, generator=gen)
    upstream = torch.randn(blk.a.shape[0], WIDTH, generator=torch.Generator().manual_seed(7))
    out = {}
    for narrow in (False, True):
        x = f.clone().requires_grad_()
        stats = CommStats()
        h = ops.BlockedAggregation.apply(blk.a, blk.a_t, x, group, stats, blocks, overlap,
                                         None, True, narrow)
        (h.float() * upstream).sum().backward()
        out[narrow] = {"h": h.detach(), "df": x.grad, "bytes": stats.total_bytes}
    wide, narrowed = out[False], out[True]
    return [{"grid": grid_text, "blocks": blocks, "overlap": overlap,
             "dtypes": (wide["h"].dtype, narrowed["h"].dtype),
             "h_equal": torch.equal(narrowed["h"].float(), wide["h"]),
             "df_equal": torch.equal(narrowed["df"], wide["df"]),
             "df_dtype": narrowed["df"].dtype,
             "bytes": (wide["bytes"], narrowed["bytes"]),
             "nonzero": bool(wide["h"].abs().sum() > 0)}]


def _all_cases(ctx, grids):
    return [row for g in grids for blocks, overlap in ((1, False), (4, False), (4, True))
            for row in _aggregate(ctx, g, blocks, overlap)]


def _check(results):
    for per_rank in results:
        for r in per_rank:
            tag = f"{r['grid']} blocks {r['blocks']} overlap {r['overlap']}"
            assert r["dtypes"] == (torch.float32, torch.bfloat16), tag
            assert r["nonzero"], tag
            assert r["h_equal"], f"{tag}: the narrowed H is not the float32 H's values"
            assert r["df_equal"] and r["df_dtype"] == torch.float32, f"{tag}: dF differs"
            assert r["bytes"][0] == r["bytes"][1] > 0, tag


@pytest.mark.slow
@pytest.mark.parametrize("world, grids, comm", [
    (3, ["3x1x1"], "torch"),
    pytest.param(2, ["2x1x1"], "mpi", marks=needs_mpi),
])
def test_narrowed_aggregation_is_the_float32_one_in_half_the_bytes(world, grids, comm):
    _check(run_ranks(_all_cases, world, grids, comm=comm))


def _in_place(ctx):
    from common.grid import AxisGroup

    g = ctx.create_groups(ProcessGrid.parse(f"{ctx.world_size}x1x1"))["x"]
    wire = g.on_wire(torch.bfloat16)
    assert isinstance(wire, AxisGroup)
    gen = torch.Generator().manual_seed(ctx.rank)
    rows = []
    for n in (0, 7, 3 * 1024 + 1, (5 << 20) // 2 + 3):  # empty, small, odd, two pieces
        x32 = torch.randn(n, generator=gen).to(torch.bfloat16).float()
        want = coll.all_reduce(x32.clone(), wire, inplace=True)
        x16 = x32.to(torch.bfloat16)
        ptr = x16.data_ptr()
        got = coll.all_reduce(x16, wire, inplace=True)
        rows.append((n, got.dtype, got.data_ptr() == ptr, torch.equal(got.float(), want)))
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("world, comm", [(3, "torch"), pytest.param(2, "mpi", marks=needs_mpi)])
def test_a_bf16_tensor_summed_in_place_is_its_own_message(world, comm):
    for per_rank in run_ranks(_in_place, world, comm=comm):
        for n, dtype, same, equal in per_rank:
            assert dtype == torch.bfloat16 and same, n
            assert equal, f"{n} elements: not the bits of the float32 sum of the same messages"


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_mm_widens_a_bf16_a_and_rounds_into_a_bf16_out(backend):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(20000, 64, generator=gen)  # above MIN_WORK: oneDNN where it runs
    b = torch.randn(64, 48, generator=gen)
    a16 = a.to(torch.bfloat16)
    got = dense.mm(a16, b, backend=backend)
    assert got.dtype == torch.float32
    assert torch.equal(got, dense.mm(a16.float(), b, backend=backend))
    into = torch.ones(20000, 48)
    dense.mm(a16, b, backend=backend, out=into, accumulate=True)
    assert torch.equal(into, 1 + dense.mm(a16.float(), b, backend=backend))
    out = torch.empty(20000, 48, dtype=torch.bfloat16)
    assert dense.mm(a, b, backend=backend, out=out) is out
    want = dense.mm(a, b, backend=backend).to(torch.bfloat16)
    if backend == "auto" and dense.onednn_available():
        assert torch.equal(out, want)  # the same blocks, rounded
    else:  # torch's row blocks may sum in another order: one bf16 rounding apart at most
        assert ((out.float() - want.float()).abs() <= want.float().abs() / 128 + 1e-30).all()
    with pytest.raises(ValueError, match="bf16 out"):
        dense.mm(a, b, out=out, accumulate=True)


def test_the_planner_keeps_a_narrowed_h_in_bf16_and_no_float32_copy(monkeypatch):
    from common.perf.gcn_memory import gcn_memory_phases
    from common.perf.gcn_workload import AGGREGATION_BLOCKS, GCNWorkload

    def work(precision):
        return GCNWorkload(num_nodes=1 << 20, nnz=16 << 20, num_features=128, num_classes=16,
                           num_layers=3, hidden=256, model="sage", norm="batch",
                           precision=precision, labelled_rows_only=False)

    shape = {"x": 2, "y": 2, "z": 2}
    assert all(work("bf16").narrows(layer, shape) for layer in (1, 2))
    assert not any(work("fp32").narrows(layer, shape) for layer in range(3))
    assert not work("bf16").narrows(1, {"x": 2, "y": 2, "z": 1})  # layer 1's O is z
    narrowed = gcn_memory_phases(work("bf16"), shape)
    monkeypatch.setattr(GCNWorkload, "narrows", lambda self, layer, shape: False)
    wide = gcn_memory_phases(work("bf16"), shape)
    # layer 1 aggregates H and R [N/P, D/I]: 2 bytes an element and one float32 row block of
    # scratch, where the float32 sums took 4; H W then reads the bf16 H, no float32 copy of it
    rows, a = (1 << 20) // 2, 256 // 2
    h32 = rows * a * 4
    scratch = rows // AGGREGATION_BLOCKS * a * 4
    assert wide["forward 1 aggregate"] - narrowed["forward 1 aggregate"] == h32 - scratch
    assert wide["forward 1 matmul"] - narrowed["forward 1 matmul"] == h32
    # backward: dH and dR held in bf16 while A^T reads them
    assert wide["backward 1 dF"] > narrowed["backward 1 dF"]
