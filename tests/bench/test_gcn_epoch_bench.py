"""bench/gcn_epoch.py's rounds, in process: every side runs once a round, the order reversed
every other round; each side's median is over all its rounds; the ratio is against the fastest
PyG setting; each round's ratio is its own medians'. The workers are replaced by fixed epoch
times, so the printed figures can be recomputed exactly (the real workers run in
tests/bench/test_gpu_check.py)."""

import re
import statistics

import pytest

from tests.bench.scripts import load_bench

# (side, THP, retained heap, pool) -> epoch times of round 0, round 1
TIMES = {("ours", "1", True, None): ([0.30, 0.32, 0.31], [0.40, 0.41, 0.42]),
         ("ours", "1", True, False): ([0.50, 0.60, 0.55], [0.52, 0.53, 0.54]),
         ("pyg", "0", False, None): ([1.30, 1.20, 1.25], [1.35, 1.36, 1.37]),
         ("pyg", "1", False, None): ([1.00, 1.10, 1.05], [1.30, 1.31, 1.32]),
         ("pyg", "1", True, None): ([1.10, 1.15, 1.12], [1.20, 1.22, 1.21])}


@pytest.fixture()
def bench(monkeypatch):
    module = load_bench("gcn_epoch")
    calls = []

    def run_worker(args, side, variant, thp, retain, pool=None):
        key = (side, thp, retain, pool)
        calls.append(key)
        return list(TIMES[key][sum(c == key for c in calls) - 1])

    monkeypatch.setattr(module, "run_worker", run_worker)
    _without_throughputs(module, monkeypatch)
    return module, calls


def _without_throughputs(module, monkeypatch):
    """The throughput lines after the ratios are not under test here: skipped."""
    monkeypatch.setattr(module, "memory_bandwidth", lambda **_: 1.0)
    monkeypatch.setattr(module, "spmm_throughput", lambda *a, **k: {})
    monkeypatch.setattr(module, "gemm_throughput", lambda *a, **k: {"relative difference": 0})
    monkeypatch.setattr(module, "weight_grad_throughput",
                        lambda *a, **k: {"relative difference": 0})


def test_rounds_reverse_the_order_and_pool_every_round(bench, capsys):
    module, calls = bench
    module.main(["--nodes", "500", "--rounds", "2", "--variants", "fixed", "--threads", "1"])
    out = capsys.readouterr().out
    order = list(TIMES)
    assert calls == order + order[::-1]  # every side once a round, reversed in the second

    def median(key):
        return statistics.median(TIMES[key][0] + TIMES[key][1])

    ours = median(order[0])
    fastest = min(order[2:], key=median)  # over both rounds: huge pages + retained heap
    assert fastest == ("pyg", "1", True, None)
    row = re.search(r"^ours \(Plexus 1x1x1\)[^\n]*?\s{2,}([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
                    out, re.M)
    assert row and float(row[1]) == pytest.approx(ours, abs=5e-4)
    assert (float(row[2]), float(row[3])) == (0.30, 0.42)
    got = re.search(r"^fixed: ours/PyG ([\d.]+) against huge pages \+ retained heap .*"
                    r"round by round ([\d.]+), ([\d.]+)$", out, re.M)
    assert got, out
    assert float(got[1]) == pytest.approx(ours / median(fastest), abs=5e-4)
    # each round against its own fastest PyG (round 0: huge pages; round 1: + retained heap)
    for r in range(2):
        pyg = min(statistics.median(TIMES[k][r]) for k in order[2:])
        assert float(got[2 + r]) == pytest.approx(statistics.median(TIMES[order[0]][r]) / pyg,
                                                  abs=5e-4)
    assert re.search(r"^ratio ours/PyG: ([\d.]+)", out, re.M)[1] == got[1]


@pytest.mark.parametrize("flag", ["--rounds", "--warmup", "--epochs"])
def test_counts_below_one_are_refused(bench, flag, capsys):
    module, _ = bench
    with pytest.raises(SystemExit) as exc:
        module.parse_args([flag, "0"])
    assert exc.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("rate", ["1.0", "-0.1"])
def test_a_dropout_rate_outside_zero_to_one_is_refused(bench, rate, capsys):
    module, _ = bench
    with pytest.raises(SystemExit) as exc:
        module.parse_args(["--dropout", rate])
    assert exc.value.code == 2
    assert f"--dropout {float(rate)}" in capsys.readouterr().err


