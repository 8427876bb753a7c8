"""plexus.config: options a model would ignore are refused; GAT's heads default."""

import pytest

from plexus.config import (
    GAT_HEADS,
    ModelConfig,
    RunConfig,
    check_run_options,
    gcn_workload,
    split_config,
)


def test_heads_are_gats_only_and_default_for_it():
    assert ModelConfig(model="gat").heads == GAT_HEADS == 8
    assert ModelConfig(model="gat", heads=2).width == 2 * 128
    assert ModelConfig().heads is None and ModelConfig().width == 128
    for model in ("gcn", "sage"):
        with pytest.raises(ValueError, match=f"--heads is GAT's: model '{model}'"):
            ModelConfig(model=model, heads=GAT_HEADS)
    with pytest.raises(ValueError, match="heads >= 1"):
        ModelConfig(model="gat", heads=0)


def test_a_residual_needs_a_hidden_to_hidden_layer():
    for layers in (1, 2):
        with pytest.raises(ValueError, match=f"--layers {layers} has none"):
            ModelConfig(residual=True, num_layers=layers)
    for model in ("gcn", "sage", "gat"):
        assert ModelConfig(model=model, residual=True, num_layers=3).residual


def test_gat_refuses_the_layer_plan_and_kernels_it_does_not_run():
    with pytest.raises(ValueError, match=r"recompute_first=False \(--keep-first-aggregation\)"):
        ModelConfig(model="gat", recompute_first=False)
    assert not ModelConfig(model="gcn", recompute_first=False).recompute_first
    gat = ModelConfig(model="gat")
    with pytest.raises(ValueError, match="--gemm torch picks"):
        check_run_options(gat, RunConfig(gemm="torch"))
    with pytest.raises(ValueError, match="--spmm numba-rows"):
        check_run_options(gat, RunConfig(spmm="numba-rows"))
    # a residual's S_l F_l is an SpMM: there the kernel runs
    check_run_options(ModelConfig(model="gat", residual=True), RunConfig(spmm="torch"))
    check_run_options(ModelConfig(), RunConfig(spmm="torch", gemm="torch"))
    with pytest.raises(ValueError, match="--gemm torch"):
        split_config(model="gat", gemm="torch")


def test_the_workload_counts_one_head_for_the_models_without_them():
    from types import SimpleNamespace

    source = SimpleNamespace(name="g", split_counts={"train": 10}, num_nodes=100, nnz=500,
                             num_features=8, num_classes=3)
    assert gcn_workload(ModelConfig(), source).heads == 1
    assert gcn_workload(ModelConfig(model="gat"), source).heads == GAT_HEADS
