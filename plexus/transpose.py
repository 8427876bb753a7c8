"""``A^T`` of a stationary adjacency without a second copy of it (docs/design/plexus-3d.md
section 13).

Every layer's backward multiplies by the transpose of its block (``dF = A^T dH``). Storing
that transpose as CSR doubles the adjacency, the largest thing a rank holds. A
:class:`TransposedSparse` reads ``A``'s own CSR blocks instead: on the CPU with numba,
:func:`plexus.kernels.csr_spmm_t` walks A's rows once and adds ``values[j] * x[i]`` into row
``indices[j]`` of the output, its columns cut into slices that threads own, so no two threads
write one row and every output row takes its terms in increasing row order, the order the row
kernel sums a transposed CSR in: the bits of ``A.transpose().matmul(x)``.

Where the product runs on torch's kernel (a GPU, ``--spmm torch``, no numba) the view needs
the transposed CSR after all: it takes it from ``stored`` (a prepared dataset's blocks of the
other parity where they are the transpose, so a device holds one copy of each, or a transpose
the dataset made once for every layer that reads it) or makes it from ``A``, once, when it
moves (:meth:`TransposedSparse.to`, before ``A`` itself moves) or on first use.

Shapes:
    A [n, m]; TransposedSparse(A) [m, n]; matmul: [n, d] -> [m, d]
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from plexus import slicing
from plexus.csr import CSRBlock, numba_kernels
from plexus.sparse import SPMM_KERNELS, BlockSparse, _kernel_array, _set_numba_threads, product_out

__all__ = ["TransposedSparse", "transposed_plan"]

SLICES_PER_THREAD = 2  # column slices per kernel thread: a slow slice delays fewer others
CHUNKS_PER_SLICE = 8  # row chunks per slice: the wavefront's fill and drain are 1/8 of it


def transposed_plan(block: CSRBlock, threads: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts ``[S + 1]``, chunks ``[C + 1]``) of :func:`plexus.kernels.csr_spmm_t` for
    ``threads`` threads: columns in ``SLICES_PER_THREAD * threads`` slices of equal width,
    rows in ``CHUNKS_PER_SLICE`` times as many chunks of equal work (nonzeros + rows); built
    once per block and thread count, kept in ``block.slicings``."""
    key = ("transposed", int(threads))
    plan = block.slicings.get(key)
    if plan is None:
        cols = block.shape[1]
        s = max(1, min(SLICES_PER_THREAD * threads, cols))
        starts = (np.arange(s + 1, dtype=np.int64) * cols) // s
        plan = block.slicings[key] = (starts,
                                      slicing.work_chunks(block.indptr, CHUNKS_PER_SLICE * s))
    return plan


