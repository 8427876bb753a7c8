"""One CSR block of a stationary adjacency (plexus.sparse keeps a grid of them).

A :class:`CSRBlock` holds ``indptr``, ``indices`` and ``values`` as numpy arrays (read-only
memory maps for a prepared dataset, or device arrays after ``BlockSparse.to``), and does what
one block needs on its own: row ranges and row subsets (the last layer's labelled rows), the
transpose, stacking, the check of a damaged file's arrays (:meth:`CSRBlock.problem`) and the
conversions to scipy and torch. The SpMM over a grid of blocks is plexus.sparse's.

Shapes:
    indptr [rows+1] int32/int64, indices [nnz] int32/int64, values [nnz] float32
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import scipy.sparse as sp
import torch

from plexus.slicing import ColumnSlicing


@dataclass
class CSRBlock:
    """One CSR block; the arrays may be read-only memory maps."""

    indptr: np.ndarray
    indices: np.ndarray
    values: np.ndarray
    shape: tuple[int, int]
    # the blocked kernel's plans, by slice width, built on first use (plexus.slicing)
    slicings: dict[int, ColumnSlicing] = field(default_factory=dict, init=False, repr=False,
                                               compare=False)

    @property
    def nnz(self) -> int:
        return int(self.indptr[-1] - self.indptr[0])  # a row-range view shares the arrays

    def row_range(self, lo: int, hi: int) -> CSRBlock:
        """Rows ``lo .. hi`` as a block that copies nothing: on the host a view of this
        block's arrays whose indptr still counts from this block's first nonzero (the numba
        kernels, the plans and :meth:`transpose` read positions from it; :meth:`to_scipy`
        and :meth:`to_torch` rebase); device arrays: indptr rebased (a copy of ``hi - lo + 1``
        entries), indices and values views. All rows: this block."""
        if lo == 0 and hi == self.shape[0]:  # the block itself, with its SpMM plans
            return self
        if isinstance(self.indptr, np.ndarray):
            return CSRBlock(self.indptr[lo:hi + 1], self.indices, self.values,
                            (hi - lo, self.shape[1]))
        start, end = int(self.indptr[lo]), int(self.indptr[hi])
        return CSRBlock(self.indptr[lo:hi + 1] - self.indptr[lo], self.indices[start:end],
                        self.values[start:end], (hi - lo, self.shape[1]))

    @property
    def nbytes(self) -> int:
        """Bytes of its row pointers and of its rows' nonzeros (a row-range view's share)."""
        return self.indptr.nbytes + self.nnz * (self.indices.itemsize + self.values.itemsize)

    def _rebased(self) -> tuple:
        """(indptr, indices, values) counting from 0: the arrays themselves, or a row-range
        view's rows (indptr copied)."""
        lo, hi = int(self.indptr[0]), int(self.indptr[-1])
        if lo == 0 and hi == self.indices.shape[0]:
            return self.indptr, self.indices, self.values
        return self.indptr - lo, self.indices[lo:hi], self.values[lo:hi]

    @classmethod
    def from_scipy(cls, m: sp.csr_matrix) -> CSRBlock:
        """int32 indices where they fit (a third less index memory), float32 values."""
        idx = np.int32 if max(m.nnz, *m.shape) < 2**31 else np.int64
        return cls(m.indptr.astype(idx), m.indices.astype(idx), m.data.astype(np.float32),
                   (int(m.shape[0]), int(m.shape[1])))

    def to_scipy(self) -> sp.csr_matrix:
        indptr, indices, values = self._rebased()
        return sp.csr_matrix((values, indices, indptr), shape=self.shape)

    def take_rows(self, rows: np.ndarray) -> CSRBlock:
        """Rows ``rows`` (ascending local row ids) gathered into a new block, each row's
        nonzeros in their stored order: a copy of ``len(rows) + 1`` indptr entries and of the
        rows' nonzeros (the source arrays, mapped or not, are only read).

        Shapes: [rows_in, m] -> [len(rows), m]
        """
        indptr = _host(self.indptr)
        rows = np.asarray(rows, dtype=np.int64)
        starts = indptr[rows].astype(np.int64)
        lengths = indptr[rows + 1].astype(np.int64) - starts
        out_ptr = np.zeros(rows.size + 1, dtype=indptr.dtype)
        np.cumsum(lengths, out=out_ptr[1:])
        take = np.repeat(starts - out_ptr[:-1], lengths) + np.arange(int(out_ptr[-1]))
        return CSRBlock(out_ptr, np.asarray(_host(self.indices))[take],
                        np.asarray(_host(self.values))[take],
                        (int(rows.size), self.shape[1]))

    def problem(self) -> str | None:
        """What is wrong with this block's arrays, or None: indptr not starting at 0, not
        ending at the nonzero count or decreasing; a column index outside the block; a NaN or
        infinite value. One pass over the arrays (numba; numpy without it), so a damaged file
        stops with a message instead of the kernel reading outside X."""
        indptr, indices, values = (_host(a) for a in (self.indptr, self.indices, self.values))
        kernels = numba_kernels() if indices.shape[0] >= 1 << 20 else None  # threads pay above
        if kernels is not None:
            code = int(kernels.csr_check(indptr, indices, values, self.shape[1]))
        else:
            code = (1 if indptr[0] != 0 or indptr[-1] != indices.shape[0] else
                    2 if (np.diff(indptr) < 0).any() else
                    3 if indices.size and (indices.min() < 0 or indices.max() >= self.shape[1])
                    else 4 if not np.isfinite(values).all() else 0)
        return [None, "its row pointers do not run from 0 to the nonzero count",
                "its row pointers decrease", f"a column index lies outside [0, {self.shape[1]})",
                "a value is NaN or infinite"][code]

    @classmethod
    def empty(cls, shape: tuple[int, int]) -> CSRBlock:
        """A block of ``shape`` without nonzeros."""
        return cls(np.zeros(shape[0] + 1, dtype=np.int32), np.zeros(0, dtype=np.int32),
                   np.zeros(0, dtype=np.float32), shape)

    @classmethod
    def vstack(cls, parts: list[CSRBlock]) -> CSRBlock:
        """The blocks ``parts`` (equal widths) one above the other, as one block (a copy)."""
        dtype = np.result_type(*(p.indptr.dtype for p in parts), *(p.indices.dtype
                                                                  for p in parts))
        nnz = np.cumsum([0] + [p.nnz for p in parts])
        arrays = [p._rebased() for p in parts]
        indptr = np.concatenate([np.zeros(1, dtype=dtype)] + [
            np.asarray(ptr[1:], dtype=dtype) + off for (ptr, _, _), off in zip(arrays, nnz)])
        return cls(indptr, np.concatenate([np.asarray(i, dtype=dtype) for _, i, _ in arrays]),
                   np.concatenate([v for _, _, v in arrays]),
                   (sum(p.shape[0] for p in parts), parts[0].shape[1]))

    def transpose(self) -> CSRBlock:
        """The CSR of this block's transpose, in memory, columns ascending in every row: a
        counting sort by column, O(nnz), the index dtype kept (numba's kernel, else a stable
        sort). Shapes: [n, m] -> [m, n]"""
        indptr, indices, values = (_host(a) for a in self._rebased())
        num_cols = self.shape[1]
        t_indptr = np.zeros(num_cols + 1, dtype=indices.dtype)
        np.cumsum(np.bincount(indices, minlength=num_cols), out=t_indptr[1:])
        t_indices = np.empty(indices.shape, dtype=indices.dtype)
        t_values = np.empty(values.shape, dtype=values.dtype)
        kernels = numba_kernels()
        if kernels is not None:
            kernels.csr_transpose(indptr, indices, values, t_indptr, t_indices, t_values)
        else:  # a stable sort keeps rows ascending inside each column
            rows = np.repeat(np.arange(indptr.size - 1, dtype=indices.dtype), np.diff(indptr))
            order = np.argsort(indices, kind="stable")
            t_indices[:], t_values[:] = rows[order], values[order]
        return CSRBlock(t_indptr, t_indices, t_values, (num_cols, self.shape[0]))

    def to_torch(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """A torch CSR tensor on ``device``: one copy of the arrays there (none on the CPU,
        where it shares memory with them; none either when the arrays already live on
        ``device``, as after :meth:`BlockSparse.to`)."""
        indptr, indices, values = self._rebased()
        with warnings.catch_warnings():  # "sparse CSR support is in beta"; non-writable maps
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_csr_tensor(
                torch.as_tensor(indptr), torch.as_tensor(indices),
                torch.as_tensor(values), size=self.shape, check_invariants=False,
            ).to(device)


def _host(a) -> np.ndarray:
    """A block array as numpy: itself, or a device tensor's host copy."""
    return a.cpu().numpy() if isinstance(a, torch.Tensor) else a


@cache
def numba_kernels():
    """plexus.kernels, or None without numba."""
    try:
        from plexus import kernels
    except ImportError:
        return None
    return kernels
