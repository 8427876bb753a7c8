"""plexus.dropout_triton, the GPU's dropout keep-mask as one Triton kernel, compiled on a GPU
and run in Triton's interpreter without one (``TRITON_INTERPRET=1``, CPU tensors): its bits
are the CPU hash's (plexus.dropout.keep_mask) for node ids beyond 2^32, keys above 2^31, odd
block shapes and every rate; the fused dropout gives the CPU's ``dropped`` values bit for
bit, and the mask; on a GPU, ``keep_mask(device="cuda")`` gives the same bits with the kernel
and with the torch hash (``PLEXUS_TRITON=0``)."""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
triton = pytest.importorskip("triton")

from plexus.dropout import _mask_key, dropped, keep_mask  # noqa: E402
from plexus.dropout_triton import fused_dropout, keep_mask_triton  # noqa: E402


@pytest.mark.parametrize("p, seed, step, layer", [(0.5, 0, 1, 0), (0.1, 7, 123, 2),
                                                  (0.9, 2**40 + 5, 3, 65536)])
def test_the_kernels_bits_are_the_cpu_hashs(p, seed, step, layer):
    gen = torch.Generator().manual_seed(seed % 1000)
    rows = torch.randint(0, 2**34, (45,), generator=gen)  # ids mod 2^32, as the CPU's
    cols = torch.randint(0, 3000, (70,), generator=gen)
    want = keep_mask(p, seed=seed, step=step, layer=layer, rows=rows, cols=cols)
    k, threshold = _mask_key(p, seed, step, layer)
    got = keep_mask_triton(rows.to(DEVICE), cols.to(DEVICE), int(k), int(threshold)).cpu()
    assert got.dtype == torch.bool and torch.equal(got, want)
    assert 0 < want.float().mean() < 1


def test_the_fused_dropout_is_the_cpus_values_and_mask():
    gen = torch.Generator().manual_seed(3)
    rows, cols = torch.arange(100, 133), torch.arange(5, 52)
    x = torch.randn(33, 47, generator=gen)
    p, (k, threshold) = 0.3, _mask_key(0.3, 4, 9, 1)
    keep = keep_mask(p, seed=4, step=9, layer=1, rows=rows, cols=cols)
    y, got = (t.cpu() for t in fused_dropout(x.to(DEVICE), rows.to(DEVICE), cols.to(DEVICE),
                                             int(k), int(threshold), p))
    assert torch.equal(got, keep)
    assert torch.equal(y, dropped(x, ~keep, p))  # bit for bit
    with pytest.raises(ValueError, match="is not"):
        fused_dropout(x[:, :5], rows, cols, int(k), int(threshold), p)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_keep_mask_on_a_gpu_is_the_kernels_and_the_torch_hashs(monkeypatch):
    rows, cols = torch.randint(0, 2**33, (1000,)), torch.arange(300)
    want = keep_mask(0.5, seed=1, step=2, layer=3, rows=rows, cols=cols)
    got = keep_mask(0.5, seed=1, step=2, layer=3, rows=rows, cols=cols, device="cuda")
    monkeypatch.setenv("PLEXUS_TRITON", "0")
    torch_hash = keep_mask(0.5, seed=1, step=2, layer=3, rows=rows, cols=cols, device="cuda")
    assert torch.equal(got.cpu(), want) and torch.equal(torch_hash.cpu(), want)
