"""Layers that multiply by the weight before they aggregate, ``Q = A (F' W)``
(PlexusGCN(weight_first=...), docs/design/plexus-3d.md section 12), against aggregating first.

What must hold: the layers the model picks are the ones common.perf.gcn_workload.weight_first_pays
names (narrowing layers of one rank by default; with ``True`` every layer whose O and I have
one rank, P > 1 included, where the partial ``A^T dQ`` is summed over P by collectives (6) and
(8)); the logits, the loss and every gradient agree with the aggregate-first path to float
rounding (bf16: to the rounding of ``F'`` instead of ``H``); the same bytes move on every axis;
and the planner's SpMM bytes and kept memory follow the order.
"""

from __future__ import annotations

import pytest

from plexus.layout import layer_widths
from tests.distributed import run_ranks
from tests.plexus.data.shards import model_source, small_graph
from tests.plexus.test_model import rel
from tests.plexus.test_recompute import train_and_eval

HIDDEN, SEED, STEP = 12, 5, 2  # hidden 12 -> 5 classes: the last layer narrows

# (model, layers, precision, learn_features, residual, norm)
CASES = [("gcn", 3, "fp32", False, False, "none"), ("gcn", 3, "fp32", True, False, "none"),
         ("sage", 2, "fp32", True, False, "none"), ("gcn", 4, "fp32", False, True, "batch"),
         ("gcn", 3, "bf16", False, False, "none"), ("sage", 3, "bf16", False, False, "none")]

# which layers multiply first with weight_first=True, per grid (layer 0 with fixed features
# too: with dropout F' = dropout(F_0) is remade in backward, plexus.ops.RemadeInputMatmul)
FORCED = {"1x1x1": [True, True, True, True], "2x1x1": [False, False, True, False],
          "1x2x1": [False, True, False, False], "1x1x2": [True, False, False, True]}


def _runs(ctx, grids):
    """Per grid and case: one training pass and backward with weight_first True (and None on
    one rank) and False: the layers chosen, logits (training and evaluation), loss, full
    gradients and bytes by axis."""
    from common.grid import ProcessGrid
    from plexus.model import PlexusGCN

    graph = small_graph()
    out = []
    for grid_text in grids:
        grid = ProcessGrid.parse(grid_text)
        groups = ctx.create_groups(grid)
        options = (None, True, False) if grid.num_ranks == 1 else (True, False)
        for kind, num_layers, precision, learn, residual, norm in CASES:
            widths = layer_widths(graph.num_features, HIDDEN, num_layers, graph.num_classes)
            source = model_source(graph, kind)
            per = {}
            for option in options:
                shard = source.shard(grid.shape, grid.coords(ctx.rank), widths)
                model = PlexusGCN(shard, groups, model=kind, seed=SEED, dropout=0.5, bias=True,
                                  learn_features=learn, residual=residual, norm=norm,
                                  labelled_rows_only=False, precision=precision,
                                  weight_first=option)
                per[option] = {"layers": list(model.weight_first),
                               **train_and_eval(model, shard, groups, graph.num_classes, STEP),
                               # each root block (by identity) and whether its CSR was made
                               "made": {k: (id(b), b.made) for k, b in (shard.root or {}).items()}}
            out.append({"case": (grid_text, kind, num_layers, precision, learn, residual, norm),
                        "per": per})
    return out


def _assert_weight_first_equals_aggregate_first(results):
    for per_rank in zip(*results):
        for r in per_rank:
            grid_text, _, num_layers, precision, _, _, _ = r["case"]
            tag = f"case {r['case']}"
            per, off = r["per"], r["per"][False]
            assert off["layers"] == [False] * num_layers, tag
            # every case has dropout, so layer 0 of fixed features (remade) may multiply first
            assert per[True]["layers"] == FORCED[grid_text][:num_layers], tag
            if None in per:  # one rank: the narrowing last layer (hidden 12 -> 5 classes);
                # GraphSAGE also the hidden layers that do not widen (12 -> 12)
                hidden = [r["case"][1] == "sage"] * (num_layers - 2)
                assert per[None]["layers"] == [False, *hidden, True][-num_layers:], tag
            # bf16 rounds F' (weight first) instead of H: a few bf16 steps apart
            tol = 3e-2 if precision == "bf16" else 1e-5
            for option, on in per.items():
                if option is False:
                    continue
                assert rel(on["logits"], off["logits"]) < tol, tag
                assert rel(on["eval"], off["eval"]) < tol, tag
                assert abs(on["loss"] - off["loss"]) <= tol * abs(off["loss"]), tag
                assert on["bytes"] == off["bytes"], f"{tag} {option}: bytes moved differ"
            for option, on in per.items():  # S's CSR made only where an SpMM reads it
                made, kind, residual = on["made"], r["case"][1], r["case"][5]
                fixed = not r["case"][4]  # layer 0 of fixed features: S F_0 (H_0's R) an SpMM
                for k, (blk, was) in made.items():
                    readers = [m for m, (other, _) in made.items() if other == blk]
                    want = any((kind == "sage" and (on["layers"][m] or (m == 0 and fixed)))
                               or (residual and 1 <= m < num_layers - 1) for m in readers)
                    assert was == want, f"{tag} {option}: root block {k} made {was}"
                assert sorted(on["grads"]) == sorted(off["grads"]), tag
                for name, want in off["grads"].items():
                    got = on["grads"][name]
                    # (a bias before batch norm has a gradient of zero up to rounding)
                    assert rel(got, want) < 10 * tol or (got - want).norm() < 1e-6, \
                        f"{tag} {option}: grad of {name} ({rel(got, want)})"


