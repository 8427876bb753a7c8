"""common.perf.gat, the GAT epoch's model: the planner ranks only grids whose inner axes split
the heads, picks one of them, shows GAT's costs growing with the heads and the edges, and its
memory per rank falling with the ranks; the command line takes ``--model gat``. (Its bytes per
axis equal a run's: tests/plexus/test_gat_model.py.)"""

import dataclasses

import pytest

from common.grid import ProcessGrid
from common.perf import GCNWorkload, auto_grid, load_profile, plan
from common.perf.cli import main
from common.perf.gat import gat_memory, gat_memory_parts
from common.perf.gcn import predict_gcn
from common.perf.gcn_workload import ogbn_products

GAT = GCNWorkload(model="gat", num_nodes=1_000_000, nnz=9_000_000, num_features=128,
                  num_classes=172, hidden=64, heads=8, attention_dropout=0.5, dropout=0.5)


def test_only_grids_whose_inner_axes_split_the_heads_run():
    work = dataclasses.replace(GAT, heads=2)
    ranked = plan(work, 8, machine="local-cpu")
    for pred in ranked.predictions:
        shape = pred.shape
        splits = all(2 % shape[ax] == 0 for ax in ("y", "x", "z"))  # layers 0, 1, 2's I
        assert (not work.grid_problems(shape)) == splits, shape
        assert pred.runnable <= splits, shape  # (a grid may also not fit in memory)
    grid, _ = auto_grid(work, 8, machine="local-cpu")
    assert not work.grid_problems(dict(grid.shape))
    with pytest.raises(ValueError, match=r"heads: 2 % x=4 = 2"):
        ProcessGrid.plexus(4, 2, 1).check(8, work.grid_problems)


def test_the_costs_grow_with_the_heads_and_the_edges():
    cpu = load_profile("local-cpu")
    shape = {"x": 2, "y": 2, "z": 2}
    base = predict_gcn(GAT, shape, cpu)
    wide = predict_gcn(dataclasses.replace(GAT, hidden=128, heads=16), shape, cpu)
    dense = predict_gcn(dataclasses.replace(GAT, nnz=4 * GAT.nnz), shape, cpu)
    assert wide.compute["spmm"] > base.compute["spmm"] and wide.memory > base.memory
    assert sum(wide.comm_bytes.values()) > sum(base.comm_bytes.values())
    assert dense.compute["spmm"] > 3 * base.compute["spmm"] and dense.memory > base.memory
    assert dense.comm_bytes == base.comm_bytes  # nothing of the edges' size is sent


def test_memory_per_rank_falls_with_the_ranks():
    one = gat_memory(GAT, {"x": 1, "y": 1, "z": 1})
    eight = gat_memory(GAT, {"x": 2, "y": 2, "z": 2})
    assert eight <= 0.5 * one
    parts = gat_memory_parts(GAT, {"x": 1, "y": 1, "z": 1})
    assert min(parts.values()) >= 0 and sum(parts.values()) == pytest.approx(one)
    # without attention dropout there is no keep-mask to keep or hash
    assert gat_memory(dataclasses.replace(GAT, attention_dropout=0.0), {"x": 1, "y": 1,
                                                                         "z": 1}) < one


def test_a_gat_workload_refuses_what_gat_does_not_run():
    for bad in ({"learn_features": True}, {"precision": "bf16"}, {"hidden": 60}):
        with pytest.raises(ValueError, match="gat runs fp32"):
            dataclasses.replace(GAT, **bad)
    # the options that change how a GCN layer runs are off for GAT, whatever was asked
    work = ogbn_products(model="gat", hidden=64, heads=8, labelled_rows_only=True,
                         overlap=True)
    assert work.labelled_rows_only is False and work.overlap is False
    shape = {"x": 2, "y": 1, "z": 1}  # the last layer's P is x
    assert work.output_rows(shape) == work.padded(shape)[0] // 2


def test_the_command_plans_a_gat(capsys):
    assert main(["gcn", "--dataset", "ogbn-products", "--model", "gat", "--hidden", "16",
                 "--heads", "4", "--ranks", "8"]) == 0
    out = capsys.readouterr().out
    # --hidden is one head's width, as plexus.train's: 4 heads of 16 are 64 wide
    assert "GAT ogbn-products" in out and "hidden=64" in out
    table = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(table) == 10  # every factorization of 8 into 3, ranked
