"""plexus.trainer: the Trainer's shape (set-up, resume, train_step, evaluate, run) on one
process, the loop on several grids, fit() on PyG data, the OGB Evaluator. Accuracy against PyG
with the same recipe is bench/accuracy.py (tests/bench/test_accuracy_bench.py)."""

import pytest
import torch

from common.grid import ProcessGrid
from common.parallel import ParallelState
from common.run import CheckpointConfig
from plexus.config import split_config
from plexus.data import InMemorySource
from plexus.data.generators import planted_partition
from plexus.trainer import Trainer, run, train_gcn
from tests.distributed import run_ranks

CONFIG = {"hidden": 8, "num_layers": 2, "lr": 0.05, "dropout": 0.5, "norm": "batch"}


def one_process_trainer(epochs, **checkpoint):
    source = InMemorySource(planted_partition(num_nodes=97, seed=3), permutation="double")
    parallel = ParallelState.single(ProcessGrid.plexus(1, 1, 1))
    return Trainer(source, parallel, **split_config(epochs=epochs, **CONFIG),
                   checkpoint=CheckpointConfig(**checkpoint))


def test_trainer_steps_evaluates_and_keeps_the_best_epoch():
    trainer = one_process_trainer(6)
    row = trainer.train_step()
    assert trainer.epoch == 1 and row["epoch"] == 1 and row["loss"] > 0
    assert {"epoch_s", "comm_s", "comm_bytes"} <= set(row) and "val_acc" not in row
    acc = trainer.evaluate()
    assert set(acc) == {"train_acc", "val_acc", "test_acc", "eval_s"}
    assert all(0 <= acc[f"{s}_acc"] <= 1 for s in ("train", "val", "test"))
    trainer.record({**row, **acc})
    rows = run(trainer)  # the loop goes on from epoch 2
    assert [r["epoch"] for r in rows] == [2, 3, 4, 5, 6] and len(trainer.history) == 6
    best = max(trainer.history, key=lambda r: r["val_acc"])  # the first of equals
    assert trainer.best == {k: best[k] for k in ("epoch", "train_acc", "val_acc", "test_acc")}
    assert trainer.best_state is not None and not trainer.preempted


def test_train_gcn_is_the_trainer_and_its_loop():
    graph = planted_partition(num_nodes=97, seed=3)
    res = train_gcn(InMemorySource(graph, permutation="double"), ProcessGrid.plexus(1, 1, 1), 0,
                    **split_config(epochs=4, **CONFIG))
    trainer = one_process_trainer(4)
    run(trainer)
    keys = ("loss", "train_acc", "val_acc", "test_acc")
    assert [[r[k] for k in keys] for r in res.history] == \
        [[r[k] for k in keys] for r in trainer.history]
    assert res.info["best"] == trainer.best and res.info["preempted"] is False


def test_resume_lives_in_the_trainer_and_continues_exactly(tmp_path):
    """6 straight epochs == 3 epochs, checkpoint, a fresh trainer resumed by its checkpoint
    config, 3 more epochs; the best epoch is found over the resumed history too."""
    straight = one_process_trainer(6)
    run(straight)
    first = one_process_trainer(3, dir=str(tmp_path))
    assert first.resume() is None  # resume not asked
    run(first)
    second = one_process_trainer(6, dir=str(tmp_path), resume=True)
    assert second.resume() == 3 and second.info["resumed_from"] == 3
    assert [r["epoch"] for r in run(second)] == [4, 5, 6]
    keys = ("epoch", "loss", "train_acc", "val_acc", "test_acc")
    assert [[r[k] for k in keys] for r in second.history] == \
        [[r[k] for k in keys] for r in straight.history]
    assert second.best == straight.best
    for (name, a, _, _), (_, b, _, _) in zip(second.model.sharded_state(),
                                             straight.model.sharded_state(), strict=True):
        assert torch.equal(a, b), name


def test_preemption_checkpoints_and_stops(tmp_path):
    trainer = one_process_trainer(5, dir=str(tmp_path))
    rows = run(trainer, should_stop=lambda: trainer.epoch >= 2)
    assert [r["epoch"] for r in rows] == [1, 2] and trainer.preempted
    assert trainer.result().info["preempted"]
    again = one_process_trainer(5, dir=str(tmp_path), resume=True)
    assert again.resume() == 2


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
