"""plexus.trainer: the Trainer's shape (set-up, resume, train_step, evaluate, run) on one
process, the loop on several grids, fit() on PyG data, the OGB Evaluator. Accuracy against PyG
with the same recipe is bench/accuracy.py (tests/bench/test_accuracy_bench.py).

Device placement, checked on the CPU (issue 29; the CUDA runs are tests/plexus/test_gpu.py):
each distinct adjacency block is uploaded once ("meta" standing in for a GPU) and nothing is
copied on the CPU, sharding allocates on the input's device, ``--runs`` frees each run before
the next sets up, and fit takes a Data whose tensors are on a GPU (a fake CUDA tensor)."""

import numpy as np
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
    assert res.info["fallbacks"] == []  # (the CPU: no CUDA graph, no Triton kernel)


def test_the_result_names_what_fell_back(monkeypatch):
    from types import SimpleNamespace

    from plexus import triton_switch

    trainer = one_process_trainer(1)
    monkeypatch.setattr(triton_switch, "_FAILED", ["relu_pack: CompilationError: no backend"])
    trainer.graph = SimpleNamespace(failed="RuntimeError: operation not permitted")
    assert trainer.result().info["fallbacks"] == [
        "CUDA graph: RuntimeError: operation not permitted",
        "Triton: relu_pack: CompilationError: no backend"]


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


@pytest.mark.cross_shape
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


def _fit_pyg(ctx, data, model):
    from plexus import fit

    res = fit(data, grid="1x1x2", epochs=30, num_layers=2, hidden=16, lr=0.05, **model)
    return [r["loss"] for r in res.history], res.history[-1]["train_acc"]


@pytest.mark.slow
@pytest.mark.parametrize("model", [{}, {"model": "gat", "heads": 2, "attention_dropout": 0.2}])
def test_fit_trains_on_a_pyg_data_object_on_two_ranks(model):
    """The README's Python entry point: plexus.fit on a torch_geometric Data with boolean
    masks, under a running 2-rank job; every rank sees the same replicated losses, which fall.
    The GCN, and GAT (``model="gat"``)."""
    from torch_geometric.data import Data

    g = planted_partition(num_nodes=301, seed=4)
    masks = {s: g.mask(s) for s in ("train", "val", "test")}
    data = Data(x=g.x, y=g.y, edge_index=g.edge_index, train_mask=masks["train"],
                val_mask=masks["val"], test_mask=masks["test"])
    (l0, acc0), (l1, acc1) = run_ranks(_fit_pyg, 2, data, model)
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


# ------------------------------------------------------------------ devices, on the CPU
def _count_uploads(monkeypatch):
    """The ids of the blocks copied to a device (CSRBlock.to_torch off the CPU), in order."""
    from plexus.sparse import CSRBlock

    calls = []
    to_torch = CSRBlock.to_torch

    def counted(self, device="cpu"):
        if torch.device(device).type != "cpu":
            calls.append(id(self))
        return to_torch(self, device)

    monkeypatch.setattr(CSRBlock, "to_torch", counted)
    return calls


def _host_blocks(shard):
    """{id: weakref} of every distinct CSR block of a shard's matrices."""
    import weakref

    return {id(b): weakref.ref(b) for blk in shard.adj.values()
            for _, _, b in blk.a.present()}  # (a_t reads a's blocks: plexus.transpose)


