"""Keyed weight initialisation: any part of a parameter, the same values on every grid.

A parameter of full shape ``[rows, cols]`` (a vector is ``[1, n]``) is cut into row blocks of
:func:`rows_per_chunk` rows (about :data:`CHUNK_NUMEL` elements). Block ``i`` is drawn, whole,
from a ``torch.Generator`` seeded with :func:`chunk_seed` ``(seed, name, i)``: a function of the
seed, the parameter's name and the block's index only, never of the grid. So a rank that owns
a slice of the parameter draws only the row blocks that its slice touches, one at a time, and
keeps the part it owns (:func:`fill_normal_`): its memory beyond its slice is a chunk or two
(the drawn block and, where its columns are cut, the kept part), never the full parameter, and
the values are those a single process draws for the full tensor. Whole rows are drawn, so a
rank holding 1/C of the columns draws C times its share: time, not memory. Values are drawn
on the CPU in float32 (so they do not depend on the device), then copied to the output.

Changing :data:`CHUNK_NUMEL` or :func:`chunk_seed` changes every initial weight.

Shapes legend: ``rows x cols`` the full parameter; ``brows x bcols`` a block of it (zero-padded
where it runs past the full parameter); ``out`` a flat range of the block's row-major order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn.functional import pad

from common.grid import ceil_div

__all__ = ["CHUNK_NUMEL", "chunk_seed", "fill_normal_", "rows_per_chunk"]

CHUNK_NUMEL = 1 << 20  # elements per drawn row block (4 MiB in float32); part of the init


def rows_per_chunk(cols: int) -> int:
    """Rows per drawn block of a parameter with ``cols`` columns (at least one row)."""
    return max(1, CHUNK_NUMEL // cols)


def chunk_seed(seed: int, name: str, index: int) -> int:
    """The 63-bit generator seed of row block ``index`` of parameter ``name`` (BLAKE2b)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _as_2d(values: Sequence[int], fill: int) -> tuple[int, int]:
    if len(values) == 2:
        return int(values[0]), int(values[1])
    if len(values) == 1:
        return fill, int(values[0])
    raise ValueError(f"keyed init handles vectors and matrices, got {len(values)} dims")


@torch.no_grad()
def fill_normal_(out: Tensor, *, seed: int, name: str, shape: Sequence[int], std: float,
                 origin: Sequence[int] | None = None, block: Sequence[int] | None = None,
                 start: int = 0) -> Tensor:
    """Fill ``out`` with its part of the keyed ``Normal(0, std)`` parameter ``name``.

    ``out`` (flat, ``L`` elements) receives elements ``start .. start + L - 1`` of the
    row-major order of the block of size ``block`` whose first element is ``origin`` in the
    full parameter of ``shape``; block elements past the full parameter, and elements past
    the block's end (padding), are zero.
    The defaults (origin 0, block = shape, start 0) give the whole parameter. Only the row
    blocks that the range touches are drawn, one at a time.

    Args:
        out: contiguous flat destination, any device and float dtype.
        seed, name: the key (with the row block's index) of the values.
        shape: the full parameter's shape, ``[rows, cols]`` or ``[n]``.
        std: standard deviation of the normal distribution (mean 0).
        origin: the block's first (row, col) in the full parameter.
        block: the block's (padded) shape.
        start: the block's flat index of ``out[0]``.

    Shapes:
        out: [L] -> returns out
    """
    rows, cols = _as_2d(shape, 1)
    row0, col0 = _as_2d(origin if origin is not None else (0,) * len(shape), 0)
    brows, bcols = _as_2d(block if block is not None else shape, 1)
    stop = start + out.numel()
    if out.dim() != 1 or not out.is_contiguous() or start < 0:
        raise ValueError(f"out must be a contiguous flat tensor and start >= 0, got shape "
                         f"{tuple(out.shape)} and start {start}")
    out.zero_()
    width = max(0, min(cols, col0 + bcols) - col0)  # block columns inside the parameter
    first = row0 + start // bcols  # full rows that [start, stop) touches, in the parameter
    last = min(rows, row0 + min(brows, ceil_div(stop, bcols)))
    if width == 0 or first >= last:
        return out
    per = rows_per_chunk(cols)
    for index in range(first // per, (last - 1) // per + 1):
        lo, hi = index * per, min(rows, (index + 1) * per)  # the drawn block's full rows
        gen = torch.Generator().manual_seed(chunk_seed(seed, name, index))
        drawn = torch.empty(hi - lo, cols).normal_(0.0, std, generator=gen)  # [hi-lo, cols]
        a, b = max(lo, first), min(hi, last)  # the rows kept, full indices
        piece = drawn[a - lo : b - lo, col0 : col0 + width]  # [b-a, width]
        if width < bcols:  # the block runs past the parameter's last column: zeros
            piece = pad(piece, (0, bcols - width))
        piece = piece.reshape(-1)  # [(b-a) * bcols], a view when all columns are kept
        flat0 = (a - row0) * bcols  # block flat index of piece[0]
        s, e = max(flat0, start), min(flat0 + piece.numel(), stop)
        out[s - start : e - start].copy_(piece[s - flat0 : e - flat0])
    return out

