"""plexus.trainer: the loop on several grids, fit() on PyG data, the OGB Evaluator. Accuracy
against PyG with the same recipe is bench/accuracy.py (tests/bench/test_accuracy_bench.py)."""

import pytest

from plexus.config import split_config
from plexus.data.generators import planted_partition
from tests.distributed import run_ranks


def _fit_losses(ctx, grid, epochs, config):
    from common.grid import ProcessGrid
    from plexus.data import InMemorySource
    from plexus.trainer import train_gcn

    graph = planted_partition(num_nodes=1001, seed=1)  # 1001 = 7*11*13: padding on 2x2x2
    source = InMemorySource(graph, permutation=config.pop("permutation"))
    res = train_gcn(source, ProcessGrid.parse(grid), ctx.rank, transport=ctx.transport,
                    **split_config(epochs=epochs, **config))
    return [(r["loss"], r["train_acc"], r["test_acc"]) for r in res.history]


@pytest.mark.slow
def test_loss_curve_8_ranks_matches_1_rank():
    config = dict(hidden=32, num_layers=3, lr=0.01, learn_features=True,
                  permutation="double")
    serial = run_ranks(_fit_losses, 1, "1x1x1", 30, config)[0]
    parallel = run_ranks(_fit_losses, 8, "2x2x2", 30, config)
    for rank_curve in parallel:  # every rank reports the same (replicated) loss
        for epoch, ((l1, a1, t1), (l8, a8, t8)) in enumerate(zip(serial, rank_curve), 1):
            assert abs(l1 - l8) <= 1e-4 * abs(l1) + 1e-6, f"epoch {epoch}: {l1} vs {l8}"
            assert abs(a1 - a8) <= 2e-3 and abs(t1 - t8) <= 2e-3, f"epoch {epoch}"
    assert serial[-1][0] < 0.5 * serial[0][0]  # it learned


def _fit_pyg(ctx, data):
    from plexus import fit

    res = fit(data, grid="1x1x2", epochs=30, num_layers=2, hidden=16, lr=0.05)
    return [r["loss"] for r in res.history], res.history[-1]["train_acc"]


@pytest.mark.slow
def test_fit_trains_on_a_pyg_data_object_on_two_ranks():
    """The README's Python entry point: plexus.fit on a torch_geometric Data with boolean
    masks, under a running 2-rank job; every rank sees the same replicated losses, which fall."""
    from torch_geometric.data import Data

    g = planted_partition(num_nodes=301, seed=4)
    masks = {s: g.mask(s) for s in ("train", "val", "test")}
    data = Data(x=g.x, y=g.y, edge_index=g.edge_index, train_mask=masks["train"],
                val_mask=masks["val"], test_mask=masks["test"])
    (l0, acc0), (l1, acc1) = run_ranks(_fit_pyg, 2, data)
    assert l0 == l1 and acc0 == acc1  # replicated on both ranks
    assert len(l0) == 30 and l0[-1] < 0.7 * l0[0], l0
    assert acc0 > 0.5


def _evaluator_vs_counting(ctx, root):
    from common.grid import ProcessGrid
    from plexus.data import load_dataset, open_source
    from plexus.data.ogb import ogb_accuracy
    from plexus.trainer import predictions, split_predictions, train_gcn

    source = open_source("ogbn-arxiv", root=root)
    res = train_gcn(source, ProcessGrid.parse("1x1x2"), ctx.rank,
                    **split_config(epochs=20, hidden=16, lr=0.05))
    evaluator = {s: ogb_accuracy("ogbn-arxiv", y, p)
                 for s, (y, p) in split_predictions(res).items()}
    graph = load_dataset("ogbn-arxiv", root=root)  # labels read independently, original order
    pred = predictions(res)
    counted = {s: float((pred[graph.split_idx(s)] == graph.y[graph.split_idx(s)])
                        .double().mean()) for s in ("train", "val", "test")}
    return evaluator, counted


@pytest.mark.slow
def test_ogb_evaluator_agrees_with_our_counting(tmp_path):
    """The official ogb Evaluator on the (label, prediction) pairs gathered from the shards
    gives exactly the accuracy counted from the original-order predictions and the loader's
    labels, on every split and every rank."""
    from tests.plexus.data.ogb_format import write_arxiv_like

    write_arxiv_like(tmp_path, num_nodes=300)
    for evaluator, counted in run_ranks(_evaluator_vs_counting, 2, str(tmp_path)):
        assert set(evaluator) == {"train", "val", "test"}
        for s in evaluator:
            assert abs(evaluator[s] - counted[s]) < 1e-12, (s, evaluator, counted)
        assert counted["train"] > 0.5, counted  # learned something: the numbers are not trivial
