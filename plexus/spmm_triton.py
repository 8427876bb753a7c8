"""The SpMM ``out = A X`` on a GPU reading a bf16 ``X`` (``--precision bf16``), as one Triton
kernel: float32 values of ``A``, float32 sums, float32 ``out``; imported only where ``triton``
is installed (:mod:`plexus.triton_switch`).

torch's CSR matmul takes one dtype for ``A``, ``X`` and the product, so a bf16 ``X`` had to be
widened to float32 first (a pass that writes twice the bytes it reads, and a product that
reads them again); cuSPARSE's bf16 SpMM would round ``A``'s values and the product to bf16. This
kernel gathers the bf16 rows (half the bytes of the product's main traffic) and keeps the
rest float32, the numbers of the float32 product of ``X.float()`` to float32 rounding.

Each program sums one row of ``A`` over a block of columns of ``X``: the row's nonzeros in
chunks of :data:`CHUNK`, each chunk's products summed, then added in order. Without a GPU the
kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``) on float32 ``X``, which is how
the tests compare it with torch's product on the CPU (tests/plexus/test_spmm_triton.py);
the interpreter has no bfloat16.

Shapes: A [n, m] CSR (int32 or int64 indices), x [m, d] -> out [n, d] float32
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["CHUNK", "csr_spmm"]

CHUNK = 16  # a row's nonzeros gathered at once
MAX_BLOCK_D = 128  # columns of X a program sums


@triton.jit
def _spmm_kernel(indptr, indices, values, x_ptr, out_ptr, d, accumulate: tl.constexpr,
                 block_d: tl.constexpr, chunk: tl.constexpr):
    row = tl.program_id(0)
    offs_d = tl.program_id(1) * block_d + tl.arange(0, block_d)
    in_d = offs_d < d
    start = tl.load(indptr + row).to(tl.int64)
    end = tl.load(indptr + row + 1).to(tl.int64)
    acc = tl.zeros([block_d], dtype=tl.float32)
    for j in range(start, end, chunk):
        offs = j + tl.arange(0, chunk)
        inside = offs < end
        cols = tl.load(indices + offs, mask=inside, other=0).to(tl.int64)
        vals = tl.load(values + offs, mask=inside, other=0.0).to(tl.float32)
        xs = tl.load(x_ptr + cols[:, None] * d + offs_d[None, :],
                     mask=inside[:, None] & in_d[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(vals[:, None] * xs, axis=0)
    at = row.to(tl.int64) * d + offs_d
    if accumulate:
        acc += tl.load(out_ptr + at, mask=in_d, other=0.0)
    tl.store(out_ptr + at, acc, mask=in_d)


def csr_spmm(a: torch.Tensor, x: torch.Tensor, out: torch.Tensor,
             accumulate: bool = False) -> torch.Tensor:
    """``out = A X`` (``accumulate``: ``out += A X``) for a torch CSR ``a`` with float32
    values, ``x`` float32 or bfloat16, ``out`` a contiguous float32 block on their device;
    returns ``out``.

    Raises:
        ValueError: shapes or dtypes that do not fit.
    """
    n, m = a.shape
    if x.dim() != 2 or x.shape[0] != m or tuple(out.shape) != (n, x.shape[1]):
        raise ValueError(f"csr_spmm of a {tuple(a.shape)} matrix with a {tuple(x.shape)} x "
                         f"into a {tuple(out.shape)} out")
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"csr_spmm writes a contiguous float32 out, not {out.dtype}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"csr_spmm reads a float32 or bfloat16 x, not {x.dtype}")
    d = x.shape[1]
    if n == 0 or d == 0:
        return out
    x = x.contiguous()
    block_d = min(MAX_BLOCK_D, triton.next_power_of_2(d))
    _spmm_kernel[(n, triton.cdiv(d, block_d))](
        a.crow_indices(), a.col_indices(), a.values(), x, out, d, accumulate=accumulate,
        block_d=block_d, chunk=CHUNK)
    return out