class TransposedSparse:
    """``A^T`` for a :class:`~plexus.sparse.BlockSparse` ``A``, sharing its blocks.

    It answers what the layers ask of a transpose: :attr:`shape`, :meth:`matmul` (with
    ``out`` and ``cols``), :meth:`to`, :attr:`nnz` and :meth:`arrays` (A's arrays, so a
    shard's distinct bytes count them once).

    Args:
        base: ``A``.
        stored: gives the CSR of ``A^T`` as a :class:`BlockSparse` where torch multiplies
            (default: ``A.transpose()``, a copy).
    """

    def __init__(self, base: BlockSparse,
                 stored: Callable[[], BlockSparse] | None = None) -> None:
        self.base = base
        self._stored = stored
        self.kernel = base.kernel
        self.device = base.device
        self._copy: BlockSparse | None = None  # the transposed CSR, where torch multiplies

    @property
    def shape(self) -> tuple[int, int]:
        return self.base.shape[1], self.base.shape[0]

    @property
    def nnz(self) -> int:
        return self.base.nnz

    @property
    def nbytes(self) -> int:
        """Bytes this view adds to its matrix: the transposed copy's, where there is one."""
        return 0 if self._copy is None else self._copy.nbytes

    def arrays(self):
        """A's arrays (and the transposed copy's, where there is one)."""
        yield from self.base.arrays()
        if self._copy is not None:
            yield from self._copy.arrays()

    def to_scipy(self):
        """The whole transpose, assembled (tests and small graphs only)."""
        return self.base.to_scipy().T.tocsr()

    def to(self, device: torch.device | str, *, kernel: str | None = None,
           uploaded: dict | None = None) -> TransposedSparse:
        """Multiply on ``device`` with ``kernel`` (:meth:`BlockSparse.to`; the base matrix
        moves by itself, after this view: a transposed copy is made from host blocks). On the
        CPU's numba kernels nothing is copied; elsewhere the transposed CSR is made (or taken
        from ``stored``) now and moved there, sharing ``uploaded`` with the other matrices."""
        if kernel is not None and kernel not in SPMM_KERNELS:
            raise ValueError(f"unknown SpMM kernel {kernel!r}; choose from {SPMM_KERNELS}")
        self.kernel = kernel or self.kernel
        self.device = torch.device(device)
        if not self._needs_copy():
            self._copy = None
        elif self._copy is not None:  # (a matrix that several layers share moves again)
            self._copy.to(self.device, kernel=self.kernel, uploaded=uploaded)
        else:
            self._make_copy(uploaded)
        return self

    def _needs_copy(self) -> bool:
        return (self.device.type != "cpu" or self.kernel == "torch"
                or numba_kernels() is None)

    def _make_copy(self, uploaded: dict | None = None) -> BlockSparse:
        copy = self._stored() if self._stored is not None else self.base.transpose()
        self._copy = copy.to(self.device, kernel=self.kernel, uploaded=uploaded)
        return self._copy

    def matmul(self, x: torch.Tensor, *, out: torch.Tensor | None = None,
               cols: tuple[int, int, tuple[int, ...]] | None = None,
               **kwargs) -> torch.Tensor:
        """``A^T @ x``, as :meth:`BlockSparse.matmul` of the transposed CSR gives it (the
        same bits; ``cols=(lo, hi, bounds)`` reads only A's rows ``lo .. hi`` and adds into
        ``out``). The blocked kernel's other options (``slice_cols`` ...) apply to the
        transposed copy only.

        Shapes: x [n, d] -> [m, d]
        """
        if self._needs_copy():
            copy = self._copy if self._copy is not None else self._make_copy()
            return copy.matmul(x, out=out, cols=cols, **kwargs)
        n, m = self.base.shape
        if x.shape[0] != n:
            raise ValueError(f"matmul of a {self.shape} matrix with a {tuple(x.shape)} one")
        x = x.detach().contiguous()
        d = x.shape[1]
        if out is None and cols is not None:
            raise ValueError("matmul(cols=...) adds into out: pass out")
        out = product_out(out, m, x)
        lo, hi = (0, n) if cols is None else (cols[0], cols[1])
        kernels = numba_kernels()
        _set_numba_threads()
        threads = kernels.numba.get_num_threads()
        xn, outn = _kernel_array(x), out.numpy()
        ahead = slicing.lookahead(4 * d)  # output rows (float32) prefetched ahead
        ro, co = self.base.row_offsets, self.base.col_offsets
        for c in range(len(co) - 1):
            band = outn[co[c]:co[c + 1]]
            first = cols is None  # a column range adds into out
            for r, row in enumerate(self.base.blocks):
                b = row[c]
                a, z = max(lo, ro[r]) - ro[r], min(hi, ro[r + 1]) - ro[r]
                if b is None or a >= z:
                    continue
                starts, chunks = transposed_plan(b, threads)
                cursor = np.empty(b.shape[0], dtype=b.indptr.dtype)
                kernels.csr_spmm_t(b.indptr, b.indices, b.values, xn[ro[r]:ro[r + 1]], band,
                                   not first, starts, chunks, cursor, a, z, ahead)
                first = False
            if first:  # no block in this column band
                band.fill(0)
        return out
