"""Dropout on shards, with the numbers of the serial model on any grid (parallel == serial):
:func:`dropout_mask` draws the keep-mask of element (node, column) of layer ``l`` at step ``e``
from a counter-based hash of (seed, e, l, node id, column), not from a generator's stream, so
a rank computes exactly the mask entries of the block it holds, and 8 ranks drop the same
entries as 1 rank. :func:`apply_dropout` and :func:`dropped` apply a mask (kept as a bool
tensor or in bits); :func:`can_spend` says when a block may be written over.
"""

from __future__ import annotations

import numpy as np
import torch

from common import dense
from plexus.csr import numba_kernels
from plexus.ops import BitMask
from plexus.triton_switch import launch, triton_function

_U32 = np.uint32


def _mix32(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer mixer (xor-shift-multiply, arithmetic mod 2^32) on uint32 arrays."""
    x = x ^ (x >> _U32(16))
    x = x * _U32(0x7FEB352D)
    x = x ^ (x >> _U32(15))
    x = x * _U32(0x846CA68B)
    return x ^ (x >> _U32(16))


def keep_mask(p: float, *, seed: int, step: int | torch.Tensor, layer: int, rows: torch.Tensor,
              cols: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Keep-mask of dropout with rate ``p`` on the block of global ``rows`` (node ids) x
    ``cols`` (column ids) of layer ``layer``'s input at ``step``, on ``device`` (default: the
    CPU).

    Entry (r, c) depends only on (seed, step, layer, r, c) (node ids modulo 2^32). Computed on
    the CPU by a numba kernel, rows in parallel (:func:`plexus.kernels.keep_mask`), or without
    numba (and for small blocks) in numpy's wrapping uint32 arithmetic, in row chunks of about
    2^22 entries so the hash's temporaries stay small; on a CUDA device by one Triton kernel
    where ``triton`` is installed (plexus.dropout_triton; ``PLEXUS_TRITON=0`` turns it off),
    else, and on other devices, by torch's int64 operations there (:func:`_keep_mask_torch`),
    so that no mask of the block's size is made on the host and copied over: the same bits
    every way. ``step`` may be an int64 [1] tensor on ``device`` (:func:`step_tensor`), which
    the Triton kernel reads there (a CUDA graph replays it with the step written before each
    replay). Shapes: rows [a], cols [b] -> [a, b] bool.
    """
    # (ids already on the device move nowhere; ids on the host are copied, and wait for it)
    if device is not None and torch.device(device).type != "cpu":
        rows, cols = rows.to(device), cols.to(device)
        fused = (triton_function("dropout_triton", "keep_mask_triton")
                 if torch.device(device).type == "cuda" else None)
        if fused is not None:
            out = launch(fused, rows, cols, _device_key(p, seed, step, layer, rows.device))
            if out is not None:
                return out
        k, threshold = _mask_key(p, seed, _host_step(step), layer)
        return _keep_mask_torch(rows, cols, int(k), int(threshold))
    k, threshold = _mask_key(p, seed, _host_step(step), layer)
    c = cols.numpy().astype(np.uint32)[None, :]
    out = np.empty((rows.numel(), c.shape[1]), dtype=bool)
    step_rows = max(1, (1 << 22) // max(c.shape[1], 1))
    with np.errstate(over="ignore"):
        r_all = rows.numpy().astype(np.uint32)
        kernels = numba_kernels() if out.size >= 1 << 16 else None  # threads pay above
        if kernels is not None:  # the same hash, rows in parallel, no temporaries
            kernels.keep_mask(r_all, c[0], np.uint64(k), np.uint64(threshold), out)
            return torch.from_numpy(out)
        for lo in range(0, r_all.size, step_rows):
            h = _cell_hash(r_all[lo:lo + step_rows, None], c, k)
            np.greater_equal(h, threshold, out=out[lo:lo + step_rows])
    return torch.from_numpy(out)


def hashed_dropout(x: torch.Tensor, p: float, *, seed: int, step: int | torch.Tensor,
                   layer: int, rows: torch.Tensor, cols: torch.Tensor, spent: bool = False,
                   grad: bool = True) -> torch.Tensor | None:
    """:func:`apply_dropout` of ``x`` with :func:`keep_mask`'s mask of ``rows`` x ``cols``
    (on ``x``'s CUDA device), as one Triton kernel each way that hashes the mask where it
    applies it, keeping no mask for backward (plexus.dropout_triton.HashedDropout): the same
    values and gradient. None where Triton is not there to run it (the caller applies the
    mask itself). ``spent``: as :func:`apply_dropout`'s; ``grad=False``: :func:`dropped`'s
    values, a new tensor and no graph (the kernel alone)."""
    if x.device.type != "cuda" or x.dtype != torch.float32:
        return None
    key = _device_key(p, seed, step, layer, x.device)
    if not grad:
        fn = triton_function("dropout_triton", "fused_dropout")
        out = None if fn is None else launch(fn, x.detach(), rows, cols, key, p, None, False)
        return None if out is None else out[0]
    fn = triton_function("dropout_triton", "HashedDropout")
    if fn is None:
        return None
    return launch(fn.apply, x, rows, cols, key, p, spent and can_spend(x), spent)


def step_tensor(step: int, device: torch.device | str) -> torch.Tensor:
    """``step`` as the int64 [1] tensor on ``device`` that the Triton kernels read their
    step from (made by a fill on the device: no copy from the host, no wait)."""
    return torch.full((1,), step, dtype=torch.int64, device=device)


def _host_step(step: int | torch.Tensor) -> int:
    """The step as an int (a step tensor on a GPU is read back: the torch paths only)."""
    return int(step.item()) if isinstance(step, torch.Tensor) else int(step)


def _device_key(p: float, seed: int, step: int | torch.Tensor, layer: int,
                device: torch.device):
    """plexus.dropout_triton.MaskKey of (seed, step, layer) and rate ``p``, its step on
    ``device``."""
    from plexus.dropout_triton import MaskKey

    if not isinstance(step, torch.Tensor):
        step = step_tensor(step, device)
    return MaskKey(int(_seed_key(seed)), step, layer, int(_threshold(p)))


def _cell_hash(rows: np.ndarray, cols: np.ndarray, k: np.uint32) -> np.ndarray:
    """The hash of cell (row, col) under key ``k`` (uint32, broadcast): what :func:`keep_mask`
    compares with its threshold. Overflow warnings are the caller's to silence."""
    return _mix32((_mix32(rows ^ k) ^ cols) * _U32(0x9E3779B1) ^ k)


def _mask_key(p: float, seed: int, step: int, layer: int) -> tuple[np.uint32, np.uint32]:
    """The hash's key of (seed, step, layer) and the threshold of rate ``p`` (uint32): the
    seed, the step and the layer mixed in, in that order, each mod 2^32."""
    k = _seed_key(seed)
    with np.errstate(over="ignore"):
        for part in np.array([step, layer], dtype=np.int64).astype(np.uint32):
            k = _mix32(np.array([k ^ part], dtype=np.uint32))[0]
    return k, _threshold(p)


def _threshold(p: float) -> np.uint32:
    """The hash value below which an entry is dropped at rate ``p``."""
    return _U32(min(int(p * 2.0**32), 2**32 - 1))


def _seed_key(seed: int) -> np.uint32:
    """The key with the seed mixed in, before the step and the layer (:func:`_mask_key`)."""
    part = np.array([seed], dtype=np.int64).astype(np.uint32)[0]
    with np.errstate(over="ignore"):
        return _mix32(np.array([_U32(0x5BD1E995) ^ part], dtype=np.uint32))[0]


_LOW32 = 0xFFFFFFFF
TORCH_MASK_ENTRIES = 1 << 22  # entries per row chunk of the torch hash (32 MiB int64 temporaries)


def _mul32_(x: torch.Tensor, m: int) -> torch.Tensor:
    """``x * m mod 2^32`` in place, for int64 ``x`` in [0, 2^32) and a constant ``m`` below
    2^32, exact in int64: ``m`` of 2^31 or more is taken as ``m - 2^32`` (the same residue),
    so no product leaves (-2^63, 2^63), and the low 32 bits of the two's complement result
    are the residue. Two passes over ``x``."""
    return x.mul_(m - (1 << 32) if m >= 1 << 31 else m).bitwise_and_(_LOW32)


def _mix32_torch(x: torch.Tensor) -> torch.Tensor:
    """:func:`_mix32` on int64 values in [0, 2^32) (a new tensor; ``x`` is not changed)."""
    x = x ^ (x >> 16)
    x = _mul32_(x, 0x7FEB352D)
    x ^= x >> 15
    x = _mul32_(x, 0x846CA68B)
    x ^= x >> 16
    return x


def _keep_mask_torch(rows: torch.Tensor, cols: torch.Tensor, k: int,
                     threshold: int) -> torch.Tensor:
    """:func:`keep_mask`'s hash in torch int64 arithmetic on the device of ``rows`` and
    ``cols``, in row chunks of :data:`TORCH_MASK_ENTRIES` entries: the numpy path's bits."""
    c = (cols.to(torch.int64) & _LOW32)[None, :]
    r_all = _mix32_torch((rows.to(torch.int64) & _LOW32) ^ k)
    out = torch.empty((rows.numel(), c.shape[1]), dtype=torch.bool, device=rows.device)
    step_rows = max(1, TORCH_MASK_ENTRIES // max(c.shape[1], 1))
    for lo in range(0, r_all.numel(), step_rows):
        h = _mix32_torch(_mul32_(r_all[lo:lo + step_rows, None] ^ c, 0x9E3779B1).bitwise_xor_(k))
        torch.ge(h, threshold, out=out[lo:lo + step_rows])
    return out


# the attention coefficients of layer l are keyed as layer l + this (its input's as layer l)
ATTENTION_LAYER_OFFSET = 1 << 16


def edge_keep_mask(p: float, *, seed: int, step: int, layer: int, dst: torch.Tensor,
                   src: torch.Tensor, heads: int, of: range | None = None) -> torch.Tensor:
    """Keep-mask of dropout with rate ``p`` on the attention coefficients of the edges
    ``src -> dst`` (global node ids, one entry per edge) of layer ``layer`` at ``step``, one
    column per head: entry (e, h) is :func:`keep_mask`'s hash of row ``dst[e]`` and column
    ``src[e] * heads + h`` (mod 2^32) under the key of layer ``layer +``
    :data:`ATTENTION_LAYER_OFFSET`, so it depends only on the edge, the head and (seed, step,
    layer): any grid, any order of the edges, drops the same coefficients. ``of``: only
    these of the ``heads`` heads (a rank's), as their columns of the whole mask.

    Shapes: dst [E], src [E] -> [E, heads] bool (or [E, len(of)])
    """
    k, threshold = _mask_key(p, seed, step, layer + ATTENTION_LAYER_OFFSET)
    of = range(heads) if of is None else of
    with np.errstate(over="ignore"):
        c = (src.numpy().astype(np.uint32)[:, None] * _U32(heads)
             + np.arange(of.start, of.stop, dtype=np.uint32)[None, :])
        h = _cell_hash(dst.numpy().astype(np.uint32)[:, None], c, k)
    return torch.from_numpy(h >= threshold)


def dropout_mask(p: float, *, seed: int, step: int, layer: int, rows: torch.Tensor,
                 cols: torch.Tensor) -> torch.Tensor:
    """Scaled keep-mask ``keep / (1 - p)`` (:func:`keep_mask`) as float32 [a, b]."""
    return keep_mask(p, seed=seed, step=step, layer=layer, rows=rows,
                     cols=cols).to(torch.float32) / (1.0 - p)


class _Dropout(torch.autograd.Function):
    """``x * keep / (1 - p)`` keeping only the mask for backward, one bit per entry
    (:class:`plexus.ops.BitMask`; a float mask would take 32). ``over_x``, ``over_grad``:
    written over ``x`` (forward), over the incoming gradient (backward): :func:`apply_dropout`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, p: float, over_x: bool,
                over_grad: bool) -> torch.Tensor:
        ctx.keep, ctx.p, ctx.over_grad = BitMask(keep), p, over_grad
        if over_x:
            ctx.mark_dirty(x)
        # on the CPU from the bits just packed (one numba pass over a large float32 block;
        # torch's masked_fill_ with the negated bool mask takes several times as long on a
        # [200K, 128] block); elsewhere the negated mask, one kernel
        return dropped(x, ctx.keep if x.device.type == "cpu" else ~keep, p, inplace=over_x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dropped(dy, ctx.keep, ctx.p, inplace=ctx.over_grad), None, None, None, None


def dropped(x: torch.Tensor, drop: torch.Tensor | BitMask, p: float, *,
            inplace: bool = False) -> torch.Tensor:
    """``x * keep / (1 - p)`` (no graph): the values :func:`apply_dropout` gives, as a new
    tensor or, with ``inplace`` where ``x`` serves as a new one would
    (:func:`common.dense.can_overwrite`), written over ``x``. ``drop``: the
    negated mask (bool), or the mask itself as bits, cleared without unpacking it where
    :meth:`BitMask.clear_` can (a large float32 CPU block)."""
    factor = torch.ones((), dtype=x.dtype) / (1.0 - p)  # as keep.float() / (1 - p)
    if inplace and dense.can_overwrite(x):
        scaled = x.mul_(factor)
    elif not (torch.is_grad_enabled() and x.requires_grad):
        # into a buffer of common.dense.empty where it can (reusable; readable by dense.tn)
        scaled = torch.mul(x, factor, out=dense.empty_like(x))
    else:
        scaled = x.mul(factor)
    return drop.clear_(scaled) if isinstance(drop, BitMask) else scaled.masked_fill_(drop, 0.0)


def apply_dropout(x: torch.Tensor, keep: torch.Tensor, p: float, *,
                  spent: bool = False) -> torch.Tensor:
    """Dropout of ``x`` with the keep-mask ``keep`` (same shape, bool) and rate ``p``.

    ``spent`` (the caller's promise): nothing reads ``x`` after this, and the gradient that
    reaches the output is read by nothing but this function's backward (the output feeds
    operations that each return a fresh gradient, and no two of them the same tensor). Then
    the passes write over their input instead of a new [N, D] block: the same values, one
    tall allocation fewer each way. Forward does so only where autograd lets ``x`` be
    modified in place (:func:`can_spend`); backward always.
    """
    return _Dropout.apply(x, keep, p, spent and can_spend(x), spent)


def drop_block(x: torch.Tensor, p: float, *, seed: int, step: int | torch.Tensor, layer: int,
               rows: torch.Tensor, cols: torch.Tensor, spent: bool = False) -> torch.Tensor:
    """Dropout of the block ``x`` of ``rows`` x ``cols`` (global ids) of ``layer``'s input at
    ``step``: :func:`hashed_dropout` where it runs (a GPU with Triton), else
    :func:`keep_mask`'s mask drawn on ``x``'s device and :func:`apply_dropout`. The same
    values either way. ``spent``: as :func:`apply_dropout`'s."""
    fused = hashed_dropout(x, p, seed=seed, step=step, layer=layer, rows=rows, cols=cols,
                           spent=spent)
    if fused is not None:
        return fused
    keep = keep_mask(p, seed=seed, step=step, layer=layer, rows=rows, cols=cols,
                     device=x.device)
    return apply_dropout(x, keep, p, spent=spent)


def can_spend(x: torch.Tensor) -> bool:
    """Whether autograd lets ``x`` be overwritten by a custom Function, and it serves as a new
    block would (:func:`common.dense.can_overwrite`: contiguous, and read in place by the weight
    gradient where a new one would be): no view (a custom Function's view output may not be
    modified in place) and no leaf that requires grad."""
    return (dense.can_overwrite(x) and not x._is_view()
            and not (x.is_leaf and x.requires_grad))
