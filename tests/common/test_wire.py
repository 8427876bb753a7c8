"""common.wire: the CPU passes of a sum whose messages are bf16 give torch's bits."""

import pytest
import torch

from common import wire
from common.grid import AxisGroup

BF16 = torch.bfloat16


def _awkward(n: int) -> torch.Tensor:
    """float32 over the whole range: subnormals, halfway cases, infinities, NaN, -0."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen) * torch.logspace(-44, 38, n)
    halfway = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)])  # ties to even
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 0.0, 1e-45,
                            3.4028235e38, -3.4028235e38, 3.3961e38])
    return torch.cat([x, halfway, special])


def test_rounding_to_bf16_is_torchs_and_widening_is_exact():
    x = _awkward(100_003)
    got = torch.empty(x.numel(), dtype=BF16)
    wire.to_bf16(x, got)
    want = x.to(BF16)
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(got), nan)  # a NaN stays a NaN; its bits are free
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    wide = torch.empty(x.numel())
    wire.from_bf16(got, wide)
    assert torch.equal(wide[~nan].view(torch.int32), want[~nan].float().view(torch.int32))
    strided = torch.empty(2 * x.numel())[::2]  # not contiguous: torch's copy
    wire.from_bf16(got, strided)
    assert torch.equal(strided[~nan], wide[~nan])


def test_chunks_add_up_in_float32_in_order():
    gen = torch.Generator().manual_seed(1)
    for g in (1, 2, 3, 8):
        parts = (torch.randn(g, 1001, generator=gen) * 1e3).to(BF16)
        want = parts[0].float()
        for j in range(1, g):
            want = want + parts[j].float()
        assert torch.equal(wire.add_chunks(parts), want), g
    # the order is j's: 2^24 + 1 + 1 left to right is 2^24 in float32 (1 + 1 first: 2^24 + 2)
    tiny = torch.tensor([[2.0**24], [1.0], [1.0]]).to(BF16)
    assert wire.add_chunks(tiny).item() == 2.0**24  # each 1 is lost against 2^24 in turn


def test_only_bf16_is_a_wire_dtype():
    group = AxisGroup("x", None, 2, 0, (0, 1))
    assert group.on_wire(BF16).wire is BF16 and group.on_wire(None).wire is None
    with pytest.raises(ValueError, match=r"torch\.bfloat16 or as they are"):
        group.on_wire(torch.float16)
