"""common.dense: ``mm`` equals ``torch.mm`` to float rounding on every backend and layout it
takes, falls back to torch where oneDNN does not apply, and refuses unknown backends."""

import pytest
import torch

from common import dense
from tests.rounding import assert_product_orders_agree

ONEDNN = pytest.mark.skipif(not dense.onednn_available(),
                            reason="this torch has no oneDNN linear primitive")


def _close(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``got`` is ``a @ b`` in some order of summation: oneDNN and MKL pick their kernels and
    blocking by backend, layout, shape and CPU, so every element is within ``gamma(k) (|a| |b|)``
    of the float64 product (``k`` the inner size; tests/rounding.py), and a wrong product
    is not."""
    assert got.dtype == a.dtype and got.shape == (a.shape[0], b.shape[1])
    assert_product_orders_agree(got, a, b, what="not a @ b")


@pytest.mark.cross_shape
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


ONEDNN_TN = pytest.mark.skipif(not dense.onednn_tn_available(),
                               reason="this torch cannot pair a tensor with oneDNN's")


def _paired(m: int, k: int, seed: int) -> torch.Tensor:
    t = dense.empty(m, k)
    t.copy_(torch.randn(m, k, generator=torch.Generator().manual_seed(seed)))
    return t


@pytest.mark.cross_shape
@pytest.mark.parametrize("backend", dense.BACKENDS)
@pytest.mark.parametrize("shape", [(3000, 64, 64), (4099, 100, 47), (70000, 3, 2), (5, 7, 3)])
def test_tn_is_the_transposed_product_on_every_backend(backend, shape):
    m, k, n = shape
    a, b = _paired(m, k, 1), _paired(m, n, 2)
    got = dense.tn(a, b, backend=backend)
    assert got.is_contiguous()
    _close(got, a.t(), b)
    _close(dense.tn(a.clone(), b, backend=backend), a.t(), b)  # not paired: torch
    _close(dense.tn(a[1:], b[1:], backend=backend), a[1:].t(), b[1:])  # views: torch


@ONEDNN_TN
def test_which_transposed_products_go_through_onednn():
    a, b = _paired(4096, 128, 1), _paired(4096, 64, 2)
    assert dense.uses_onednn_tn(a, b)
    assert not dense.uses_onednn_tn(a, b, "torch")
    assert not dense.uses_onednn_tn(a.clone(), b)  # torch's own memory
    assert not dense.uses_onednn_tn(a, b.clone())
    assert not dense.uses_onednn_tn(a[:4000], b[:4000])  # a part of the oneDNN tensor
    assert not dense.uses_onednn_tn(a[:, :64], b)
    assert not dense.uses_onednn_tn(a.t().contiguous().t()[:, :64], b)
    small_a, small_b = _paired(256, 256, 3), _paired(256, 8, 4)  # paired, too little work
    assert not dense.uses_onednn_tn(small_a, small_b)
    a.requires_grad_()
    assert not dense.uses_onednn_tn(a, b)  # autograd would not see the product
    with torch.no_grad():
        assert dense.uses_onednn_tn(a, b)
    assert dense.uses_onednn_tn(a.detach(), b)  # another tensor over the same memory: found


@ONEDNN_TN
def test_a_paired_tensor_is_an_ordinary_tensor_that_owns_its_memory():
    import gc

    t = dense.empty(1024, 96)
    assert t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
    assert t.shape == (1024, 96) and t.data_ptr() in dense._OWNERS
    t.numpy()[:] = 3.0  # numba and numpy write it through numpy
    view = t[10:20]
    addr = t.data_ptr()
    del t
    gc.collect()
    assert addr in dense._OWNERS and float(view.sum()) == 3.0 * 10 * 96  # the view keeps it
    del view
    gc.collect()
    assert addr not in dense._OWNERS  # freed with its last tensor: no stale address


def test_empty_pairs_only_large_float32_cpu_tensors(monkeypatch):
    def paired(t):
        return t.data_ptr() in dense._OWNERS

    assert not paired(dense.empty(8, 8))  # under PAIR_MIN
    assert not paired(dense.empty(1024, 96, dtype=torch.float64))
    assert not paired(dense.empty(1024, 96, dtype=torch.bfloat16))
    assert dense.empty(1024, 96, dtype=torch.float64).dtype == torch.float64
    assert paired(dense.empty(1024, 96)) == dense.onednn_tn_available()
    monkeypatch.setattr(dense, "onednn_tn_available", lambda: False)
    t = dense.empty(1024, 96)
    assert not paired(t) and t.shape == (1024, 96)


@ONEDNN_TN
def test_a_freed_buffer_serves_the_next_request_of_its_shape_or_a_smaller_one(pooling):
    import gc

    t = dense.empty(1024, 96)
    addr = t.data_ptr()
    del t
    gc.collect()
    assert pooling.pooled == 4 * 1024 * 96
    again = dense.empty(1024, 96)
    assert again.data_ptr() == addr and pooling.pooled == 0  # the same memory, no fresh pages
    assert dense.uses_onednn_tn(again, dense.empty(1024, 2048))
    del again
    gc.collect()
    narrower = dense.empty(2048, 32)  # 2/3 of the pooled buffer: its start
    assert narrower.data_ptr() == addr and narrower.shape == (2048, 32)
    assert not narrower._is_view() and narrower.is_contiguous()
    narrower.fill_(2.0)
    assert float(narrower.sum()) == 2.0 * 2048 * 32
    assert not dense.uses_onednn_tn(narrower, dense.empty(2048, 2048))  # not the whole: torch
    del narrower
    gc.collect()
    wider = dense.empty(4096, 96)  # more than it holds: a new buffer
    assert wider.data_ptr() != addr
    dense.pool_freed(False)
    assert pooling.free == [] and pooling.pooled == 0


@ONEDNN_TN
def test_the_pool_never_holds_more_than_was_in_use_at_once(pooling):
    """A miss hands back, oldest first, what would take the total (in use and pooled) beyond
    the most in use at once; hand_back_pooled empties the pool and leaves it on."""
    import gc

    small, big = 2048 * 64, 1024 * 512  # elements
    a, b = dense.empty(2048, 64), dense.empty(2048, 64)
    del a, b
    gc.collect()
    assert pooling.pooled == 2 * 4 * small
    c = dense.empty(1024, 80)  # served by one of them (5/8 of its size)
    d = dense.empty(1024, 512)  # a miss: a new mark, and the other would pass it: it goes
    assert pooling.pooled == 0 and pooling.in_use == 4 * (small + big)
    assert pooling.mark == 4 * (small + big)
    del c, d
    gc.collect()
    assert pooling.pooled == 4 * (small + big)
    e = dense.empty(4096, 300)  # a miss larger than both: a new mark, both go back
    assert pooling.pooled == 0 and pooling.in_use == 4 * 4096 * 300 == pooling.mark
    del e
    gc.collect()
    f = dense.empty(1024, 72)  # too small for e (1/16 of it): a miss; f + e > the mark
    assert pooling.pooled == 0 and pooling.in_use == 4 * 1024 * 72 <= pooling.mark
    del f
    gc.collect()
    assert pooling.pooled == 4 * 1024 * 72
    dense.hand_back_pooled()
    assert pooling.pooled == 0 and pooling.free == [] and pooling.enabled


@ONEDNN_TN
def test_a_larger_buffer_served_to_a_custom_function_can_be_modified_in_place(pooling):
    """A request served by the start of a larger pooled buffer is a tensor of its own, not a
    torch view: autograd forbids modifying a custom Function's view output in place (the
    bias is added to ``H W`` in place)."""
    import gc

    t = dense.empty(1024, 96)
    del t
    gc.collect()

    class Product(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return dense.mm(x, torch.eye(64), out=dense.empty(2048, 64))

        @staticmethod
        def backward(ctx, dy):
            return dy

    x = torch.randn(2048, 64, requires_grad=True)
    y = Product.apply(x)
    assert not y._is_view() and pooling.pooled == 0  # the pooled buffer served it
    y.add_(1.0).sum().backward()
    assert torch.equal(x.grad, torch.ones(2048, 64))


@ONEDNN_TN
def test_a_buffer_freed_while_the_pool_is_locked_is_queued_not_waited_for(pooling):
    """The last reference to a buffer can go inside ``_Pool.take`` itself, on the same thread:
    any allocation there may start a garbage collection that frees a cycle holding one. Its
    finalizer waited for the lock that thread held, and the rank hung (seen in a 4-rank CI
    run). Now it queues the buffer and the holder counts it."""
    import gc
    import threading

    class NoWait:
        """The pool's lock, raising where a blocking acquire would wait (for ever, here)."""

        def __init__(self):
            self.inner = threading.Lock()

        def acquire(self, blocking=True):
            got = self.inner.acquire(blocking=False)
            if not got and blocking:
                raise AssertionError("waited for the pool's lock")
            return got

        def release(self):
            self.inner.release()

        def __enter__(self):
            return self.acquire()

        def __exit__(self, *exc):
            self.release()

    pooling.lock = NoWait()
    t = dense.empty(1024, 96)
    addr = t.data_ptr()
    with pooling.lock:  # as take holds it
        del t
        gc.collect()
        assert len(pooling.returned) == 1 and pooling.pooled == 0 and pooling.in_use > 0
    again = dense.empty(1024, 96)  # take counts the queue first: the freed buffer serves it
    assert again.data_ptr() == addr and not pooling.returned
    assert pooling.in_use == 4 * 1024 * 96 and pooling.pooled == 0
    del again
    gc.collect()  # the lock is free: counted at once
    assert pooling.pooled == 4 * 1024 * 96 and pooling.in_use == 0 and not pooling.returned


