"""plexus.last_layer: the last layer on the labelled rows only against the same model on every
row (LayerPlan.labelled_rows_only).

The same accuracies, predictions and Evaluator pairs; the loss, logits and gradients to float
rounding with a stated bound (tests/rounding.py). Each logit row is the same sum in the same
order up to the last layer's ``H W``, but that is a vendor GEMM (torch.mm: MKL; common.dense
sends products this small to torch) of R rows against one of N/P, and MKL may sum a row of
another height in another order (its edge kernels take the last M mod 8 rows; AVX-512 and
AVX2 block differently); where the last layer's O or I group has more than 2 ranks the ring
all-reduces of H and Q also sum in an order that depends on the buffer's length. Backward,
the last layer's ``dW``/``db`` sums over fewer rows and ``dH = dQ W^T`` is again a GEMM of R
rows against N/P.
"""

import numpy as np
import pytest
import torch

from common.comm_stats import CommStats
from plexus.data.memory import InMemorySource
from plexus.layout import layer_widths
from plexus.loss import sharded_cross_entropy
from plexus.model import PlexusGCN
from tests.distributed import needs_mpi, run_ranks
from tests.plexus.bounds import (
    BACKWARD_SUMS,
    assert_gradients_agree,
    assert_loss_agrees,
    last_layer_sums,
)
from tests.plexus.data.shards import model_source, small_graph
from tests.plexus.test_model import HIDDEN, few_labels_graph
from tests.rounding import assert_orders_agree

# (graph, model, layers, trainable features, dropout, norm): the recipe's parts around the
# last layer; fixed features without dropout cache H_0 (a one-layer model caches the labelled
# rows, and its all-rows pass, predictions(), recomputes every row)
ON_OFF_CASES = [
    ("small", "gcn", 3, True, 0.5, "batch"),
    ("few", "sage", 2, False, 0.0, "layer"),
    ("few", "gcn", 1, False, 0.0, "none"),
]


def _on_off(ctx, grids):
    """Every ON_OFF_CASES case on each grid, the last layer on the labelled rows (on) and on
    every row (off): loss, logits of the labelled rows, correct counts, the Evaluator's pairs,
    every node's prediction, every gradient and the bytes moved; the Evaluator's pairs also
    against those of every output row gathered."""
    from common import collectives as coll
    from common.grid import ProcessGrid
    from plexus.data import SPLITS
    from plexus.layout import roles
    from plexus.loss import correct_counts, sharded_argmax
    from plexus.trainer import TrainResult, _outputs, predictions, split_predictions

    graphs = {"small": small_graph(), "few": few_labels_graph()}
    out = []
    for grid_text in grids:
        grid = ProcessGrid.parse(grid_text)
        groups = ctx.create_groups(grid)
        for case in ON_OFF_CASES:
            name, kind, num_layers, learn, dropout, norm = case
            graph = graphs[name]
            widths = layer_widths(graph.num_features, HIDDEN, num_layers, graph.num_classes)
            source = model_source(graph, kind)
            o_ax, i_ax, p_ax = roles(num_layers - 1)
            per = {}
            for rows_only in (True, False):
                shard = source.shard(grid.shape, grid.coords(ctx.rank), widths)
                # weight_first off: on one rank the narrowing last layer would multiply first
                # over every row and aggregate first over the labelled ones (another order)
                model = PlexusGCN(shard, groups, model=kind, learn_features=learn, seed=5,
                                  dropout=dropout, bias=True, norm=norm,
                                  labelled_rows_only=rows_only, weight_first=False)
                assert (model.labelled_rows is not None) == rows_only
                if model.plan.cache_first:
                    model()  # cache H_0 (predictions() below switches the rows it caches)
                stats = CommStats()
                logits = model(stats, step=3)
                loss = sharded_cross_entropy(logits, model.output_rows(shard.labels),
                                             model.output_rows(shard.masks["train"]),
                                             num_classes=graph.num_classes,
                                             count=shard.split_counts["train"],
                                             group_o=groups[o_ax], group_p=groups[p_ax],
                                             stats=stats)
                loss.backward()
                model.eval()
                with torch.no_grad():
                    pred = sharded_argmax(model(), num_classes=graph.num_classes,
                                          group_o=groups[o_ax])
                    correct = correct_counts(pred, model.output_rows(shard.labels),
                                             {s: model.output_rows(m)
                                              for s, m in shard.masks.items()}, groups[p_ax])
                result = TrainResult([], model, shard, dict(groups))
                labelled = shard.labelled_rows()
                splits = split_predictions(result)
                # only the split rows are gathered: the pairs every output row's gather gives
                full = [coll.all_gather(t, groups[p_ax]).cpu() for t in _outputs(result)]
                for i, s in enumerate(SPLITS, start=1):
                    assert all(torch.equal(a, b) for a, b in zip(splits[s], (
                        full[1][full[2] == i], full[0][full[2] == i]), strict=True)), s
                per[rows_only] = {
                    "loss": loss.detach(), "correct": correct,
                    "logits": logits.detach() if rows_only else logits.detach()[labelled],
                    "splits": splits, "every": predictions(result),
                    "grads": {n: model.gather(k, t.grad, layer)
                              for n, t, k, layer in model.sharded_state()
                              if t.grad is not None},
                    "bytes": stats.total_bytes}
            inner = shard.widths_padded[num_layers - 1] // groups[i_ax].size
            out.append({"case": (grid_text, *case), "last": num_layers - 1,
                        "exact": groups[o_ax].size <= 2 and groups[i_ax].size <= 2,
                        # (GraphSAGE's H W + R W_r: one sum of twice the terms)
                        "terms": max(inner * (2 if kind == "sage" else 1),
                                     groups[o_ax].size, groups[i_ax].size),
                        "rows": shard.num_nodes_padded, "layers": num_layers,
                        "train": shard.split_counts["train"], "classes": graph.num_classes,
                        "on": per[True], "off": per[False]})
    return out


