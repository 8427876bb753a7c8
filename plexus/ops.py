"""The autograd operators of one Plexus GCN layer (docs/design/plexus-3d.md sections 1 and 4).

Each is a ``torch.autograd.Function`` with both passes written out, so the collectives and the
memory kept for backward are explicit: plexus.model composes them into the layer.
"""

from __future__ import annotations

from typing import Any

import torch

from common import flat
from common.grid import AxisGroup

__all__ = ["GatheredMatmul", "ReLU", "SpMM"]


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
    """``H @ W`` with ``W`` all-gathered over P from its flat shard (common.flat), in both
    passes.

    The gathered ``W`` is not kept for backward: it is gathered again (collective 5), and
    ``dW`` is reduce-scattered back to flat shards (collective 6).

    Shapes: h [N/P, D_l/I], w_shard [ceil(D_l/I * D_l+1/O / P)], shape (D_l/I, D_l+1/O)
    -> [N/P, D_l+1/O]
    """

    @staticmethod
    def forward(ctx: Any, h, w_shard, group: AxisGroup, shape, stats):
        ctx.group, ctx.shape, ctx.stats = group, shape, stats
        ctx.save_for_backward(h, w_shard)
        return h @ flat.gather(w_shard, group, shape, stats=stats)

    @staticmethod
    def backward(ctx: Any, dq):
        h, w_shard = ctx.saved_tensors
        group, shape, stats = ctx.group, ctx.shape, ctx.stats
        dh = None
        if ctx.needs_input_grad[0]:
            dh = dq @ flat.gather(w_shard, group, shape, stats=stats).t()
        return dh, flat.reduce_scatter(h.t() @ dq, group, stats=stats), None, None, None
