"""common.dense: ``mm`` equals ``torch.mm`` to float rounding on every backend and layout it
takes, falls back to torch where oneDNN does not apply, and refuses unknown backends."""

import pytest
import torch

from common import dense

ONEDNN = pytest.mark.skipif(not dense.onednn_available(),
                            reason="this torch has no oneDNN linear primitive")


def _close(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    want = a.double() @ b.double()
    assert got.dtype == a.dtype and got.shape == want.shape
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= 1e-5 * scale, "not a @ b"


@pytest.mark.parametrize("backend", dense.BACKENDS)
@pytest.mark.parametrize("shape", [(3000, 64, 64), (4099, 100, 47), (1000, 256, 33), (5, 7, 3)])
def test_mm_is_the_product_on_every_backend(backend, shape):
    m, k, n = shape
    g = torch.Generator().manual_seed(m)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    _close(dense.mm(a, b, backend=backend), a, b)
    _close(dense.mm(a, b.t().contiguous().t(), backend=backend), a, b)  # b a transposed view
    strided = torch.randn(k, 2 * n, generator=g)[:, ::2]  # b with a column stride
    _close(dense.mm(a, strided, backend=backend), a, strided)


@ONEDNN
def test_which_products_go_through_onednn():
    a, b = torch.randn(4096, 128), torch.randn(128, 128)
    assert dense.uses_onednn(a, b)
    assert dense.uses_onednn(a, b.t())  # a transposed weight is copied, cheaply
    assert not dense.uses_onednn(a, b, "torch")
    assert not dense.uses_onednn(a.t().contiguous().t(), b)  # H^T-style views stay with torch
    assert not dense.uses_onednn(a.double(), b.double())
    assert not dense.uses_onednn(a[:8, :8], b[:8, :8])  # too little work for the call's overhead
    w = b.clone().requires_grad_()
    assert not dense.uses_onednn(a, w)  # autograd would not see the product
    with torch.no_grad():
        assert dense.uses_onednn(a, w)


def test_unknown_backends_are_refused():
    with pytest.raises(ValueError, match=r"unknown dense product backend 'mkl'.*auto"):
        dense.mm(torch.ones(2, 2), torch.ones(2, 2), backend="mkl")
    assert dense.check_backend("torch") == "torch"


def test_onednn_asked_where_torch_lacks_it_is_refused(monkeypatch):
    monkeypatch.setattr(dense, "onednn_available", lambda: False)
    with pytest.raises(ValueError, match="no usable oneDNN linear primitive; use 'auto'"):
        dense.check_backend("onednn")
    a, b = torch.randn(4096, 128), torch.randn(128, 128)
    assert not dense.uses_onednn(a, b)
    _close(dense.mm(a, b), a, b)  # auto falls back to torch