def _assert_on_equals_off(results):
    for per_rank in zip(*results):
        # the largest |logit| of the case over every rank: the loss reads them all
        logit_max = max((r["off"]["logits"].abs().max().item() for r in per_rank
                         if r["off"]["logits"].numel()), default=0.0)
        for r in per_rank:
            tag = f"case {r['case']}"
            on, off = r["on"], r["off"]
            # classes and counts from the logits: equal unless a logit pair sits within the
            # bound below (none does on these graphs)
            assert on["correct"] == off["correct"], tag
            for s in off["splits"]:
                for a, b in zip(on["splits"][s], off["splits"][s], strict=True):
                    assert torch.equal(a, b), f"{tag}: Evaluator pairs of {s} differ"
            assert torch.equal(on["every"], off["every"]), f"{tag}: predictions differ"
            assert on["bytes"] <= off["bytes"], tag  # (2), (4), (7) and the loss: R rows
            # the logits' H W is a vendor GEMM of R rows against N/P (module docstring), so
            # even where every sum of ours and every all-reduce has one order they agree to
            # float rounding, not bit for bit (normwise: the logits of these small untrained
            # models do not cancel far below their terms)
            sums = last_layer_sums(r["exact"])
            assert_orders_agree(on["logits"], off["logits"], terms=r["terms"], products=sums,
                                scale=logit_max, what=f"{tag}: logits")
            assert_loss_agrees(on["loss"], off["loss"], terms=r["terms"], sums=sums,
                               logit_max=logit_max, train=r["train"], classes=r["classes"],
                               what=tag)
            # backward: the last layer's dW, db sum over fewer rows, and below it dH = dQ W^T
            # is a GEMM of R rows against one of N/P (module docstring)
            assert_gradients_agree(on["grads"], off["grads"], terms=r["rows"],
                                   sums=sums + 1 + BACKWARD_SUMS * r["layers"], what=tag)