@pytest.mark.parametrize("variant", ["fixed", "learn"])
def test_pyg_drops_every_layer_input_and_aggregates_every_layer_with_dropout(variant,
                                                                            monkeypatch):
    """With --dropout PyG's side drops each layer's input (3 layers: 3 calls an epoch) and,
    with fixed features, cannot use the precomputed A X: every layer aggregates, as ours."""
    import torch
    from torch_geometric.nn import GCNConv

    from plexus.data.generators import planted_partition

    module = load_bench("gcn_epoch")
    graph = planted_partition(num_nodes=60, num_features=8, num_classes=3, seed=0)
    adj = module.to_torch_csr(module.normalized_adjacency(graph.edge_index.numpy(), 60))
    dropped, aggregated = [], []
    real_dropout, real_forward = torch.nn.functional.dropout, GCNConv.forward
    monkeypatch.setattr(torch.nn.functional, "dropout",
                        lambda h, p, *a, **k: dropped.append(p) or real_dropout(h, p, *a, **k))
    monkeypatch.setattr(GCNConv, "forward",
                        lambda self, *a, **k: aggregated.append(1) or real_forward(self, *a, **k))
    for rate in (0.0, 0.5):
        dropped.clear(), aggregated.clear()
        times = module.pyg_epochs(graph, adj, 4, 3, 2, 0.01, variant=variant, dropout=rate)
        assert len(times) == 2 and all(t > 0 for t in times)
        assert dropped == ([0.5] * 6 if rate else [])
        # fixed without dropout: layer 0 is a linear map of the cached A X (2 of 3 aggregate)
        assert len(aggregated) == (4 if variant == "fixed" and not rate else 6)


def test_json_appends_a_run_of_the_printed_figures_with_its_provenance(bench, tmp_path,
                                                                       capsys):
    from bench.provenance import read_runs

    module, calls = bench
    path = tmp_path / "results" / "epoch.json"
    argv = ["--nodes", "500", "--rounds", "2", "--variants", "fixed", "--threads", "1",
            "--json", str(path)]
    module.main(argv)
    out = capsys.readouterr().out
    (run,) = read_runs(path)
    assert run["bench"] == "gcn_epoch" and run["device"] == "cpu"
    assert run["provenance"]["command"] == "python bench/gcn_epoch.py " + " ".join(argv)
    (row,) = run["rows"]
    printed = re.search(r"^fixed: ours/PyG ([\d.]+) against (.*) \(the fastest PyG\).*"
                        r"round by round ([\d.]+), ([\d.]+)$", out, re.M)
    assert f"{row['ratio']:.3f}" == printed[1] and row["pyg_setting"] == printed[2]
    assert [f"{r:.3f}" for r in row["round_ratios"]] == [printed[3], printed[4]]
    assert row["ratio"] == pytest.approx(row["ours_s"] / row["pyg_s"])
    assert row["no_pool_ratio"] == pytest.approx(row["no_pool_s"] / row["pyg_s"])
    assert (row["variant"], row["nodes"], row["norm"]) == ("fixed", 500, "none")
    calls.clear()  # the fake workers' times again
    module.main(argv)  # a second run goes after the first
    assert len(read_runs(path)) == 2


def test_the_target_on_a_gpu_tightens_from_a_million_nodes():
    import torch

    module = load_bench("gcn_epoch")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert module.target_of(cpu, 5_000_000) == 0.35
    assert module.target_of(cuda, 100_000) == 1.0
    assert module.target_of(cuda, 1_000_000) == module.target_of(cuda, 2_000_000) == 0.8
    assert module.target_of(cuda, 1_000_000, "bf16") == 0.5
    assert module.target_of(cuda, 100_000, "bf16") == 1.0
    assert module.target_of(cpu, 100_000, "bf16") is None  # halves bytes there, not time
    assert module.verdict(0.5, None).startswith("no target")
    assert module.verdict(0.3, 0.35).endswith("met") and module.verdict(0.4, 0.35).endswith(
        "MISSED")


