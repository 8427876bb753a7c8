"""Stationary adjacency blocks and the CPU SpMM kernel Plexus runs on them.

A :class:`BlockSparse` is an ``[n, m]`` matrix kept as a grid of CSR blocks: rows cut at
``row_sizes``, columns at ``col_sizes``. The in-memory source (plexus.data.memory) uses one
block; a prepared dataset (plexus.data.mapped) gives one block per ``k x k`` file block the
rank owns, each memory-mapped from disk, so loading copies and concatenates nothing.

``A @ X`` on CPU runs a numba kernel that accumulates straight into the output: no zero-fill
pass and no result copy (torch's CSR matmul does both on CPU), and the blocks of a block row
accumulate into the same output rows. By default (``auto``, ``numba``) it is cache-blocked
(plexus.slicing: column slices sized to the cache, planned once per block, X rows prefetched);
``numba-rows`` is the plain row-parallel kernel, bit-identical to it (bench/spmm.py times both
and torch's). Without numba, on a GPU, or with ``kernel="torch"`` (``plexus.train --spmm
torch``), each block goes through ``torch.sparse`` instead.

``take_rows`` and ``transpose`` copy a row subset of a matrix and its transpose, once, for a
layer that computes only some output rows (the last layer on the labelled rows,
plexus.data.shard.GraphShard.restrict_last_layer); the subset's rows multiply bit for bit as
the full matrix's.

X may be bfloat16 (``plexus.train --precision bf16``): the product is float32, summed in the
same order as for ``X.float()`` and bit-identical to it. The numba kernels read the bf16 rows
directly and widen each element as they add it (plexus.kernels ``_widen``): no float32 copy of
X, and half the bytes per gathered row (the slices, sized by X's element size, take twice the
rows). On a GPU with Triton, plexus.spmm_triton's kernel reads the bf16 rows there too
(float32 values and sums; float32 rounding, not the CPU's bits). torch's kernel (a GPU without
Triton, ``--spmm torch``) takes float32 operands: it converts the X rows of one column band at
a time.

The blocks themselves are :class:`plexus.csr.CSRBlock` (imported here as well).

Shapes:
    CSRBlock:  indptr [rows+1] int32/int64, indices [nnz] int32/int64, values [nnz] float32
    matmul:    [n, m] @ [m, d] -> [n, d]
    take_rows: [n, m] -> [R, m] (one row band)
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import scipy.sparse as sp
import torch

from common import dense
from plexus import slicing
from plexus.csr import CSRBlock, numba_kernels
from plexus.triton_switch import launch, triton_function

__all__ = ["SPMM_KERNELS", "BlockSparse", "CSRBlock", "product_out", "sum_dtype"]

SPMM_KERNELS = ("auto", "numba", "numba-rows", "torch")


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of an SpMM's output (its sums) for an X of ``dtype``: float32 for the 16-bit
    floats, else ``dtype`` itself."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def product_out(out: torch.Tensor | None, rows: int, x: torch.Tensor) -> torch.Tensor:
    """The ``[rows, d]`` output of a sparse product with ``x [*, d]``: ``out`` checked (a
    contiguous tensor of :func:`sum_dtype`), or a new one from :func:`common.dense.empty`,
    which oneDNN can read in place for the ``dW`` it may feed."""
    shape, dtype = (rows, x.shape[1]), sum_dtype(x.dtype)
    if out is None:
        return dense.empty(*shape, dtype=dtype, device=x.device)
    if tuple(out.shape) != shape or not out.is_contiguous() or out.dtype != dtype:
        raise ValueError(f"out must be a contiguous {shape} tensor of {dtype}")
    return out


def _kernel_array(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the numpy array the numba kernels read: bfloat16 as its uint16 bits
    (plexus.kernels widens them), anything else as it is. No copy."""
    return x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


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
        self._row_blocks: dict[int, tuple[list[int], list[BlockSparse]]] = {}
        self._torch_cols: dict[tuple[int, int, int, int], torch.Tensor] = {}  # matmul(cols=)

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

    def take_rows(self, rows: np.ndarray) -> BlockSparse:
        """The rows ``rows`` (ascending) of this matrix as a new ``[len(rows), m]`` matrix of
        one row band and the same column bands: each column band's block stacks the rows of
        ``rows`` from the blocks above each other (:meth:`CSRBlock.take_rows`; a copy of those
        rows only). Every output row sums the same nonzeros in the same order as here, so
        :meth:`matmul` gives bit-identical rows, and the transpose has one column band.

        Shapes: [n, m] -> [len(rows), m]
        """
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (np.any(np.diff(rows) <= 0) or rows[0] < 0 or rows[-1] >= self.shape[0]):
            raise ValueError(f"rows must ascend within [0, {self.shape[0]})")
        ro, co = self.row_offsets, self.col_offsets
        cuts = np.searchsorted(rows, ro)  # rows[cuts[r]:cuts[r + 1]] fall in row band r
        bands = [rows[cuts[r]:cuts[r + 1]] - ro[r] for r in range(len(self.blocks))]
        stacked: list[CSRBlock | None] = []
        for c in range(len(co) - 1):
            column = [row[c] for row in self.blocks]
            if all(b is None for b in column):
                stacked.append(None)
                continue
            stacked.append(CSRBlock.vstack([
                CSRBlock.empty((band.size, co[c + 1] - co[c])) if b is None
                else b.take_rows(band) for b, band in zip(column, bands)]))
        out = BlockSparse([stacked], [int(rows.size)], np.diff(co).tolist())
        out.kernel = self.kernel
        return out

    def row_blocks(self, num: int) -> tuple[list[int], list[BlockSparse]]:
        """(bounds, parts): ``num`` row ranges of equal height (so every rank with the same
        rows cuts them alike: the ranks of a group all-reduce the same ranges) and their
        matrices (``parts[b]`` = rows ``bounds[b] .. bounds[b + 1]``, same column bands;
        :meth:`CSRBlock.row_range` views, on this matrix's device), built once per ``num``
        and dropped by :meth:`to`. Each row of a part multiplies bit for bit as here.
        """
        num = max(1, min(int(num), self.shape[0]))
        if num in self._row_blocks:
            return self._row_blocks[num]
        bounds = [self.shape[0] * b // num for b in range(num + 1)]
        parts = [self._rows(lo, hi) for lo, hi in itertools.pairwise(bounds)]
        self._row_blocks[num] = (bounds, parts)
        return bounds, parts

    def _rows(self, lo: int, hi: int) -> BlockSparse:
        """Rows ``lo .. hi`` as a matrix of views (:meth:`row_blocks`)."""
        ro = self.row_offsets
        bands = [(r, max(lo, ro[r]) - ro[r], min(hi, ro[r + 1]) - ro[r])
                 for r in range(len(self.blocks)) if ro[r] < hi and ro[r + 1] > lo]
        blocks = [[None if b is None else b.row_range(a, z) for b in self.blocks[r]]
                  for r, a, z in bands]
        out = BlockSparse(blocks, [z - a for _, a, z in bands], np.diff(self.col_offsets).tolist())
        out.kernel, out.device = self.kernel, self.device
        if self.device.type != "cpu":
            out._torch = {(r, c): b.to_torch(self.device) for r, c, b in out.present()}
        return out

    def transpose(self) -> BlockSparse:
        """The transpose ``[m, n]``, block by block (:meth:`CSRBlock.transpose`; a copy)."""
        blocks = [[None if b is None else b.transpose() for b in col]
                  for col in zip(*self.blocks)]
        out = BlockSparse(blocks, np.diff(self.col_offsets).tolist(),
                          np.diff(self.row_offsets).tolist())
        out.kernel = self.kernel
        return out

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

    def to(self, device: torch.device | str, *, kernel: str | None = None,
           uploaded: dict | None = None) -> BlockSparse:
        """Use ``device`` for :meth:`matmul`; off CPU the blocks become torch CSR tensors there.

        Off CPU each block is copied to the device once and its host arrays are let go: the
        block in :attr:`blocks` becomes a :class:`CSRBlock` whose arrays are the device
        tensor's (so ``nnz``, ``nbytes`` and :meth:`arrays` still answer, for the device
        copy). Matrices that share a block (the layers of one parity, a symmetric dataset's
        transposes, the same block file mapped twice) share its device copy when they are
        moved with the same ``uploaded`` dict. Moving back to the CPU copies device blocks to
        host arrays; on the CPU nothing is copied.

        Args:
            device: where :meth:`matmul` runs.
            kernel: the CPU SpMM: ``"auto"`` (numba when installed, else torch), ``"numba"``
                (ImportError without numba) or ``"torch"`` (torch.sparse); None keeps it.
            uploaded: blocks already on ``device``, keyed by their arrays (the file of a
                mapped array, else its identity), shared by the calls of one set-up; it holds
                the host blocks too, so let it go once every matrix is moved.
        """
        import mmap

        if kernel is not None:
            if kernel not in SPMM_KERNELS:
                raise ValueError(f"unknown SpMM kernel {kernel!r}; choose from {SPMM_KERNELS}")
            if kernel == "numba" and numba_kernels() is None:
                raise ImportError("the numba SpMM kernel needs numba: pip install numba, or "
                                  "use --spmm torch")
            self.kernel = kernel
        self.device = torch.device(device)
        self._torch = {}
        self._row_blocks = {}
        self._torch_cols = {}
        cache: dict = {} if uploaded is None else uploaded

        def block_key(b: CSRBlock) -> tuple:  # a whole-file map by its file, else by identity
            return tuple((a.filename, a.offset) if isinstance(getattr(a, "base", None),
                                                              mmap.mmap)
                         else id(a) for a in (b.indptr, b.indices, b.values))

        for r, c, b in list(self.present()):
            if self.device.type == "cpu" and not isinstance(b.indptr, torch.Tensor):
                continue  # host arrays stay as they are: nothing to copy
            k = (self.device, block_key(b))
            if k not in cache:
                if self.device.type == "cpu":  # a device block back to host arrays
                    t = None
                    moved = CSRBlock(*(a.cpu().numpy() for a in (b.indptr, b.indices,
                                                                  b.values)), b.shape)
                else:
                    t = b.to_torch(self.device)  # the one copy of this block
                    moved = CSRBlock(t.crow_indices(), t.col_indices(), t.values(), b.shape)
                # b stays in the cache while it lives, so no other array can take its id
                cache[k] = cache[self.device, block_key(moved)] = (b, moved, t)
            _, self.blocks[r][c], t = cache[k]
            if t is not None:
                self._torch[r, c] = t
        return self

    def matmul(self, x: torch.Tensor, *, slice_cols: int | None = None,
               feature_tile: int | None = None, cache_bytes: int | None = None,
               out: torch.Tensor | None = None,
               cols: tuple[int, int, tuple[int, ...]] | None = None) -> torch.Tensor:
        """``self @ x``: [n, m] @ [m, d] -> a new [n, d] tensor (no autograd).

        On CPU with numba (kernel ``auto`` or ``numba``) every block runs the cache-blocked
        kernel of :mod:`plexus.slicing`; ``numba-rows`` runs the row kernel
        (:func:`plexus.kernels.csr_spmm`). Both give bit-identical results. The blocks of a
        block row accumulate into the same output rows, in column order.

        Args:
            x: [m, d], float32 or bfloat16 (the product is float32: :func:`sum_dtype`).
            slice_cols: columns per slice of the blocked kernel (default: sized to the cache,
                :func:`plexus.slicing.slice_cols`; a block whose X rows fit gets one slice).
            feature_tile: cut X's d columns into tiles of this width, each tile running all
                slices (must divide d; default d, no tiling).
            cache_bytes: the cache the default slices are sized for (default:
                :func:`plexus.slicing.cache_bytes`, ``$PLEXUS_SPMM_CACHE_BYTES`` or sysfs).
            out: write the product into this contiguous [n, d] tensor (returned).
            cols: ``(lo, hi, bounds)``: only the columns ``lo .. hi`` of this matrix (so
                only the rows ``lo .. hi`` of ``x`` are read), *added* into ``out`` (zero it
                before the first range). ``bounds`` lists every range boundary of the
                caller's partition, so that each block is planned once. Running the ranges of
                a partition in increasing order gives, on the numba kernels, the bits of one
                full :meth:`matmul` (each row's terms in column order); torch's kernel sums
                each range's product instead.

        Shapes:
            x: [m, d] -> [n, d]
        """
        x = x.detach().contiguous()
        d = x.shape[1]
        if cols is None:  # the whole product, written over out
            if x.shape[0] != self.shape[1]:
                raise ValueError(f"matmul of a {self.shape} matrix with a {tuple(x.shape)} one")
            tile = d if feature_tile is None else feature_tile
            if d and (tile < 1 or d % tile):
                raise ValueError(f"feature_tile={feature_tile} must divide the width d={d}")
            out = product_out(out, self.shape[0], x)
            lo, hi, bounds, add = 0, self.shape[1], (), False
        else:  # columns lo .. hi, added into out
            lo, hi, bounds = cols
            if out is None:
                raise ValueError("matmul(cols=...) adds into out: pass out")
            if (x.shape[0] != self.shape[1] or tuple(out.shape) != (self.shape[0], d)
                    or out.dtype != sum_dtype(x.dtype)):
                raise ValueError(f"columns {lo}..{hi} of a {self.shape} matrix with a "
                                 f"{tuple(x.shape)} {x.dtype} x into a {tuple(out.shape)} "
                                 f"{out.dtype} out")
            tile, add = d, True
        kernels = (numba_kernels() if x.device.type == "cpu" and self.kernel != "torch"
                   else None)
        if kernels is None and self.kernel == "numba-rows" and x.device.type == "cpu":
            raise ImportError("the numba-rows SpMM kernel needs numba: pip install numba")
        if kernels is not None:
            _set_numba_threads()
            tile = max(tile, 1)
            xn, outn = _kernel_array(x), out.numpy()
            row_bytes = tile * x.element_size()
            cache = slicing.cache_bytes(cache_bytes) if slice_cols is None else 0
        ro, co = self.row_offsets, self.col_offsets
        for r, row in enumerate(self.blocks):
            rows = slice(ro[r], ro[r + 1])
            first = not add  # the first block of a row writes its rows, the others add
            for c, b in enumerate(row):
                a, z = max(lo, co[c]), min(hi, co[c + 1])
                if b is None or a >= z:
                    continue
                if kernels is not None and self.kernel == "numba-rows" and not add:
                    kernels.csr_spmm(b.indptr, b.indices, b.values, xn[co[c]:co[c + 1]],
                                     outn[rows], not first)
                elif kernels is not None:  # (numba-rows' bits, column ranges included)
                    width = (slicing.slice_cols(b.shape, b.nnz, row_bytes, cache)
                             if slice_cols is None else slice_cols)
                    local = tuple(int(v) - co[c] for v in bounds if co[c] < v < co[c + 1])
                    plan = slicing.block_slicing(b, width, local)
                    s_lo, s_hi = plan.slice_range(a - co[c], z - co[c])
                    x3 = xn[co[c]:co[c + 1]].reshape(b.shape[1], d // tile, tile)  # free views
                    out3 = outn[rows].reshape(b.shape[0], d // tile, tile)  # [rows, T, t]
                    kernels.csr_spmm_sliced(b.indptr, plan.cuts, plan.chunks, b.indices,
                                            b.values, x3, out3, not first,
                                            slicing.lookahead(row_bytes), s_lo, s_hi)
                else:
                    block = self._torch_block(r, c, b, a - co[c], z - co[c], x.device)
                    if not _bf16_spmm(block, x[a:z], out[rows], not first):
                        block, xs = block.to(out.dtype), x[a:z].to(out.dtype)
                        if first and _mm_writes_out(out.device):  # no product to copy
                            torch.mm(block, xs, out=out[rows])
                        elif first:
                            out[rows].copy_(torch.mm(block, xs))
                        else:
                            out[rows].add_(torch.mm(block, xs))
                first = False
            if first and not add:  # an empty block row
                out[rows].zero_()
        return out

    def _torch_block(self, r: int, c: int, b: CSRBlock, a: int, z: int,
                     device: torch.device) -> torch.Tensor:
        """Block (r, c) as a torch CSR matrix on ``device`` (its copy made by :meth:`to`, or
        made now), or its columns ``a .. z`` only (built once per range, kept until the next
        :meth:`to`)."""
        t = self._torch.get((r, c))
        t = b.to_torch(device) if t is None else t
        if (a, z) == (0, b.shape[1]):
            return t
        sub = self._torch_cols.get((r, c, a, z))
        if sub is None:
            sub = self._torch_cols[r, c, a, z] = _torch_cols(t, a, z)
        return sub


def _bf16_spmm(block: torch.Tensor, x: torch.Tensor, out: torch.Tensor, add: bool) -> bool:
    """``out = block @ x`` (``add``: ``+=``) by plexus.spmm_triton's kernel where ``x`` is a
    bf16 block on a GPU and Triton runs there: the bf16 rows are read as they are, the sums
    are float32. False where it did not run (the caller's torch product widens ``x``)."""
    if x.dtype != torch.bfloat16 or x.device.type != "cuda" or out.dtype != torch.float32:
        return False
    spmm = triton_function("spmm_triton", "csr_spmm")
    return spmm is not None and launch(spmm, block, x, out, add) is not None


@functools.cache
def _mm_writes_out(device: torch.device) -> bool:
    """Whether torch's CSR product writes into a given ``out`` on ``device`` (tried once on a
    2 x 2 matrix: a torch build without it takes a new tensor and a copy)."""
    a = torch.eye(2, device=device).to_sparse_csr()
    out = torch.zeros(3, 2, device=device)
    try:
        torch.mm(a, torch.ones(2, 2, device=device), out=out[1:])
    except (RuntimeError, NotImplementedError):
        return False
    return bool((out[1:] == 1).all()) and not bool(out[0].any())


def _torch_cols(t: torch.Tensor, a: int, z: int) -> torch.Tensor:
    """Columns ``a .. z`` of a torch CSR matrix (a copy)."""
    return t.to_sparse_coo().index_select(1, torch.arange(a, z, device=t.device)).to_sparse_csr()


def _set_numba_threads() -> None:
    """Use as many kernel threads as torch uses (init_distributed splits cores over ranks)."""
    import numba

    want = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)
