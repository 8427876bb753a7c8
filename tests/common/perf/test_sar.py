"""common.perf.sar and the icelake-hdr200 profile: SAR's CPU-cluster runs beside our planner's
predictions, and bench/paper_check.py's SAR table read back against the model."""

import dataclasses
import re
import subprocess
import sys

import pytest

from common.perf.gcn import gcn_collectives, gcn_memory, plan_gcn
from common.perf.gcn_memory import CUT_BYTES
from common.perf.machine import load_profile
from common.perf.sar import PAPERS_SYMMETRIC_NNZ, PROFILE, SAR_NUMBERS, compare_sar, sar_workload
from tests.distributed import ROOT


def test_the_profile_names_a_source_for_every_number():
    m = load_profile(PROFILE)
    text = " ".join(m.sources)
    for name in ("memory_bandwidth", "spmm_bandwidth", "gemm_flops", "node_memory",
                 "inter.bandwidth", "inter.alpha_s", "intra.bandwidth", "collective_call_s",
                 "ranks_per_node", "cores_per_node"):
        assert name in text, name
    assert m.ranks_per_node == 2 and m.cores_per_node == 72 and m.device_memory is None
    assert "fitted" in m.description  # says nothing is fitted


def test_the_workload_is_sars_setting():
    w = sar_workload()
    assert (w.model, w.norm, w.hidden, w.num_layers) == ("sage", "batch", 256, 3)
    assert w.nnz == PAPERS_SYMMETRIC_NNZ and not w.learn_features
    assert w.labelled_fraction == pytest.approx(0.0139, abs=1e-4)


def test_rows_are_the_planners_best_grid_and_the_ratios_follow():
    m = load_profile(PROFILE)
    rows = compare_sar(m)
    assert [r.number.nodes for r in rows] == [32, 64, 128] == [n.nodes for n in SAR_NUMBERS]
    for r in rows:
        best = plan_gcn(sar_workload(), 2 * r.number.nodes, m).best
        assert r.prediction.shape == best.shape and r.epoch_s == best.total_s
        assert r.memory_gb_per_node == pytest.approx(2 * best.memory / 1e9)
        assert r.time_ratio == pytest.approx(r.epoch_s / r.number.epoch_s)
        assert r.memory_ratio == pytest.approx(r.memory_gb_per_node / r.number.peak_gb)
    # more nodes: faster and smaller per node, as SAR measured
    assert rows[0].epoch_s > rows[1].epoch_s > rows[2].epoch_s
    assert rows[0].memory_gb_per_node > rows[1].memory_gb_per_node > rows[2].memory_gb_per_node


def test_batch_norm_costs_collectives_memory_and_time():
    plain = dataclasses.replace(sar_workload(), norm="none")
    shape = {"x": 4, "y": 4, "z": 4}
    extra = len(gcn_collectives(sar_workload(), shape)) - len(gcn_collectives(plain, shape))
    # per hidden layer two entries: the two statistics forward (count 2), both gradient sums
    # in one call of twice the bytes backward (plexus.norms)
    assert extra == 4
    assert gcn_memory(sar_workload(), shape) > gcn_memory(plain, shape)
    with pytest.raises(ValueError, match="norm"):
        dataclasses.replace(plain, norm="group")


@pytest.mark.slow
def test_paper_check_prints_the_sar_rows_the_model_gives():
    out = subprocess.run([sys.executable, "bench/paper_check.py"], cwd=ROOT, text=True,
                         capture_output=True).stdout
    sections = out.split("--precision ")[1:]
    assert [t.split()[0] for t in sections] == ["fp32", "bf16"], out
    for precision, text in zip(("fp32", "bf16"), sections, strict=True):
        best, _, capped = text.partition("the fastest grid within SAR's memory per node:")
        _check_sar_table(best, {r.number.nodes: r for r in compare_sar(precision=precision)})
        within = compare_sar(precision=precision, within_sar_memory=True)
        if capped:  # printed where it differs from the fastest grids: each within SAR's memory
            _check_sar_table(capped, {r.number.nodes: r for r in within})
            assert all(r.memory_ratio <= 1.0 for r in within), precision
        else:
            assert [r.prediction.shape for r in within] == [
                r.prediction.shape for r in compare_sar(precision=precision)]


