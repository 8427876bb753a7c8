"""bench/gat_epoch.py on a small graph: both sides run their epochs, and the verdict line gives
the ratio of the medians it prints, against the target, with the exit code to match."""

from __future__ import annotations

import re

import pytest

from tests.bench.scripts import load_bench


def test_the_bench_times_both_sides_and_judges_the_ratio(capsys):
    pytest.importorskip("torch_geometric")
    module = load_bench("gat_epoch")
    code = module.main(["--nodes", "1500", "--epochs", "2", "--warmup", "1", "--heads", "2",
                        "--hidden", "4"])
    out = capsys.readouterr().out
    verdict = re.search(r"ours (\d+) ms, PyG (\d+) ms; ours/PyG ([\d.]+) \(target <= 0.5: "
                        r"(met|NOT met)\)", out)
    assert verdict, out
    assert code == (0 if verdict[4] == "met" else 1)
    assert float(verdict[3]) == pytest.approx(int(verdict[1]) / max(int(verdict[2]), 1),
                                              abs=0.05 + 1 / max(int(verdict[2]), 1))