@pytest.mark.cross_shape
@pytest.mark.parametrize("world, grids", [
    (1, ["1x1x1"]),
    # a layer with O = I = 1 and P = 2 in each (layer 2, 1 and 0); 203 nodes pad to 204
    pytest.param(2, ["2x1x1", "1x2x1", "1x1x2"], marks=pytest.mark.slow),
])
def test_weight_first_equals_aggregating_first(world, grids):
    _assert_weight_first_equals_aggregate_first(run_ranks(_runs, world, grids))


def _saved_bf16(ctx):
    """A one-rank 3-layer GraphSAGE in bf16 multiplying first in every layer: its layers,
    widths, and the bf16 blocks of all N rows that autograd saved (shape, address)."""
    import torch

    from common.grid import ProcessGrid
    from plexus.model import PlexusGCN

    graph = small_graph()
    grid = ProcessGrid.parse("1x1x1")
    groups = ctx.create_groups(grid)
    widths = layer_widths(graph.num_features, HIDDEN, 3, graph.num_classes)
    shard = model_source(graph, "sage").shard(grid.shape, grid.coords(ctx.rank), widths)
    model = PlexusGCN(shard, groups, model="sage", seed=SEED, dropout=0.5, bias=True,
                      labelled_rows_only=False, precision="bf16",
                      weight_first=True)
    saved: list[torch.Tensor] = []

    def pack(t):
        if t.dtype == torch.bfloat16 and t.dim() == 2 and t.shape[0] >= graph.num_nodes:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(step=STEP)
    return {"layers": list(model.weight_first), "widths": widths,
            "saved": [(tuple(t.shape), t.data_ptr()) for t in saved]}


def test_graphsages_two_products_keep_one_bf16_copy_of_f():
    """``F' W`` and ``F' W_r`` read the same F': in bf16 they keep one rounded copy of it for
    their dW, not one each (plexus.model PlexusGCN._kept_copy). Layer 0 of fixed features
    remakes F' in backward and keeps none; layers 1 and 2 keep one [N, 12] copy each."""
    import collections

    (got,) = run_ranks(_saved_bf16, 1)
    assert got["layers"] == [True, True, True]
    assert got["widths"][1] == got["widths"][2] == HIDDEN
    times = collections.Counter(ptr for shape, ptr in got["saved"] if shape[1] == HIDDEN)
    assert sorted(times.values()) == [2, 2], got["saved"]


