"""plexus.spmm_triton, the GPU's SpMM of a bf16 X (float32 values, sums and product), compiled
on a GPU and run in Triton's interpreter without one (``TRITON_INTERPRET=1``, CPU tensors,
float32 X: the interpreter has no bfloat16): equal to torch's product to float32 rounding,
with int32 and int64 indices, empty rows, widths that do not fill a block, and added into an
existing product; on a GPU a bf16 X gives the float32 product of ``X.float()``, and
BlockSparse.matmul takes this kernel for a bf16 X."""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
triton = pytest.importorskip("triton")

from plexus.spmm_triton import CHUNK, csr_spmm  # noqa: E402


def _matrix(n, m, density, seed, index_dtype):
    """A random [n, m] CSR matrix (float32 values) with some empty rows, and its dense copy."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.rand(n, m, generator=gen) * (torch.rand(n, m, generator=gen) < density)
    dense[::7] = 0  # empty rows
    dense[3, : 3 * CHUNK + 5] = 1.5  # a row longer than several chunks
    a = dense.to_sparse_csr()
    a = torch.sparse_csr_tensor(a.crow_indices().to(index_dtype),
                                a.col_indices().to(index_dtype), a.values(), a.shape)
    return a, dense


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("d", [1, 37, 160])
def test_the_kernel_is_torchs_product_to_float32_rounding(index_dtype, d):
    a, dense = _matrix(45, 60, 0.2, d, index_dtype)
    x = torch.randn(60, d, generator=torch.Generator().manual_seed(1))
    want = dense.double() @ x.double()
    out = torch.full((45, d), float("nan"), device=DEVICE)  # written over, never read
    got = csr_spmm(a.to(DEVICE), x.to(DEVICE), out).cpu()
    scale = (dense.double().abs() @ x.double().abs()).clamp_min(1e-30)
    assert ((got.double() - want).abs() / scale).max() < 1e-6
    base = torch.randn(45, d, generator=torch.Generator().manual_seed(2))
    added = csr_spmm(a.to(DEVICE), x.to(DEVICE), base.clone().to(DEVICE),
                     accumulate=True).cpu()
    assert ((added.double() - base.double() - want).abs() / (scale + 1)).max() < 1e-6


def test_shapes_and_dtypes_that_do_not_fit_are_refused():
    a, _ = _matrix(5, 6, 0.5, 0, torch.int64)
    a, x = a.to(DEVICE), torch.randn(6, 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"of a \(5, 6\) matrix with a \(6, 3\) x"):
        csr_spmm(a, x[:, :3], torch.empty(5, 4, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous float32 out"):
        csr_spmm(a, x, torch.empty(5, 4, device=DEVICE, dtype=torch.float64))
    with pytest.raises(ValueError, match="float32 or bfloat16 x"):
        csr_spmm(a, x.double(), torch.empty(5, 4, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_bf16_x_on_a_gpu_gives_the_float32_product_and_blocksparse_takes_it():
    import scipy.sparse as sp

    from plexus.sparse import BlockSparse

    a, dense = _matrix(2000, 3000, 0.01, 5, torch.int32)
    x = torch.randn(3000, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = dense.double() @ x.double()  # the bf16 values, widened exactly
    got = csr_spmm(a.cuda(), x.cuda(), torch.empty(2000, 128, device="cuda")).cpu()
    scale = (dense.double().abs() @ x.double().abs()).clamp_min(1e-30)
    assert ((got.double() - want).abs() / scale).max() < 1e-6
    blocks = BlockSparse.single(sp.csr_matrix(dense.numpy())).to(torch.device("cuda"))
    product = blocks.matmul(x.cuda())
    assert product.dtype == torch.float32
    assert ((product.cpu().double() - want).abs() / scale).max() < 1e-6
