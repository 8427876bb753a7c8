"""plexus.relu_triton, the GPU's ReLU as one Triton kernel each way, compiled on a GPU and run
in Triton's interpreter without one (``TRITON_INTERPRET=1``, CPU tensors): forward gives
``torch.relu_``'s values (-0 and NaN kept) and BitMask's bits of ``q > 0``; backward gives
``masked_fill``'s values from the bits (+0 where cleared, NaN and -0 kept where set); sizes
that do not fill a byte or a block; ops.ReLU takes the kernels on a GPU."""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
triton = pytest.importorskip("triton")

from plexus.ops import BitMask, ReLU  # noqa: E402
from plexus.relu_triton import BLOCK_BYTES, masked_by_bits, relu_pack  # noqa: E402


def _block(n, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x[::5] = 0.0
    x[1::7] = -0.0
    x[2::11] = float("nan")
    return x


def _same(a, b):
    """Equal bit for bit (NaN and the sign of zero included)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("n", [1, 13, 8 * BLOCK_BYTES, 8 * BLOCK_BYTES * 3 + 5])
def test_the_kernels_give_the_torch_values_and_bitmasks_bits(n):
    x = _block(n, n)
    want = torch.relu_(x.clone())
    want_bits = BitMask(want > 0).bits
    q = x.clone().to(DEVICE)
    bits = relu_pack(q)
    assert _same(q.cpu(), want) and torch.equal(bits.cpu(), want_bits)
    dy = _block(n, n + 1)
    back = masked_by_bits(dy.to(DEVICE), bits).cpu()
    assert _same(back, dy.masked_fill(~(want > 0), 0.0))
    inplace = dy.clone().to(DEVICE)
    assert masked_by_bits(inplace, bits, out=inplace) is inplace
    assert _same(inplace.cpu(), back)


def test_what_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="contiguous float32"):
        relu_pack(torch.zeros(4, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="contiguous float32"):
        relu_pack(torch.zeros(8, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="2 bytes of bits for 24 entries"):
        masked_by_bits(torch.zeros(24, device=DEVICE), torch.zeros(2, dtype=torch.uint8,
                                                                   device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ops_relu_on_a_gpu_takes_the_kernels_with_torchs_numbers(monkeypatch):
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("PLEXUS_TRITON", flag)
        base = torch.randn(3000, 129, generator=torch.Generator().manual_seed(4)).cuda()
        base.requires_grad_(True)
        y = ReLU.apply(base * 1.0)
        (y * torch.arange(129, device="cuda")).sum().backward()
        outs.append((y.detach(), base.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