@ONEDNN_TN
def test_garbage_collections_inside_the_pool_never_hang():
    """End to end: cycles holding buffers, collected at many points of ``empty`` (a small
    first-generation threshold moves where a collection starts; before the fix 6 of these 7
    thresholds hung), in a child process so that a hang fails the test instead of the suite."""
    import subprocess
    import sys

    from tests.distributed import ROOT

    code = """
import gc
from common import dense
for threshold in range(7, 14):
    gc.set_threshold(threshold, 1, 1)
    for i in range(1500):
        class Cycle: pass
        c = Cycle(); c.c = c; c.t = dense.empty(300, 256)
        del c
        junk = [[] for _ in range(i % 7)]
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_a_disabled_pool_keeps_nothing():
    import gc

    dense.pool_freed(False)
    t = dense.empty(1024, 96)
    del t
    gc.collect()
    assert dense._POOL.pooled == 0 and dense._POOL.free == []


def test_can_overwrite_says_where_writing_over_a_block_serves_as_a_new_one():
    small, wide = torch.randn(37, 11), torch.randn(4, 8, 1024)  # never paired: any will do
    assert dense.can_overwrite(small) and dense.can_overwrite(wide)
    assert not dense.can_overwrite(small.t())
    assert not dense.can_overwrite(torch.ones(()).expand(3, 4))
    big = torch.randn(1024, 96)
    assert dense.can_overwrite(big) == (not dense.onednn_tn_available())  # unpaired: tn can't
    assert dense.can_overwrite(dense.empty(1024, 96))
    assert not dense.can_overwrite(dense.empty(2048, 96)[:1024])  # a part of one
    with pytest.warns(DeprecationWarning, match="now common.dense.can_overwrite"):
        assert dense.like_empty(small)  # the former name, for a release


def test_empty_like_is_contiguous_and_pairs_2d_blocks():
    block = torch.randn(96, 1024).t()  # a non-contiguous 2-D block
    got = dense.empty_like(block)
    assert got.shape == block.shape and got.dtype == block.dtype and got.is_contiguous()
    assert (got.data_ptr() in dense._OWNERS) == dense.onednn_tn_available()
    cube = torch.randn(4, 8, 2048).transpose(0, 2)
    got = dense.empty_like(cube)
    assert got.shape == cube.shape and got.is_contiguous() and got.data_ptr() not in dense._OWNERS


@pytest.mark.parametrize("backend", dense.BACKENDS)
def test_tn_widens_a_bf16_operand_a_row_block_at_a_time(backend, monkeypatch):
    """``tn`` of a bf16 ``a`` and a float32 ``b`` is ``a.float()^T b``: the bits of the
    whole widened copy's product where that copy fits ``WIDEN_BYTES``, and above it the same
    product summed over row blocks (each block's sum in float32) to float rounding; the
    planner charges the copy that ``WIDEN_BYTES`` bounds."""
    from common.perf import gcn_memory

    assert gcn_memory.WIDEN_BYTES == dense.WIDEN_BYTES
    g = torch.Generator().manual_seed(5)
    a = torch.randn(5003, 48, generator=g).to(torch.bfloat16)
    b = dense.empty(5003, 20).copy_(torch.randn(5003, 20, generator=g))
    whole = dense.tn(a, b, backend=backend)
    wide = dense.empty(5003, 48).copy_(a.float())
    assert torch.equal(whole, dense.tn(wide, b, backend=backend))
    monkeypatch.setattr(dense, "WIDEN_BYTES", 48 * 4 * 700)  # 700 rows a block: 8 blocks
    blocked = dense.tn(a, b, backend=backend)
    assert blocked.dtype == torch.float32 and blocked.shape == (48, 20)
    assert_product_orders_agree(blocked.t(), b.t(), a.float(), what="not a^T b")



@ONEDNN_TN
def test_tn_of_a_large_bf16_operand_runs_its_row_blocks_through_onednn(monkeypatch):
    """Above ``WIDEN_BYTES`` each row block of ``a`` (widened) and of ``b`` is copied into
    buffers of ``empty`` and the blocks' products go through oneDNN (all but a last block
    below ``PAIR_MIN``), added in row order: ``a.float()^T b`` to float rounding."""
    calls = []
    real = dense._onednn_tn
    monkeypatch.setattr(dense, "_onednn_tn", lambda x, y: calls.append(1) or real(x, y))
    monkeypatch.setattr(dense, "WIDEN_BYTES", 4 * (64 + 48) * 2000)  # 2000 rows a block
    g = torch.Generator().manual_seed(6)
    a = torch.randn(9003, 64, generator=g).to(torch.bfloat16)
    b = dense.empty(9003, 48).copy_(torch.randn(9003, 48, generator=g))
    got = dense.tn(a, b)
    assert len(calls) == 4  # 4 blocks of 2000 rows; the last 1003 rows too few to pair
    assert got.dtype == torch.float32 and got.shape == (64, 48)
    assert_product_orders_agree(got.t(), b.t(), a.float(), what="not a^T b")
    calls.clear()
    assert_product_orders_agree(dense.tn(a, b, backend="torch").t(), b.t(), a.float(),
                                what="not a^T b")
    assert calls == []  # torch's backend: torch's products


def test_tf32_is_auto_on_the_cpu_and_tensor_cores_on_a_gpu_for_the_call_only():
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(3000, 64, generator=g), torch.randn(64, 64, generator=g)
    assert torch.equal(dense.mm(a, b, backend="tf32"), dense.mm(a, b))  # the CPU: auto's
    matmul = torch.backends.cuda.matmul
    name, on = (("fp32_precision", "tf32") if hasattr(matmul, "fp32_precision")
                else ("allow_tf32", True))
    before = getattr(matmul, name)
    assert before != on
    gpu = SimpleNamespace(device=torch.device("cuda"))  # the setting is a flag: no GPU needed
    with dense.tensor_cores("tf32", gpu):
        assert getattr(matmul, name) == on
    assert getattr(matmul, name) == before
    with pytest.raises(RuntimeError, match="inside"), dense.tensor_cores("tf32", gpu):
        raise RuntimeError("inside")
    assert getattr(matmul, name) == before  # put back on an error too
    for backend, t in (("auto", gpu), ("torch", gpu), ("tf32", a)):  # (a: a CPU tensor)
        with dense.tensor_cores(backend, t):
            assert getattr(matmul, name) == before


@ONEDNN_TN
@pytest.mark.parametrize("shape", [(1024, 96), (1023, 97)])  # an even and an odd count
def test_a_tall_bf16_block_lies_in_a_pooled_buffer_and_comes_back_to_it(pooling, shape):
    """A bf16 block from ``empty`` is an ordinary contiguous tensor over a float32 buffer of
    the pool (not one ``tn`` reads), and its memory serves the next request once freed."""
    import gc

    t = dense.empty(*shape, dtype=torch.bfloat16)
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == shape and t.is_contiguous()
    assert t.data_ptr() not in dense._OWNERS
    t.fill_(1.5)
    assert float(t.float().sum()) == 1.5 * shape[0] * shape[1]
    addr = t.data_ptr()
    del t
    gc.collect()
    assert pooling.pooled == 4 * ((shape[0] * shape[1] + 1) // 2)
    assert dense.empty(*shape, dtype=torch.bfloat16).data_ptr() == addr  # no fresh pages


def test_converted_is_to_with_the_same_bits():
    x = torch.randn(1000, 70)
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0e38])
    got = dense.converted(x, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.is_contiguous()
    assert torch.equal(got.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    assert dense.converted(got, torch.bfloat16) is got  # already that dtype: itself
    wide = dense.converted(got, torch.float32)
    assert torch.equal(wide.view(torch.int32), got.float().view(torch.int32))
    v = torch.randn(5000)  # not 2-D: torch's own
    assert torch.equal(dense.converted(v, torch.bfloat16), v.to(torch.bfloat16))


@ONEDNN_TN
def test_bf16_blocks_and_float32_blocks_do_not_take_each_others_buffers(pooling):
    """A bf16 block (and ``tn``'s whole copies) takes only a pooled buffer of its own shape:
    a freed float32 block's buffer waits for the next float32 block, which then needs no
    fresh pages, and a larger pooled buffer is not cut down for a whole request."""
    import gc

    big = dense.empty(16384, 256)  # the most in use at once (the pool's bound) 16 MiB
    del big
    gc.collect()
    t = dense.empty(4096, 128)  # (the 16 MiB buffer, over 4x its size, is handed back)
    addr = t.data_ptr()
    del t
    gc.collect()
    assert pooling.pooled == 4 * 4096 * 128
    half = dense.converted(torch.randn(4096, 128), torch.bfloat16)
    assert half.data_ptr() != addr and pooling.pooled == 4 * 4096 * 128  # not taken
    again = dense.empty(4096, 128)
    assert again.data_ptr() == addr and dense.uses_onednn_tn(again, dense.empty(4096, 64))
    del again
    gc.collect()
    whole = dense.empty(3000, 128, whole=True)  # smaller than the pooled one
    assert whole.data_ptr() != addr and dense._onednn_of(whole) is not None
    assert [4096, 128] in [list(b.shape) for b in pooling.free]  # left in the pool
