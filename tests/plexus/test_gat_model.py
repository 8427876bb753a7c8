"""The 3D-parallel GAT (plexus.model.PlexusGCN with ``model="gat"``, plexus.gat_model) equals the
serial GAT (plexus.gat_reference.SerialGAT, float64) of the same seed: the loss, the logits of
a training pass and of an eval-mode pass after it, and the gradient of every weight, attention
vector, bias and norm parameter, with dropout on the inputs and on the coefficients, on 1x1x1
and on 2x2x2, 1x2x4 and 4x1x2 (203 nodes: every grid pads; the double permutation; the last
layer's classes padded), for two, three and four layers, with batch and layer norm, feature
normalisation and residuals, from the in-memory source and from a prepared dataset; each
rank's bytes per axis are common.perf.gat's; and one rank's logits are PyG's ``GATConv``
stack's."""

from __future__ import annotations

import pytest
import torch

from common.grid import ProcessGrid
from plexus import layout
from plexus.gat_reference import SerialGAT
from tests.distributed import run_ranks
from tests.plexus.data.shards import model_source, small_graph
from tests.plexus.test_model import full_logits, rel
from tests.plexus.test_recipe import assert_loss_and_grads, one_pass, train_and_evaluate

HEADS, HIDDEN, SEED, STEP, RATE = 4, 2, 6, 3, 0.3
GRIDS = {1: ["1x1x1"], 8: ["2x2x2", "1x2x4", "4x1x2"]}
CASES = [  # (layers, dropout, attention dropout, norm, normalize features, bias, residual)
    (2, RATE, RATE, "none", False, True, False),
    (3, RATE, RATE, "batch", True, True, True),
    (4, 0.0, RATE, "layer", False, False, True),
    (3, 0.0, 0.0, "batch", False, False, False),  # bare but the norm: bytes as common.perf's
]
BARE = CASES[-1]


def _widths(graph, num_layers):
    return layout.layer_widths(graph.num_features, HEADS * HIDDEN, num_layers,
                               graph.num_classes)


def _serial(graph, case):
    num_layers, dropout, attention, norm, normalize, bias, residual = case
    ref = SerialGAT(graph, _widths(graph, num_layers), heads=HEADS, seed=SEED, dropout=dropout,
                    attention_dropout=attention, bias=bias, norm=norm,
                    normalize_features=normalize, residual=residual)
    return train_and_evaluate(ref, graph, STEP)


def _parallel(ctx, grids, cases=CASES, prepared=None):
    from plexus.data import PreparedGraph
    from plexus.model import PlexusGCN

    graph = small_graph()
    source = PreparedGraph(prepared) if prepared else model_source(graph, "gat")
    out = []
    for grid_text in grids:
        grid = ProcessGrid.parse(grid_text)
        groups = ctx.create_groups(grid)
        for case in cases:
            num_layers, dropout, attention, norm, normalize, bias, residual = case
            shard = source.shard(grid.shape, grid.coords(ctx.rank), _widths(graph, num_layers))
            net = PlexusGCN(shard, groups, model="gat", heads=HEADS, seed=SEED, dropout=dropout,
                            attention_dropout=attention, bias=bias, norm=norm,
                            normalize_features=normalize, residual=residual)
            got = one_pass(net, shard, groups, graph.num_classes, num_layers)
            out.append({**got, "case": (grid_text, *case), "shape": grid.shape,
                        "rows": shard.out_rows})
    return out


def _check(results):
    graph = small_graph()
    for per_rank in zip(*results, strict=True):
        grid_text, *case = per_rank[0]["case"]
        tag = f"{grid_text}, case {case}"
        ref = _serial(graph, case)
        assert_loss_and_grads(per_rank, ref, tag)
        for key in ("logits", "eval"):
            got = full_logits(per_rank, key, "rows", ref[key], graph.num_classes)
            assert not torch.isnan(got).any(), f"{tag}: some {key} were on no rank"
            assert rel(got, ref[key]) < 1e-5, f"{tag}: {key} differ ({rel(got, ref[key])})"
        if tuple(case) == BARE:
            _check_bytes(graph, case, per_rank, tag)


def _check_bytes(graph, case, per_rank, tag):
    """Every rank's bytes on each axis are common.perf.gat's prediction for the workload."""
    from common.perf.gat import gat_collectives
    from common.perf.gcn import GCNWorkload
    from common.perf.model import bytes_by_axis

    work = GCNWorkload(model="gat", num_nodes=graph.num_nodes, nnz=1,
                       num_features=graph.num_features, num_classes=graph.num_classes,
                       num_layers=case[0], hidden=HEADS * HIDDEN, heads=HEADS, norm=case[3])
    for r in per_rank:
        want = {k: v for k, v in bytes_by_axis(gat_collectives(work, r["shape"], loss=False),
                                               r["shape"]).items() if v}
        got: dict[str, int] = {}
        for key, b in r["bytes"].items():
            got[key.split("/")[0]] = got.get(key.split("/")[0], 0) + b
        assert {k: v for k, v in got.items() if v} == want, f"{tag}: bytes {got} != {want}"


