"""Machine profiles: ring formulas, placement, measured fits, compute rates, loading."""

import json

import pytest

from common.perf import machine
from common.perf.model import Collective


def simple_machine(**kw):
    """Two links and rates with round numbers; 4 ranks per node, 2 NICs."""
    base = dict(name="toy", ranks_per_node=4, node_memory=64e9, device_memory=1e9,
                intra=machine.Link(alpha_s=1e-6, bandwidth=100e9),
                inter=machine.Link(alpha_s=5e-6, bandwidth=10e9), nics_per_node=2,
                compute=(machine.Compute(spmm_bandwidth=1e12, gemm_flops=1e13,
                                   memory_bandwidth=1e12),))
    return machine.MachineProfile(**{**base, **kw})


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
    assert machine.within_node(2, 2, 4)
    assert not machine.within_node(2, 4, 4) and not machine.within_node(8, 1, 4)
    alpha, beta, kind = m.link_for("all_reduce", 2, 4, node_ranks=4)  # stride 4: crosses nodes
    assert kind == "inter" and alpha == 5e-6
    assert beta == pytest.approx(2 * 10e9 / 4)  # 2 NICs shared by the 4 ranks of a node
    assert m.link_for("all_reduce", 3, 1, node_ranks=4)[2] == "inter"  # 3 does not divide 4


def test_measured_fit_overrides_the_link_model():
    fit = machine.CollectiveFit(op="all_gather", ranks_per_node=4, group_size=2, alpha_s=1e-3,
                          bandwidth=1e8)
    m = simple_machine(collectives=(fit,))
    assert m.link_for("all_gather", 2, 1, node_ranks=4) == (1e-3, 1e8, "measured")
    assert m.link_for("all_reduce", 2, 1, node_ranks=4)[2] == "intra"
    assert m.collective_time("all_gather", 1e6, 2, node_ranks=4) == pytest.approx(
        1e-3 + 0.5 * 1e6 / 1e8)


def test_compute_rates_by_ranks_on_the_node():
    rates = tuple(machine.Compute(ranks_per_node=k, spmm_bandwidth=8e9 / k, gemm_flops=1e10,
                            memory_bandwidth=1e10) for k in (2, 4))
    m = simple_machine(ranks_per_node=None, device_memory=None, compute=rates)
    assert m.compute_at(4).spmm_bandwidth == 2e9
    assert m.compute_at(8).spmm_bandwidth == pytest.approx(1e9)  # 4 measured, 8 share: half
    assert m.memory_per_rank(8) == 64e9 / 8  # host memory split among the ranks of the node


def test_profile_validation():
    with pytest.raises(ValueError, match="bandwidth > 0"):
        machine.Link(alpha_s=0.0, bandwidth=0.0)
    with pytest.raises(ValueError, match="group_size"):
        machine.CollectiveFit(op="all_reduce", ranks_per_node=2, group_size=4, alpha_s=0,
                        bandwidth=1.0)
    with pytest.raises(ValueError, match="unknown collective"):
        Collective("x", "broadcast", 4)


@pytest.mark.parametrize("name", machine.available_profiles())
def test_shipped_profiles_load_and_round_trip(name, tmp_path):
    m = machine.load_profile(name)
    assert m.name == name and m.sources and m.compute
    m.save(tmp_path / "p.json")
    assert machine.load_profile(tmp_path / "p.json") == m


def test_shipped_profiles_include_the_presets_and_a_measured_one():
    assert {"perlmutter-a100", "frontier-mi250x", "local-cpu"} <= set(machine.available_profiles())
    local = machine.load_profile("local-cpu")
    measured = {(c.ranks_per_node, c.group_size) for c in local.collectives}
    assert {(4, 2), (4, 4), (8, 2), (8, 4), (8, 8)} <= measured  # G = 4 and 8, every group


def test_load_profile_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="perlmutter-a100"):
        machine.load_profile("no-such-machine")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="malformed"):
        machine.load_profile(bad)
    monkeypatch.setenv(machine.ENV_PROFILE, "frontier-mi250x")
    assert machine.load_profile().name == "frontier-mi250x"


def test_groups_spanning_nodes_share_the_nics_by_ranks_per_node():
    """A ring with k ranks on each node leaves the node once: the node's R/k groups share its
    NICs, so each gets nics * bandwidth * k / R (toy: 2 NICs x 10 GB/s, R = 4)."""
    m = simple_machine()
    assert [machine.group_ranks_per_node(g, s, 4) for g, s in
            [(8, 1), (8, 2), (4, 4), (3, 1), (16, 1), (6, 1)]] == [4, 2, 1, 1, 4, 1]
    assert m.link_for("all_reduce", 8, 1, node_ranks=4) == (5e-6, 20e9, "inter")
    assert m.link_for("all_reduce", 8, 2, node_ranks=4)[1] == pytest.approx(10e9)
    assert m.link_for("all_reduce", 4, 4, node_ranks=4)[1] == pytest.approx(5e9)


