"""plexus.report.run_summary: what it computes after training, and in what order."""

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
        "best": {"epoch": 1}, "setup_s": 0.0, "config": {"run": {"eval_every": 1}}})
    source = SimpleNamespace(name="ogbn-arxiv", num_nodes=3, num_edges=2)
    ctx = SimpleNamespace(world_size=1, launcher="single", device=torch.device("cpu"),
                          is_main=True, transport=None)
    out = report.run_summary(result, source, "1x1x1", ctx)
    assert calls == [("pass", False), ("pass", True),
                     ("accuracy", "ogbn-arxiv"), ("accuracy", "ogbn-arxiv")]
    assert out["ogb_evaluator"] == {"train": 0.0}
    assert out["ogb_evaluator_best_val"] == {"train": 1.0}