def test_the_planner_runs_a_weight_first_layer_at_its_output_width():
    from common.perf.gcn import GCNWorkload, gcn_compute, gcn_memory_parts, weight_first_pays
    from common.perf.machine import load_profile

    one = {"x": 1, "y": 1, "z": 1}
    # the rule: O and I of one rank; by default P too, and the layer narrows
    assert weight_first_pays((1, 1, 1), 256, 47)
    assert not weight_first_pays((1, 1, 1), 100, 256)
    assert not weight_first_pays((1, 1, 2), 256, 47)
    assert weight_first_pays((1, 1, 2), 100, 256, option=True)
    assert not weight_first_pays((2, 1, 1), 256, 47, option=True)
    assert not weight_first_pays((1, 1, 1), 256, 47, fixed_first=True)
    # layer 0 of fixed features: only asked for, and only where F' can be remade (dropout)
    assert not weight_first_pays((1, 1, 1), 256, 47, fixed_first=True, remade=True)
    assert weight_first_pays((1, 1, 2), 256, 47, fixed_first=True, remade=True, option=True)
    assert not weight_first_pays((1, 1, 1), 256, 47, fixed_first=True, option=True)
    assert not weight_first_pays((1, 1, 1), 256, 47, rows_only=True)
    assert not weight_first_pays((1, 1, 1), 256, 47, option=False)
    # GraphSAGE keeps one F' instead of H and R: it multiplies first where the layer does
    # not widen, on one rank
    assert weight_first_pays((1, 1, 1), 64, 64, terms=2)
    assert not weight_first_pays((1, 1, 1), 64, 64)
    assert not weight_first_pays((1, 1, 1), 64, 80, terms=2)
    assert not weight_first_pays((1, 1, 2), 64, 64, terms=2)
    base = dict(num_nodes=100_000, nnz=2_000_000, num_features=100, num_classes=47,
                hidden=256, dropout=0.5)
    auto, off = GCNWorkload(**base), GCNWorkload(**base, weight_first=False)
    assert [auto.weight_first_layer(layer, one) for layer in range(3)] == [False, False, True]
    assert not any(off.weight_first_layer(layer, one) for layer in range(3))
    # few labelled rows: the last layer runs on them and aggregates first
    few = GCNWorkload(**base, labelled_fraction=0.01)
    assert not few.weight_first_layer(2, one)
    # papers100M's shape (128 -> 64, dropout): layer 0 remade only with weight_first=True,
    # then its SpMMs 64 wide once each way instead of 128 wide twice, and nothing kept
    # (16 classes: the last layer narrows and multiplies first either way; layer 1 keeps its
    # width, so only layer 0's SpMMs differ)
    paper = dict(num_nodes=100_000, nnz=2_000_000, num_features=128, num_classes=16,
                 hidden=64, dropout=0.5, cache_first_aggregation=False)
    remade, kept = GCNWorkload(**paper, weight_first=True), GCNWorkload(**paper)
    assert remade.weight_first_layer(0, one) and not kept.weight_first_layer(0, one)
    assert not GCNWorkload(**{**paper, "dropout": 0.0}, weight_first=True).weight_first_layer(
        0, one)  # H_0 cached: no SpMM to save
    machine = load_profile("local-cpu")
    spmm = {w: gcn_compute(w, one, machine, node_ranks=1)["spmm"] for w in (remade, kept)}
    # layer 0: 64 wide once each way instead of 128 wide twice (the backward's A^T, read from
    # A's own CSR, costs an output row written back per nonzero)
    assert spmm[remade] < 0.9 * spmm[kept]
    assert gcn_memory_parts(remade, one)["kept_h"] == gcn_memory_parts(kept, one)["kept_h"]
    spmm_auto = gcn_compute(auto, one, machine, node_ranks=1)["spmm"]
    spmm_off = gcn_compute(off, one, machine, node_ranks=1)["spmm"]
    assert spmm_auto < 0.8 * spmm_off  # the last layer's two SpMMs 47 wide instead of 256
    # one rank: F' [N, 256] kept instead of H [N, 256]: the same bytes
    assert gcn_memory_parts(auto, one)["kept_h"] == gcn_memory_parts(off, one)["kept_h"]


def test_the_planner_keeps_one_f_for_graphsages_two_products():
    """A weight-first GraphSAGE layer keeps one F' for both products' dW (bf16: one rounded
    copy, test_graphsages_two_products_keep_one_bf16_copy_of_f), and autograd frees dQ after
    both terms' SpMM backward, before the second product's: its backward holds the two
    dF' but not dQ beside them. In bf16 the float32 F' is held beside the copy until both
    products are made."""
    from common.perf.gcn_memory import F32, _layers, gcn_memory_phases
    from common.perf.gcn_workload import GCNWorkload

    one = {"x": 1, "y": 1, "z": 1}
    block = (1 << 20) * 64 * F32  # F', dQ, dG and each dF' alike here: 64 -> 64
    phases = {}
    for precision in ("fp32", "bf16"):
        work = GCNWorkload(num_nodes=1 << 20, nnz=16 << 20, num_features=64, num_classes=16,
                           num_layers=3, hidden=64, model="sage", precision=precision,
                           dropout=0.5, labelled_rows_only=False)
        lay = _layers(work, one)[1]
        assert lay["first"] and lay["kept_h"] == (1 << 20) * 64 * work.stored_bytes
        phases[precision] = p = gcn_memory_phases(work, one)
        assert p["backward 1 matmul"] == p["backward 1 dG"] + 2 * 64 * 64 * F32
    fp32, bf16 = phases["fp32"], phases["bf16"]
    assert bf16["forward 1 matmul"] - fp32["forward 1 matmul"] == block // 2
    assert bf16["forward 1 aggregate"] - fp32["forward 1 aggregate"] == block // 2
