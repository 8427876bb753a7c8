"""The engine-independent performance model: pure arithmetic, profiles, planning CLI."""

import json
import math
import subprocess
import sys

import pytest

from common.perf import machine as M
from common.perf.calibrate import fit_alpha_beta
from common.perf.model import Collective, bytes_by_axis, factorizations, spearman


def simple_machine(**kw):
    """Two links and rates with round numbers; 4 ranks per node, 2 NICs."""
    base = dict(name="toy", ranks_per_node=4, node_memory=64e9, device_memory=1e9,
                intra=M.Link(alpha_s=1e-6, bandwidth=100e9),
                inter=M.Link(alpha_s=5e-6, bandwidth=10e9), nics_per_node=2,
                compute=(M.Compute(spmm_bandwidth=1e12, gemm_flops=1e13,
                                   memory_bandwidth=1e12),))
    return M.MachineProfile(**{**base, **kw})


def test_perf_modules_do_not_import_torch():
    code = ("import sys, common.perf, common.perf.machine, common.perf.model, common.perf.gcn, "
            "common.perf.gpt, common.perf.paper, common.plan; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("n, axes, count", [(1, 3, 1), (8, 3, 10), (64, 3, 28), (12, 3, 18),
                                            (6, 4, 16), (64, 4, 84), (7, 3, 3)])
def test_factorizations_are_every_ordered_product(n, axes, count):
    out = factorizations(n, axes)
    assert len(out) == count == len(set(out))
    assert all(len(f) == axes and math.prod(f) == n for f in out)


def test_factorizations_refuse_nonsense():
    with pytest.raises(ValueError, match="n >= 1"):
        factorizations(0, 3)


def test_ring_formulas():
    m = simple_machine()
    mb = 8e6
    # a group of 4 with stride 1 lies inside a node of 4: intra link
    t = m.collective_time("all_reduce", mb, 4, stride=1, node_ranks=4)
    assert t == pytest.approx(2 * 3 * 1e-6 + 2 * 3 / 4 * mb / 100e9)
    t = m.collective_time("all_gather", mb, 4, stride=1, node_ranks=4)
    assert t == pytest.approx(3 * 1e-6 + 3 / 4 * mb / 100e9)
    assert m.collective_time("reduce_scatter", mb, 1, node_ranks=4) == 0.0


def test_placement_shares_nics_among_the_node_ranks():
    m = simple_machine()
    assert M.within_node(2, 2, 4) and not M.within_node(2, 4, 4) and not M.within_node(8, 1, 4)
    alpha, beta, kind = m.link_for("all_reduce", 2, 4, node_ranks=4)  # stride 4: crosses nodes
    assert kind == "inter" and alpha == 5e-6
    assert beta == pytest.approx(2 * 10e9 / 4)  # 2 NICs shared by the 4 ranks of a node
    assert m.link_for("all_reduce", 3, 1, node_ranks=4)[2] == "inter"  # 3 does not divide 4


def test_measured_fit_overrides_the_link_model():
    fit = M.CollectiveFit(op="all_gather", ranks_per_node=4, group_size=2, alpha_s=1e-3,
                          bandwidth=1e8)
    m = simple_machine(collectives=(fit,))
    assert m.link_for("all_gather", 2, 1, node_ranks=4) == (1e-3, 1e8, "measured")
    assert m.link_for("all_reduce", 2, 1, node_ranks=4)[2] == "intra"
    assert m.collective_time("all_gather", 1e6, 2, node_ranks=4) == pytest.approx(
        1e-3 + 0.5 * 1e6 / 1e8)


def test_compute_rates_by_ranks_on_the_node():
    rates = tuple(M.Compute(ranks_per_node=k, spmm_bandwidth=8e9 / k, gemm_flops=1e10,
                            memory_bandwidth=1e10) for k in (2, 4))
    m = simple_machine(ranks_per_node=None, device_memory=None, compute=rates)
    assert m.compute_at(4).spmm_bandwidth == 2e9
    assert m.compute_at(8).spmm_bandwidth == pytest.approx(1e9)  # 4 measured, 8 share: half
    assert m.memory_per_rank(8) == 64e9 / 8  # host memory split among the ranks of the node


def test_profile_validation():
    with pytest.raises(ValueError, match="bandwidth > 0"):
        M.Link(alpha_s=0.0, bandwidth=0.0)
    with pytest.raises(ValueError, match="group_size"):
        M.CollectiveFit(op="all_reduce", ranks_per_node=2, group_size=4, alpha_s=0,
                        bandwidth=1.0)
    with pytest.raises(ValueError, match="unknown collective"):
        Collective("x", "broadcast", 4)


@pytest.mark.parametrize("name", M.available_profiles())
def test_shipped_profiles_load_and_round_trip(name, tmp_path):
    m = M.load_profile(name)
    assert m.name == name and m.sources and m.compute
    m.save(tmp_path / "p.json")
    assert M.load_profile(tmp_path / "p.json") == m


def test_shipped_profiles_include_the_presets_and_a_measured_one():
    assert {"perlmutter-a100", "frontier-mi250x", "local-cpu"} <= set(M.available_profiles())
    local = M.load_profile("local-cpu")
    measured = {(c.ranks_per_node, c.group_size) for c in local.collectives}
    assert {(4, 2), (4, 4), (8, 2), (8, 4), (8, 8)} <= measured  # G = 4 and 8, every group


def test_load_profile_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="perlmutter-a100"):
        M.load_profile("no-such-machine")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="malformed"):
        M.load_profile(bad)
    monkeypatch.setenv(M.ENV_PROFILE, "frontier-mi250x")
    assert M.load_profile().name == "frontier-mi250x"


def test_bytes_by_axis_uses_ring_bytes():
    shape = {"data": 2, "depth": 3, "row": 1}
    colls = [Collective("data", "all_reduce", 100, count=3),
             Collective("depth", "all_gather", 7), Collective("row", "all_reduce", 8),
             Collective("data+depth", "all_reduce", 12)]
    assert bytes_by_axis(colls, shape) == {"data": 300, "depth": 4, "data+depth": 20}


def test_spearman_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    a = [1.0, 2.0, 2.0, 5.0, 3.0, 9.0]
    b = [2.0, 1.0, 4.0, 4.0, 3.0, 8.0]
    assert spearman(a, b) == pytest.approx(stats.spearmanr(a, b).statistic)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_fit_alpha_beta_recovers_exact_parameters():
    alpha, beta, steps = 2e-4, 3e8, 6
    samples = [(x, steps * alpha + x / beta) for x in (1e3, 1e5, 1e6, 8e6)]
    a, b = fit_alpha_beta(steps, samples)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


def test_plan_cli_prints_a_ranked_table(capsys):
    from common.plan import main

    assert main(["gcn", "--nodes", "1000", "--nnz", "20000", "--features", "16",
                 "--classes", "4", "--ranks", "8", "--machine", "perlmutter-a100"]) == 0
    out = capsys.readouterr().out
    assert "comm x" in out and "GiB/rank" in out and "runner-up" in out
    assert len([ln for ln in out.splitlines() if " yes" in ln]) == 10  # every grid of 8 fits
    assert main(["gcn", "--ranks", "4"]) == 2
    assert "--nodes" in capsys.readouterr().err
