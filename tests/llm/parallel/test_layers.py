"""The tensor-parallel layers of llm.parallel.layers: the collectives of a Linear pair match the
spec's volumes on 8 ranks (shared launch ``eight_ranks``), each overlap runs exactly where it is on,
one rank is plain ``linear``, and the overlap switches parse."""

import pytest
import torch
from torch.nn.functional import linear

from common.comm_stats import CommStats
from common.grid import AXONN_AXES, AxisGroup, ProcessGrid, ceil_div
from llm.config import Overlap
from llm.parallel.gpt import make_groups
from llm.parallel.layers import DepthGrads, DepthWeights, OverlapCounts, ParallelLinear
from tests.rounding import assert_product_orders_agree

VOLUME_CASES = [("1x2x2x2", "all"), ("1x2x2x2", "none"), ("2x4x1x1", "all"),
                ("1x1x2x4", "all"), ("1x2x2x2", "oag")]


def linear_pair(groups, overlap, stats=None):
    """A normal Linear (14 -> 10) then a transposed one (10 -> 14), random flat shards."""
    ov = Overlap.parse(overlap)
    counts = OverlapCounts()
    weights = DepthWeights(groups["depth"], prefetch=ov.oag, stats=stats, counts=counts)
    grads = DepthGrads(groups["depth"], defer=ov.ors, stats=stats, counts=counts)
    r, c, z = (groups[a].size for a in ("row", "col", "depth"))
    layers = [ParallelLinear(torch.randn(ceil_div((10 // r) * (14 // c), z)), (10 // r, 14 // c),
                             transposed=False, groups=groups, weights=weights, grads=grads,
                             overlap=ov, stats=stats),
              ParallelLinear(torch.randn(ceil_div((14 // c) * (10 // r), z)), (14 // c, 10 // r),
                             transposed=True, groups=groups, weights=weights, grads=grads,
                             overlap=ov, stats=stats)]
    return layers, weights, grads, counts


def linear_volumes(ctx, grid_text, overlap):
    """Forward and backward of :func:`linear_pair` on this rank: (axis, op) -> (calls, bytes
    sent per rank) of its collectives, and its overlap counts."""
    groups = make_groups(ProcessGrid.parse(grid_text, AXONN_AXES), ctx.rank, ctx.transport)
    stats = CommStats()
    layers, weights, grads, counts = linear_pair(groups, overlap, stats)
    weights.begin_forward()
    x = torch.randn(3, 2, 14 // groups["col"].size, requires_grad=True)  # [b, T, in/C]
    layers[1](layers[0](x)).sum().backward()
    grads.finish()
    assert all(layer.weight.grad is not None for layer in layers)
    return {"volumes": {k: (v.calls, v.bytes) for k, v in stats.records.items()},
            "overlapped": (counts.oar, counts.ors, counts.oag)}


def expected_linear_volumes(depth, row, col):
    """Section 2 of the spec, float32, b * T = 6 rows, padded flat shards."""
    shard = ceil_div((10 // row) * (14 // col), depth)  # both blocks hold 10/R x 14/C entries
    gather = (depth - 1) * shard * 4  # ring all-gather of Z shards: (Z-1)/Z of Z*shard*4
    narrow, wide = 6 * (10 // row) * 4, 6 * (14 // col) * 4  # [6, 10/R] and [6, 14/C]
    out = {}
    if depth > 1:
        out[("depth", "all_gather")] = (4, 4 * gather)  # 2 Linears x (forward + backward)
        out[("depth", "reduce_scatter")] = (2, 2 * gather)
    if col > 1:  # normal forward y [6, 10/R], transposed backward dX [6, 10/R]
        out[("col", "all_reduce")] = (2, 2 * 2 * (col - 1) * narrow // col)
    if row > 1:  # normal backward dX [6, 14/C], transposed forward y [6, 14/C]
        out[("row", "all_reduce")] = (2, 2 * 2 * (row - 1) * wide // row)
    return out


def expected_overlaps(depth, row, col, overlap):
    """(oar, ors, oag) for the pair: OAR overlaps the normal Linear's dX all-reduce over row
    and the transposed one's over col; ORS defers both reduce-scatters; OAG consumes the
    forward prefetches of Linears 0 and 1 and the backward prefetch of Linear 0."""
    ov = Overlap.parse(overlap)
    return ((row > 1) + (col > 1) if ov.oar else 0, 2 if ov.ors and depth > 1 else 0,
            3 if ov.oag and depth > 1 else 0)


@pytest.mark.slow
def test_linear_collectives_have_the_spec_volumes_and_overlaps(eight_ranks):
    for (grid_text, overlap), *per_rank in zip(VOLUME_CASES,
                                               *[r["volumes"] for r in eight_ranks]):
        _, depth, row, col = (int(v) for v in grid_text.split("x"))
        want = expected_linear_volumes(depth, row, col)
        for rank, got in enumerate(per_rank):
            tag = f"grid {grid_text} overlap {overlap} rank {rank}"
            assert got["volumes"] == want, tag  # overlap changes when, never how much
            assert got["overlapped"] == expected_overlaps(depth, row, col, overlap), tag


def one_rank_groups_for(names=("data", "depth", "row", "col")):
    return {a: AxisGroup(a, None, 1, 0) for a in names}


@pytest.mark.cross_shape
@pytest.mark.parametrize("transposed", [False, True])
def test_one_rank_is_a_plain_linear(transposed):
    """Groups of one rank: forward and both gradients are linear's (our own GEMM calls against
    autograd's, other layouts: each product within 2 gamma(k) |a||b| of the exact one);
    nothing overlaps."""
    groups = one_rank_groups_for()
    counts = OverlapCounts()
    ov = Overlap()
    weights = DepthWeights(groups["depth"], prefetch=True, stats=None, counts=counts)
    grads = DepthGrads(groups["depth"], defer=True, stats=None, counts=counts)
    full = torch.randn(10, 14)
    layer = ParallelLinear(full.reshape(-1).clone(), (10, 14), transposed=transposed,
                           groups=groups, weights=weights, grads=grads, overlap=ov, stats=None)
    x = torch.randn(3, 2, 14, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = full.clone().requires_grad_()
    weights.begin_forward()
    y = layer(x)
    y_ref = linear(x_ref, w_ref)
    assert_product_orders_agree(y, x_ref.detach(), full.t(), "y")
    dy = torch.randn_like(y)
    y.backward(dy)
    grads.finish()
    y_ref.backward(dy)
    assert_product_orders_agree(x.grad, dy, full, "dx")
    assert_product_orders_agree(x_ref.grad, dy, full, "dx reference")
    dw = layer.weight.grad.view(10, 14)
    flat_dy, flat_x = dy.reshape(-1, 10), x_ref.detach().reshape(-1, 14)
    assert_product_orders_agree(dw, flat_dy.t(), flat_x, "dw")
    assert_product_orders_agree(w_ref.grad, flat_dy.t(), flat_x, "dw reference")
    assert counts == OverlapCounts()


def test_overlap_parse():
    assert Overlap.parse("all") == Overlap() and str(Overlap()) == "all"
    assert Overlap.parse("none") == Overlap(oar=False, ors=False, oag=False)
    assert Overlap.parse("oar, oag") == Overlap(ors=False)
    assert str(Overlap.parse("ors")) == "ors"
    with pytest.raises(ValueError, match="unknown"):
        Overlap.parse("oar,fast")
