"""plexus.dropout_triton, the GPU's dropout keep-mask as one Triton kernel, compiled on a GPU
and run in Triton's interpreter without one (``TRITON_INTERPRET=1``, CPU tensors): its bits
are the CPU hash's (plexus.dropout.keep_mask) for node ids beyond 2^32, keys above 2^31, odd
block shapes and every rate; the fused dropout gives the CPU's ``dropped`` values bit for
bit, and the mask; HashedDropout (the mask hashed again in backward, none kept) gives
apply_dropout's values and gradient; a kernel that fails at its first launch leaves the torch
hash; on a GPU, ``keep_mask(device="cuda")`` gives the same bits with the kernel and with the
torch hash (``PLEXUS_TRITON=0``), and so does the dropout of a layer."""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
triton = pytest.importorskip("triton")

from plexus import dropout  # noqa: E402
from plexus.dropout import _device_key, apply_dropout, dropped, keep_mask  # noqa: E402
from plexus.dropout_triton import HashedDropout, fused_dropout, keep_mask_triton  # noqa: E402


@pytest.mark.parametrize("p, seed, step, layer", [(0.5, 0, 1, 0), (0.1, 7, 123, 2),
                                                  (0.9, 2**40 + 5, 3, 65536)])
def test_the_kernels_bits_are_the_cpu_hashs(p, seed, step, layer):
    gen = torch.Generator().manual_seed(seed % 1000)
    rows = torch.randint(0, 2**34, (45,), generator=gen)  # ids mod 2^32, as the CPU's
    cols = torch.randint(0, 3000, (70,), generator=gen)
    want = keep_mask(p, seed=seed, step=step, layer=layer, rows=rows, cols=cols)
    key = _device_key(p, seed, step, layer, DEVICE)
    got = keep_mask_triton(rows.to(DEVICE), cols.to(DEVICE), key).cpu()
    assert got.dtype == torch.bool and torch.equal(got, want)
    assert 0 < want.float().mean() < 1
    # the step read from device memory: written there, the next mask is the next step's
    key.step.fill_(step + 1)
    got = keep_mask_triton(rows.to(DEVICE), cols.to(DEVICE), key).cpu()
    assert torch.equal(got, keep_mask(p, seed=seed, step=step + 1, layer=layer, rows=rows,
                                      cols=cols))
    assert not torch.equal(got, want)


def test_the_fused_dropout_is_the_cpus_values_and_mask():
    gen = torch.Generator().manual_seed(3)
    rows, cols = torch.arange(100, 133), torch.arange(5, 52)
    x = torch.randn(33, 47, generator=gen)
    p, key = 0.3, _device_key(0.3, 4, 9, 1, DEVICE)
    keep = keep_mask(p, seed=4, step=9, layer=1, rows=rows, cols=cols)
    y, got = (t.cpu() for t in fused_dropout(x.to(DEVICE), rows.to(DEVICE), cols.to(DEVICE),
                                             key, p))
    assert torch.equal(got, keep)
    assert torch.equal(y, dropped(x, ~keep, p))  # bit for bit
    with pytest.raises(ValueError, match="is not"):
        fused_dropout(x[:, :5], rows, cols, key, p)
    with pytest.raises(ValueError, match=r"float32, bfloat16 or float16 x, not torch\.float64"):
        fused_dropout(x.double(), rows, cols, key, p)
    for out in (torch.empty(47, 33).t(), torch.empty(33, 46), torch.empty(33, 47).double()):
        with pytest.raises(ValueError, match="writes a contiguous"):  # nothing written
            fused_dropout(x, rows, cols, key, p, out=out.to(DEVICE))
    if DEVICE == "cuda":  # (the interpreter computes in numpy, which has no bfloat16)
        y16, none = fused_dropout(x.bfloat16().to(DEVICE), rows.to(DEVICE), cols.to(DEVICE),
                                  key, p, with_mask=False)
        assert none is None and torch.equal(y16.cpu(), dropped(x.bfloat16(), ~keep, p))