@pytest.mark.cross_shape
@pytest.mark.parametrize("world", sorted(GRIDS))
def test_the_3d_gat_is_the_serial_gat(world):
    _check(run_ranks(_parallel, world, GRIDS[world]))


@pytest.mark.cross_shape
def test_the_3d_gat_on_a_prepared_dataset_is_the_serial_gat(tmp_path):
    """The same on the blocks plexus.prepare writes (GCN's, whose pattern GAT reads; 4 x 4
    blocks, so 203 nodes pad to 204), mapped by each rank."""
    from plexus.data.sources import graph_source
    from plexus.data.writer import prepare

    prepare(graph_source(small_graph()), tmp_path / "p", blocks=4, seed=11, quiet=True)
    _check(run_ranks(_parallel, 8, GRIDS[8], CASES[:2], str(tmp_path / "p")))


def _heads_that_do_not_split(ctx):
    from plexus.model import PlexusGCN

    graph = small_graph()
    grid = ProcessGrid.parse("1x2x1")  # layer 0's I is y: 2 ranks
    shard = model_source(graph, "gat").shard(grid.shape, grid.coords(ctx.rank),
                                             layout.layer_widths(graph.num_features, 6, 2,
                                                                 graph.num_classes))
    groups = ctx.create_groups(grid)
    with pytest.raises(ValueError, match="3 heads do not split over its I axis"):
        PlexusGCN(shard, groups, model="gat", heads=3)
    # nor does a GAT take the options of GCN layers (its last layer computes every row)
    with pytest.raises(ValueError, match="runs none of the layer plan's options"):
        PlexusGCN(shard, groups, model="gat", heads=2, labelled_rows_only=True)
    from plexus.layer_plan import LayerPlan

    with pytest.raises(ValueError, match="runs none of the layer plan's options"):
        PlexusGCN(shard, groups, model="gat", heads=2,
                  plan=LayerPlan(labelled_rows_only=True, weight_first=(False, False)))
    PlexusGCN(shard, groups, model="gat", heads=2, aggregation_blocks=1)  # the default: fine
    return True


def test_heads_must_split_over_each_layers_inner_axis():
    assert run_ranks(_heads_that_do_not_split, 2) == [True, True]


def _one_rank_logits(ctx, num_layers):
    from plexus.model import PlexusGCN

    graph = small_graph()
    grid = ProcessGrid.parse("1x1x1")
    shard = model_source(graph, "gat").shard(grid.shape, grid.coords(ctx.rank),
                                             _widths(graph, num_layers))
    net = PlexusGCN(shard, ctx.create_groups(grid), model="gat", heads=HEADS, seed=SEED,
                    bias=True)
    net.eval()
    logits = net().detach()
    out = torch.empty(graph.num_nodes, logits.shape[1])
    rows = torch.from_numpy(shard.out_rows.astype("int64"))
    out[rows[rows >= 0]] = logits[rows >= 0]
    return out[:, :graph.num_classes]


@pytest.mark.parametrize("num_layers", [2, 3])
def test_one_rank_is_pygs_gatconv_stack(num_layers):
    """One rank's logits are PyG's ``GATConv`` stack's with the same weights (float32, no
    dropout): the semantics are GATConv's, not similar ones."""
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    from plexus.gat_reference import init_gat

    graph = small_graph()
    widths = _widths(graph, num_layers)
    ours = run_ranks(_one_rank_logits, 1, num_layers)[0]
    h = graph.x.float()
    for layer, p in enumerate(init_gat(widths, HEADS, SEED)):
        last = layer == num_layers - 1
        c = p["att_src"].shape[1]
        conv = pyg_nn.GATConv(widths[layer], c, heads=HEADS, concat=not last,
                              negative_slope=0.2, add_self_loops=True, bias=True)
        with torch.no_grad():
            conv.lin.weight.copy_(p["w"].t())
            conv.att_src.copy_(p["att_src"].view(1, HEADS, c))
            conv.att_dst.copy_(p["att_dst"].view(1, HEADS, c))
            conv.bias.zero_()
        h = conv(h, graph.edge_index)
        h = h if last else torch.relu(h)
    assert torch.allclose(ours, h.detach(), rtol=1e-5, atol=1e-5), (ours - h).abs().max()
