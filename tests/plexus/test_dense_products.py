"""The dense products of a plexus layer (``H W``, ``dQ W^T``, ``dW = H^T dQ``, the recomputed
layer 0's row blocks) through common.dense: oneDNN by default on the CPU, torch's BLAS with
``gemm="torch"``; the two train alike to float rounding (the same losses, accuracies within a
node, weights within 5e-5), oneDNN really runs where it applies, and the optimizer is torch's
fused AdamW."""

import pytest

from common import dense
from common.grid import ProcessGrid
from plexus.config import RunConfig, split_config
from plexus.data import InMemorySource
from plexus.data.generators import planted_partition
from plexus.trainer import train_gcn

# big enough that every product passes common.dense.MIN_WORK: 1500 x 64 x 64 multiply-adds
GRAPH = {"num_nodes": 1500, "num_features": 64, "num_classes": 5, "seed": 7}


def _train(gemm: str, **config) -> dict:
    graph = planted_partition(**GRAPH)
    res = train_gcn(InMemorySource(graph), ProcessGrid.plexus(1, 1, 1), 0,
                    **split_config(epochs=3, hidden=64, num_layers=3, lr=0.01, gemm=gemm,
                                   optimizer="adamw", **config))
    state = {name: res.model.gather(kind, t.detach(), layer)
             for name, t, kind, layer in res.model.sharded_state()}
    return {"history": res.history, "state": state, "model": res.model}


@pytest.mark.cross_shape
@pytest.mark.skipif(not dense.onednn_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("config", [
    {"dropout": 0.0},                       # cached H_0, weight first in the last layer
    {"dropout": 0.5},                       # layer 0 recomputed in row blocks
    {"dropout": 0.0, "learn_features": True},
    {"dropout": 0.5, "model": "sage"},
], ids=["cached", "recomputed", "learned", "sage"])
def test_onednn_and_torch_products_train_alike(config, monkeypatch):
    calls, tn_calls = [], []
    for name, seen in (("uses_onednn", calls), ("uses_onednn_tn", tn_calls)):
        real = getattr(dense, name)
        monkeypatch.setattr(dense, name, lambda a, b, backend="auto", real=real, seen=seen,
                            **kw: seen.append(real(a, b, backend, **kw)) or seen[-1])
    ours = _train("auto", **config)
    assert any(calls), "no product went through oneDNN"
    if dense.onednn_tn_available() and config.get("model") != "sage":
        assert any(tn_calls), "no dW = H^T dQ went through oneDNN"
    calls.clear()
    tn_calls.clear()
    theirs = _train("torch", **config)
    assert not any(calls) and not any(tn_calls), "gemm='torch' still called oneDNN"
    for a, b in zip(ours["history"], theirs["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        for split in ("train", "val", "test"):
            assert abs(a[f"{split}_acc"] - b[f"{split}_acc"]) <= 1 / 300  # a node at most
    for name, t in ours["state"].items():
        want = theirs["state"][name]
        # 5e-5: float rounding of the products, through three AdamW steps (lr 0.01), whose
        # normalised steps carry an entry's rounding of a near-zero gradient in full
        assert (t - want).abs().max() <= 5e-5 * max(want.abs().max().item(), 1.0), name
    opt_fused = {group.get("fused") for group in _optimizer_groups(ours["model"])}
    assert opt_fused == {True}


def _optimizer_groups(model):
    from plexus.config import OptimConfig
    from plexus.trainer import make_optimizer

    return make_optimizer(model, OptimConfig(optimizer="adamw")).param_groups


def test_the_gemm_option_is_checked():
    with pytest.raises(ValueError, match="unknown dense product backend 'blas'"):
        RunConfig(gemm="blas")


@pytest.mark.cross_shape
@pytest.mark.skipif(not dense.onednn_tn_available(), reason="this torch has no oneDNN")
def test_pooled_buffers_train_alike(monkeypatch):
    """``pool_buffers`` (on by default) reuses memory, not numbers: the same history as
    without it, and the pool really served requests."""
    served = []
    real = dense._Pool.take

    def take(self, rows, cols, whole=False):
        before = len(self.free)
        got = real(self, rows, cols, whole)
        served.append(len(self.free) < before)
        return got

    monkeypatch.setattr(dense._Pool, "take", take)
    pooled = _train("auto", dropout=0.5)  # the default
    assert dense._POOL.enabled and any(served), "the pool served no request"
    plain = _train("auto", dropout=0.5, pool_buffers=False)
    assert not dense._POOL.enabled and dense._POOL.free == []
    for a, b in zip(pooled["history"], plain["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


def test_pool_buffers_follows_retain_freed_memory_unless_given():
    from plexus.train import parse_args

    assert parse_args(["--dataset", "cora"]).pool_buffers is None
    assert parse_args(["--dataset", "cora", "--pool-buffers"]).pool_buffers is True
    assert parse_args(["--dataset", "cora", "--no-pool-buffers"]).pool_buffers is False
    assert RunConfig().pools_buffers and not RunConfig(retain_freed_memory=False).pools_buffers
    assert not RunConfig(pool_buffers=False).pools_buffers
    assert RunConfig(retain_freed_memory=False, pool_buffers=True).pools_buffers