def test_on_a_gpu_one_process_a_side_runs_every_workload(monkeypatch):
    """Each launch runs fixed and learn; the learn calls read what the fixed calls' processes
    measured, round by round, and launch nothing."""
    import json
    import subprocess
    from types import SimpleNamespace

    module = load_bench("gcn_epoch")
    monkeypatch.setattr(module, "_LATER", {})
    monkeypatch.setattr(module, "DROPOUT_S", {})
    launched = []

    def fake_run(cmd, **_):
        variants = cmd[cmd.index("--variant") + 1].split(",")
        n = len(launched)
        launched.append(variants)
        times = {v: [float(10 * n + i)] for i, v in enumerate(variants)}
        return SimpleNamespace(returncode=0, stderr="", stdout=json.dumps(
            {"times": times, "dropout_s": {v: 0.5 for v in variants}, "threads": 1}))

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = module.parse_args(["--device", "cuda", "--nodes", "500", "--dropout", "0.5"])
    got = {v: [module.run_worker(args, "ours", v, "1", True) for _ in range(2)]
           for v in ("fixed", "learn")}  # the main loop's order: a workload's rounds in turn
    assert launched == [["fixed", "learn"]] * 2  # two rounds, two processes, not four
    assert got == {"fixed": [[0.0], [10.0]], "learn": [[1.0], [11.0]]}
    assert module.DROPOUT_S == {"fixed": [0.5, 0.5], "learn": [0.5, 0.5]}
    cpu = module.parse_args(["--nodes", "500"])
    module.run_worker(cpu, "ours", "learn", "1", True)
    assert launched[-1] == ["learn"]  # on the CPU a process a workload


@pytest.mark.parametrize("pyg_bf16", [True, False, "fails"])
def test_ours_in_bf16_is_judged_against_pyg_in_float32(pyg_bf16, monkeypatch, capsys):
    """--precision bf16 runs the float32 workloads first, then ours in bf16 with fixed
    features only; its ratio (and each round's) is over PyG's fastest float32 median, with
    PyG in bf16 printed beside where torch takes it, not run where it does not, and left out
    with its error where its run fails after all."""
    module = load_bench("gcn_epoch")
    calls = []
    times = {("ours", "fixed"): 0.4, ("ours", "learn"): 0.5, ("ours", "fixed-bf16"): 0.3,
             ("pyg", "fixed"): 1.0, ("pyg", "learn"): 1.1, ("pyg", "fixed-bf16"): 0.8}

    def run_worker(args, side, case, thp, retain, pool=None):
        calls.append((side, case))
        if pyg_bf16 == "fails" and (side, case) == ("pyg", "fixed-bf16"):
            module.ERRORS[case] = "RuntimeError: no bf16 kernel"
            return None
        bump = 0.1 if thp == "0" else 0.0  # PyG's default allocator the slower
        return [times[side, case] + bump] * 2

    monkeypatch.setattr(module, "ERRORS", {})
    monkeypatch.setattr(module, "run_worker", run_worker)
    monkeypatch.setattr(module, "pyg_takes_bf16", lambda device: None if pyg_bf16 else "no")
    _without_throughputs(module, monkeypatch)
    module.main(["--nodes", "500", "--rounds", "2", "--precision", "bf16", "--threads", "1"])
    out = capsys.readouterr().out
    order = [case for _, case in calls]
    assert order.index("fixed-bf16") > max(i for i, c in enumerate(order) if c == "learn")
    assert "learn-bf16" not in order and "learn-bf16: not run" in out
    assert (("pyg", "fixed-bf16") in calls) == bool(pyg_bf16)
    got = re.search(r"^fixed-bf16: ours/PyG ([\d.]+) against huge pages \(the fastest PyG\) "
                    r"in float32 .*round by round ([\d.]+), ([\d.]+)$", out, re.M)
    assert got, out
    assert float(got[1]) == float(got[2]) == float(got[3]) == pytest.approx(0.3 / 1.0,
                                                                             abs=5e-4)
    same = re.search(r"^fixed-bf16: against PyG in bf16 too: ours/PyG ([\d.]+)$", out, re.M)
    assert (same is not None) == (pyg_bf16 is True)
    if pyg_bf16 is True:
        assert float(same[1]) == pytest.approx(0.3 / 0.8, abs=5e-4)
    elif pyg_bf16 == "fails":
        assert "fixed-bf16: PyG in bf16 failed, not counted: RuntimeError: no bf16" in out
        assert "PyG GCNConv (CSR, bf16)" not in out  # no row of its times
    else:
        assert "PyG in bf16 not run: no" in out
    # the final line is the first workload's, in float32
    assert re.search(r"^ratio ours/PyG: ([\d.]+)  \(fixed;", out, re.M)[1] == "0.400"