@pytest.mark.parametrize("spent", [False, True])
def test_hashed_dropout_gives_apply_dropouts_values_and_gradient(spent):
    """Forward and backward each hash the mask again: no mask kept, the same numbers as the
    mask drawn, applied and kept as bits; ``spent`` writes over x and over the gradient."""
    gen = torch.Generator().manual_seed(5)
    rows, cols = torch.randint(0, 2**33, (29,), generator=gen), torch.arange(64, 101)
    w = torch.randn(37, 37, generator=gen)
    p, key = 0.5, _device_key(0.5, 1, 4, 2, DEVICE)
    keep = keep_mask(p, seed=1, step=4, layer=2, rows=rows, cols=cols)
    outs, grads = [], []
    for fused in (False, True):
        base = torch.randn(29, 37, generator=torch.Generator().manual_seed(9)).to(DEVICE)
        base.requires_grad_(True)
        x = base * 1.0  # a fresh non-leaf block, as a layer's input
        if fused:
            y = HashedDropout.apply(x, rows.to(DEVICE), cols.to(DEVICE), key, p, spent, spent)
        else:
            y = apply_dropout(x, keep.to(DEVICE), p, spent=spent)
        (y @ w.to(DEVICE)).square().sum().backward()
        outs.append(y.detach().cpu())
        grads.append(base.grad.cpu())
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    assert (outs[1] == 0).float().mean().item() == pytest.approx(0.5, abs=0.1)


def test_a_kernel_that_fails_at_its_first_launch_leaves_the_torch_paths(monkeypatch):
    from plexus import triton_switch

    monkeypatch.setattr(triton_switch, "_FAILED", [])
    monkeypatch.setattr(triton_switch, "_LAUNCHED", set())

    def broken(*args):
        raise RuntimeError("no C compiler")

    with pytest.warns(RuntimeWarning, match=r"failed at its first launch .*no C compiler"):
        assert triton_switch.launch(broken, 1) is None
    # nor used again in this process
    assert triton_switch.triton_function("dropout_triton", "keep_mask_triton") is None
    monkeypatch.setattr(triton_switch, "_FAILED", [])

    def works(x):
        if x < 0:
            raise RuntimeError("a later error")
        return x

    def short_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    def broken_device(*args):  # an earlier kernel's error, surfacing at this launch
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    for exc, fn in ((torch.OutOfMemoryError, short_of_memory), (ValueError, fused_dropout),
                    (torch.AcceleratorError, broken_device)):
        with pytest.raises(exc):  # not Triton's failing: raised, and Triton stays on
            triton_switch.launch(fn, torch.ones(2, 2), torch.ones(1), torch.ones(1), None, 0.5)
    assert not triton_switch._FAILED
    assert triton_switch.launch(works, 2) == 2
    with pytest.raises(RuntimeError, match="a later error"):  # once it ran, errors are raised
        triton_switch.launch(works, -1)
    assert triton_switch.triton_function("dropout_triton",
                                         "keep_mask_triton") is keep_mask_triton


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_keep_mask_on_a_gpu_is_the_kernels_and_the_torch_hashs(monkeypatch):
    rows, cols = torch.randint(0, 2**33, (1000,)), torch.arange(300)
    want = keep_mask(0.5, seed=1, step=2, layer=3, rows=rows, cols=cols)
    got = keep_mask(0.5, seed=1, step=2, layer=3, rows=rows, cols=cols, device="cuda")
    monkeypatch.setenv("PLEXUS_TRITON", "0")
    torch_hash = keep_mask(0.5, seed=1, step=2, layer=3, rows=rows, cols=cols, device="cuda")
    assert torch.equal(got.cpu(), want) and torch.equal(torch_hash.cpu(), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layer_dropout_on_a_gpu_hashes_in_the_kernel_with_the_masks_numbers(monkeypatch):
    rows, cols = torch.randint(0, 2**33, (5000,)).cuda(), torch.arange(128).cuda()
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("PLEXUS_TRITON", flag)
        x = torch.randn(5000, 128, generator=torch.Generator().manual_seed(1)).cuda()
        x.requires_grad_(True)
        y = dropout.hashed_dropout(x * 1.0, 0.5, seed=3, step=7, layer=1, rows=rows, cols=cols)
        if flag == "0":
            assert y is None  # Triton off: the caller draws and applies the mask
            keep = keep_mask(0.5, seed=3, step=7, layer=1, rows=rows, cols=cols, device="cuda")
            y = apply_dropout(x * 1.0, keep, 0.5)
        y.square().sum().backward()
        outs.append((y.detach(), x.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    # a mask kept as its key (layer 0's F' remade in backward): the kernel alone, no graph
    monkeypatch.setenv("PLEXUS_TRITON", "1")
    x = torch.randn(5000, 128, generator=torch.Generator().manual_seed(2)).cuda()
    again = dropout.hashed_dropout(x, 0.5, seed=3, step=dropout.step_tensor(7, "cuda"),
                                   layer=1, rows=rows, cols=cols, grad=False)
    keep = keep_mask(0.5, seed=3, step=7, layer=1, rows=rows, cols=cols, device="cuda")
    assert again.grad_fn is None and torch.equal(again, dropped(x, ~keep, 0.5))
