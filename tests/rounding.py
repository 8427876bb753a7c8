"""How far apart two float results may be when a vendor library computed them.

Where our own code fixes the order of every sum (plexus's numba SpMM kernels, the dropout hash,
our collectives' reductions), the tests compare bits: same inputs, same bits, on any CPU.
A vendor library (MKL, oneDNN, OpenBLAS, cuBLAS, cuSPARSE, and ATen's own vectorised
reductions) picks its kernel and its blocking by CPU, instruction set, thread count, operand
shape and even the operands' alignment, so the same product of another height, another row
set or another thread count may sum in another order. MKL's AVX-512 kernels on an Intel Xeon
sum the rows of a CSR product over a row subset in another order than over every row; MKL
on the same machine gives the rows of ``a[idx] @ b`` other bits than those of ``a @ b`` for
some shapes and not others. Such results are compared to float rounding with the bound below.

The bound (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. (3.4) and
(3.11)): a sum of ``n`` terms ``x_i`` computed in floating point in any order is within
``gamma(n - 1) * sum |x_i|`` of the exact sum, where ``gamma(m) = m u / (1 - m u)`` and ``u``
is the unit roundoff (2^-24 for float32). Two orders of the same sum are therefore within
``2 gamma(n - 1) sum |x_i|`` of each other, and two computations of ``C = A B`` within
``2 gamma(k) (|A| |B|)`` elementwise (``k`` the inner size; ``gamma(k)`` covers ``k - 1``
additions and the products' own rounding). A result that goes through ``p`` such products in
turn, with maps between them that do not enlarge differences (ReLU, a fixed dropout mask's
exact scaling, the log-softmax's slope of at most 1 per logit), differs to first order by at
most the sum of the ``p`` products' bounds, each carried forward by the absolute values of
what follows it. :func:`order_bound` gives that factor, ``2 p gamma(n)``, relative to the
magnitudes involved; a test that compares normwise scales it by the largest magnitude of the
result it compares (:func:`assert_orders_agree`), which holds where the sums do not cancel
far below their terms' magnitudes; a single product is checked elementwise
(:func:`assert_product_orders_agree`).
"""

from __future__ import annotations

import torch

UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24,
                 torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u``: half the distance from 1 to the next float of ``dtype``."""
    return UNIT_ROUNDOFF[dtype]


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """``n u / (1 - n u)``: the relative error bound of a sum of ``n + 1`` terms (or a dot
    product of ``n`` pairs) in ``dtype``, in any order."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"{n} terms in {dtype}: n u >= 1, no bound")
    return nu / (1 - nu)


def order_bound(terms: int, *, products: int = 1, dtype: torch.dtype = torch.float32,
                stored: torch.dtype | None = None) -> float:
    """How far two orders of summation may move a result that passes through ``products``
    sums of at most ``terms`` terms each, relative to the magnitude of the terms:
    ``2 * products * gamma(terms)`` (module docstring). Where each sum's result is stored in a
    narrower ``stored`` dtype (bf16 activations summed in float32), the two stored results may
    round to neighbouring values once the sums differ: ``2 u`` of ``stored`` more per sum."""
    if terms < 1 or products < 1:
        raise ValueError(f"terms and products are at least 1, got {terms} and {products}")
    bound = 2 * products * gamma(terms, dtype)
    if stored is not None and unit_roundoff(stored) > unit_roundoff(dtype):
        bound += 2 * products * unit_roundoff(stored)
    return bound


def assert_orders_agree(got: torch.Tensor, want: torch.Tensor, *, terms: int,
                        products: int = 1, scale: float | None = None,
                        stored: torch.dtype | None = None, what: str = "") -> None:
    """``got`` equals ``want`` up to another order of summation: every element within
    ``order_bound(terms, products, stored=stored) * scale`` of ``want``'s, ``scale`` by default
    the largest ``|want|`` (the normwise form of the bound). Same shape, same dtype, same
    non-finite entries."""
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: {got.shape} {got.dtype} against {want.shape} {want.dtype}"
    dtype = want.dtype
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), f"{what}: non-finite entries differ"
    if not finite.any():
        return
    if scale is None:
        scale = want[finite].abs().max().item()
    bound = order_bound(terms, products=products, dtype=dtype, stored=stored) * scale
    worst = (got[finite] - want[finite]).abs().max().item()
    assert worst <= bound, (f"{what}: differs by {worst:.3g}, more than another order of "
                            f"summation explains ({bound:.3g}: {products} sum(s) of at most "
                            f"{terms} terms, scale {scale:.3g})")


def assert_product_orders_agree(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                                what: str = "") -> None:
    """``got`` is ``a @ b`` in some order of summation: every element within
    ``gamma(k) (|a| |b|)`` of the exact product (computed in float64), so any vendor kernel's
    result passes (two of them are within twice that of each other), and a wrong product does
    not."""
    k = a.shape[-1]
    exact = a.double() @ b.double()
    room = gamma(max(k, 1), a.dtype) * (a.double().abs() @ b.double().abs())
    excess = ((got.detach().double() - exact).abs() - room).max().item()
    assert excess <= 0, f"{what}: {excess:.3g} beyond the rounding of a {k}-term product"

