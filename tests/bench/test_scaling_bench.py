"""bench/scaling.py's timing check with the grids' runs replaced by fixed times: the rows,
the checks' figures and the figure it writes, and the run ``--json`` appends."""

import re
from argparse import Namespace

import pytest

from bench.provenance import read_runs
from tests.bench.scripts import load_bench

# grid -> (epoch s, comm s) of the fake runs
TIMES = {"1x1x4": (0.30, 0.10), "1x2x2": (0.25, 0.08), "1x4x1": (0.40, 0.12),
         "2x1x2": (0.20, 0.05), "2x2x1": (0.22, 0.06), "4x1x1": (0.35, 0.07)}


def test_json_appends_the_rows_and_checks_as_printed(monkeypatch, tmp_path, capsys):
    module = load_bench("scaling")
    monkeypatch.setattr(module, "run_grid", lambda grid, ranks, args, tmp: {
        "epoch_s": TIMES[grid][0], "comm_s": TIMES[grid][1], "bytes": {}})
    path = tmp_path / "scaling.json"
    argv = ["--dataset", "rmat-8", "--ranks", "4", "--out", str(tmp_path), "--json", str(path)]
    code = module.main(argv)
    out = capsys.readouterr().out
    (run,) = read_runs(path)
    assert (run["bench"], run["model"], run["dataset"]) == ("scaling", "gcn", "rmat-8")
    assert run["provenance"]["command"] == "python bench/scaling.py " + " ".join(argv)
    assert run["ok"] == (code == 0)
    assert [r["grid"] for r in run["rows"]] == list(TIMES)
    work = module.graph_workload("rmat-8", Namespace(model="gcn", layers=3, hidden=128,
                                                     norm="none"))
    machine = module.load_profile("local-cpu")
    for row in run["rows"]:
        shape = tuple(int(v) for v in row["grid"].split("x"))
        assert row["measured_ms"] == pytest.approx(1e3 * TIMES[row["grid"]][0])
        assert row["measured_comm_ms"] == pytest.approx(1e3 * TIMES[row["grid"]][1])
        assert row["predicted_ms"] == pytest.approx(
            1e3 * module.predict_gcn(work, shape, machine).total_s)
    rho = module.spearman([r["predicted_ms"] for r in run["rows"]],
                          [r["measured_ms"] for r in run["rows"]])
    assert run["summary"]["spearman"] == pytest.approx(rho)
    printed = re.search(r"over all 6 grids: ([-\d.]+)", out)[1]
    assert printed == f"{rho:.3f}"
    gap = re.search(r"^G=4: Spearman ([-\d.]+);.*gap ([-\d.]+)%", out, re.M)
    assert f"{run['summary']['spearman_by_ranks']['4']:.3f}" == gap[1]
    assert f"{100 * run['summary']['best_gap']['4']:.1f}" == gap[2]
    assert (tmp_path / "scaling.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "scaling.csv").read_text().count("\n") == 1 + len(TIMES)
