"""Cache-blocked CPU SpMM: column slices sized to the cache, planned once per CSR block.

``A @ X`` with a row-parallel CSR kernel reads a random row of X per nonzero. When the X rows a
block references exceed the cache, each read goes to DRAM (or to a far, shared slice of the
last-level cache). Cache blocking (DistGNN, Md et al., SC'21, arXiv 2104.06700) cuts the columns
of A into slices whose X rows fit in the cache and accumulates the slices into the output one
after the other: each slice's X rows are read from memory once and then gathered from the
cache, at the price of streaming the output once per slice. Slices cut in increasing column
order keep every row's sum in nonzero order, so the result is bit-identical to the row kernel
(:func:`plexus.kernels.csr_spmm_sliced`). The kernel also prefetches the X rows of the next
nonzeros (the cursor in :func:`plexus.kernels._spmm_chunk`).

Slice width: ``slice_cols = cache_budget // (t * itemsize)`` X rows of a feature tile of width
``t``, the budget being the last-level cache (sysfs; ``PLEXUS_SPMM_CACHE_BYTES`` or the
``cache_bytes`` argument override it; 32 MiB without either) divided by ``CACHE_SHARE``: the
output rows and the index arrays stream through the same cache, and on a shared machine other
processes use it too. A block whose referenced X rows (at most ``min(m, nnz)``) fit in the
budget gets one slice: the plain row kernel plus prefetching. The 1/2 comes from sweeping
the slice count (bench/spmm.py ``--sweep-slices``) where sysfs reports 32 MiB: the 200K x 128
bench case and R-MAT 18 ran fastest near the counts 1/2 gives, and the many more slices of 1/8
ran slower than the row kernel itself (docs/benchmarks.md, "SpMM on the CPU"). A VM's sysfs
may report its host's cache instead of the VM's share of it; ``PLEXUS_SPMM_CACHE_BYTES`` then
sets the budget.

Precomputed once per block and slice width (:class:`ColumnSlicing`, cached on the
:class:`~plexus.csr.CSRBlock`): ``cuts`` ``[S - 1, rows]``, where each row's nonzeros cross
into the next slice, counted from the row's start (``uint16``: ``(S - 1) * rows * 2`` bytes,
nothing for one slice; indptr's dtype in a block with a row of 65,536 nonzeros or more), and
``chunks`` ``[K + 1]``, row ranges of equal work (nonzeros + rows) for the threads (R-MAT rows
are skewed). The kernel adds a row's start to its cuts, one sequential read a row and slice:
at scale the plans are the largest part of the adjacency after its indices and values (the
planner's adjacency, common.perf.gcn_memory), and offsets halve them. The matrix itself is
neither copied nor reordered, so memory-mapped blocks are read in place.

Feature tiling (``feature_tile``: X's columns in tiles, each tile all slices) is built but off
by default: in the SpMM bench every tile width below 128 was slower (docs/benchmarks.md).

Shapes:
    cuts:   [S - 1, rows]  uint16 (or indptr's dtype: a row of 65,536 nonzeros or more)
    chunks: [K + 1]        int64
    spmm:   [rows, m] @ [m, d] -> [rows, d]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

CACHE_ENV = "PLEXUS_SPMM_CACHE_BYTES"
DEFAULT_CACHE_BYTES = 32 << 20  # when sysfs says nothing
CACHE_SHARE = 2  # slice X rows take 1/2 of the last-level cache (see the module docstring)
LOOKAHEAD_BYTES = 4096  # X bytes in flight per thread: 8 rows of 128 float32
CHUNKS_PER_BLOCK = 256  # row chunks of equal work, scheduled over the threads
CUT_ROW_LIMIT = 1 << 16  # rows shorter than this keep their cuts in uint16
SYSFS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")


def parse_size(text: str) -> int:
    """``"491520K"``, ``"32M"``, ``"2097152"`` (sysfs or the environment) -> bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMG" else text
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ValueError(f"cannot read a cache size from {text!r}; write bytes or e.g. 32M"
                         ) from None


