"""The suite on other CPUs' code paths (tests/cpu_variants.py): the tests that compare a vendor
library's results across shapes, row sets, grids or kernels (marked ``cross_shape``) pass
again under every variant that changes a vendor library's bits on this CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import cpu_variants
from tests.cpu_variants import VARIANTS, Variant
from tests.rounding import gamma, order_bound


@pytest.fixture(scope="session")
def changing() -> list[tuple[Variant, list[str]]]:
    """The variants this CPU supports that change some product's bits here, with the names of
    those products (tests/cpu_variants.py's probe, one process per variant)."""
    base = cpu_variants.probe()
    found = [(v, cpu_variants.bits_changed(v, base)) for v in VARIANTS
             if cpu_variants.supported(v)]
    return [(v, names) for v, names in found if names]


def test_each_variant_is_one_library_switch():
    names = [v.name for v in VARIANTS]
    assert len(set(names)) == len(names)
    assert {v.var for v in VARIANTS} == {"MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS",
                                        "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"}
    xeon = {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert all(cpu_variants.supported(v, xeon) for v in VARIANTS)
    avx2_only = [v.name for v in VARIANTS if not cpu_variants.supported(v, {"avx2"})]
    assert avx2_only == ["MKL_ENABLE_INSTRUCTIONS=AVX512", "ATEN_CPU_CAPABILITY=avx512"]


def test_the_rounding_bound():
    """gamma and order_bound as Higham defines them, and a bound that a real reordering meets
    while a wrong result does not."""
    import torch

    from tests.rounding import assert_orders_agree, assert_product_orders_agree

    u = 2.0 ** -24
    assert gamma(10) == pytest.approx(10 * u / (1 - 10 * u), rel=1e-15)
    assert order_bound(10, products=3) == pytest.approx(6 * gamma(10), rel=1e-15)
    with pytest.raises(ValueError, match="n u >= 1"):
        gamma(2 ** 25)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(300, 500, generator=g), torch.randn(500, 20, generator=g)
    forward = a @ b
    backward = (a.flip(1) @ b.flip(0))  # the same sums in the reverse order
    assert_product_orders_agree(forward, a, b)
    assert_product_orders_agree(backward, a, b)
    assert_orders_agree(backward, forward, terms=500, scale=(a.abs() @ b.abs()).max().item())
    wrong = forward.clone()
    wrong[3, 4] += 1e-3 * forward.abs().max()
    with pytest.raises(AssertionError, match="beyond the rounding"):
        assert_product_orders_agree(wrong, a, b)
    with pytest.raises(AssertionError, match="more than another order"):
        assert_orders_agree(wrong, forward, terms=500)


def test_rounds_keep_every_variant_in_fewest_runs():
    cbwr, compat, aten, dnn = (VARIANTS[0], VARIANTS[1], VARIANTS[3], VARIANTS[7])
    assert cpu_variants.rounds([cbwr, compat, aten, dnn]) == [[cbwr, aten, dnn], [compat]]
    assert cpu_variants.rounds([]) == []
    env = cpu_variants.clean_env(compat, aten)
    assert env["MKL_CBWR"] == "COMPATIBLE" and env["ATEN_CPU_CAPABILITY"] == "default"
    assert not any(k.startswith("PYTEST_XDIST") for k in env)


# a round per value of the variable with the most values (ATEN_CPU_CAPABILITY: 3)
MAX_ROUNDS = max(sum(v.var == w.var for w in VARIANTS) for v in VARIANTS)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(MAX_ROUNDS))
def test_cross_shape_tests_pass_under_other_code_paths(index, changing):
    """The ``cross_shape`` tests that run in the test process, again under the variants of
    round ``index`` (:func:`tests.cpu_variants.rounds`) of those that change bits here;
    launches of several ranks skip in this run (``make test-cpus`` runs them under each)."""
    from tests.distributed import IN_PROCESS_ONLY

    rounds = cpu_variants.rounds([v for v, _ in changing])
    if index >= len(rounds):
        pytest.skip(f"{len(rounds)} round(s) keep every variant that changes bits here")
    variants = rounds[index]
    what = "; ".join(f"{v.name} changes {', '.join(names)}" for v, names in changing
                     if v in variants)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
         "-m", "cross_shape and not slow and not gpu", "tests"],
        cwd=cpu_variants.ROOT, env={**cpu_variants.clean_env(*variants), IN_PROCESS_ONLY: "1"},
        capture_output=True, text=True, timeout=900, check=False)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, f"under {what}:\n{tail}"
    assert " passed" in run.stdout, tail  # the marked tests ran, not none
