"""plexus.model: the 3D GCN on many grids equals an independent dense serial GCN.

For every grid, permutation mode and a node count that needs padding: the loss, the full
logits, every weight gradient and the trainable-feature gradient match plain dense torch
autograd to 1e-5 relative (norm-wise). Several grids run in one launch per world size.
"""

import numpy as np
import pytest
import torch

from common.comm_stats import CommStats
from common.grid import ProcessGrid, ceil_div
from plexus.data.memory import InMemorySource
from plexus.layout import layer_widths
from plexus.loss import sharded_cross_entropy
from plexus.model import PlexusGCN
from plexus.reference import SerialGCN, gcn_adjacency
from tests.distributed import needs_mpi, run_ranks
from tests.plexus.data.shards import small_graph

HIDDEN = 6  # not divisible by 4: padded widths on 4-sized axes


def serial_reference(graph, num_layers, hidden, seed):
    """The dense float64 GCN of plexus.reference with trainable features: loss, logits and
    the gradients of every weight and of the features."""
    widths = layer_widths(graph.num_features, hidden, num_layers, graph.num_classes)
    ref = SerialGCN(graph, widths, learn_features=True, seed=seed)
    f = ref()
    loss = torch.nn.functional.cross_entropy(f[graph.train_idx], graph.y[graph.train_idx])
    loss.backward()
    return {"loss": loss.item(), "logits": f.detach(),
            "wgrads": [w.grad for w in ref.weights], "xgrad": ref.features.grad}