@pytest.mark.cross_shape
@pytest.mark.parametrize("world, grids", [
    (1, ["1x1x1"]),
    pytest.param(8, ["1x2x4", "4x1x2", "2x2x2"], marks=pytest.mark.slow),
])
def test_labelled_rows_equal_all_rows(world, grids):
    """The last layer on the labelled rows only against every row, on graphs with nodes in no
    split: the same classes, the loss, logits and gradients to float rounding (module
    docstring; the bounds: :func:`last_layer_sums`, :func:`assert_loss_agrees`,
    :func:`assert_gradients_agree`)."""
    _assert_on_equals_off(run_ranks(_on_off, world, grids))


def _lone_labels(ctx):
    """A graph with two labelled nodes on a grid whose last layer splits rows over P = 2 and
    classes over O = 2: a rank's row chunk may hold no labelled row (empty SpMM, all-reduces
    and loss terms)."""
    from common.grid import ProcessGrid
    from plexus.data import Graph
    from plexus.data.generators import planted_partition
    from plexus.layout import roles
    from plexus.loss import correct_counts, sharded_argmax
    from plexus.trainer import TrainResult, split_predictions

    g = planted_partition(num_nodes=101, num_classes=3, num_features=5, avg_degree=4, seed=1)
    g = Graph.from_edge_index(g.edge_index.numpy(), g.x.numpy(), g.y.numpy(), num_classes=3,
                              train_idx=np.array([7]), val_idx=np.array([11]),
                              test_idx=np.array([], dtype=np.int64))
    grid = ProcessGrid.parse("1x2x2")
    groups = ctx.create_groups(grid)
    o_ax, _, p_ax = roles(1)
    out = []
    for rows_only in (True, False):
        shard = InMemorySource(g).shard(grid.shape, grid.coords(ctx.rank),
                                        layer_widths(5, 4, 2, 3))
        model = PlexusGCN(shard, groups, learn_features=True, bias=True,
                          labelled_rows_only=rows_only)
        logits = model()
        loss = sharded_cross_entropy(logits, model.output_rows(shard.labels),
                                     model.output_rows(shard.masks["train"]), num_classes=3,
                                     count=1, group_o=groups[o_ax], group_p=groups[p_ax])
        loss.backward()
        with torch.no_grad():
            pred = sharded_argmax(model(), num_classes=3, group_o=groups[o_ax])
            correct = correct_counts(pred, model.output_rows(shard.labels),
                                     {s: model.output_rows(m) for s, m in shard.masks.items()},
                                     groups[p_ax])
        splits = split_predictions(TrainResult([], model, shard, dict(groups)))
        out.append({"rows": logits.shape[0], "loss": loss.item(), "correct": correct,
                    "logit_max": logits.abs().max().item() if logits.numel() else 0.0,
                    "grads": dict(enumerate(model.full_weights(grads=True))),
                    "splits": splits, "n_pad": shard.num_nodes_padded,
                    "inner": shard.widths_padded[1] // groups["x"].size})
    return out


@pytest.mark.slow
@pytest.mark.cross_shape
@pytest.mark.parametrize("comm", ["torch", pytest.param("mpi", marks=needs_mpi)])
def test_a_rank_without_labelled_rows(comm):
    """The same counts and classes; the loss and gradients to float rounding: O and P have 2
    ranks and I one, so only the last layer's vendor GEMMs of R rows against N/P (H W and
    dQ W^T) and its dW's sum over fewer rows sum in other orders (module docstring)."""
    results = run_ranks(_lone_labels, 4, comm=comm)
    rows = [on["rows"] for on, _ in results]  # each row is held by the 2 ranks of its O
    assert min(rows) == 0 and sum(rows) == 4, rows
    # every rank's all-row logits: the largest |logit| (the labelled ones are among them)
    logit_max = max(off["logit_max"] for _, off in results)
    for on, off in results:
        assert on["correct"] == off["correct"]
        assert_loss_agrees(on["loss"], off["loss"], terms=on["inner"],
                           sums=last_layer_sums(True), logit_max=logit_max, train=1, classes=3,
                           what="lone labels")
        assert_gradients_agree(on["grads"], off["grads"], terms=on["n_pad"],
                               sums=last_layer_sums(True) + 1 + BACKWARD_SUMS * 2,
                               what="lone labels")
        for s, (y, p) in off["splits"].items():
            assert torch.equal(y, on["splits"][s][0]) and torch.equal(p, on["splits"][s][1])


@pytest.mark.cross_shape
def test_labelled_rows_of_a_prepared_dataset(tmp_path):
    """Mapped 4 x 4 block files (the labelled rows gathered from several blocks into one
    band): on and off agree as on an in-memory graph (to float rounding: the last layer's
    vendor GEMMs run R rows against N, test_labelled_rows_equal_all_rows), and both sources
    give the same numbers bit for bit (the same products of the same shapes, and our SpMM
    sums each row in column order across the blocks)."""
    from common.grid import ProcessGrid
    from common.parallel import ParallelState
    from plexus.data import PreparedGraph
    from plexus.data.sources import graph_source
    from plexus.data.writer import prepare
    from plexus.layout import roles

    graph = few_labels_graph()
    prepare(graph_source(graph), tmp_path / "p", blocks=4, seed=0, quiet=True)
    groups = dict(ParallelState.single(ProcessGrid.plexus(1, 1, 1)).groups)
    o_ax, _, p_ax = roles(2)
    runs = {}
    for name, source in (("mapped", PreparedGraph(tmp_path / "p")),
                         ("memory", InMemorySource(graph, seed=0, pad_multiple=4))):
        for rows_only in (True, False):
            shard = source.shard({"x": 1, "y": 1, "z": 1}, {"x": 0, "y": 0, "z": 0},
                                 layer_widths(7, HIDDEN, 3, 5))
            model = PlexusGCN(shard, groups, learn_features=True, seed=5, bias=True,
                              labelled_rows_only=rows_only, weight_first=False)  # one order
            logits = model()
            loss = sharded_cross_entropy(logits, model.output_rows(shard.labels),
                                         model.output_rows(shard.masks["train"]),
                                         num_classes=5, count=shard.split_counts["train"],
                                         group_o=groups[o_ax], group_p=groups[p_ax])
            loss.backward()
            if not rows_only:
                logits = logits[shard.labelled_rows()]
            runs[name, rows_only] = {"loss": loss.detach(), "logits": logits.detach(),
                                     **{n: t.grad for n, t, _, _ in model.sharded_state()}}
    terms = shard.widths_padded[2]  # the last layer's H W: one rank, no all-reduce
    assert len(PreparedGraph(tmp_path / "p").shard(
        {"x": 1, "y": 1, "z": 1}, {"x": 0, "y": 0, "z": 0}, [7, 5]).adj[0].a.blocks) == 4
    for name in ("mapped", "memory"):
        on, off = runs[name, True], runs[name, False]
        logit_max = off["logits"].abs().max().item()
        assert_orders_agree(on["logits"], off["logits"], terms=terms,
                            products=last_layer_sums(True), scale=logit_max, what=name)
        assert_loss_agrees(on["loss"], off["loss"], terms=terms, sums=last_layer_sums(True),
                           logit_max=logit_max, train=shard.split_counts["train"], classes=5,
                           what=name)
        grads = {k: t for k, t in off.items() if k not in ("loss", "logits")}
        assert_gradients_agree({k: on[k] for k in grads}, grads, terms=shard.num_nodes_padded,
                               sums=last_layer_sums(True) + 1 + BACKWARD_SUMS * 3, what=name)
    for key, want in runs["memory", True].items():
        assert torch.equal(runs["mapped", True][key], want), key


@pytest.mark.cross_shape
@pytest.mark.parametrize("spmm", ["auto", "torch"])
def test_trainer_runs_the_last_layer_on_labelled_rows(spmm):
    """On a graph with 20% of its nodes in a split the trainer's model runs the last layer on
    those rows by default, with the CPU kernel the trainer gave the full blocks: its losses and
    every accuracy equal the all-row model's, and split_predictions and predictions give the
    same classes.

    What is bits and what is rounding: the last layer aggregates the labelled rows first,
    A_R H against every row's (A H)[R], then multiplies them by W, a GEMM of R rows against
    one of N. On ``auto`` that SpMM is our kernel, which sums each row in column order
    whatever the row set, so its rows are the full product's, bit for bit, and so are its
    transpose's sums (the other rows add zeros). On ``torch`` it is torch's CSR product (MKL
    on the CPU), whose AVX-512 kernels sum a row subset in another order than every row:
    within order_bound(K) of the full product's rows, K = the longest row (tests/rounding.py).
    The GEMM is MKL's on both kernels, another height: the first losses agree within twice
    the logits' bound (the mean cross-entropy's slope in each row's logits sums to at most 2
    in absolute value), order_bound(max(K, hidden), products) with one product (the GEMM) on
    ``auto`` and two on ``torch``, relative to the loss (the logits of this untrained model
    are of the loss's size). From the first update on, dW differs in the last bits, and each
    later epoch adds the rounding of a step's products: epoch e within
    order_bound(K, products=10 * (e + 1)), ten products a step."""

    from common.grid import ProcessGrid
    from common.parallel import ParallelState
    from plexus.config import split_config
    from plexus.trainer import Trainer, predictions, run, split_predictions
    from tests.rounding import assert_orders_agree, order_bound

    graph = few_labels_graph()

    def train(**model):
        t = Trainer(InMemorySource(graph),
                    ParallelState.single(ProcessGrid.plexus(1, 1, 1)),
                    **split_config(epochs=4, hidden=8, num_layers=2, lr=0.05, dropout=0.5,
                                   spmm=spmm, **model))
        run(t)
        return t

    on, off = train(), train(labelled_rows_only=False)  # ModelConfig's option (auto: on here)
    assert on.model.labelled_rows is not None and off.model.labelled_rows is None
    assert on.shard.labelled_adj.a.kernel == on.shard.labelled_adj.a_t.kernel == \
        on.shard.adj[1].a.kernel == ("torch" if spmm == "torch" else "auto")
    assert on.model.labelled_rows.numel() == sum(on.shard.split_counts.values())
    last = on.shard.labelled_adj
    rows = on.model.labelled_rows
    full = on.shard.adj[1]
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(full.a.shape[1], 8, generator=gen)
    dq = torch.randn(rows.numel(), 8, generator=gen)
    sums = {"A_R H": (last.a.matmul(h), full.a.matmul(h)[rows]),
            "A_R^T dQ": (last.a_t.matmul(dq), full.a_t.matmul(
                torch.zeros(full.a.shape[0], 8).index_copy_(0, rows, dq)))}
    # the longest row or column of A with its self-loops
    terms = max(int(torch.bincount(e, minlength=graph.num_nodes).max()) + 1
                for e in graph.edge_index)
    for name, (got, want) in sums.items():
        if spmm == "torch":
            assert_orders_agree(got, want, terms=terms, what=name)
        else:
            assert torch.equal(got, want), name
    first, want = on.history[0]["loss"], off.history[0]["loss"]
    products = 2 if spmm == "torch" else 1
    assert abs(first - want) <= 2 * order_bound(max(terms, 8), products=products) * want, \
        (first, want)
    # a step's products per layer: the SpMM and the GEMM forward, their two transposes and dW
    step_products = 5 * 2
    for epoch, (a, b) in enumerate(zip(on.history, off.history, strict=True)):
        bound = 2 * order_bound(terms, products=step_products * (epoch + 1)) * b["loss"]
        assert abs(a["loss"] - b["loss"]) <= bound, (epoch, a["loss"], b["loss"], bound)
        assert [a[f"{s}_acc"] for s in ("train", "val", "test")] == \
            [b[f"{s}_acc"] for s in ("train", "val", "test")]
    res_on, res_off = on.result(), off.result()
    for s, (y, p) in split_predictions(res_off, best=True).items():
        y_on, p_on = split_predictions(res_on, best=True)[s]
        assert torch.equal(y, y_on) and torch.equal(p, p_on), s
    assert torch.equal(predictions(res_on), predictions(res_off))
