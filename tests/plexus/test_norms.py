"""plexus.norms on one rank: the batch norm's numba kernels (plexus.norm_kernels) against its
torch composition, float32 and bf16-kept, with and without the ReLU after it.

The kernels add the column sums in float64, the composition in float32 (a matrix-vector
product): the outputs and gradients agree to a few float32 roundings (4e-6 relative; 2e-4 for
the gradients of a bf16-kept block, whose torch side sums the widened products in float32,
and those sums cancel: 5e-5 seen),
the running statistics likewise, and the ReLU's mask and the kept bf16 block are the same
bits. The kernels' sums are the same bits on 1 and 2 threads.
"""

import contextlib

import pytest
import torch

pytest.importorskip("numba")

from common.grid import AxisGroup
from plexus import norms, ops

ONE = AxisGroup("z", None, 1, 0)


@contextlib.contextmanager
def counting_fused_calls():
    """Counts the calls of the kernels' Function (``plexus.norms._FusedBatchNorm``) while the
    block runs: ``with counting_fused_calls() as calls: ...; calls[0]``."""
    calls = [0]
    apply = norms._FusedBatchNorm.apply

    def counted(*args):
        calls[0] += 1
        return apply(*args)

    norms._FusedBatchNorm.apply = counted
    try:
        yield calls
    finally:
        norms._FusedBatchNorm.apply = apply


def _run(fused, rows, width, keep, relu, over_grad, *, view=False):
    norms.FUSED_MIN_ENTRIES = 0 if fused else 1 << 62
    try:
        real = torch.ones(rows, dtype=torch.bool)
        real[-3:] = False  # padded rows: out of the statistics, in the affine map's gradient
        bn = norms.ShardedBatchNorm(width, real, rows - 3, ONE)
        gen = torch.Generator().manual_seed(rows + width)
        with torch.no_grad():
            bn.weight.copy_(torch.rand(width, generator=gen) + 0.5)
            bn.bias.copy_(torch.randn(width, generator=gen) * 0.1)
        x = (torch.randn(rows, width, generator=gen) * 2 + 1).requires_grad_()
        q = x * 1.0
        if view:  # not spent: the output is a new block
            q = q[:, :]
        with counting_fused_calls() as calls, ops.StoredIn(keep):
            y = bn(q, relu=relu, over_grad=over_grad)
        assert calls[0] == int(fused)
        out = y.detach().clone()
        y.backward(torch.randn(rows, width, generator=gen))
        return {"y": out, "dq": x.grad, "dw": bn.weight.grad, "db": bn.bias.grad,
                "mean": bn.running_mean, "var": bn.running_var}
    finally:
        norms.FUSED_MIN_ENTRIES = 1 << 16


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("keep", [None, torch.bfloat16])
@pytest.mark.parametrize("relu, over_grad", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("rows, width", [(2051, 32), (1500, 33), (9, 5)])
def test_kernels_equal_the_composition(keep, relu, over_grad, rows, width):
    got = _run(True, rows, width, keep, relu, over_grad)
    want = _run(False, rows, width, keep, relu, over_grad)
    for name in got:
        bound = 2e-4 if name in ("dw", "dq") and keep is not None else 4e-6
        assert _rel(got[name], want[name]) < bound, name
    if relu:  # the ReLU's mask: the same entries are zero
        assert torch.equal(got["y"] > 0, want["y"] > 0)


def test_a_view_is_not_written_over():
    got = _run(True, 600, 24, None, True, False, view=True)
    want = _run(False, 600, 24, None, True, False, view=True)
    assert _rel(got["dq"], want["dq"]) < 4e-6


def test_a_large_block_takes_the_kernels_by_default():
    rows, width = 1 << 11, 64  # 2^17 entries
    q = torch.randn(rows, width)
    assert norms._norm_kernels(q, torch.bfloat16) is not None
    assert norms._norm_kernels(q[:, :32], None) is None  # not contiguous
    assert norms._norm_kernels(q[:16], None) is None  # too small to pay
    assert norms._norm_kernels(q.double(), None) is None


def test_kernels_keep_torch_bf16_and_the_relu_mask_bits():
    from plexus import kernels, norm_kernels

    rows, width = 2051, 40
    q = torch.randn(rows, width) * 3
    q[5, 7] = float("nan")
    mean = torch.randn(width)
    scale, shift = torch.rand(width) + 0.5, torch.randn(width)
    out = torch.empty_like(q)
    kept = torch.empty(rows, width, dtype=torch.bfloat16)
    bits = torch.empty(-(-rows * width // 8), dtype=torch.uint8)
    norm_kernels.normalize(q.numpy(), mean.numpy(), scale.numpy(), shift.numpy(), out.numpy(),
                           kept.view(torch.uint16).numpy(), True, bits.numpy())
    centred = q - mean
    finite = ~centred.isnan()
    assert torch.equal(kept[finite], centred.to(torch.bfloat16)[finite])
    assert kept[5, 7].isnan()
    want = torch.addcmul(shift, centred, scale)
    relu_bits = torch.empty_like(bits)
    kernels.relu_pack(want.view(-1).numpy(), relu_bits.numpy())  # plexus.ops.ReLU's kernel
    assert torch.equal(bits, relu_bits)
    assert torch.allclose(out, want, rtol=1e-6, atol=1e-6, equal_nan=True)


_SUMS = """
import hashlib, sys
import numpy as np, torch
from plexus import norm_kernels
rows, width = 5000, 48
gen = torch.Generator().manual_seed(3)
dy, keep = torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)
mask = (torch.rand(rows, generator=gen) > 0.1).float()
bits = torch.randint(0, 256, (rows * width // 8,), dtype=torch.uint8, generator=gen)
chunks = norm_kernels.num_chunks(rows)
sums = np.empty((chunks, width))
norm_kernels.column_sums(dy.numpy(), mask.numpy(), keep[0].numpy(), True, sums)
grads = np.empty((chunks, 3, width))
norm_kernels.gradient_sums(dy.numpy(), keep.numpy(), mask.numpy(), True, bits.numpy(), grads)
import numba
print(numba.get_num_threads(), hashlib.sha256(sums.tobytes() + grads.tobytes()).hexdigest())
"""


def test_the_sums_are_the_same_bits_on_any_number_of_threads():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    got = []
    for threads in (1, 2):
        env = {**os.environ, "NUMBA_NUM_THREADS": str(threads), "PYTHONPATH": str(root)}
        out = subprocess.run([sys.executable, "-c", _SUMS], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
        got.append(out)
    assert [g[0] for g in got] == ["1", "2"]
    assert got[0][1] == got[1][1]
