"""Where one rank's local tensor sits in a global one (:class:`Slab`), and filling a slab
from the pieces of another grid's slabs (:class:`SlabFiller`): the geometry of sharded
checkpoints (:mod:`common.sharded`), pure numpy.

A :class:`Slab`, in the form both trainers use::

    block   = padded_global[rows][:, cols]      rows: a range or explicit row ids (features
                                                in a permuted node order); cols: a range
    local   = block                              (flat=None)
            | block.ravel()[flat[0]:flat[1]]     (flat split over a third axis, zero beyond)

Row ids or columns at or beyond the global shape are padding (zero, never stored anywhere
else). A 1-D global tensor is a one-row matrix (``rows=(0, 1)``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from common.grid import ceil_div

__all__ = ["PieceReader", "RowIndex", "Slab", "SlabFiller", "storage_dtype"]

_CHUNK = 1 << 22  # elements per read of a source piece (bounds its buffer)
_GAP_BYTES = 4096  # skipped bytes between two rows below which one read takes both


@dataclass(frozen=True)
class Slab:
    """Where a local tensor sits in a global one (module docstring).

    Attributes:
        shape: the global, unpadded shape (1-D or 2-D).
        rows: block rows: ``(lo, hi)`` or an int64 array of global row ids (ids >= shape[0]
            are padding rows).
        cols: block columns ``(lo, hi)``; ``hi`` may exceed the width (padding).
        flat: ``(lo, hi)``: the local tensor is these elements of the row-major flattened
            block (zero beyond it); None: the local tensor is the block itself.
    """

    shape: tuple[int, ...]
    rows: tuple[int, int] | np.ndarray
    cols: tuple[int, int]
    flat: tuple[int, int] | None = None

    @staticmethod
    def whole(shape: tuple[int, ...]) -> Slab:
        """The whole tensor on one rank."""
        r, c = _as_2d(shape)
        return Slab(tuple(shape), (0, r), (0, c))

    def row_ids(self) -> np.ndarray:
        if isinstance(self.rows, np.ndarray):
            return self.rows.astype(np.int64, copy=False)
        return np.arange(self.rows[0], self.rows[1], dtype=np.int64)

    @property
    def width(self) -> int:
        return self.cols[1] - self.cols[0]

    def numel(self) -> int:
        if self.flat is not None:
            return self.flat[1] - self.flat[0]
        n = self.rows.size if isinstance(self.rows, np.ndarray) else self.rows[1] - self.rows[0]
        return n * self.width

    def describe(self) -> dict[str, Any]:
        """JSON form (explicit row ids are stored in the shard file, not here)."""
        rows: Any = ({"ids": int(self.rows.size), "digest": _digest(self.rows)}
                     if isinstance(self.rows, np.ndarray) else list(self.rows))
        return {"shape": list(self.shape), "rows": rows, "cols": list(self.cols),
                "flat": None if self.flat is None else list(self.flat)}


def _as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 1:
        return 1, shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    raise ValueError(f"sharded checkpoints hold 1-D or 2-D tensors, got shape {shape}")


def _digest(ids: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(ids, dtype=np.int64).tobytes()).hexdigest()


def storage_dtype(dtype: torch.dtype) -> np.dtype:
    """A numpy dtype of ``dtype``'s size to move its bytes (numpy has no bfloat16)."""
    if dtype == torch.bfloat16:
        return np.dtype(np.uint16)
    return torch.empty(0, dtype=dtype).numpy().dtype


