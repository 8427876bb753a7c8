"""Smoke test of bench/accuracy.py: --quick trains plexus and PyG on both generated graphs
(the planted partition and the arxiv-like graph read back through the OGB loader) with gcn and
sage, and prints one table row per pair with finite numbers on both sides. The 1-point
parity target is not asserted at quick settings (30 epochs, 2 seeds); the full run checks it."""

import json
import math
import re

import pytest

from tests.bench.scripts import load_bench
from tests.distributed import ROOT, launch

SCRIPT = ROOT / "bench" / "accuracy.py"
NUM = r"([0-9.]+|nan|inf)"
ACC = rf"\s+{NUM}\+-{NUM}"
# dataset, model, plexus best, plexus last, PyG best, PyG last, diff, train ms, eval ms, result
ROW = re.compile(r"^(planted|arxiv-like)\s+(gcn|sage|gat)" + ACC * 4 + r"\s+([+-][0-9.]+|nan)"
                 + rf"\s+{NUM} / {NUM}" * 2 + r"\s+(PASS|FAIL)\s*$")
CHANCE = {"planted": 100 / 8, "arxiv-like": 100 / 5}  # points: the graphs' planted classes


@pytest.mark.slow
def test_bench_accuracy_quick_prints_both_sides(tmp_path):
    out = tmp_path / "rows.json"
    args = ["--quick", "--tolerance", "100", "--json", str(out)]
    r = launch([str(SCRIPT), *args], launcher="single", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "command: python bench/accuracy.py " + " ".join(args) in r.stdout
    assert "plexus best" in r.stdout and "PyG best" in r.stdout
    rows = {}
    for line in r.stdout.splitlines():
        if m := ROW.match(line):
            rows[m.group(1), m.group(2)] = [float(v) for v in m.groups()[2:-1]]
    assert sorted(rows) == sorted((d, m) for d in CHANCE for m in ("gcn", "sage", "gat")), \
        r.stdout
    for (dataset, _), values in rows.items():
        assert all(math.isfinite(v) for v in values), (dataset, values)
        plexus_best, pyg_best = values[0], values[4]
        assert 0 < plexus_best <= 100 and 0 < pyg_best <= 100
        if dataset == "arxiv-like":  # raw features learn within 30 epochs; row-normalised
            assert min(plexus_best, pyg_best) > CHANCE[dataset]  # ones (planted) take ~100
        assert all(ms > 0 for ms in values[9:]), values
    saved = json.loads(out.read_text())
    assert len(saved["rows"]) == 6
    for row in saved["rows"]:
        assert len(row["plexus"]["seeds"]) == len(row["pyg"]["seeds"]) == 2


def test_rows_pass_within_tolerance_and_select_first_best_val():
    bench = load_bench("accuracy")
    history = [{"epoch": e, "val_acc": v, "test_acc": t, "epoch_s": 0.1, "eval_s": 0.05}
               for e, (v, t) in enumerate([(0.5, 0.4), (0.7, 0.6), (0.7, 0.9), (0.6, 0.8)], 1)]
    run = bench.summarize(history)
    assert (run.best_epoch, run.best_test, run.last_test) == (2, 0.6, 0.8)
    other = bench.Run(best_test=0.605, best_val=0.7, best_epoch=3, last_test=0.8, train_ms=1.0,
                      eval_ms=1.0)
    runs = {"plexus": [run], "pyg": [other]}
    row = bench.row_of("planted", "gcn", runs, tolerance=1.0)
    assert row["pass"] and row["diff"] == pytest.approx(60.0 - 60.5)
    assert not bench.row_of("planted", "gcn", runs, tolerance=0.4)["pass"]
    assert "PASS" in bench.fmt_row(row)
