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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from common.grid import ceil_div

__all__ = ["Slab", "SlabFiller", "storage_dtype"]

_CHUNK = 1 << 22  # elements per vectorised read (bounds the index arrays)


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

    def fill(self, src_ids: np.ndarray, src_cols: tuple[int, int],
             src_flat: tuple[int, int] | None, data: np.ndarray) -> None:
        c_lo, c_hi = max(self.valid_cols[0], src_cols[0]), min(self.valid_cols[1], src_cols[1])
        if c_hi <= c_lo or not self.sorted_ids.size:
            return
        w_src = src_cols[1] - src_cols[0]
        f_lo, f_hi = src_flat if src_flat is not None else (0, src_ids.size * w_src)
        # source block rows whose elements this piece holds, then those the target wants
        first, last = f_lo // w_src, min(ceil_div(f_hi, w_src), src_ids.size)
        cand = np.arange(first, last, dtype=np.int64)
        hit = np.searchsorted(self.sorted_ids, src_ids[first:last])
        hit = np.minimum(hit, self.sorted_ids.size - 1)
        found = self.sorted_ids[hit] == src_ids[first:last]
        src_rows, dst_rows = cand[found], self.sorted_pos[hit[found]]
        cols = np.arange(c_lo, c_hi, dtype=np.int64)
        step = max(1, _CHUNK // cols.size)
        for lo in range(0, src_rows.size, step):
            sr, dr = src_rows[lo:lo + step], dst_rows[lo:lo + step]
            flat = sr[:, None] * w_src + (cols - src_cols[0])[None, :]
            mask = (flat >= f_lo) & (flat < f_hi)
            vals = np.asarray(data[flat[mask] - f_lo])
            self.region[np.broadcast_to(dr[:, None], mask.shape)[mask],
                        np.broadcast_to((cols - self.slab.cols[0])[None, :], mask.shape)[mask]
                        ] = vals

    def result(self) -> np.ndarray:
        slab = self.slab
        if slab.flat is None:
            return self.region if len(slab.shape) == 2 else self.region.reshape(-1)
        start = slab.flat[0] - self.lo_row * slab.width
        out = np.zeros(slab.flat[1] - slab.flat[0], dtype=self.region.dtype)
        got = self.region.reshape(-1)[start:start + out.size]
        out[:got.size] = got
        return out