def test_intra_peer_bandwidth_limits_small_rings_inside_a_node():
    m = simple_machine(intra_peer_bandwidth=30e9)
    assert m.link_for("all_gather", 2, 1, node_ranks=4)[1] == 30e9  # one peer's links
    assert m.link_for("all_gather", 4, 1, node_ranks=4)[1] == 90e9  # three peers
    assert simple_machine(intra_peer_bandwidth=50e9).intra_ring_bandwidth(4) == 100e9  # cap


def test_latency_optimal_steps_and_level_seconds():
    steps = machine.latency_optimal_steps
    assert [steps("all_gather", g) for g in (1, 2, 5, 8, 9)] == [0, 1, 3, 3, 4]  # Bruck
    assert [steps("reduce_scatter", g) for g in (2, 8, 6)] == [1, 3, None]  # halving: 2^j
    with pytest.raises(ValueError, match="all_gather and reduce_scatter"):
        steps("all_reduce", 4)
    # g = 8: 3 steps instead of the ring's 7, the same 7/8 M bytes
    assert machine.level_seconds("all_gather", 8e6, 8, 1e-6, 1e9) == pytest.approx(
        3e-6 + 7 / 8 * 8e6 / 1e9)
    assert machine.level_seconds("reduce_scatter", 6e6, 6, 1e-6, 1e9) == pytest.approx(
        5e-6 + 5 / 6 * 6e6 / 1e9)  # no halving for 6 ranks: the ring
    assert machine.level_seconds("all_gather", 1e6, 1, 1e-6, 1e9) == 0.0


def test_two_level_formulas_by_hand():
    """g = 16 ranks, 4 per node (stride 1, R = 4), n = 4 nodes; toy links, call 10 us."""
    c = 10e-6
    m = simple_machine(collective_call_s=c)
    mb = 4e6
    rail = 2 * 10e9 / 4  # the node's 2 NICs shared by its 4 ranks
    intra_ag = 2 * 1e-6 + 3 / 4 * mb / 100e9  # Bruck over 4: 2 steps
    inter_ag = 2 * 5e-6 + 3 / 4 * (mb / 4) / rail  # over 4 nodes on M/4
    ag = m.two_level_time("all_gather", mb, 16, stride=1, node_ranks=4)
    assert ag == pytest.approx(intra_ag + inter_ag + 2 * c)
    rs = m.two_level_time("reduce_scatter", mb, 16, stride=1, node_ranks=4)
    assert rs == pytest.approx(ag)  # 4 = 2^2: recursive halving mirrors Bruck
    assert m.two_level_time("all_reduce", mb, 16, stride=1, node_ranks=4) == pytest.approx(
        rs + ag)
    # one rank per node (stride 4): only the inter level, log2(8) = 3 steps
    assert m.two_level_time("all_gather", mb, 8, stride=4, node_ranks=4) == pytest.approx(
        3 * 5e-6 + 7 / 8 * mb / rail + c)
    ring = m.collective_time("all_gather", mb, 16, stride=1, node_ranks=4)
    assert ring == pytest.approx(c + 15 * 5e-6 + 15 / 16 * mb / 20e9)
    auto = m.collective_time("all_gather", mb, 16, stride=1, node_ranks=4, algorithm="auto")
    assert auto == min(ring, ag)
    assert m.collective_time("all_gather", mb, 16, stride=1, node_ranks=4,
                             algorithm="two-level") == ag


def test_two_level_pays_on_many_nodes_with_small_messages_only():
    m = machine.load_profile("perlmutter-a100")

    def both(op, mb, g, stride):
        return [m.collective_time(op, mb, g, stride=stride, node_ranks=4, algorithm=a)
                for a in ("ring", "two-level")]

    ring, two = both("all_reduce", 64e3, 256, 4)  # 256 nodes, one rank each, 64 KB
    assert two < ring / 5  # 2 * log2(256) steps instead of 2 * 255
    ring, two = both("all_gather", 64e3, 64, 1)  # 16 nodes, 4 ranks each
    assert two < ring
    ring, two = both("all_reduce", 1e9, 16, 1)  # 1 GB over 4 nodes: the intra stages cost
    assert ring < two
    ring, two = both("all_reduce", 1e9, 4, 1)  # inside a node: two calls instead of one
    assert ring < two


def test_collective_algorithm_is_validated_and_measured_fits_win():
    with pytest.raises(ValueError, match="unknown collective algorithm 'tree'"):
        simple_machine(collective_algorithm="tree")
    fit = machine.CollectiveFit(op="all_gather", ranks_per_node=4, group_size=2, alpha_s=1e-3,
                                bandwidth=1e8)
    m = simple_machine(collectives=(fit,), collective_algorithm="two-level")
    assert m.collective_time("all_gather", 1e6, 2, node_ranks=4) == pytest.approx(
        1e-3 + 0.5 * 1e6 / 1e8)
    with pytest.raises(ValueError, match="choose from"):
        m.collective_time("all_gather", 1e6, 2, node_ranks=4, algorithm="tree")
