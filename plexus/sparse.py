"""Stationary adjacency blocks and the CPU SpMM kernel Plexus runs on them.

A :class:`BlockSparse` is an ``[n, m]`` matrix kept as a grid of CSR blocks: rows cut at
``row_sizes``, columns at ``col_sizes``. The in-memory source (plexus.data.memory) uses one
block; a prepared dataset (plexus.data.mapped) gives one block per ``k x k`` file block the
rank owns, each memory-mapped from disk, so loading copies and concatenates nothing.

``A @ X`` on CPU runs a numba kernel, parallel over rows, that writes each output row once:
no zero-fill pass and no result copy (torch's CSR matmul does both on CPU), and the blocks of a
block row accumulate into the same output rows. On the 200K-node bench graph it is about 2.7x
faster than ``torch.mm`` on a CSR tensor (bench/gcn_epoch.py prints both). Without numba, on
a GPU, or with ``kernel="torch"`` (``plexus.train --spmm torch``), each block goes through
``torch.sparse`` instead.

Shapes:
    CSRBlock:  indptr [rows+1] int32/int64, indices [nnz] int32/int64, values [nnz] float32
    matmul:    [n, m] @ [m, d] -> [n, d]
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cache

import numpy as np
import scipy.sparse as sp
import torch

SPMM_KERNELS = ("auto", "numba", "torch")


@dataclass
class CSRBlock:
    """One CSR block; the arrays may be read-only memory maps."""

    indptr: np.ndarray
    indices: np.ndarray
    values: np.ndarray
    shape: tuple[int, int]

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    @property
    def nbytes(self) -> int:
        return self.indptr.nbytes + self.indices.nbytes + self.values.nbytes

    @classmethod
    def from_scipy(cls, m: sp.csr_matrix) -> CSRBlock:
        """int32 indices where they fit (a third less index memory), float32 values."""
        idx = np.int32 if max(m.nnz, *m.shape) < 2**31 else np.int64
        return cls(m.indptr.astype(idx), m.indices.astype(idx), m.data.astype(np.float32),
                   (int(m.shape[0]), int(m.shape[1])))

    def to_scipy(self) -> sp.csr_matrix:
        return sp.csr_matrix((self.values, self.indices, self.indptr), shape=self.shape)

    def to_torch(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """A torch CSR tensor on ``device`` (shares memory with the arrays on CPU)."""
        with warnings.catch_warnings():  # "sparse CSR support is in beta"; non-writable maps
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_csr_tensor(
                torch.as_tensor(self.indptr), torch.as_tensor(self.indices),
                torch.as_tensor(self.values), size=self.shape, check_invariants=False,
            ).to(device)


class BlockSparse:
    """An ``[n, m]`` sparse matrix as a grid of :class:`CSRBlock` (None = empty block).

    Args:
        blocks: ``blocks[r][c]`` is the block of row band ``r`` and column band ``c``.
        row_sizes, col_sizes: heights of the row bands, widths of the column bands.
    """

    def __init__(self, blocks: list[list[CSRBlock | None]], row_sizes: list[int],
                 col_sizes: list[int]) -> None:
        if len(blocks) != len(row_sizes) or any(len(r) != len(col_sizes) for r in blocks):
            raise ValueError("blocks must be a len(row_sizes) x len(col_sizes) grid")
        for r, row in enumerate(blocks):
            for c, b in enumerate(row):
                if b is not None and b.shape != (row_sizes[r], col_sizes[c]):
                    raise ValueError(f"block ({r}, {c}) has shape {b.shape}, expected "
                                     f"{(row_sizes[r], col_sizes[c])}")
        self.blocks = blocks
        self.row_offsets = np.concatenate([[0], np.cumsum(row_sizes)]).astype(int).tolist()
        self.col_offsets = np.concatenate([[0], np.cumsum(col_sizes)]).astype(int).tolist()
        self.shape = (self.row_offsets[-1], self.col_offsets[-1])
        self.device = torch.device("cpu")
        self.kernel = "auto"
        self._torch: dict[tuple[int, int], torch.Tensor] = {}

    @classmethod
    def single(cls, m: sp.csr_matrix) -> BlockSparse:
        """One block holding all of ``m``."""
        return cls([[CSRBlock.from_scipy(m)]], [m.shape[0]], [m.shape[1]])

    def present(self):
        """Yield ``(r, c, block)`` for every stored block."""
        for r, row in enumerate(self.blocks):
            for c, b in enumerate(row):
                if b is not None:
                    yield r, c, b

    @property
    def nnz(self) -> int:
        return sum(b.nnz for _, _, b in self.present())

    @property
    def nbytes(self) -> int:
        """Bytes of all index and value arrays (mapped or not)."""
        return sum(b.nbytes for _, _, b in self.present())

    def arrays(self):
        """Yield every index and value array (to count distinct memory across matrices)."""
        for _, _, b in self.present():
            yield from (b.indptr, b.indices, b.values)

    def to_scipy(self) -> sp.csr_matrix:
        """The whole matrix, assembled (tests and small graphs only)."""
        grid = [[b.to_scipy() if b is not None else None for b in row] for row in self.blocks]
        for r, row in enumerate(grid):  # sp.bmat needs a known shape in every band
            for c, b in enumerate(row):
                if b is None:
                    row[c] = sp.csr_matrix((self.row_offsets[r + 1] - self.row_offsets[r],
                                            self.col_offsets[c + 1] - self.col_offsets[c]),
                                           dtype=np.float32)
        return sp.bmat(grid, format="csr", dtype=np.float32)

    def to(self, device: torch.device | str, *, kernel: str | None = None) -> BlockSparse:
        """Use ``device`` for :meth:`matmul`; off CPU the blocks become torch CSR tensors there.

        Args:
            device: where :meth:`matmul` runs.
            kernel: the CPU SpMM: ``"auto"`` (numba when installed, else torch), ``"numba"``
                (ImportError without numba) or ``"torch"`` (torch.sparse); None keeps it.
        """
        if kernel is not None:
            if kernel not in SPMM_KERNELS:
                raise ValueError(f"unknown SpMM kernel {kernel!r}; choose from {SPMM_KERNELS}")
            if kernel == "numba" and _load_numba() is None:
                raise ImportError("the numba SpMM kernel needs numba: pip install numba, or "
                                  "use --spmm torch")
            self.kernel = kernel
        self.device = torch.device(device)
        self._torch = ({} if self.device.type == "cpu" else
                       {(r, c): b.to_torch(self.device) for r, c, b in self.present()})
        return self

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``self @ x``: [n, m] @ [m, d] -> a new [n, d] tensor (no autograd)."""
        if x.shape[0] != self.shape[1]:
            raise ValueError(f"matmul of a {self.shape} matrix with a {tuple(x.shape)} one")
        x = x.detach().contiguous()
        out = torch.empty(self.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        kernel = (_load_numba() if x.device.type == "cpu" and self.kernel != "torch"
                  else None)
        if kernel is not None:
            _set_numba_threads()
            xn, outn = x.numpy(), out.numpy()
        ro, co = self.row_offsets, self.col_offsets
        for r, row in enumerate(self.blocks):
            rows = slice(ro[r], ro[r + 1])
            first = True
            for c, b in enumerate(row):
                if b is None:
                    continue
                cols = slice(co[c], co[c + 1])
                if kernel is not None:
                    kernel(b.indptr, b.indices, b.values, xn[cols], outn[rows], not first)
                else:
                    t = self._torch.get((r, c))
                    t = b.to_torch(x.device) if t is None else t
                    prod = torch.mm(t.to(x.dtype), x[cols])
                    out[rows].copy_(prod) if first else out[rows].add_(prod)
                first = False
            if first:  # an empty block row
                out[rows].zero_()
        return out


@cache
def _load_numba():
    try:
        from plexus.kernels import csr_spmm
    except ImportError:
        return None
    return csr_spmm


def _set_numba_threads() -> None:
    """Use as many kernel threads as torch uses (init_distributed splits cores over ranks)."""
    import numba

    want = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)
