"""The autograd operators of one Plexus GCN layer (docs/design/plexus-3d.md sections 1 and 4).

Each is a ``torch.autograd.Function`` with both passes written out, so the collectives and the
memory kept for backward are explicit: plexus.model composes them into the layer.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from common import collectives as coll
from common import flat
from common.grid import AxisGroup

__all__ = ["BlockedAggregation", "GatheredMatmul", "ReLU", "SpMM"]


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


class BlockedAggregation(torch.autograd.Function):
    """``H = A @ F`` all-reduced over ``group`` (collective 2), in row blocks; backward ``dH``
    all-reduced over ``group`` (7) in the same blocks and ``dF = A^T dH`` accumulated block by
    block (docs/design/plexus-3d.md section 10).

    Forward: block ``b``'s rows of H are computed, then their all-reduce is started; with
    ``overlap`` it is asynchronous, so it travels while block ``b + 1`` computes (the MPI
    transport's communication thread on CPU, NCCL's stream on GPU); all are waited on at the
    end. Backward: every block's all-reduce of ``dH`` is started at once, and the columns of
    ``A^T`` that block ``b`` feeds are multiplied as soon as its all-reduce is done, while the
    later blocks' are still in flight. Without ``overlap`` the same collectives run
    synchronously in the same order: the two give the same bits.

    Exactness: each row of H is the row kernel's sum; on the numba kernels the backward's
    column ranges of ``A^T`` add each row's terms in column order, so dF has the bits of one
    unblocked ``A^T @ dH``. What may differ from the unblocked layer is the all-reduce's
    summation order, which MPI and NCCL may choose by message size (never for 2 ranks).

    Shapes: f [m, d] -> [n, d]; backward dh [n, d] -> df [m, d]
    """

    @staticmethod
    def forward(ctx: Any, a, a_t, f, group: AxisGroup, stats, num_blocks: int,
                overlap: bool):
        bounds, parts = a.row_blocks(num_blocks)
        f = f.detach()
        out = torch.empty(a.shape[0], f.shape[1], dtype=f.dtype, device=f.device)
        handles = []
        for (lo, hi), part in zip(itertools.pairwise(bounds), parts):
            part.matmul(f, out=out[lo:hi])
            handles.append(coll.all_reduce(out[lo:hi], group, stats=stats, async_op=overlap,
                                           inplace=True))
        if overlap:
            for h in handles:
                h.wait()
        ctx.a_t, ctx.bounds, ctx.group, ctx.stats, ctx.overlap = a_t, bounds, group, stats, overlap
        return out

    @staticmethod
    def backward(ctx: Any, dh):
        bounds, group, stats, overlap = ctx.bounds, ctx.group, ctx.stats, ctx.overlap
        red = dh.contiguous().clone()  # reduced in place, block by block
        ranges = list(itertools.pairwise(bounds))
        handles = [coll.all_reduce(red[lo:hi], group, stats=stats, async_op=overlap,
                                   inplace=True) for lo, hi in ranges]
        df = None
        if ctx.needs_input_grad[2]:
            a_t = ctx.a_t
            df = torch.zeros(a_t.shape[0], red.shape[1], dtype=red.dtype, device=red.device)
            for (lo, hi), h in zip(ranges, handles):
                if overlap:
                    h.wait()
                a_t.matmul(red, out=df, cols=(lo, hi, tuple(bounds)))
        elif overlap:
            for h in handles:
                h.wait()
        return None, None, df, None, None, None, None


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
    def forward(ctx: Any, h, w_shard, group: AxisGroup, shape, stats, gathered=None):
        """``gathered``: the handle of this W's all-gather issued earlier (async, so that it
        travels during the aggregation), or None to gather now."""
        ctx.group, ctx.shape, ctx.stats = group, shape, stats
        ctx.save_for_backward(h, w_shard)
        w = (flat.gather(w_shard, group, shape, stats=stats) if gathered is None
             else gathered.wait())
        return h @ w

    @staticmethod
    def backward(ctx: Any, dq):
        h, w_shard = ctx.saved_tensors
        group, shape, stats = ctx.group, ctx.shape, ctx.stats
        dh = None
        if ctx.needs_input_grad[0]:
            dh = dq @ flat.gather(w_shard, group, shape, stats=stats).t()
        return dh, flat.reduce_scatter(h.t() @ dq, group, stats=stats), None, None, None, None
