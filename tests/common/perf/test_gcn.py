"""The GCN epoch model: padding and volumes against plexus, the trainer's counted bytes, the
memory filter, and `plexus.train --grid auto`."""

import dataclasses

import pytest

from common.perf import gcn
from common.perf.machine import load_profile
from tests.common.perf.machines import tiny_gpu

SHAPES = [(1, 1, 1), (2, 2, 2), (1, 2, 4), (4, 1, 2), (3, 2, 5), (8, 1, 1), (1, 1, 8)]


def small(**kw):
    """The graph of tests/plexus/test_model.py: 203 nodes, 7 features,
    5 classes, hidden 6 (so most grids pad nodes and widths)."""
    return gcn.GCNWorkload(num_nodes=203, nnz=1200, num_features=7, num_classes=5, hidden=6,
                         **kw)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layers", [1, 3, 4])
def test_padding_equals_plexus_partition(shape, layers):
    from plexus import layout as part

    s = dict(zip("xyz", shape))
    work = small(num_layers=layers)
    n, widths = work.padded(s)
    assert n == part.padded_num_nodes(203, s)
    assert widths == part.padded_widths(work.widths, s)
    assert [gcn.roles(layer) for layer in range(6)] == [part.roles(layer) for layer in range(6)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layers", [3, 4])
def test_volumes_equal_the_reference_expected_bytes(shape, layers):
    """Trainable features, model collectives only: the per-(axis, op) sums that
    test_parallel_equals_serial checks against the trainer, summed per axis."""
    from common.perf.model import bytes_by_axis
    from tests.plexus.test_model import expected_bytes

    s = dict(zip("xyz", shape))
    work = small(num_layers=layers, learn_features=True)
    n, widths = work.padded(s)
    want: dict[str, int] = {}
    for key, b in expected_bytes(s, n, widths).items():
        want[key.split("/")[0]] = want.get(key.split("/")[0], 0) + b
    got = bytes_by_axis(gcn.gcn_collectives(work, s, loss=False), s)
    assert got == want


def test_fixed_features_skip_layer_zero_aggregation_after_the_first_epoch():
    s = {"x": 2, "y": 2, "z": 2}
    first = gcn.gcn_collectives(small(), s, first_epoch=True)
    steady = gcn.gcn_collectives(small(), s)
    learned = gcn.gcn_collectives(small(learn_features=True), s)
    assert len(first) - len(steady) == 2  # (1) and (2) at layer 0
    assert len(learned) - len(steady) == 5  # and backward (5), (7), (8) at layer 0
    assert gcn.gcn_collectives(small(learn_features=True), s, first_epoch=True) == learned
    no_cache = gcn.gcn_collectives(small(cache_first_aggregation=False), s)
    assert no_cache == first


def test_last_layer_on_labelled_rows():
    """R rows in the last layer when at most half the nodes are labelled (or when asked):
    fewer bytes, less time and less memory; 1.0 (old callers) and above half change nothing."""
    s = {"x": 2, "y": 1, "z": 4}  # last layer (3 layers): roles (y, z, x), P = x = 2
    machine = load_profile("local-cpu")
    for frac in (1.0, 0.6):
        assert small(labelled_fraction=frac).output_rows(s) == 204 // 2  # N pads to 204
        assert gcn.predict_gcn(small(labelled_fraction=frac), s, machine) == \
            gcn.predict_gcn(small(labelled_rows_only=False), s, machine)
    few = small(labelled_fraction=0.2)
    assert few.output_rows(s) == round(0.2 * 203 / 2) == 20
    assert small(labelled_fraction=0.6, labelled_rows_only=True).output_rows(s) == 61
    # logits as wide as papers100M's 172 classes, so that the last layer holds the peak (with
    # 40 classes a hidden layer's backward does, and the labelled rows' blocks only add)
    wide = {"num_nodes": 20000, "nnz": 200000, "num_features": 64, "num_classes": 172}
    on, off = (gcn.predict_gcn(gcn.GCNWorkload(**wide, labelled_fraction=0.2,
                                               labelled_rows_only=rows_only), s, machine)
               for rows_only in (None, False))
    assert on.memory < off.memory and sum(on.compute.values()) < sum(off.compute.values())
    assert on.comm_bytes["x"] == off.comm_bytes["x"]  # P: weights and dF, not the rows
    assert on.comm_bytes["z"] < off.comm_bytes["z"]  # I: Q of R rows
    with pytest.raises(ValueError, match="labelled_fraction"):
        small(labelled_fraction=1.5)


def test_papers100m_memory_counts_the_labelled_rows():
    """ogbn-papers100M labels 1.4% of its nodes: one rank's [N, 172] logits and last-layer H
    (111M rows) give way to 1.5M rows plus the gathered adjacency rows."""
    paper = gcn.ogbn_papers100m()
    assert paper.labelled_fraction == pytest.approx(0.0139, abs=1e-4)
    one = {"x": 1, "y": 1, "z": 1}
    assert paper.output_rows(one) == 1_546_782
    every = gcn.ogbn_papers100m(labelled_rows_only=False)
    part = {k: gcn.gcn_memory_parts(every, one)[k] - gcn.gcn_memory_parts(paper, one)[k]
            for k in ("adjacency", "kept_h", "kept_other")}
    n, rows = 111_059_956, 1_546_782
    assert part["kept_h"] == (n - rows) * 128 * 4  # H_2 [N, 128] kept for dW
    assert part["kept_other"] == (n - rows) * 172 * 4  # the logits [N, 172]
    gathered = 1_726_745_828 * rows / n * 8 + (rows + 1) * 4  # the rows (no transpose)
    assert part["adjacency"] == pytest.approx(-gathered, rel=1e-9)
    # every row: the loss on [N, 172] logits is the peak; the labelled rows move it to a
    # hidden layer's backward, about 115 GB lower
    peak = {w.labelled_rows_only: max(gcn.gcn_memory_phases(w, one).items(), key=lambda kv: kv[1])
            for w in (every, paper)}
    assert peak[False][0] == "loss" and peak[None][0].startswith("backward 1")
    assert gcn.gcn_memory(every, one) - gcn.gcn_memory(paper, one) > 100e9


def _trainer_bytes(ctx, cases):
    from common.grid import ProcessGrid
    from plexus.config import ModelConfig, RunConfig
    from plexus.data import InMemorySource
    from plexus.trainer import train_gcn
    from tests.plexus.data.shards import small_graph
    from tests.plexus.test_model import few_labels_graph

    graphs = {"small": InMemorySource(small_graph()), "few": InMemorySource(few_labels_graph())}
    out = []
    for grid, layers, learn, name, kind, norm in cases:
        model = ModelConfig(model=kind, norm=norm, num_layers=layers, hidden=6,
                            learn_features=learn, dropout=0.0,
                            bias=False)  # the paper's bare model, which common.perf models
        res = train_gcn(graphs[name], ProcessGrid.parse(grid), ctx.rank, model=model,
                        run=RunConfig(epochs=2), transport=ctx.transport)
        rows = res.model.labelled_rows
        # the content of the messages (common.perf counts no padding: CommRecord.padding)
        out.append(([{a: b - row["comm_padding_by_axis"].get(a, 0)
                      for a, b in row["comm_bytes_by_axis"].items()} for row in res.history],
                    None if rows is None else rows.numel()))
    return out


GRIDS = {4: ["2x2x1", "1x2x2", "4x1x1", "1x1x4"], 8: ["2x2x2", "1x2x4", "4x1x2", "8x1x1"]}


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_trainer_counted_bytes_equal_the_model(world):
    """plexus.trainer.train_gcn counts, per axis, exactly the model's volumes: epoch 1 and a
    steady epoch, fixed and trainable features, loss collectives included, every row of the
    last layer (small_graph: 90% labelled) or its labelled rows only (20% labelled: the
    model given each rank's own share R P / N); GraphSAGE and the two norms (their
    statistics and affine gradients) on two grids each."""
    from tests.distributed import run_ranks
    from tests.plexus.test_model import few_labels_graph

    cases = [(g, 3 + i % 2, i in (1, 2), "small", "gcn", "none")
             for i, g in enumerate(GRIDS[world])]
    cases += [(g, 3 + i % 2, i == 0, "few", "gcn", "none")
              for i, g in enumerate(GRIDS[world][:2])]
    cases += [(GRIDS[world][1], 3, False, "small", "sage", "batch"),
              (GRIDS[world][2], 3, False, "small", "gcn" if world == 4 else "sage", "layer")]
    results = run_ranks(_trainer_bytes, world, cases)
    few = few_labels_graph()
    labelled = sum(few.split_idx(s).numel() for s in ("train", "val", "test")) / 203
    for k, (grid, layers, learn, name, kind, norm) in enumerate(cases):
        s = dict(zip("xyz", map(int, grid.split("x"))))
        num_p = s[gcn.roles(layers - 1)[2]]
        for rank, per_rank in enumerate(results):
            counted, rows = per_rank[k]
            assert (rows is None) == (name == "small"), (grid, name)
            share = 1.0 if rows is None else rows * num_p / 203
            if rows is not None:
                assert abs(share - labelled) < 0.1, (grid, rank, rows)
            work = small(num_layers=layers, learn_features=learn, labelled_fraction=share,
                         model=kind, norm=norm)
            for epoch, first in ((0, True), (1, False)):
                want = gcn.predict_gcn(work, s, load_profile("local-cpu"), first_epoch=first)
                assert counted[epoch] == want.comm_bytes, (grid, layers, learn, name, epoch,
                                                           rank)


def test_memory_filter_and_no_fitting_grid():
    tiny = tiny_gpu(25e6)
    work = gcn.GCNWorkload(num_nodes=20000, nnz=200000, num_features=64, num_classes=8)
    one = gcn.plan_gcn(work, 1, tiny)
    assert not one.runnable
    with pytest.raises(ValueError, match="no grid of 1 ranks fits"):
        _ = one.best
    eight = gcn.plan_gcn(work, 8, tiny)
    assert eight.runnable and not all(p.fits for p in eight.predictions)
    assert gcn.gcn_memory(work, {"x": 2, "y": 2, "z": 2}) < gcn.gcn_memory(work, {"x": 1, "y": 1,
                                                                              "z": 1}) / 3


@pytest.mark.slow
def test_plexus_train_grid_auto_logs_choice_and_runner_up(tmp_path):
    import json

    from tests.distributed import run_module

    metrics = tmp_path / "m.jsonl"
    r = run_module("plexus.train", ["--grid", "auto:perlmutter-a100", "--epochs", "1",
                                    "--hidden", "16", "--metrics", str(metrics)], ranks=4,
                   timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("grid auto:"))
    assert "runner-up" in line and "[profile perlmutter-a100]" in line
    chosen = line.split()[2]
    summary = json.loads(metrics.read_text().splitlines()[-1])["summary"]
    assert summary["grid"] == chosen


def test_index_width_is_the_largest_blocks_and_transposes_are_counted_where_stored():
    """int32 indices wherever a rank's largest block has fewer than 2^31 nonzeros (plexus
    picks the width block by block); the CPU's backward reads each block as its own transpose
    (plexus.transpose), a GPU's multiplies a stored one: the adjacency's nonzeros twice, and
    the backward SpMM's bytes follow."""
    from common.perf.gcn import backward_spmm_bytes, spmm_bytes, spmm_t_bytes
    from common.perf.gcn_memory import _adjacency
    from common.perf.machine import load_profile
    from common.perf.sar import sar_workload

    work = sar_workload()  # 3.34e9 nonzeros: above 2^31 on one rank
    assert work.index_width() == 8 and work.index_width({"x": 1, "y": 1, "z": 1}) == 8
    assert work.index_width({"x": 2, "y": 1, "z": 1}) == 8  # layer 1 cuts A over y and z only
    assert work.index_width({"x": 2, "y": 2, "z": 2}) == 4
    assert dataclasses.replace(work, index_bytes=8).index_width({"x": 8, "y": 8, "z": 4}) == 8
    shape = {"x": 2, "y": 2, "z": 2}
    every = dataclasses.replace(work, labelled_rows_only=False)  # (no labelled-row blocks)
    (cpu, _), (gpu, _) = _adjacency(every, shape, False), _adjacency(every, shape, True)
    nnz = work.nnz / 4  # per layout (the root blocks exchange their rows: no CSR of S)
    # layers 0 and 2 share nothing on 2x2x2 (other axes): three blocks, each stored twice
    # on a GPU with its transposed row pointers, and no cursor there
    n = work.padded(shape)[0]
    assert gpu - cpu == pytest.approx(3 * (nnz * 8 + (n // 2 + 1) * 4) - n // 2 * 4, rel=1e-9)
    a100, icelake = load_profile("perlmutter-a100"), load_profile("icelake-hdr200")
    args = (1000, 800, 5000.0, 64)
    kw = {"index_bytes": 4, "cache_line": 64}
    assert backward_spmm_bytes(a100, *args, **kw) == spmm_bytes(800, 5000.0, 64, **kw)
    assert backward_spmm_bytes(icelake, *args, **kw) == spmm_t_bytes(*args, **kw)
    assert spmm_t_bytes(*args, **kw) > spmm_bytes(800, 5000.0, 64, **kw)  # a row written back


def test_layer_0_blocks_count_until_h0_is_cached():
    """With the cached H_0 the trainer drops layer 0's blocks where no other layer reads them
    (plexus.model.PlexusGCN.release_first_blocks): the planner counts them in the first
    layer's forward phase, not in the adjacency kept for the run; where another layer's
    blocks are cut alike (one rank, 3 layers: layers 0 and 2), or with dropout (no cache),
    they stay."""
    from common.perf.gcn_memory import _adjacency
    from common.perf.sar import sar_workload

    work = sar_workload()  # GraphSAGE, 3 layers, fixed features, no dropout
    shape = {"x": 8, "y": 8, "z": 4}
    total, released = _adjacency(work, shape, False)
    assert 0 < released < total / 2
    parts = gcn.gcn_memory_parts(work, shape)
    assert parts["adjacency"] == pytest.approx(total - released, rel=1e-12)
    phases = gcn.gcn_memory_phases(work, shape)
    kept = parts["kept_h"] + parts["kept_other"]
    assert parts["transient"] == pytest.approx(max(
        max(phases.values()), phases["forward 0 aggregate"] + released) - kept, rel=1e-12)
    assert _adjacency(work, {"x": 1, "y": 1, "z": 1}, False)[1] == 0  # layer 2 reads them
    assert _adjacency(dataclasses.replace(work, dropout=0.5), shape, False)[1] == 0
    assert _adjacency(dataclasses.replace(work, learn_features=True), shape, False)[1] == 0


def test_a_mapped_last_layer_on_labelled_rows_counts_its_full_block_out():
    """A prepared dataset's last-layer block that no step reads gives its pages back
    (plexus.data.shard.GraphShard.restrict_last_layer): the planner leaves out its nonzeros,
    its row pointers and its plan, and keeps the root block and the labelled rows' copy; an
    in-memory graph, all rows, a GPU (stored transposes), one rank (layers 0 and 2 share the
    block) or seven layers (layer 6 reads layout 0) keep it."""
    from common.perf.gcn_memory import CUT_BYTES, _adjacency, _parked_key, _plan_bytes
    from common.perf.sar import sar_workload

    work = sar_workload()  # GraphSAGE, 1.4% labelled: the last layer on the labelled rows
    shape = {"x": 8, "y": 8, "z": 4}
    resident = dataclasses.replace(work, mapped=False)
    assert _parked_key(work, shape) == (0, "x", "y")  # layer 2: rows over x, columns over y
    n, w = work.padded(shape)
    rows, cols, nnz = n // 8, n // 8, work.nnz / 64
    block = nnz * (4 + 4) + (rows + 1) * 4 + _plan_bytes(rows, cols, nnz, w[2] // 4 * 4,
                                                         CUT_BYTES)
    assert _adjacency(resident, shape, False)[0] - _adjacency(work, shape, False)[0] == \
        pytest.approx(block, rel=1e-12)
    for kept, where in ((dataclasses.replace(work, labelled_rows_only=False), shape),
                        (work, {"x": 1, "y": 1, "z": 1}),
                        (dataclasses.replace(work, num_layers=7), shape)):
        assert _parked_key(kept, where) is None
    assert _adjacency(work, shape, True) == _adjacency(resident, shape, True)


def test_a_gpu_in_bf16_holds_and_rounds_a_copy_of_each_later_spmm_operand():
    """On a GPU in bf16 a later layer's float32 F' is rounded into a bf16 copy the SpMM reads
    (plexus.ops.read_in): the forward aggregation holds it beside F' (rows x width x 2 bytes),
    the SpMM gathers half the bytes, and the rounding pass is charged; float32 and the CPU
    are as before."""
    from common.perf.gcn_memory import gcn_memory_phases

    shape = {"x": 1, "y": 1, "z": 1}
    for precision in ("fp32", "bf16"):
        work = gcn.GCNWorkload(num_nodes=20000, nnz=200000, num_features=64, num_classes=8,
                               hidden=128, precision=precision)
        cpu, gpu = (gcn_memory_phases(work, shape, rounds_x=r) for r in (False, True))
        grown = {k: gpu[k] - cpu[k] for k in cpu if gpu[k] != cpu[k]}
        if precision == "fp32":
            assert not grown
        else:  # layer 1: F_1 [20000, 128] copied to bf16; layer 2 multiplies first: its
            # G = F_2 W [20000, 8]; layer 0 reads F_0, stored in bf16
            assert grown == {"forward 1 aggregate": 20000 * 128 * 2,
                             "forward 2 aggregate": 20000 * 8 * 2}, grown
    # the SpMMs' time: bf16 saves more of it on a GPU (every layer's gathers halved) than on
    # the CPU (layer 0's)
    saved = {}
    for machine in (load_profile("local-cpu"), tiny_gpu(80e9)):
        spmm = [gcn.gcn_compute(gcn.GCNWorkload(num_nodes=20000, nnz=200000, num_features=64,
                                                num_classes=8, hidden=128, precision=p),
                                shape, machine, node_ranks=1)["spmm"] for p in ("fp32", "bf16")]
        saved[machine.device_memory is not None] = spmm[1] / spmm[0]
    assert saved[True] < saved[False] <= 1.0, saved  # (the CPU: H_0 cached, no layer-0 SpMM)
