"""plexus.transpose: A^T @ X from A's own CSR, bit for bit the transposed CSR's product."""

import itertools

import numba
import numpy as np
import pytest
import scipy.sparse as sp
import torch

from plexus.sparse import BlockSparse, CSRBlock
from plexus.transpose import TransposedSparse, transposed_plan


def _csr(rows, cols, density, seed, *, skew=False, empty_rows=0):
    """A random float32 CSR block, sorted columns; ``skew``: a few columns hold most
    nonzeros (R-MAT-like in-degrees); the first ``empty_rows`` rows have no nonzeros."""
    rng = np.random.default_rng(seed)
    nnz = int(rows * cols * density)
    r = rng.integers(empty_rows, rows, nnz) if rows > empty_rows else np.zeros(0, int)
    c = (rng.zipf(1.6, r.size) * 7919) % cols if skew else rng.integers(0, cols, r.size)
    m = sp.csr_matrix((rng.standard_normal(r.size).astype(np.float32), (r, c)),
                      shape=(rows, cols))
    m.sum_duplicates()
    return CSRBlock.from_scipy(m)


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _stored(a: BlockSparse) -> BlockSparse:
    """The transposed CSR the layers stored before (rows ascending in each column)."""
    t = a.transpose()
    t.kernel = a.kernel
    return t


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_view_gives_the_stored_transposes_bits(threads, dtype):
    """Bands with empty blocks and empty rows, skewed columns, float32 and bf16 X (the sum is
    float32 either way), one and two kernel threads (a different wavefront): the bits of the
    row kernel and of the blocked kernel on the stored transpose."""
    before = numba.get_num_threads()
    torch_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)  # the kernels follow torch's count
        blocks = [[_csr(40, 30, 0.2, 1, skew=True), None, _csr(40, 50, 0.1, 2), None],
                  [None, None, None, None],
                  [_csr(70, 30, 0.3, 3, empty_rows=9), _csr(70, 20, 0.2, 4), None, None]]
        a = BlockSparse(blocks, [40, 5, 70], [30, 20, 50, 7])  # column band 3: no block
        view = TransposedSparse(a)
        assert view.shape == (107, 115) and view.nnz == a.nnz and view.nbytes == 0
        x = torch.randn(115, 24).to(dtype)
        got = view.matmul(x)
        assert got.dtype == torch.float32 and got.shape == (107, 24)
        stored = _stored(a)
        for kernel in ("numba-rows", "numba"):
            stored.to("cpu", kernel=kernel)
            assert torch.equal(_bits(got), _bits(stored.matmul(x))), kernel
        np.testing.assert_allclose(got.numpy(), a.to_scipy().T @ x.float().numpy(),
                                   rtol=1e-5, atol=1e-5)
        out = torch.full((107, 24), float("nan"))  # overwritten, not added to
        assert view.matmul(x, out=out) is out and torch.equal(out, got)
        assert torch.equal(out[100:], torch.zeros(7, 24))
    finally:
        torch.set_num_threads(torch_threads)
        numba.set_num_threads(before)


def test_row_ranges_add_up_to_the_whole_product():
    """The overlapped backward's pieces (plexus.ops.BlockedAggregation): A's row ranges,
    added into out in increasing order, give the bits of one product."""
    a = BlockSparse([[_csr(600, 500, 0.02, 5, skew=True)], [_csr(400, 500, 0.03, 6)]],
                    [600, 400], [500])
    view, dh = TransposedSparse(a), torch.randn(1000, 16)
    bounds = [0, 250, 600, 700, 1000]
    got = torch.zeros(500, 16)
    for lo, hi in itertools.pairwise(bounds):
        view.matmul(dh, out=got, cols=(lo, hi, tuple(bounds)))
    assert torch.equal(got, view.matmul(dh))
    assert torch.equal(got, _stored(a).matmul(dh))
    with pytest.raises(ValueError, match="pass out"):
        view.matmul(dh, cols=(0, 250, tuple(bounds)))
    with pytest.raises(ValueError, match="matmul of a"):
        view.matmul(torch.randn(999, 16))


def test_torch_kernel_and_stored_blocks_multiply_a_copy():
    """Where torch multiplies, the view makes (or takes from ``stored``) the transposed CSR,
    once, and counts its bytes; back on numba the copy goes."""
    a = BlockSparse.single(_csr(80, 60, 0.1, 7).to_scipy())
    x = torch.randn(80, 8)
    view = TransposedSparse(a).to("cpu", kernel="torch")
    assert view.nbytes > 0 and view._copy is not None
    np.testing.assert_allclose(view.matmul(x).numpy(), a.to_scipy().T @ x.numpy(), rtol=1e-5,
                               atol=1e-6)
    made = []

    def stored():
        made.append(1)
        return _stored(a)

    view = TransposedSparse(a, stored).to("cpu", kernel="torch")
    view.to("cpu", kernel="torch")  # moved again: the same copy
    assert made == [1]
    assert view.to("cpu", kernel="numba").nbytes == 0 and view._copy is None
    with pytest.raises(ValueError, match="unknown SpMM kernel"):
        view.to("cpu", kernel="fast")


def test_the_plan_slices_columns_per_thread_and_rows_by_work():
    blk = _csr(1000, 300, 0.05, 8, skew=True)
    starts, chunks = transposed_plan(blk, 3)
    assert starts.tolist() == [0, 50, 100, 150, 200, 250, 300]
    assert chunks[0] == 0 and chunks[-1] == 1000 and len(chunks) == 49
    assert np.all(np.diff(chunks) >= 0)
    assert transposed_plan(blk, 3)[0] is starts  # kept with the block
    tiny = _csr(3, 2, 0.5, 9)
    starts, chunks = transposed_plan(tiny, 8)
    assert starts.tolist() == [0, 1, 2] and chunks[-1] == 3