def last_level_cache_bytes(root: Path = SYSFS_CACHE) -> int | None:
    """Size of cpu0's highest-level data or unified cache from sysfs; None if unreadable."""
    best: tuple[int, int] | None = None
    for index in sorted(root.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and (best is None or level > best[0]):
            best = (level, size)
    return None if best is None else best[1]


def cache_bytes(override: int | None = None) -> int:
    """The cache the slices are sized for: ``override``, else ``$PLEXUS_SPMM_CACHE_BYTES``, else
    the last-level cache from sysfs, else 32 MiB."""
    if override is not None:
        if override <= 0:
            raise ValueError(f"cache_bytes must be positive, got {override}")
        return int(override)
    env = os.environ.get(CACHE_ENV)
    if env:
        size = parse_size(env)
        if size <= 0:
            raise ValueError(f"{CACHE_ENV}={env!r} must be a positive size")
        return size
    return _sysfs_cache_bytes() or DEFAULT_CACHE_BYTES


@cache
def _sysfs_cache_bytes() -> int | None:
    return last_level_cache_bytes()


def slice_cols(shape: tuple[int, int], nnz: int, row_bytes: int, cache: int) -> int:
    """Columns per slice for a ``shape`` block with ``nnz`` nonzeros, X rows of ``row_bytes``:
    ``cache // CACHE_SHARE // row_bytes``, or all columns (one slice) when the X rows the block
    can reference, ``min(m, nnz)``, fit in that budget.

    At most ``1 + nnz // rows`` slices (one more than the mean row length): past that most
    slices hold nothing of a row, yet each costs the row a cut (the plan: ``4`` or ``8`` bytes
    per row and slice, kept with the block) and a pass over its output. A 1M-node graph of 17
    nonzeros per row cut into 8 x 8 blocks has about 2 per block row: 15 slices per block made
    the plans larger than the blocks themselves (bench/memory.py ogb)."""
    rows, m = shape
    budget_rows = max(1, cache // CACHE_SHARE // max(1, row_bytes))
    if min(m, nnz) <= budget_rows:
        return m
    most = 1 + nnz // max(1, rows)
    return max(budget_rows, -(-m // most))


@dataclass(frozen=True)
class ColumnSlicing:
    """Where the nonzeros of each row cross from one column slice to the next.

    Args:
        slice_cols: columns per slice (the last may be narrower).
        cuts: [S - 1, rows] nonzero positions from each row's start
            (:func:`plexus.kernels.csr_slice_cuts`).
        chunks: [K + 1] row boundaries of about equal nonzeros + rows.
    """

    slice_cols: int
    cuts: np.ndarray
    chunks: np.ndarray
    starts: np.ndarray  # [S + 1] first column of each slice, then the column count

    def slice_range(self, lo: int, hi: int) -> tuple[int, int]:
        """The slices ``(s_lo, s_hi)`` that make up columns ``lo .. hi`` (both must be slice
        boundaries: the block's ``bounds``)."""
        s_lo, s_hi = np.searchsorted(self.starts, [lo, hi])
        if self.starts[s_lo] != lo or self.starts[s_hi] != hi:
            raise ValueError(f"columns {lo}..{hi} are not slice boundaries of this plan")
        return int(s_lo), int(s_hi)

    @property
    def num_slices(self) -> int:
        return int(self.cuts.shape[0]) + 1

    @property
    def nbytes(self) -> int:
        """Memory the slicing adds to its block."""
        return self.cuts.nbytes + self.chunks.nbytes


def column_slicing(indptr: np.ndarray, indices: np.ndarray, num_cols: int,
                   width: int, bounds: tuple[int, ...] = ()) -> ColumnSlicing:
    """Plan slices of ``width`` columns over a CSR block (sorted columns in each row), also
    cut at the columns ``bounds`` (:attr:`ColumnSlicing.starts` tells which slices a column
    range covers)."""
    from plexus.kernels import csr_slice_cuts

    if width < 1:
        raise ValueError(f"slice width must be >= 1 column, got {width}")
    rows = indptr.shape[0] - 1
    even = np.arange(0, num_cols, width, dtype=np.int64)
    starts = np.union1d(even, np.clip(np.asarray(bounds, dtype=np.int64), 0, num_cols))
    starts = np.append(starts[starts < num_cols], num_cols) if num_cols else np.zeros(2,
                                                                                     np.int64)
    num_slices = starts.size - 1
    cuts = np.empty((num_slices - 1, rows), dtype=cut_dtype(indptr))
    if num_slices > 1 and rows > 0:
        csr_slice_cuts(indptr, indices, starts.astype(indptr.dtype), cuts)
    return ColumnSlicing(int(width), cuts, work_chunks(indptr, CHUNKS_PER_BLOCK), starts)


def cut_dtype(indptr: np.ndarray) -> np.dtype:
    """The dtype of a block's cuts (offsets from each row's start): ``uint16`` where no row
    has :data:`CUT_ROW_LIMIT` nonzeros, else ``indptr``'s own (writable: the kernels' one
    signature for either)."""
    longest = int(np.diff(indptr).max()) if indptr.shape[0] > 1 else 0
    return np.dtype(np.uint16) if longest < CUT_ROW_LIMIT else np.dtype(indptr.dtype)


def work_chunks(indptr: np.ndarray, num: int) -> np.ndarray:
    """``[K + 1]`` int64 boundaries of at most ``num`` row ranges of a CSR block with about
    equal work = nonzeros + rows (each row streams its output; R-MAT rows are skewed)."""
    rows = indptr.shape[0] - 1
    work = np.asarray(indptr, dtype=np.int64) - int(indptr[0]) + np.arange(rows + 1)
    num_chunks = max(1, min(num, rows))
    chunks = np.searchsorted(work, np.linspace(0, work[-1], num_chunks + 1)).astype(np.int64)
    chunks[0], chunks[-1] = 0, rows
    return chunks


def lookahead(row_bytes: int) -> int:
    """Nonzeros the prefetch cursor runs ahead: LOOKAHEAD_BYTES of X rows, 4 .. 16 rows."""
    return int(min(16, max(4, LOOKAHEAD_BYTES // max(1, row_bytes))))


def block_slicing(block, width: int, bounds: tuple[int, ...] = ()) -> ColumnSlicing:
    """The :class:`ColumnSlicing` of a :class:`~plexus.csr.CSRBlock` for slices of
    ``width`` columns (also cut at ``bounds``), built on first use and kept in
    ``block.slicings``."""
    width = max(1, min(int(width), block.shape[1]))
    plan = block.slicings.get((width, bounds))
    if plan is None:
        plan = column_slicing(block.indptr, block.indices, block.shape[1], width, bounds)
        block.slicings[width, bounds] = plan
    return plan
