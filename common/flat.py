"""Flat sharding: a block flattened and split over a group into equal, zero-padded chunks.

Both engines keep their weight blocks this way (FSDP / ZeRO-3 style): Plexus over the depth
role P of each layer (docs/design/plexus-3d.md), the 4D GPT over ``depth``
(docs/design/llm-4d-goldfish.md). A block is gathered before use and its gradient
reduce-scattered back to the shards:

==============================  ==============================  ==============================
function                        forward                         backward
==============================  ==============================  ==============================
flat_shard (pure)               keep chunk ``index`` of ``num``
gather                          all-gather, view as the block   (no autograd)
all_gather_reduce_scatter       all-gather, view as the block   pad, reduce-scatter
reduce_scatter                  pad, reduce-scatter a gradient  (no autograd)
==============================  ==============================  ==============================

Member ``k`` of a group of ``g`` holds elements ``[k*s, (k+1)*s)`` of the row-major flattened
block, ``s = ceil(numel / g)``; the last chunks are zero beyond ``numel``. The zero padding
is never read back: :func:`unflatten` drops it, and the padding's gradient is zero.

Shapes legend: block ``[a, b]`` (any shape: ``numel`` elements), ``g`` the group size,
``s = ceil(numel / g)``; a flat shard is ``[s]``, the gathered flat buffer ``[g*s]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, overload

import torch

from common import autograd
from common import collectives as coll
from common.collectives import CommHandle
from common.comm_stats import CommStats
from common.grid import AxisGroup, ceil_div


def shard_size(numel: int, num: int) -> int:
    """Elements of each of ``num`` flat shards of a block of ``numel``: ``ceil(numel / num)``."""
    return ceil_div(numel, num)


def shard_range(numel: int, num: int, index: int) -> tuple[int, int]:
    """``(lo, hi)``: the flattened block's elements shard ``index`` of ``num`` holds (``hi``
    may pass ``numel``: the padding). Pure."""
    size = shard_size(numel, num)
    return index * size, (index + 1) * size


def flat_shard(block: torch.Tensor, num: int, index: int) -> torch.Tensor:
    """Chunk ``index`` of ``num`` of the flattened block, zero-padded to equal chunks (a copy,
    on the block's device). Pure.

    Shapes: block [a, b] -> [ceil(a * b / num)]
    """
    flat = block.reshape(-1)
    lo, hi = shard_range(flat.numel(), num, index)
    out = block.new_zeros(hi - lo)
    piece = flat[lo:hi]
    out[: piece.numel()] = piece
    return out


def unflatten(flat: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The block of a gathered flat buffer: its first ``prod(shape)`` elements, viewed
    (without a slice where they are all of it: a slice's backward writes its gradient into a
    fresh zeroed buffer of the whole size, a view's backward is a view).

    Shapes: flat [g*s] -> shape
    """
    size = math.prod(shape)
    return (flat if flat.numel() == size else flat[:size]).view(tuple(shape))


@overload
def gather(shard: torch.Tensor, group: AxisGroup, shape: Sequence[int], *,
           stats: CommStats | None = ..., async_op: Literal[False] = ...) -> torch.Tensor: ...


@overload
def gather(shard: torch.Tensor, group: AxisGroup, shape: Sequence[int], *,
           stats: CommStats | None = ..., async_op: Literal[True]) -> CommHandle: ...


def gather(shard: torch.Tensor, group: AxisGroup, shape: Sequence[int], *,
           stats: CommStats | None = None, async_op: bool = False
           ) -> torch.Tensor | CommHandle:
    """The block from every member's flat shard: all-gather over ``group`` (collective; no
    autograd). With ``async_op`` a handle whose ``wait()`` returns the block. On a group of
    one the block is a view of ``shard``.

    Shapes: shard [s] -> shape (the block [a, b])
    """
    if async_op:
        handle = coll.all_gather(shard, group, stats=stats, async_op=True)
        assert isinstance(handle, CommHandle)
        return CommHandle(handle, lambda: unflatten(handle.wait(), shape))
    full = coll.all_gather(shard, group, stats=stats)
    assert isinstance(full, torch.Tensor)
    return unflatten(full, shape)


def all_gather_reduce_scatter(shard: torch.Tensor, group: AxisGroup, shape: Sequence[int],
                              stats: CommStats | None = None) -> torch.Tensor:
    """Forward: all-gather the flat shards over ``group`` and view the block; backward: the
    block's gradient flattened, zero-padded and reduce-scattered over ``group``.

    For a flat-sharded tensor that every member gathers and uses differently: the gradient of
    each shard is the sum of every member's gradient of its elements.

    Shapes: shard [s] -> shape (the block [a, b])
    """
    return unflatten(autograd.all_gather_reduce_scatter(shard, group, stats=stats), shape)


@overload
def reduce_scatter(block: torch.Tensor, group: AxisGroup, *, stats: CommStats | None = ...,
                   async_op: Literal[False] = ...) -> torch.Tensor: ...


@overload
def reduce_scatter(block: torch.Tensor, group: AxisGroup, *, stats: CommStats | None = ...,
                   async_op: Literal[True]) -> CommHandle: ...


def reduce_scatter(block: torch.Tensor, group: AxisGroup, *, stats: CommStats | None = None,
                   async_op: bool = False) -> torch.Tensor | CommHandle:
    """This member's flat shard of the sum over ``group`` of every member's ``block`` (a
    gradient block): flatten, zero-pad to ``g*s``, reduce-scatter (collective; no autograd).
    With ``async_op`` a handle whose ``wait()`` returns the shard.

    Shapes: block [a, b] -> [s], s = ceil(a * b / g)
    """
    flat = block.reshape(-1)
    pad = shard_size(flat.numel(), group.size) * group.size - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return coll.reduce_scatter(flat, group, stats=stats, async_op=async_op)