@pytest.mark.parametrize("storage", ["in memory", "prepared"])
def test_each_distinct_block_is_uploaded_once_and_shared_by_its_layers(tmp_path, monkeypatch,
                                                                         storage):
    """A 3-layer 1x1x1 run: layers 0 and 2 use the same matrix, so the host holds the blocks
    of two matrices and no transpose, and the device the blocks of two matrices and their
    transposes (4 CSR blocks; 2 for a symmetric prepared dataset, whose odd layers read the
    even files transposed), not 6; the host blocks are let go after the upload. ("meta"
    stands in for a GPU: the copy is real, the memory is not.)"""
    import gc

    from plexus.data import PreparedGraph
    from plexus.data.sources import graph_source
    from plexus.data.writer import prepare
    from plexus.trainer import upload_adjacency

    graph = planted_partition(num_nodes=97, seed=3)  # symmetric
    if storage == "prepared":
        prepare(graph_source(graph), tmp_path / "p", blocks=1, quiet=True)
        source = PreparedGraph(tmp_path / "p")
    else:
        source = InMemorySource(graph)
    one = {"x": 1, "y": 1, "z": 1}
    shard = source.shard(one, {"x": 0, "y": 0, "z": 0},
                         [graph.num_features, 8, 8, graph.num_classes])
    host = _host_blocks(shard)
    assert len(host) == 2  # the sources share the blocks of equal layouts already
    assert all(blk.a_t.nbytes == 0 for blk in shard.adj.values())  # no transposed copy
    distinct = 2 if storage == "prepared" else 4
    uploads = _count_uploads(monkeypatch)
    upload_adjacency(shard, "meta")
    assert len(uploads) == len(set(uploads)) == distinct
    gc.collect()
    assert all(ref() is None for ref in host.values())  # no host copy left behind
    adj = shard.adj
    assert adj[0].a._torch[0, 0] is adj[2].a._torch[0, 0]
    assert adj[0].a_t._copy._torch[0, 0] is adj[2].a_t._copy._torch[0, 0]
    assert adj[0].a.blocks[0][0] is adj[2].a.blocks[0][0]
    assert adj[0].a.blocks[0][0].indptr.device.type == "meta"
    if storage == "prepared":  # A'' = A'^T: layer 1's matrix is layer 0's transpose's files
        assert adj[1].a._torch[0, 0] is adj[0].a_t._copy._torch[0, 0]


def test_on_the_cpu_the_trainer_copies_no_block(monkeypatch):
    uploads = _count_uploads(monkeypatch)
    source = InMemorySource(planted_partition(num_nodes=97, seed=3), permutation="double")
    trainer = Trainer(source, ParallelState.single(ProcessGrid.plexus(1, 1, 1)),
                      **split_config(epochs=1, hidden=8, num_layers=3, residual=True))
    run(trainer)
    assert uploads == []
    assert all(isinstance(b.indptr, np.ndarray) for blk in trainer.shard.adj.values()
               for _, _, b in blk.a.present())


def test_sharding_allocates_on_the_tensors_device():
    """flat_shard and the shard maps allocate on the input's device, never a hidden CPU one
    (issue 29, finding 7; "meta" stands in for a GPU)."""
    from common import flat
    from plexus import shards

    assert flat.flat_shard(torch.ones(3, 5, device="meta"), 2, 1).device.type == "meta"
    source = InMemorySource(planted_partition(num_nodes=97, seed=3))
    grid = ProcessGrid.plexus(1, 1, 1)
    shard = source.shard(grid.shape, grid.coords(0), [4, 8, 3])
    groups = grid.create_groups(0, None, transport=None)
    maps = shards.shard_maps(shard)
    for (kind, layer), spec in maps.items():
        local = shards.shard(torch.ones(spec.shape, device="meta"), spec, groups)
        assert local.device.type == "meta", (kind, layer)


def _runs_free_the_previous_model(ctx, argv):
    """plexus.train's --runs loop, watched: each set-up checks that no earlier run's model or
    trainer is still alive (weak references, no gc.collect of its own)."""
    import weakref

    import plexus.train as cli

    alive = []

    class Watched(cli.Trainer):
        def __init__(self, *args, **kwargs):
            alive.append([name for name, ref in refs if ref() is not None])
            super().__init__(*args, **kwargs)
            refs.extend([("model", weakref.ref(self.model)), ("trainer", weakref.ref(self))])

    refs: list = []
    cli.Trainer = Watched
    try:
        assert cli.main(argv) == 0
    finally:
        cli.Trainer = Watched.__base__
    return alive


def test_runs_free_the_previous_run_before_the_next_set_up(tmp_path):
    """issue 29, finding 7: --runs N kept the previous run's model, shards and optimizer state
    (on a GPU: its memory) alive while the next run set up."""
    argv = ["--epochs", "2", "--runs", "3", "--hidden", "8", "--layers", "2", "--device",
            "cpu", "--log-every", "100", "--metrics", str(tmp_path / "m.jsonl")]
    (alive,) = run_ranks(_runs_free_the_previous_model, 1, argv)
    assert alive == [[], [], []], alive


