"""The engine-independent performance model: pure arithmetic (factorizations, bytes per
group, rank correlation); no module of common.perf imports torch."""

import math
import subprocess
import sys

import pytest

from common.perf.model import Collective, bytes_by_axis, factorizations, spearman


def test_perf_modules_do_not_import_torch():
    code = ("import sys, common.perf, common.perf.machine, common.perf.model, common.perf.gcn, "
            "common.perf.gpt, common.perf.paper, common.perf.cli; "
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
