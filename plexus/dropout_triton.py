"""The dropout keep-mask of :func:`plexus.dropout.keep_mask` as one Triton kernel, for GPUs
(imported only where ``triton`` is installed): each program hashes a tile of (row, column)
cells in uint32 arithmetic, the same xor-shift-multiply mixer as the CPU's, and compares with
the threshold, so its bits are the CPU hash's. :func:`fused_dropout` also applies the mask in
the same pass: ``x * keep / (1 - p)`` and the mask, one read of ``x`` and one write of each,
where the torch hash takes about fifteen int64 passes over the block before the mask is used.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors),
which is how the tests compare their bits with the CPU hash's (tests/plexus/test_dropout_triton.py).

Shapes: rows [a], cols [b] (int64 node and column ids) -> [a, b] bool; x [a, b] float.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fused_dropout", "keep_mask_triton"]

BLOCK_ROWS, BLOCK_COLS = 32, 64  # a program's tile of cells


@triton.jit
def _mix32(x):
    """plexus.dropout._mix32 on uint32 (wrapping multiplies)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _tile_keep(rows_ptr, cols_ptr, n_rows, n_cols, k, threshold,
               block_r: tl.constexpr, block_c: tl.constexpr):
    """(the tile's keep bits, its row offsets, its column offsets, its in-bounds mask)."""
    offs_r = tl.program_id(0) * block_r + tl.arange(0, block_r)
    offs_c = tl.program_id(1) * block_c + tl.arange(0, block_c)
    in_r, in_c = offs_r < n_rows, offs_c < n_cols
    key = k.to(tl.uint32)
    r = tl.load(rows_ptr + offs_r, mask=in_r, other=0).to(tl.uint32)  # ids mod 2^32
    c = tl.load(cols_ptr + offs_c, mask=in_c, other=0).to(tl.uint32)
    h = _mix32(((_mix32(r ^ key)[:, None] ^ c[None, :]) * 0x9E3779B1) ^ key)
    keep = h >= threshold.to(tl.uint32)
    return keep, offs_r, offs_c, in_r[:, None] & in_c[None, :]


@triton.jit(do_not_specialize=["k", "threshold"])
def _keep_kernel(rows_ptr, cols_ptr, out_ptr, n_rows, n_cols, k, threshold,
                 block_r: tl.constexpr, block_c: tl.constexpr):
    keep, offs_r, offs_c, inside = _tile_keep(rows_ptr, cols_ptr, n_rows, n_cols, k, threshold,
                                              block_r, block_c)
    at = offs_r.to(tl.int64)[:, None] * n_cols + offs_c[None, :]
    tl.store(out_ptr + at, keep.to(tl.int8), mask=inside)


@triton.jit(do_not_specialize=["k", "threshold"])
def _dropout_kernel(x_ptr, rows_ptr, cols_ptr, y_ptr, keep_ptr, n_rows, n_cols, k, threshold,
                    scale, block_r: tl.constexpr, block_c: tl.constexpr):
    keep, offs_r, offs_c, inside = _tile_keep(rows_ptr, cols_ptr, n_rows, n_cols, k, threshold,
                                              block_r, block_c)
    at = offs_r.to(tl.int64)[:, None] * n_cols + offs_c[None, :]
    x = tl.load(x_ptr + at, mask=inside, other=0.0)
    y = tl.where(keep, x * scale, 0.0)
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(keep_ptr + at, keep.to(tl.int8), mask=inside)


def _grid(n_rows: int, n_cols: int) -> tuple[int, int]:
    return triton.cdiv(n_rows, BLOCK_ROWS), triton.cdiv(max(n_cols, 1), BLOCK_COLS)


def keep_mask_triton(rows: torch.Tensor, cols: torch.Tensor, k: int,
                     threshold: int) -> torch.Tensor:
    """The keep-mask of :func:`plexus.dropout.keep_mask` under key ``k`` and ``threshold``
    (:func:`plexus.dropout._mask_key`), on the device of ``rows`` and ``cols``.
    Shapes: [a], [b] -> [a, b] bool"""
    rows, cols = rows.to(torch.int64).contiguous(), cols.to(torch.int64).contiguous()
    out = torch.empty((rows.numel(), cols.numel()), dtype=torch.bool, device=rows.device)
    if out.numel():
        _keep_kernel[_grid(*out.shape)](rows, cols, out.view(torch.int8), rows.numel(),
                                        cols.numel(), int(k), int(threshold),
                                        block_r=BLOCK_ROWS, block_c=BLOCK_COLS)
    return out


def fused_dropout(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, k: int,
                  threshold: int, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x * keep / (1 - p), keep)`` with :func:`keep_mask_triton`'s mask, in one pass over
    ``x`` (contiguous [a, b] on the ids' device). Shapes: x [a, b] -> ([a, b], [a, b] bool)"""
    if tuple(x.shape) != (rows.numel(), cols.numel()):
        raise ValueError(f"x {tuple(x.shape)} is not [rows, cols] = "
                         f"[{rows.numel()}, {cols.numel()}]")
    rows, cols = rows.to(torch.int64).contiguous(), cols.to(torch.int64).contiguous()
    x = x.contiguous()
    # the factor plexus.dropout.dropped multiplies by, in x's dtype: the same products
    factor = float(torch.ones((), dtype=x.dtype) / (1.0 - p))
    y = torch.empty_like(x)
    keep = torch.empty(x.shape, dtype=torch.bool, device=x.device)
    if x.numel():
        _dropout_kernel[_grid(*x.shape)](x, rows, cols, y, keep.view(torch.int8), rows.numel(),
                                         cols.numel(), int(k), int(threshold), factor,
                                         block_r=BLOCK_ROWS, block_c=BLOCK_COLS)
    return y, keep