class _FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it lives on cuda:0 and, as a CUDA tensor does, refuses numpy;
    ``.cpu()`` gives the plain tensor (what a copy to the host gives)."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() "
                        "to copy the tensor to host memory first.")

    def cpu(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).clone()


def test_fit_takes_a_pyg_data_on_a_gpu_and_leaves_it_there():
    """issue 29, finding 7: fit refused a Data on CUDA (its edges went to numpy); now it is
    copied to the CPU for sharding and the caller's object is untouched."""
    _, fake = _data_on_cpu_and_fake_gpu()
    assert fake.x.device.type == "cuda"
    with pytest.raises(TypeError, match="numpy"):  # what the old fit ran into
        fake.edge_index.numpy()
    got = run_ranks(_fit_both, 1)[0]
    assert got["fake"] == got["plain"] and len(got["plain"]) == 3
    assert got["still_on_gpu"]  # the caller's Data is not moved in place


def _data_on_cpu_and_fake_gpu():
    from torch_geometric.data import Data

    g = planted_partition(num_nodes=97, seed=3)
    masks = {f"{s}_mask": g.mask(s) for s in ("train", "val", "test")}
    plain = Data(x=g.x, y=g.y, edge_index=g.edge_index, **masks)
    fake = Data(**{k: v.as_subclass(_FakeCudaTensor) for k, v in plain.to_dict().items()})
    return plain, fake


def _fit_both(ctx):
    from plexus.trainer import fit

    plain, fake = _data_on_cpu_and_fake_gpu()
    cfg = dict(grid="1x1x1", device="cpu", epochs=3, num_layers=2, hidden=8, lr=0.05)
    losses = {name: [r["loss"] for r in fit(data, **cfg).history]
              for name, data in (("plain", plain), ("fake", fake))}
    return {**losses, "still_on_gpu": all(type(getattr(fake, k)) is _FakeCudaTensor
                                          for k in ("x", "y", "edge_index", "train_mask"))}


# ------------------------------------------------------------------ --eval-every
def eval_every_trainer(epochs, eval_every, **checkpoint):
    """one_process_trainer's run (dropout and batch norm on) with ``eval_every``."""
    source = InMemorySource(planted_partition(num_nodes=97, seed=3), permutation="double")
    parallel = ParallelState.single(ProcessGrid.plexus(1, 1, 1))
    return Trainer(source, parallel,
                   **split_config(epochs=epochs, eval_every=eval_every, **CONFIG),
                   checkpoint=CheckpointConfig(**checkpoint))


ACC_KEYS = ("train_acc", "val_acc", "test_acc", "eval_s")


def test_eval_every_trains_the_same_and_picks_the_best_among_evaluated_epochs():
    """--eval-every 4 over 10 epochs evaluates 4, 8 and the last, 10. Evaluation draws no
    random numbers and leaves batch norm's running statistics alone, so the losses and the
    weights are those of evaluating every epoch, bit for bit, and so are the accuracies of the
    evaluated epochs; the best epoch and its kept shards are chosen among those only (here
    not the best of all epochs, 6)."""
    every = eval_every_trainer(10, 1)
    run(every)
    sparse = eval_every_trainer(10, 4)
    rows = run(sparse)
    assert [r["epoch"] for r in rows] == list(range(1, 11)) and sparse.history == rows
    evaluated = [r["epoch"] for r in rows if "val_acc" in r]
    assert evaluated == [4, 8, 10] and every.best["epoch"] not in evaluated
    for r in rows:  # an epoch not evaluated carries no accuracy at all, not even its time
        assert (r["epoch"] in evaluated) == all(k in r for k in ACC_KEYS) == any(
            k in r for k in ACC_KEYS), r
    assert [r["loss"] for r in rows] == [r["loss"] for r in every.history]
    for r in rows:
        if r["epoch"] in evaluated:
            assert all(r[k] == every.history[r["epoch"] - 1][k] for k in ACC_KEYS[:3]), r
    for (name, a, _, _), (_, b, _, _) in zip(sparse.model.sharded_state(),
                                             every.model.sharded_state(), strict=True):
        assert torch.equal(a, b), name
    best = max((every.history[e - 1] for e in evaluated), key=lambda r: r["val_acc"])
    assert sparse.best == {k: best[k] for k in ("epoch", "train_acc", "val_acc", "test_acc")}
    # the kept shards are those of that epoch: a run stopped there has the same weights
    assert sparse.best["epoch"] == 8
    at_best = eval_every_trainer(best["epoch"], 4)
    run(at_best)
    for name, t, _, _ in at_best.model.sharded_state():
        assert torch.equal(sparse.best_state[name], t), name


