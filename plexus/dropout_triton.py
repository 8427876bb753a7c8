"""The dropout keep-mask of :func:`plexus.dropout.keep_mask` as one Triton kernel, for GPUs
(imported only where ``triton`` is installed): each program hashes a tile of (row, column)
cells in uint32 arithmetic, the same xor-shift-multiply mixer as the CPU's, and compares with
the threshold, so its bits are the CPU hash's. :func:`fused_dropout` also applies the mask in
the same pass: ``x * keep / (1 - p)`` and the mask, one read of ``x`` and one write of each,
where the torch hash takes about fifteen int64 passes over the block before the mask is used.
:class:`HashedDropout` is that pass as an autograd function whose backward hashes the mask
again instead of keeping it (plexus.layer_dropout uses it on a GPU).

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors),
which is how the tests compare their bits with the CPU hash's (tests/plexus/test_dropout_triton.py).

The step of a mask's key is read from device memory (:class:`MaskKey`), so a CUDA graph that
captured the kernels draws each replay's masks from the step written there before it.

Shapes: rows [a], cols [b] (int64 node and column ids) -> [a, b] bool; x [a, b] float.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["HashedDropout", "MaskKey", "fused_dropout", "keep_mask_triton"]

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
def _tile_keep(rows_ptr, cols_ptr, n_rows, n_cols, seed_key, step_ptr, layer, threshold,
               block_r: tl.constexpr, block_c: tl.constexpr):
    """(the tile's keep bits, its row offsets, its column offsets, its in-bounds mask). The
    key is plexus.dropout._mask_key's, its step read from device memory: a CUDA graph
    replays the kernel with the step written there before each replay."""
    offs_r = tl.program_id(0) * block_r + tl.arange(0, block_r)
    offs_c = tl.program_id(1) * block_c + tl.arange(0, block_c)
    in_r, in_c = offs_r < n_rows, offs_c < n_cols
    step = tl.load(step_ptr).to(tl.uint32)  # (int64 mod 2^32, as the host's key)
    key = _mix32(_mix32(seed_key.to(tl.uint32) ^ step) ^ layer.to(tl.uint32))
    r = tl.load(rows_ptr + offs_r, mask=in_r, other=0).to(tl.uint32)  # ids mod 2^32
    c = tl.load(cols_ptr + offs_c, mask=in_c, other=0).to(tl.uint32)
    h = _mix32(((_mix32(r ^ key)[:, None] ^ c[None, :]) * 0x9E3779B1) ^ key)
    keep = h >= threshold.to(tl.uint32)
    return keep, offs_r, offs_c, in_r[:, None] & in_c[None, :]


@triton.jit(do_not_specialize=["seed_key", "layer", "threshold"])
def _keep_kernel(rows_ptr, cols_ptr, out_ptr, n_rows, n_cols, seed_key, step_ptr, layer,
                 threshold, block_r: tl.constexpr, block_c: tl.constexpr):
    keep, offs_r, offs_c, inside = _tile_keep(rows_ptr, cols_ptr, n_rows, n_cols, seed_key,
                                              step_ptr, layer, threshold, block_r, block_c)
    at = offs_r.to(tl.int64)[:, None] * n_cols + offs_c[None, :]
    tl.store(out_ptr + at, keep.to(tl.int8), mask=inside)


@triton.jit(do_not_specialize=["seed_key", "layer", "threshold"])
def _dropout_kernel(x_ptr, rows_ptr, cols_ptr, y_ptr, keep_ptr, n_rows, n_cols, seed_key,
                    step_ptr, layer, threshold, scale, block_r: tl.constexpr,
                    block_c: tl.constexpr, store_keep: tl.constexpr):
    keep, offs_r, offs_c, inside = _tile_keep(rows_ptr, cols_ptr, n_rows, n_cols, seed_key,
                                              step_ptr, layer, threshold, block_r, block_c)
    at = offs_r.to(tl.int64)[:, None] * n_cols + offs_c[None, :]
    x = tl.load(x_ptr + at, mask=inside, other=0.0)
    y = tl.where(keep, x * scale, 0.0)
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=inside)  # (y may be x: in place)
    if store_keep:
        tl.store(keep_ptr + at, keep.to(tl.int8), mask=inside)


def _grid(n_rows: int, n_cols: int) -> tuple[int, int]:
    return triton.cdiv(n_rows, BLOCK_ROWS), triton.cdiv(max(n_cols, 1), BLOCK_COLS)


class MaskKey(NamedTuple):
    """What a mask is hashed from: ``seed_key`` (:func:`plexus.dropout._seed_key` of the
    seed), ``step`` (int64 [1] on the device: read by the kernel), ``layer`` and
    ``threshold`` (:func:`plexus.dropout._mask_key`'s)."""

    seed_key: int
    step: torch.Tensor
    layer: int
    threshold: int

    def args(self) -> tuple:
        return (int(self.seed_key), self.step, int(self.layer), int(self.threshold))


def keep_mask_triton(rows: torch.Tensor, cols: torch.Tensor, key: MaskKey) -> torch.Tensor:
    """The keep-mask of :func:`plexus.dropout.keep_mask` of ``key``, on the device of ``rows``
    and ``cols``. Shapes: [a], [b] -> [a, b] bool"""
    rows, cols = rows.to(torch.int64).contiguous(), cols.to(torch.int64).contiguous()
    out = torch.empty((rows.numel(), cols.numel()), dtype=torch.bool, device=rows.device)
    if out.numel():
        _keep_kernel[_grid(*out.shape)](rows, cols, out.view(torch.int8), rows.numel(),
                                        cols.numel(), *key.args(),
                                        block_r=BLOCK_ROWS, block_c=BLOCK_COLS)
    return out


def fused_dropout(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, key: MaskKey,
                  p: float, out: torch.Tensor | None = None,
                  with_mask: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x * keep / (1 - p), keep)`` with :func:`keep_mask_triton`'s mask, in one pass over
    ``x`` (contiguous [a, b] on the ids' device, float32, bfloat16 or float16: the factor
    travels as a float32). ``out``: where the values go (``x`` itself: in place);
    ``with_mask=False``: no mask is written (None in its place).
    Shapes: x [a, b] -> ([a, b], [a, b] bool)"""
    if tuple(x.shape) != (rows.numel(), cols.numel()):
        raise ValueError(f"x {tuple(x.shape)} is not [rows, cols] = "
                         f"[{rows.numel()}, {cols.numel()}]")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"fused_dropout takes float32, bfloat16 or float16 x, not {x.dtype} "
                         "(its factor travels as a float32)")
    if out is not None and (tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype
                            or not out.is_contiguous()):
        raise ValueError(f"fused_dropout writes a contiguous {tuple(x.shape)} {x.dtype} out, "
                         f"not a {tuple(out.shape)} {out.dtype} one")
    rows, cols = rows.to(torch.int64).contiguous(), cols.to(torch.int64).contiguous()
    x = x.contiguous()
    # the factor plexus.dropout.dropped multiplies by, in x's dtype: the same products
    factor = float(torch.ones((), dtype=x.dtype) / (1.0 - p))
    y = torch.empty_like(x) if out is None else out
    keep = torch.empty(x.shape, dtype=torch.bool, device=x.device) if with_mask else None
    if x.numel():
        _dropout_kernel[_grid(*x.shape)](x, rows, cols, y, y if keep is None else
                                         keep.view(torch.int8), rows.numel(), cols.numel(),
                                         *key.args(), factor,
                                         block_r=BLOCK_ROWS, block_c=BLOCK_COLS,
                                         store_keep=keep is not None)
    return y, keep


class HashedDropout(torch.autograd.Function):
    """``x * keep / (1 - p)`` whose mask is hashed in the kernel that applies it, in forward
    and again in backward: one pass each way, and nothing kept for backward but the ids and
    the key (where :class:`plexus.dropout._Dropout` keeps the mask as bits, and packs and
    unpacks them in passes of their own). The same values, both ways, as
    :func:`plexus.dropout.apply_dropout` with :func:`plexus.dropout.keep_mask`'s mask.

    ``over_x``, ``over_grad``: written over ``x`` (forward), over the incoming gradient
    (backward), as :func:`plexus.dropout.apply_dropout`'s ``spent``.
    Shapes: x [a, b], rows [a], cols [b] -> [a, b]
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, key: MaskKey,
                p: float, over_x: bool, over_grad: bool) -> torch.Tensor:
        # (the step tensor is kept as it is, not saved: the step is rewritten in place each
        # epoch, after this pass's backward)
        ctx.save_for_backward(rows, cols)
        ctx.key, ctx.p, ctx.over_grad = key, p, over_grad
        if over_x and x.is_contiguous():
            ctx.mark_dirty(x)
            return fused_dropout(x, rows, cols, key, p, out=x, with_mask=False)[0]
        return fused_dropout(x, rows, cols, key, p, with_mask=False)[0]

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        rows, cols = ctx.saved_tensors
        over = ctx.over_grad and dy.is_contiguous()
        dx = fused_dropout(dy, rows, cols, ctx.key, ctx.p, out=dy if over else None,
                           with_mask=False)[0]
        return dx, None, None, None, None, None, None