def _check_sar_table(out: str, rows: dict) -> None:
    printed = re.findall(r"^\s*(\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)"
                         r"\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s*$", out, re.M)
    assert [int(p[0]) for p in printed] == [32, 64, 128], out
    for nodes, ranks, grid, ours_s, gb, sar_s, sar_gb, t_ratio, m_ratio in printed:
        r = rows[int(nodes)]
        assert int(ranks) == 2 * int(nodes) and grid == r.prediction.label()
        assert float(ours_s) == pytest.approx(r.epoch_s, abs=0.006)
        assert float(gb) == pytest.approx(r.memory_gb_per_node, abs=0.06)
        assert (float(sar_s), float(sar_gb)) == (r.number.epoch_s, r.number.peak_gb)
        assert float(t_ratio) == pytest.approx(r.time_ratio, abs=0.006)
        assert float(m_ratio) == pytest.approx(r.memory_ratio, abs=0.006)


def test_the_savings_table_ends_at_the_prediction_and_each_saving_cuts():
    """What each saving contributes: the last column is the prediction's memory per node, and
    each earlier way takes more (int64 indices, then the stored transposes, by exactly the
    adjacency's difference; then the batch norm as torch operations, by its transients; then
    the plans' cuts in the index width, the last layer's full block resident, the CSR of
    GraphSAGE's ``S`` in every layout, by the adjacency's; and a bf16 ``H`` widened whole for
    ``dW``, by the transients)."""
    from common.perf.gcn_memory import gcn_memory_parts
    from common.perf.sar import savings_table

    widened = []  # what widening in row blocks saves, per row
    for precision in ("fp32", "bf16"):
        rows = compare_sar(precision=precision)
        lines = savings_table(rows).splitlines()[1:]
        for c, line in zip(rows, lines, strict=True):
            nodes, grid, *gb = line.split()
            assert (int(nodes), grid) == (c.number.nodes, c.prediction.label())
            old, mid, unfused, fused, cuts, parked, compact, now = map(float, gb)
            assert now == pytest.approx(c.memory_gb_per_node, abs=0.06)
            # (the fused norm cuts the peak where a norm phase is the peak; float32 widens
            # nothing)
            assert old > mid > unfused >= fused > cuts > parked > compact >= now
            assert compact == now or precision == "bf16"
            widened.append(compact - now)
            shape = c.prediction.shape
            before = dataclasses.replace(c.workload, mapped=False)

            def parts(work=before, shape=shape, **kw):  # as before the savings of the table
                return gcn_memory_parts(work, shape, **{"cut_bytes": None, "compact_root": False,
                                                        "widen_bytes": None, **kw})

            def gb_of(a, b, part):  # GB a node (two ranks) that ``part`` differs by
                return (a[part] - b[part]) * 2 / 1e9

            adj = parts(stored_transposes=True)
            assert mid - unfused == pytest.approx(gb_of(adj, parts(), "adjacency"), abs=0.11)
            assert unfused - fused == pytest.approx(
                gb_of(parts(fused_norm=False), parts(), "transient"), abs=0.11)
            # the cuts, the parked block and the compact S: adjacency alone
            offsets = parts(cut_bytes=CUT_BYTES)
            assert fused - cuts == pytest.approx(gb_of(parts(), offsets, "adjacency"), abs=0.11)
            resident = parts(c.workload, cut_bytes=CUT_BYTES)
            assert cuts - parked == pytest.approx(gb_of(offsets, resident, "adjacency"),
                                                  abs=0.11)
            compact_s = parts(c.workload, cut_bytes=CUT_BYTES, compact_root=True)
            assert parked - compact == pytest.approx(
                gb_of(resident, compact_s, "adjacency"), abs=0.11)
            assert compact - now == pytest.approx(gb_of(compact_s, gcn_memory_parts(
                c.workload, shape), "transient"), abs=0.11)
    assert max(widened) > 1.0  # bf16 at 128 nodes, where backward's dW was the peak