def _parallel(ctx, cases):
    torch.manual_seed(0)
    out = []
    for grid_text, mode, num_layers, learn in cases:
        graph = small_graph()
        grid = ProcessGrid.parse(grid_text)
        grid.check(ctx.world_size)
        groups = ctx.create_groups(grid)
        coords = grid.coords(ctx.rank)
        widths = layer_widths(graph.num_features, HIDDEN, num_layers, graph.num_classes)
        shard = InMemorySource(graph, permutation=mode, seed=11).shard(grid.shape, coords,
                                                                         widths)
        model = PlexusGCN(shard, groups, learn_features=learn, seed=5)
        if not learn:  # fixed features: the first pass caches H_0, the second must reuse it
            model()
            assert model._h0 is not None
        stats = CommStats()  # the model's collectives only (the loss gets none)
        logits = model(stats)
        o_ax, _, p_ax = ("x", "y", "z") if (num_layers - 1) % 3 == 0 else (
            ("z", "x", "y") if (num_layers - 1) % 3 == 1 else ("y", "z", "x"))
        loss = sharded_cross_entropy(logits, shard.labels, shard.masks["train"],
                                     num_classes=graph.num_classes,
                                     count=shard.split_counts["train"],
                                     group_o=groups[o_ax], group_p=groups[p_ax])
        loss.backward()
        out.append({
            "bytes": {k: v["bytes"] for k, v in stats.as_dict().items()},
            "shape": grid.shape, "n_pad": shard.num_nodes_padded,
            "widths_pad": shard.widths_padded,
            "case": (grid_text, mode, num_layers, learn),
            "loss": loss.item(),
            "logits": logits.detach(),
            "rows": shard.out_rows,
            "class_offset": groups[o_ax].rank * logits.shape[1],
            "wgrads": model.full_weights(grads=True),
            "xgrad": model.full_features(grads=True) if learn else None,
        })
    return out


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _assert_matches(results):
    graph = small_graph()
    refs = {}
    for per_rank in zip(*results):  # one case, every rank
        grid_text, mode, num_layers, learn = per_rank[0]["case"]
        tag = f"grid {grid_text} permutation {mode} layers {num_layers} learn {learn}"
        if num_layers not in refs:
            refs[num_layers] = serial_reference(graph, num_layers, HIDDEN, seed=5)
        ref = refs[num_layers]
        logits = torch.full_like(ref["logits"], float("nan"))
        for r in per_rank:
            assert abs(r["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), tag
            real = r["rows"] >= 0
            c0 = r["class_offset"]
            width = min(r["logits"].shape[1], graph.num_classes - c0)
            if width > 0:
                logits[torch.from_numpy(r["rows"][real]), c0:c0 + width] = \
                    r["logits"][torch.from_numpy(real), :width].double()
            for lw, (got, want) in enumerate(zip(r["wgrads"], ref["wgrads"])):
                assert rel(got, want) < 1e-5, f"{tag}: grad of W_{lw} differs ({rel(got, want)})"
            if learn:
                assert rel(r["xgrad"], ref["xgrad"]) < 1e-5, f"{tag}: feature gradient differs"
                assert r["bytes"] == expected_bytes(r["shape"], r["n_pad"], r["widths_pad"]), tag
        assert not torch.isnan(logits).any(), f"{tag}: some logits not held by any rank"
        assert rel(logits, ref["logits"]) < 1e-5, f"{tag}: logits differ"


def expected_bytes(shape, n, widths):
    """Ring volumes per rank of docs/design/plexus-3d.md section 4, summed per (axis, op),
    float32, trainable features (so collective 8 runs at layer 0 too)."""
    roles = [("x", "y", "z"), ("z", "x", "y"), ("y", "z", "x")]
    out = {}

    def add(axis, op, full_bytes):
        g = shape[axis]
        if g > 1:
            factor = 2 * (g - 1) if op == "all_reduce" else (g - 1)
            key = f"{axis}/{op}"
            out[key] = out.get(key, 0) + factor * full_bytes // g

    def flat(numel, g):  # a flat shard is padded to a multiple of g elements
        return ceil_div(numel, g) * g * 4

    for layer in range(len(widths) - 1):
        o, i, p = roles[layer % 3]
        d_in, d_out = widths[layer], widths[layer + 1]
        f_block = (n // shape[o]) * (d_in // shape[i])
        w_block = (d_in // shape[i]) * (d_out // shape[o])
        h_bytes = (n // shape[p]) * (d_in // shape[i]) * 4
        q_bytes = (n // shape[p]) * (d_out // shape[o]) * 4
        if layer == 0:
            add(p, "all_gather", flat(f_block, shape[p]))        # (1)
            add(p, "reduce_scatter", flat(f_block, shape[p]))    # (8) trainable features
        else:
            add(p, "all_reduce", f_block * 4)                    # (8)
        add(o, "all_reduce", h_bytes)                            # (2)
        add(p, "all_gather", flat(w_block, shape[p]))            # (3)
        add(i, "all_reduce", q_bytes)                            # (4)
        add(p, "all_gather", flat(w_block, shape[p]))            # (5)
        add(p, "reduce_scatter", flat(w_block, shape[p]))        # (6)
        add(o, "all_reduce", h_bytes)                            # (7)
    return out


MODES = ("none", "single", "double")


def _cases(grids):
    """Every permutation mode with trainable features (3 or 4 layers), plus the cached
    fixed-feature path once per grid."""
    return [(g, m, 3 if i % 2 == 0 else 4, True) for g in grids for i, m in enumerate(MODES)] \
        + [(g, "double", 4, False) for g in grids]


@pytest.mark.parametrize("world, grids, comm", [
    (1, ["1x1x1"], "torch"),
    (2, ["2x1x1", "1x2x1", "1x1x2"], "torch"),
    (4, ["2x2x1", "1x2x2"], "torch"),
    (8, ["1x2x4", "4x1x2", "2x2x2"], "torch"),
    # the MPI transport on the lopsided grid (tests/common/test_mpi.py checks it equals gloo
    # collective by collective)
    pytest.param(8, ["4x1x2"], "mpi", marks=needs_mpi),
])
@pytest.mark.slow
def test_plexus_equals_serial(world, grids, comm):
    _assert_matches(run_ranks(_parallel, world, _cases(grids), comm=comm))


def test_serial_reference_agrees_with_pyg(tiny_graph):
    """The dense reference's Â and the data side's equal PyG's gcn_norm on the same graph (an
    independent check of the normalisation convention)."""
    from torch_geometric.nn.conv.gcn_conv import gcn_norm
    from torch_geometric.utils import to_dense_adj

    from plexus.data.partition import normalized_adjacency

    graph = tiny_graph
    ei, w = gcn_norm(graph.edge_index, None, graph.num_nodes, add_self_loops=True)
    dense_pyg = to_dense_adj(ei, edge_attr=w, max_num_nodes=graph.num_nodes)[0].T  # rows=target
    ours = normalized_adjacency(graph.edge_index.numpy(), graph.num_nodes).toarray()
    np.testing.assert_allclose(ours, dense_pyg.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(gcn_adjacency(graph).numpy(), dense_pyg.numpy(), rtol=1e-6,
                               atol=1e-7)
