"""plexus.model: the 3D GCN on many grids equals an independent dense serial GCN.

For every grid, permutation mode and a node count that needs padding: the loss, the full
logits, every weight gradient and the trainable-feature gradient match plain dense torch
autograd to 1e-5 relative (norm-wise), with the last layer on the labelled rows and on every
row (the two against each other: tests/plexus/test_last_layer.py), and the cached ``H_0`` of
fixed features reused by the next pass. Several grids run in one launch per world size.
"""


import pytest
import torch

from common.comm_stats import CommStats
from common.grid import ProcessGrid, ceil_div
from plexus.data.memory import InMemorySource
from plexus.layout import layer_widths
from plexus.loss import sharded_cross_entropy
from plexus.model import PlexusGCN
from plexus.reference import SerialGCN
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
    for grid_text, mode, num_layers, learn, rows_only in cases:
        graph = small_graph()
        grid = ProcessGrid.parse(grid_text)
        grid.check(ctx.world_size)
        groups = ctx.create_groups(grid)
        coords = grid.coords(ctx.rank)
        widths = layer_widths(graph.num_features, HIDDEN, num_layers, graph.num_classes)
        shard = InMemorySource(graph, permutation=mode, seed=11).shard(grid.shape, coords,
                                                                         widths)
        model = PlexusGCN(shard, groups, learn_features=learn, seed=5,
                          labelled_rows_only=rows_only)
        if not learn:  # fixed features: the first pass caches H_0, the second must reuse it
            model()
            assert model._h0 is not None
        stats = CommStats()  # the model's collectives only (the loss gets none)
        logits = model(stats)
        o_ax, _, p_ax = ("x", "y", "z") if (num_layers - 1) % 3 == 0 else (
            ("z", "x", "y") if (num_layers - 1) % 3 == 1 else ("y", "z", "x"))
        loss = sharded_cross_entropy(logits, model.output_rows(shard.labels),
                                     model.output_rows(shard.masks["train"]),
                                     num_classes=graph.num_classes,
                                     count=shard.split_counts["train"],
                                     group_o=groups[o_ax], group_p=groups[p_ax])
        loss.backward()
        with torch.no_grad():
            every_row = model(all_rows=True)
        held = model.output_rows(torch.from_numpy(shard.out_rows)).numpy()
        out.append({
            "bytes": {k: v["bytes"] for k, v in stats.as_dict().items()},
            "shape": grid.shape, "n_pad": shard.num_nodes_padded,
            "widths_pad": shard.widths_padded, "rows_last": logits.shape[0],
            "case": (grid_text, mode, num_layers, learn, rows_only),
            "loss": loss.item(),
            "logits": logits.detach(), "every_row": every_row, "all_rows": shard.out_rows,
            "rows": held,
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
    labelled = graph.mask("train") | graph.mask("val") | graph.mask("test")
    for per_rank in zip(*results):  # one case, every rank
        grid_text, mode, num_layers, learn, rows_only = per_rank[0]["case"]
        tag = (f"grid {grid_text} permutation {mode} layers {num_layers} learn {learn} "
               f"labelled rows only {rows_only}")
        if num_layers not in refs:
            refs[num_layers] = serial_reference(graph, num_layers, HIDDEN, seed=5)
        ref = refs[num_layers]
        logits = full_logits(per_rank, "logits", "rows", ref["logits"], graph.num_classes)
        every_row = full_logits(per_rank, "every_row", "all_rows", ref["logits"],
                                graph.num_classes)
        for r in per_rank:
            assert abs(r["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), tag
            for lw, (got, want) in enumerate(zip(r["wgrads"], ref["wgrads"])):
                assert rel(got, want) < 1e-5, f"{tag}: grad of W_{lw} differs ({rel(got, want)})"
            if learn:
                assert rel(r["xgrad"], ref["xgrad"]) < 1e-5, f"{tag}: feature gradient differs"
                assert r["bytes"] == expected_bytes(r["shape"], r["n_pad"], r["widths_pad"],
                                                    r["rows_last"]), tag
        held = labelled if rows_only else torch.ones_like(labelled)
        assert not torch.isnan(logits[held]).any(), f"{tag}: some logits not held by any rank"
        assert torch.isnan(logits[~held]).all(), f"{tag}: logits of unlabelled nodes computed"
        assert rel(logits[held], ref["logits"][held]) < 1e-5, f"{tag}: logits differ"
        assert not torch.isnan(every_row).any(), f"{tag}: all_rows logits not held by any rank"
        assert rel(every_row, ref["logits"]) < 1e-5, f"{tag}: all_rows logits differ"


def full_logits(per_rank, key, rows_key, like, num_classes):
    """The [N, C] logits assembled from every rank's block ``key`` whose rows are the node
    ids ``rows_key`` (-1: padding); NaN where no rank holds a node."""
    full = torch.full_like(like, float("nan"))
    for r in per_rank:
        rows = r[rows_key]
        real = rows >= 0
        c0 = r["class_offset"]
        width = min(r[key].shape[1], num_classes - c0)
        if width > 0:
            full[torch.from_numpy(rows[real]), c0:c0 + width] = \
                r[key][torch.from_numpy(real), :width].double()
    return full


def expected_bytes(shape, n, widths, rows_last=None):
    """Ring volumes per rank of docs/design/plexus-3d.md section 4, summed per (axis, op),
    float32, trainable features (so collective 8 runs at layer 0 too); the last layer's H and
    Q have ``rows_last`` rows (its labelled rows; default all N/P)."""
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
        rows = n // shape[p]
        if layer == len(widths) - 2 and rows_last is not None:
            rows = rows_last
        h_bytes = rows * (d_in // shape[i]) * 4
        q_bytes = rows * (d_out // shape[o]) * 4
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
    """Every permutation mode with trainable features (3 or 4 layers) and the last layer on
    the labelled rows, the same on every row once, plus the cached fixed-feature path once per
    grid (the default: on this graph, 90% labelled, every row)."""
    return [(g, m, 3 if i % 2 == 0 else 4, True, True) for g in grids
            for i, m in enumerate(MODES)] \
        + [(g, "double", 3, True, False) for g in grids[:1]] \
        + [(g, "double", 4, False, None) for g in grids]


@pytest.mark.cross_shape
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


def few_labels_graph():
    """small_graph's size with 20% of the nodes in a split: the default runs the last layer
    on the labelled rows."""
    from plexus.data.generators import planted_partition

    return planted_partition(num_nodes=203, num_classes=5, num_features=7, avg_degree=5,
                             split_fractions=(0.1, 0.05, 0.05), seed=3)
