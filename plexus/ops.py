"""The autograd operators of one Plexus GCN layer (plexus-3d.md sections 1 and 4).

Each is a ``torch.autograd.Function`` with both passes written out, so the collectives and the
memory kept for backward are explicit: plexus.model composes them into the layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from common import collectives as coll
from common.grid import AxisGroup

__all__ = ["GatheredMatmul", "ReLU", "SpMM", "gather_flat"]


class SpMM(torch.autograd.Function):
    """``A @ F`` for a :class:`~plexus.sparse.BlockSparse` ``A``; backward ``A^T @ dH`` with
    the precomputed transpose."""

    @staticmethod
    def forward(ctx: Any, a, a_t, f):
        ctx.a_t = a_t
        return a.matmul(f)

    @staticmethod
    def backward(ctx: Any, dh):
        return None, None, ctx.a_t.matmul(dh) if ctx.needs_input_grad[2] else None


class ReLU(torch.autograd.Function):
    """In-place ``relu`` of a fresh tensor that keeps only the bool mask ``out > 0`` for
    backward (1 byte per entry, not the float output's 4: the output is the next layer's input,
    which is spent once its aggregation has run). Same values as ``torch.relu_`` both ways."""

    @staticmethod
    def forward(ctx: Any, q):
        ctx.mark_dirty(q)
        out = torch.relu_(q)
        ctx.save_for_backward(out > 0)
        return out

    @staticmethod
    def backward(ctx: Any, dy):
        (keep,) = ctx.saved_tensors
        return dy.masked_fill(~keep, 0.0)


class GatheredMatmul(torch.autograd.Function):
    """``H @ W`` with ``W`` all-gathered over P from its flat shard, in both passes.

    The gathered ``W`` is not kept for backward: it is gathered again (collective 5), and
    ``dW`` is reduce-scattered back to flat shards (collective 6).
    """

    @staticmethod
    def forward(ctx: Any, h, w_shard, group: AxisGroup, shape, stats):
        ctx.group, ctx.shape, ctx.stats = group, shape, stats
        ctx.save_for_backward(h, w_shard)
        return h @ gather_flat(w_shard, group, shape, stats)

    @staticmethod
    def backward(ctx: Any, dq):
        h, w_shard = ctx.saved_tensors
        group, shape, stats = ctx.group, ctx.shape, ctx.stats
        dh = None
        if ctx.needs_input_grad[0]:
            dh = dq @ gather_flat(w_shard, group, shape, stats).t()
        dw = (h.t() @ dq).reshape(-1)
        pad = w_shard.numel() * group.size - dw.numel()
        if pad:
            dw = torch.cat([dw, dw.new_zeros(pad)])
        return dh, coll.reduce_scatter(dw, group, stats=stats), None, None, None


def gather_flat(shard: torch.Tensor, group: AxisGroup, shape, stats) -> torch.Tensor:
    full = coll.all_gather(shard, group, stats=stats)
    return full[: math.prod(shape)].view(shape)
