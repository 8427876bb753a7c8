"""The check against the Plexus paper (SC'25) on the Perlmutter preset."""

from common.perf.paper import PAPERS100M_MS, check_papers100m, check_products


def test_paper_products_ranks_3d_above_2d_above_1d():
    """ogbn-products on 64 Perlmutter GPUs: top 5 all 3D; best 3D < best 2D < best 1D
    (paper: 69 / 82 / 180 ms)."""
    check = check_products()
    assert check.top5_all_3d, [p.label() for p in check.plan.runnable[:5]]
    assert check.ordered, {d: p.total_s for d, p in check.best_by_dims.items()}


def test_paper_papers100m_within_2x():
    rows = check_papers100m()
    assert [g for g, _, _ in rows] == list(PAPERS100M_MS)
    for gpus, pred, ms in rows:
        assert 0.5 <= 1e3 * pred.total_s / ms <= 2.0, (gpus, pred.label(), pred.total_s, ms)
        assert pred.dims == 3 and pred.fits