class RowIndex:
    """The explicit row ids of a source piece, sorted once: a read finds the rows it wants
    by a binary search over the ids of its own span, so reading a piece in many chunks
    (:mod:`common.consolidate`) is not a pass over every id of the piece per chunk.

    Attributes:
        size: rows of the piece.
        sorted_ids: its row ids, ascending (int64).
        order: the piece's row of each of ``sorted_ids``.
    """

    def __init__(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        self.size = ids.size
        # 32-bit positions where they fit: the index lives as long as its tensor is read
        order = np.argsort(ids, kind="stable")
        self.order = order.astype(np.int32) if ids.size < 2**31 else order
        self.sorted_ids = ids[order]


# read(start, out): out = elements start .. start + out.size of a source piece's data
PieceReader = Callable[[int, np.ndarray], None]


def _array_reader(data: np.ndarray) -> PieceReader:
    def read(start: int, out: np.ndarray) -> None:
        out[...] = data[start:start + out.size].reshape(out.shape)
    return read


class SlabFiller:
    """The region of block rows a target slab covers, filled from the source pieces of a
    checkpoint (each a slab of another grid: :meth:`fill`), then cut to the slab
    (:meth:`result`)."""

    def __init__(self, slab: Slab, dtype: np.dtype) -> None:
        self.slab = slab
        ids = slab.row_ids()
        w = slab.width
        if slab.flat is None:
            self.lo_row, self.hi_row = 0, ids.size
        else:
            self.lo_row = min(slab.flat[0] // max(w, 1), ids.size)
            self.hi_row = min(ceil_div(slab.flat[1], max(w, 1)), ids.size)
        self.ids = ids[self.lo_row:self.hi_row]
        self.region = np.zeros((self.ids.size, w), dtype=dtype)
        nrows, ncols = _as_2d(slab.shape)
        self.valid_cols = (slab.cols[0], min(slab.cols[1], ncols))
        real = np.flatnonzero(self.ids < nrows)
        order = np.argsort(self.ids[real], kind="stable")
        self.sorted_ids, self.sorted_pos = self.ids[real][order], real[order]

    def wants(self, src_cols: tuple[int, int]) -> bool:
        """Whether a source piece of columns ``src_cols`` holds anything of the target (else
        its rows need not be read)."""
        return (bool(self.sorted_ids.size) and max(self.valid_cols[0], src_cols[0])
                < min(self.valid_cols[1], src_cols[1]))

    def fill(self, src_rows: tuple[int, int] | np.ndarray | RowIndex, src_cols: tuple[int, int],
             src_flat: tuple[int, int] | None, data: np.ndarray | PieceReader) -> None:
        """Copy what the target wants of one source piece.

        Args:
            src_rows: the piece's rows: ``(lo, hi)``, its explicit ids, or their
                :class:`RowIndex` (made once by the caller that reads the piece again).
            src_cols, src_flat: the piece's columns and flat range (:class:`Slab`).
            data: the piece's local tensor (flat, the storage dtype), or a function
                ``read(start, out)`` that fills ``out`` with its elements from ``start`` on,
                so that only the rows the target wants are read (:mod:`common.sharded`).
        """
        if not self.wants(src_cols):
            return
        c_lo, c_hi = max(self.valid_cols[0], src_cols[0]), min(self.valid_cols[1], src_cols[1])
        if isinstance(src_rows, np.ndarray):
            src_rows = RowIndex(src_rows)
        read = _array_reader(data) if isinstance(data, np.ndarray) else data
        w_src = src_cols[1] - src_cols[0]
        n_src = src_rows.size if isinstance(src_rows, RowIndex) else src_rows[1] - src_rows[0]
        f_lo, f_hi = src_flat if src_flat is not None else (0, n_src * w_src)
        # source block rows whose elements this piece holds, then those the target wants
        first, last = f_lo // w_src, min(ceil_div(f_hi, w_src), n_src)
        src, dst = self._matches(src_rows, first, last)
        if not src.size:
            return
        # the piece's columns, and the region's, that the target wants
        col_lo, col_hi = c_lo - src_cols[0], c_hi - src_cols[0]
        dst_col = c_lo - self.slab.cols[0]
        # rows the flat range cuts (its first and last) hold only some of their columns
        whole = (src * w_src >= f_lo) & ((src + 1) * w_src <= f_hi)
        for k in np.flatnonzero(~whole):
            lo = max(col_lo, f_lo - int(src[k]) * w_src)
            hi = min(col_hi, f_hi - int(src[k]) * w_src)
            if hi > lo:
                read(int(src[k]) * w_src + lo - f_lo,
                     self.region[dst[k], dst_col + lo - col_lo:dst_col + hi - col_lo])
        self._copy_rows(src[whole], dst[whole], w_src, f_lo, col_lo, col_hi, dst_col, read)

    def _matches(self, src_rows: tuple[int, int] | RowIndex, first: int, last: int
                 ) -> tuple[np.ndarray, np.ndarray]:
        """(source block rows in ``first:last`` the target wants, ascending; the region rows
        they go to)."""
        if not isinstance(src_rows, RowIndex):  # a range: intersect it with the target's ids
            lo, hi = np.searchsorted(self.sorted_ids, [src_rows[0] + first, src_rows[0] + last])
            return self.sorted_ids[lo:hi] - src_rows[0], self.sorted_pos[lo:hi]
        # the piece's ids within the target's span, each looked up among the target's ids
        lo = int(np.searchsorted(src_rows.sorted_ids, self.sorted_ids[0], side="left"))
        hi = int(np.searchsorted(src_rows.sorted_ids, self.sorted_ids[-1], side="right"))
        ids, rows = src_rows.sorted_ids[lo:hi], src_rows.order[lo:hi].astype(np.int64)
        hit = np.minimum(np.searchsorted(self.sorted_ids, ids), self.sorted_ids.size - 1)
        found = (self.sorted_ids[hit] == ids) & (rows >= first) & (rows < last)
        src, dst = rows[found], self.sorted_pos[hit[found]]
        order = np.argsort(src, kind="stable")
        return src[order], dst[order]

    def _copy_rows(self, src: np.ndarray, dst: np.ndarray, w_src: int, f_lo: int, col_lo: int,
                   col_hi: int, dst_col: int, read: PieceReader) -> None:
        """Columns ``col_lo:col_hi`` of whole source rows ``src`` (ascending) into region
        rows ``dst``: one read per run of rows that lie close together in the piece, each
        at most about :data:`_CHUNK` elements (a lone row straight into the region)."""
        if not src.size:
            return
        width = col_hi - col_lo
        itemsize = self.region.itemsize
        # a gap of under a page is read rather than skipped: the kernel reads whole pages
        near = (np.diff(src) * w_src - width) * itemsize <= _GAP_BYTES
        same_window = np.diff(src * w_src // _CHUNK) == 0
        starts = np.concatenate([[0], np.flatnonzero(~(near & same_window)) + 1, [src.size]])
        for a, b in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
            r0 = int(src[a])
            if b - a == 1:
                read(r0 * w_src + col_lo - f_lo,
                     self.region[dst[a], dst_col:dst_col + width])
                continue
            rows = np.empty(((int(src[b - 1]) - r0 + 1) * w_src), dtype=self.region.dtype)
            read(r0 * w_src - f_lo, rows)  # [rows spanned, w_src]
            self.region[dst[a:b], dst_col:dst_col + width] = \
                rows.reshape(-1, w_src)[src[a:b] - r0, col_lo:col_hi]

    def result(self) -> np.ndarray:
        slab = self.slab
        if slab.flat is None:
            return self.region if len(slab.shape) == 2 else self.region.reshape(-1)
        start = slab.flat[0] - self.lo_row * slab.width
        out = np.zeros(slab.flat[1] - slab.flat[0], dtype=self.region.dtype)
        got = self.region.reshape(-1)[start:start + out.size]
        out[:got.size] = got
        return out
