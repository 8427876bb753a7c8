"""The calibration's alpha-beta fit (the measuring itself runs in bench/)."""

import pytest

from common.perf.calibrate import fit_alpha_beta


def test_fit_alpha_beta_recovers_exact_parameters():
    alpha, beta, steps = 2e-4, 3e8, 6
    samples = [(x, steps * alpha + x / beta) for x in (1e3, 1e5, 1e6, 8e6)]
    a, b = fit_alpha_beta(steps, samples)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