def test_eval_every_larger_than_the_run_still_evaluates_the_last_epoch():
    trainer = eval_every_trainer(4, 100)
    rows = run(trainer)
    assert [("val_acc" in r) for r in rows] == [False, False, False, True]
    assert trainer.best["epoch"] == 4 and trainer.best_state is not None


def test_eval_every_resumes_over_a_mixed_history(tmp_path):
    """6 epochs (evaluated: 3, 6), a checkpoint, a resumed run to 10 (evaluated: 9, 10) ==
    10 straight epochs with --eval-every 3: the rows without accuracies go through the
    checkpoint's history as they are, and the best is found over the whole of it."""
    straight = eval_every_trainer(10, 3)
    run(straight)
    run(eval_every_trainer(6, 3, dir=str(tmp_path)))
    second = eval_every_trainer(10, 3, dir=str(tmp_path), resume=True)
    assert second.resume() == 6
    assert [("val_acc" in r) for r in second.history] == [False, False, True] * 2
    assert [r["epoch"] for r in run(second)] == [7, 8, 9, 10]
    keys = ("epoch", "loss", *ACC_KEYS[:3])
    assert [[r.get(k) for k in keys] for r in second.history] == \
        [[r.get(k) for k in keys] for r in straight.history]
    assert second.best == straight.best
    for (name, a, _, _), (_, b, _, _) in zip(second.model.sharded_state(),
                                             straight.model.sharded_state(), strict=True):
        assert torch.equal(a, b), name


def test_eval_every_evaluates_the_epoch_a_preemption_stops_at(tmp_path):
    trainer = eval_every_trainer(10, 4, dir=str(tmp_path))
    rows = run(trainer, should_stop=lambda: trainer.epoch >= 2)
    assert [r["epoch"] for r in rows] == [1, 2] and trainer.preempted
    assert "val_acc" not in rows[0] and "val_acc" in rows[1]
    assert trainer.best["epoch"] == 2


@pytest.mark.parametrize("bad", [0, -3])
def test_eval_every_must_be_at_least_one(bad):
    from plexus.config import RunConfig

    with pytest.raises(ValueError, match=f"need eval_every >= 1 .*got {bad}"):
        RunConfig(eval_every=bad)


@pytest.mark.parametrize("model", ["gcn", "sage"])
def test_layer_0_blocks_are_dropped_once_h0_is_cached_and_the_run_is_the_same(model):
    """Fixed features without dropout cache H_0: the trainer then drops layer 0's adjacency
    (and root) block, which no other layer of a 2-layer model reads; the losses and
    accuracies are those of a run that keeps it, and a model that must compute H_0 again
    says why it cannot."""
    graph = planted_partition(num_nodes=97, seed=3)
    cfg = split_config(epochs=3, **{**CONFIG, "dropout": 0.0, "model": model})

    def keep(shard, net, info):
        net.release_first_blocks = False

    runs = [train_gcn(InMemorySource(graph, permutation="double"),
                      ProcessGrid.plexus(1, 1, 1), 0, on_setup=hook, **cfg)
            for hook in (None, keep)]
    released, kept = runs
    assert 0 not in released.shard.adj and 0 in kept.shard.adj
    if model == "sage":
        assert 0 not in released.shard.root and 0 in kept.shard.root
    keys = ("loss", "train_acc", "val_acc", "test_acc")
    assert [[r[k] for k in keys] for r in released.history] == \
        [[r[k] for k in keys] for r in kept.history]
    released.model.to("cpu")  # drops the cached H_0
    with pytest.raises(RuntimeError, match="released once H_0 was cached"):
        released.model()
