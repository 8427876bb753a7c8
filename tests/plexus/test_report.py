"""plexus.report.run_summary: what it computes after training, and in what order."""

import re
from types import SimpleNamespace

import torch

from plexus import report


def test_both_evaluator_passes_run_before_the_evaluator_is_imported(monkeypatch):
    """The final and the best-validation forward passes both run before ``ogb_accuracy``
    (whose import of ogb, pandas and the rest stays resident and would add to the second
    pass's peak), and each split's accuracy comes from its own pass."""
    import plexus.data.ogb as ogb

    calls = []

    def passes(result, *, best=False):
        calls.append(("pass", best))
        y = torch.tensor([1, 2, 3])
        return {"train": (y, y if best else torch.zeros(3, dtype=torch.int64)),
                "val": (torch.tensor([], dtype=torch.int64),) * 2}  # empty: skipped

    def accuracy(name, y, p):
        calls.append(("accuracy", name))
        return float((y == p).double().mean())

    monkeypatch.setattr(report, "split_predictions", passes)
    monkeypatch.setattr(ogb, "ogb_accuracy", accuracy)
    monkeypatch.setattr(report, "peaks_per_rank_max", lambda device, transport: {})
    row = {"epoch_s": 1.0, "comm_s": 0.0, "comm_exposed_s": 0.0, "comm_bytes": 0, "loss": 1.0,
           "train_acc": 0.5, "val_acc": 0.5, "test_acc": 0.5}
    result = SimpleNamespace(history=[row], info={
        "best": {"epoch": 1}, "best_state": {}, "setup_s": 0.0,
        "config": {"run": {"eval_every": 1}}})
    source = SimpleNamespace(name="ogbn-arxiv", num_nodes=3, num_edges=2)
    ctx = SimpleNamespace(world_size=1, launcher="single", device=torch.device("cpu"),
                          is_main=True, transport=None)
    out = report.run_summary(result, source, "1x1x1", ctx)
    assert calls == [("pass", False), ("pass", True),
                     ("accuracy", "ogbn-arxiv"), ("accuracy", "ogbn-arxiv")]
    assert out["ogb_evaluator"] == {"train": 0.0}
    assert out["ogb_evaluator_best_val"] == {"train": 1.0}


def test_after_a_resume_the_best_epochs_evaluator_numbers_are_not_the_final_models(
        tmp_path, capsys):
    """The best validation epoch lies before the checkpoint a run resumed from: its weights
    are gone, so the summary says so instead of scoring the final weights as the best's, and
    asking for them is an error, not the final model's predictions."""
    import pytest

    from common.grid import ProcessGrid
    from common.parallel import ParallelState
    from common.run import CheckpointConfig
    from plexus.config import split_config
    from plexus.data import InMemorySource
    from plexus.data.generators import planted_partition
    from plexus.trainer import Trainer, run, split_predictions

    def trainer(epochs, val_acc, directory=tmp_path, **checkpoint):
        source = InMemorySource(planted_partition(num_nodes=97, seed=3), permutation="double")
        source.name = "ogbn-arxiv"  # its report runs the OGB Evaluator
        t = Trainer(source, ParallelState.single(ProcessGrid.plexus(1, 1, 1)),
                    **split_config(epochs=epochs, hidden=8, num_layers=2),
                    checkpoint=CheckpointConfig(dir=str(directory), **checkpoint))
        evaluate = t.evaluate
        t.evaluate = lambda: {**evaluate(), "val_acc": val_acc(t.epoch)}
        return t

    run(trainer(3, lambda epoch: 1.0 if epoch == 2 else 0.0))  # best: epoch 2
    second = trainer(5, lambda epoch: 0.5, resume=True)
    second.resume()
    run(second)
    result = second.result()
    assert result.info["best"]["epoch"] == 2 and result.info["best_state"] is None
    with pytest.raises(ValueError, match=r"best validation epoch \(2\) came before the resume "
                       r"from epoch 3"):
        split_predictions(result, best=True)
    ctx = SimpleNamespace(world_size=1, launcher="single", device=torch.device("cpu"),
                          is_main=True, transport=None)
    out = report.run_summary(result, second.source, "1x1x1", ctx)
    assert "ogb_evaluator" in out and "ogb_evaluator_best_val" not in out
    assert "came before the resume" in out["ogb_evaluator_best_val_unavailable"]
    report.print_summary(out)
    assert re.search(r"at best val +not available: the best validation epoch \(2\) came "
                     "before the resume from epoch 3", capsys.readouterr().out)
    # the best epoch is the one resumed from: the weights loaded are its own
    run(trainer(3, lambda epoch: epoch / 10, tmp_path / "b"))
    third = trainer(4, lambda epoch: 0.0, tmp_path / "b", resume=True)
    third.resume()
    held = {name: t.clone() for name, t, _, _ in third.model.sharded_state()}
    run(third)
    assert third.best["epoch"] == 3 and third.best_state.keys() == held.keys()
    assert all(torch.equal(third.best_state[k], held[k]) for k in held)
