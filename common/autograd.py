"""Differentiable collectives along one grid axis, in forward/backward pairs.

Convention: a tensor *replicated* over a group carries a replicated gradient (every member
holds the full gradient), and a *partial* tensor (one summand per member) carries the
gradient of the sum. Under that convention the adjoint pairs are:

=============================  =========================  ===========================
function                       forward                    backward
=============================  =========================  ===========================
all_reduce_identity            all-reduce (sum)           identity
identity_all_reduce            identity                   all-reduce (sum)
all_reduce_all_reduce          all-reduce (sum)           all-reduce (sum)
all_gather_reduce_scatter      all-gather along dim       reduce-scatter along dim
reduce_scatter_all_gather      reduce-scatter along dim   all-gather along dim
split_all_gather               keep own chunk along dim   all-gather along dim
all_gather_split               all-gather along dim       keep own chunk along dim
=============================  =========================  ===========================

Each takes the one :class:`~common.grid.AxisGroup` it uses and an optional
:class:`~common.comm_stats.CommStats`; backward collectives are counted in the same stats.
Groups of size 1 are the identity in both directions. The flat-shard pair (gather a flattened
block before use, reduce-scatter its gradient) is :func:`common.flat.all_gather_reduce_scatter`.
"""

from __future__ import annotations

from typing import Any

import torch

from common import collectives as coll
from common.comm_stats import CommStats
from common.grid import AxisGroup


class _AllReduceIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, group, stats, inplace):
        if inplace:
            ctx.mark_dirty(x)
        return coll.all_reduce(x, group, stats=stats, inplace=inplace)

    @staticmethod
    def backward(ctx: Any, dy):
        return dy, None, None, None


class _IdentityAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy):
        return coll.all_reduce(dy, ctx.group, stats=ctx.stats), None, None


class _AllReduceAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, group, stats, inplace):
        ctx.group, ctx.stats = group, stats
        if inplace:
            ctx.mark_dirty(x)
        return coll.all_reduce(x, group, stats=stats, inplace=inplace)

    @staticmethod
    def backward(ctx: Any, dy):
        return coll.all_reduce(dy, ctx.group, stats=ctx.stats), None, None, None


class _AllGatherReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, group, dim, stats):
        ctx.group, ctx.dim, ctx.stats = group, dim, stats
        return coll.all_gather(x, group, dim=dim, stats=stats)

    @staticmethod
    def backward(ctx: Any, dy):
        return coll.reduce_scatter(dy, ctx.group, dim=ctx.dim, stats=ctx.stats), None, None, None


class _ReduceScatterAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, group, dim, stats):
        ctx.group, ctx.dim, ctx.stats = group, dim, stats
        return coll.reduce_scatter(x, group, dim=dim, stats=stats)

    @staticmethod
    def backward(ctx: Any, dy):
        return coll.all_gather(dy, ctx.group, dim=ctx.dim, stats=ctx.stats), None, None, None


class _SplitAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, group, dim, stats):
        ctx.group, ctx.dim, ctx.stats = group, dim, stats
        return coll.chunk(x, group, dim=dim).clone()

    @staticmethod
    def backward(ctx: Any, dy):
        return coll.all_gather(dy, ctx.group, dim=ctx.dim, stats=ctx.stats), None, None, None


class _AllGatherSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, group, dim, stats):
        ctx.group, ctx.dim = group, dim
        return coll.all_gather(x, group, dim=dim, stats=stats)

    @staticmethod
    def backward(ctx: Any, dy):
        return coll.chunk(dy, ctx.group, dim=ctx.dim).contiguous(), None, None, None


def all_reduce_identity(
    x: torch.Tensor, group: AxisGroup, stats: CommStats | None = None, *, inplace: bool = False
) -> torch.Tensor:
    """Forward: all-reduce (sum) over ``group``; backward: identity.

    Turns per-rank partial sums into a replicated tensor (Megatron's ``g``). ``inplace``:
    reduce into ``x`` itself, saving a buffer of its size; for a fresh contiguous tensor that
    nothing else reads (autograd refuses the backward if something saved it).
    """
    return x if group.size == 1 else _AllReduceIdentity.apply(x, group, stats, inplace)


def identity_all_reduce(
    x: torch.Tensor, group: AxisGroup, stats: CommStats | None = None
) -> torch.Tensor:
    """Forward: identity; backward: all-reduce (sum) over ``group``.

    Marks a replicated tensor that each member uses differently, so its gradient is the sum
    of the members' partial gradients (Megatron's ``f``).
    """
    return x if group.size == 1 else _IdentityAllReduce.apply(x, group, stats)


def all_reduce_all_reduce(
    x: torch.Tensor, group: AxisGroup, stats: CommStats | None = None, *, inplace: bool = False
) -> torch.Tensor:
    """Forward: all-reduce (sum) over ``group``; backward: all-reduce (sum) over ``group``.

    Turns per-rank partial sums into a replicated tensor that each member then uses
    differently (a statistic summed over a split dimension, an aggregation whose rows feed
    every member's own columns), so the gradient of each partial is the sum of the members'
    gradients: ``identity_all_reduce(all_reduce_identity(x))`` in one function. ``inplace``
    as :func:`all_reduce_identity`.
    """
    return x if group.size == 1 else _AllReduceAllReduce.apply(x, group, stats, inplace)


def all_gather_reduce_scatter(
    x: torch.Tensor, group: AxisGroup, dim: int = 0, stats: CommStats | None = None
) -> torch.Tensor:
    """Forward: all-gather along ``dim`` over ``group``; backward: reduce-scatter along ``dim``.

    For a sharded tensor (e.g. an FSDP-style weight shard) gathered and then used differently
    by each member: the gradient of each shard is the sum of every member's partial gradient.

    Shapes: x [..., s, ...] -> [..., g*s, ...]
    """
    return x if group.size == 1 else _AllGatherReduceScatter.apply(x, group, dim, stats)


def reduce_scatter_all_gather(
    x: torch.Tensor, group: AxisGroup, dim: int = 0, stats: CommStats | None = None
) -> torch.Tensor:
    """Forward: reduce-scatter along ``dim`` over ``group``; backward: all-gather along ``dim``.

    Shapes: x [..., g*s, ...] (a partial sum) -> [..., s, ...] (this rank's chunk of the sum)
    """
    return x if group.size == 1 else _ReduceScatterAllGather.apply(x, group, dim, stats)


def split_all_gather(
    x: torch.Tensor, group: AxisGroup, dim: int = 0, stats: CommStats | None = None
) -> torch.Tensor:
    """Forward: keep this rank's chunk along ``dim`` (no communication); backward: all-gather.

    Shapes: x [..., g*s, ...] (replicated) -> [..., s, ...]
    """
    return x if group.size == 1 else _SplitAllGather.apply(x, group, dim, stats)


def all_gather_split(
    x: torch.Tensor, group: AxisGroup, dim: int = 0, stats: CommStats | None = None
) -> torch.Tensor:
    """Forward: all-gather along ``dim``; backward: keep this rank's chunk of the gradient.

    For a gathered tensor whose consumers are replicated over the group (so the gradient
    arriving is already the full, replicated gradient).

    Shapes: x [..., s, ...] -> [..., g*s, ...]
    """
    return x if group.size == 1 else _AllGatherSplit.apply(x, group, dim, stats)
