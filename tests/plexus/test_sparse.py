"""plexus.sparse: BlockSparse SpMM (numba and torch kernels) against scipy."""

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from plexus.sparse import BlockSparse, CSRBlock


def test_block_sparse_matmul_matches_scipy():
    rng = np.random.default_rng(0)
    row_sizes, col_sizes = [5, 0, 7], [4, 6]
    blocks = [[None, CSRBlock.from_scipy(sp.random(5, 6, 0.4, format="csr", random_state=1))],
              [None, None],
              [CSRBlock.from_scipy(sp.random(7, 4, 0.3, format="csr", random_state=2)), None]]
    m = BlockSparse(blocks, row_sizes, col_sizes)
    full = m.to_scipy().toarray()
    for dtype in (torch.float32, torch.float64):
        x = torch.from_numpy(rng.standard_normal((10, 3))).to(dtype)
        want = full @ x.double().numpy()
        for kernel in ("numba", "torch"):
            got = m.to("cpu", kernel=kernel).matmul(x)
            assert got.dtype == dtype
            np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-6)
    wide = sp.random(3, 5, 0.5, format="csr", random_state=3)
    one = CSRBlock(wide.indptr.astype(np.int64), wide.indices.astype(np.int64),
                   wide.data.astype(np.float32), (3, 5))
    np.testing.assert_allclose(BlockSparse([[one]], [3], [5]).matmul(torch.ones(5, 2)).numpy(),
                               wide @ np.ones((5, 2)), rtol=1e-6)
    with pytest.raises(ValueError, match="has shape"):
        BlockSparse([[one]], [4], [5])




def test_unknown_kernel_is_refused():
    m = BlockSparse.single(sp.identity(3, format="csr", dtype=np.float32))
    with pytest.raises(ValueError, match="unknown SpMM kernel"):
        m.to("cpu", kernel="cusparse")
