"""The GCN epoch model: padding and volumes against plexus, the trainer's counted bytes, the
memory filter, and `plexus.train --grid auto`."""

import pytest

from common.perf import gcn
from common.perf.machine import Compute, Link, MachineProfile, load_profile

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


def _trainer_bytes(ctx, cases):
    from common.grid import ProcessGrid
    from plexus.config import ModelConfig, RunConfig
    from plexus.data import InMemorySource
    from plexus.trainer import train_gcn
    from tests.plexus.data.shards import small_graph

    graph = InMemorySource(small_graph())
    out = []
    for grid, layers, learn in cases:
        model = ModelConfig(num_layers=layers, hidden=6, learn_features=learn, dropout=0.0,
                            bias=False)  # the paper's bare model, which common.perf models
        res = train_gcn(graph, ProcessGrid.parse(grid), ctx.rank, model=model,
                        run=RunConfig(epochs=2), transport=ctx.transport)
        out.append([row["comm_bytes_by_axis"] for row in res.history])
    return out


GRIDS = {4: ["2x2x1", "1x2x2", "4x1x1", "1x1x4"], 8: ["2x2x2", "1x2x4", "4x1x2", "8x1x1"]}


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_trainer_counted_bytes_equal_the_model(world):
    """plexus.trainer.train_gcn counts, per axis, exactly the model's volumes: epoch 1 and a
    steady epoch, fixed and trainable features, loss collectives included."""
    from tests.distributed import run_ranks

    cases = [(g, 3 + i % 2, i in (1, 2)) for i, g in enumerate(GRIDS[world])]
    results = run_ranks(_trainer_bytes, world, cases)
    for k, (grid, layers, learn) in enumerate(cases):
        s = dict(zip("xyz", map(int, grid.split("x"))))
        work = small(num_layers=layers, learn_features=learn)
        for epoch, first in ((0, True), (1, False)):
            want = gcn.predict_gcn(work, s, load_profile("local-cpu"), first_epoch=first)
            for rank, per_rank in enumerate(results):
                assert per_rank[k][epoch] == want.comm_bytes, (grid, layers, learn, epoch, rank)


def test_memory_filter_and_no_fitting_grid():
    tiny = MachineProfile(name="tiny", node_memory=1e12, device_memory=35e6,
                          intra=Link(alpha_s=0, bandwidth=1e9), inter=Link(alpha_s=0,
                                                                           bandwidth=1e9),
                          compute=(Compute(spmm_bandwidth=1e9, gemm_flops=1e9,
                                           memory_bandwidth=1e9),))
    work = gcn.GCNWorkload(num_nodes=20000, nnz=200000, num_features=64, num_classes=8)
    one = gcn.plan_gcn(work, 1, tiny)
    assert not one.runnable
    with pytest.raises(ValueError, match="no grid of 1 ranks fits"):
        _ = one.best
    eight = gcn.plan_gcn(work, 8, tiny)
    assert eight.runnable and not all(p.fits for p in eight.predictions)
    assert gcn.gcn_memory(work, {"x": 2, "y": 2, "z": 2}) < gcn.gcn_memory(work, {"x": 1, "y": 1,
                                                                              "z": 1}) / 4


@pytest.mark.slow
def test_plexus_train_grid_auto_logs_choice_and_runner_up(tmp_path):
    import json

    from tests.distributed import launch

    metrics = tmp_path / "m.jsonl"
    r = launch(["-m", "plexus.train", "--grid", "auto:perlmutter-a100", "--epochs", "1",
                "--hidden", "16", "--metrics", str(metrics)], ranks=4, launcher="mpiexec",
               timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("grid auto:"))
    assert "runner-up" in line and "[profile perlmutter-a100]" in line
    chosen = line.split()[2]
    summary = json.loads(metrics.read_text().splitlines()[-1])["summary"]
    assert summary["grid"] == chosen
