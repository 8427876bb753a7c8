"""Batch and layer norm on shards of a 3D grid, with the numbers of the serial model on any
grid (parallel == serial):

* :class:`ShardedBatchNorm` normalises a block [N/P, D/O] (rows split over P, replicated over
  I) with statistics over the real rows of the whole graph: the per-column sums are all-reduced
  over P in the forward pass and the gradient's column sums in the backward pass. With
  ``relu=True`` it returns ``relu(norm(q))``; on a large float32 CPU block both passes are
  then a few numba kernels over the block (:mod:`plexus.norm_kernels`), the ReLU's mask kept
  in bits beside the centred block.
* :class:`ShardedLayerNorm` normalises each row over the real columns, all-reduced over O.
* :func:`make_norm` builds either for a layer of a shard.
* :func:`normalized_features` is PyG's ``NormalizeFeatures`` on a feature block, its global
  minimum and row sums all-reduced.

Padding: rows and columns that only exist to make the grid divide are masked out of every
statistic; padded columns stay zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from common import autograd, dense
from common import collectives as coll
from common.comm_stats import CommStats
from common.grid import AxisGroup
from common.perf.gcn_memory import NORM_CHUNKS
from plexus import layout, ops
from plexus.data import partition
from plexus.data.shard import GraphShard
from plexus.dropout import can_spend
from plexus.ops import StoredIn
from plexus.shards import node_chunk

# the smallest block the fused kernels take (below it their threads cost more than they save);
# tests lower it to run them on small graphs
FUSED_MIN_ENTRIES = 1 << 16


def _norm_kernels(q: torch.Tensor, keep: torch.dtype | None) -> Any:
    """plexus.norm_kernels where they can run the norm of ``q`` kept in ``keep`` (a contiguous
    float32 CPU block of :data:`FUSED_MIN_ENTRIES` or more, kept in float32 or bf16, numba
    installed), else None."""
    if (q.device.type != "cpu" or q.dtype != torch.float32 or not q.is_contiguous()
            or q.dim() != 2 or q.numel() < max(1, FUSED_MIN_ENTRIES)
            or keep not in (None, torch.float32, torch.bfloat16)):
        return None
    try:
        from plexus import norm_kernels
    except ImportError:
        return None
    return norm_kernels


def _np(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy; bf16 as its uint16 bit patterns."""
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


def _sums(parts: np.ndarray) -> torch.Tensor:
    """The per-chunk sums (float64) added in order of the chunk, as float32."""
    total = parts[0].copy()
    for c in range(1, parts.shape[0]):
        total += parts[c]
    return torch.from_numpy(total.astype(np.float32))


def _row_chunks(rows: int, num: int = NORM_CHUNKS) -> list[tuple[int, int]]:
    """``num`` row ranges of about equal height covering ``rows`` (one empty range for none)."""
    step = max(1, -(-rows // num))
    return [(lo, min(lo + step, rows)) for lo in range(0, rows, step)] or [(0, 0)]


class _RowSplitBatchNorm(torch.autograd.Function):
    """Training-mode batch norm of a block whose rows are split over ``group``, in few passes
    over the block: the statistics are matrix-vector products with the real-row mask (no
    masked copy of ``q``), the centred block is the one tensor kept for backward (in ``keep``,
    bf16 under :class:`plexus.ops.StoredIn`, like every kept activation), and backward
    all-reduces its two column sums in one call. The same mathematics as composing the tensor
    operations under autograd (the statistics' gradient included: padded rows feed no
    statistic but get the affine map's gradient): 8 passes over the block forward and 14
    backward, against about 45 for the composition, and three all-reduces instead of six.

    ``spend`` (``q`` is fresh and read by nothing else, :func:`can_spend`): the output is
    written over ``q``. With ``keep`` the centred block is made there too, the squares and
    backward's widened centred block and products are made
    :data:`common.perf.gcn_memory.NORM_CHUNKS` row chunks at a time, and with ``over_grad``
    (the gradient reaching the output is read by nothing else, as :class:`plexus.ops.ReLU`'s)
    ``dq`` is written over it: each pass then holds one block
    and a chunk beside what it keeps, not three blocks. The column sums of a chunked pass add
    the chunks' sums. The rounded centred block is recentred in backward (its real rows' sum
    all-reduced with the two gradient sums: three vectors), so ``dq`` sums to zero over the
    real rows as in float32.

    Shapes: q [R, D], weight and bias [D], mask [R] (1.0 for real rows) -> y [R, D], and the
    batch mean and (biased) variance [D] for the running statistics.
    """

    @staticmethod
    def forward(ctx, q, weight, bias, mask, num_rows, eps, group, stats, keep, spend,
                over_grad):
        mean = coll.all_reduce(mask @ q, group, stats=stats) / num_rows
        if spend:
            ctx.mark_dirty(q)
        if keep is None:
            centred = q - mean
            squares = mask @ centred.square()
        else:  # the squares a chunk at a time
            centred = q.sub_(mean) if spend else q - mean
            squares = sum(mask[lo:hi] @ centred[lo:hi].square()
                          for lo, hi in _row_chunks(q.shape[0]))
        var = coll.all_reduce(squares, group, stats=stats) / num_rows
        inv = torch.rsqrt(var + eps)
        ctx.save_for_backward(centred if keep is None else dense.converted(centred, keep),
                              weight, mask, inv)
        ctx.num_rows, ctx.group, ctx.stats, ctx.over_grad = num_rows, group, stats, over_grad
        ctx.mark_non_differentiable(mean, var)
        y = torch.addcmul(bias, centred, weight * inv, out=q if spend else None)
        return y, mean, var

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        saved, weight, mask, inv = ctx.saved_tensors
        n, scale = ctx.num_rows, weight * inv
        if saved.dtype == dy.dtype:
            # over every row of every member: sum dy (the bias's gradient) and sum dy (q - mean)
            sums = torch.stack([dy.sum(0), (dy * saved).sum(0)])
            d_bias, d_centred = coll.all_reduce(sums, ctx.group, stats=ctx.stats)
            # dq = dy s - mask (s / n) (sum dy + inv^2 sum(dy (q - mean)) (q - mean)), s = w inv
            dq = torch.addcmul(scale * d_bias / n, saved, scale * inv * inv * d_centred / n)
            dq.mul_(mask[:, None]).neg_().addcmul_(dy, scale)
            return dq, d_centred * inv, d_bias, None, None, None, None, None, None, None, None
        chunks = _row_chunks(dy.shape[0])  # the centred block widened a chunk at a time
        # rounded, the centred block's real rows no longer sum to zero: recentred here (its
        # column sum, offset), so that dq's real rows do (a bias before the norm gets no
        # gradient, as in float32)
        prod = offset = 0
        for lo, hi in chunks:
            wide = saved[lo:hi].to(dy.dtype)
            prod = prod + (dy[lo:hi] * wide).sum(0)
            offset = offset + mask[lo:hi] @ wide
        d_bias, d_centred, offset = coll.all_reduce(torch.stack([dy.sum(0), prod, offset]),
                                                    ctx.group, stats=ctx.stats)
        dq = dy if ctx.over_grad and dense.can_overwrite(dy) else torch.empty_like(dy)
        k2 = scale * inv * inv * d_centred / n
        k1 = scale * d_bias / n - k2 * (offset / n)
        for lo, hi in chunks:
            t = torch.addcmul(k1, saved[lo:hi].to(dy.dtype), k2)
            t.mul_(mask[lo:hi, None]).neg_()
            torch.addcmul(t, dy[lo:hi], scale, out=dq[lo:hi])
        return dq, d_centred * inv, d_bias, None, None, None, None, None, None, None, None


class _FusedBatchNorm(torch.autograd.Function):
    """:class:`_RowSplitBatchNorm`'s mathematics (and, with ``relu``, the ReLU after it) in the
    kernels of :mod:`plexus.norm_kernels`: forward two reads of ``q`` for the statistics and one
    pass that writes the output (over ``q`` with ``spend``) and the centred block kept for
    backward (in ``keep``: float32, or bf16 under :class:`plexus.ops.StoredIn`); backward one
    read for the column sums and one pass that writes ``dq`` (over the gradient with
    ``over_grad``). The column sums add in a fixed order (float32 within chunks of rows,
    float64 across them: the same bits on any number of threads); rounded to bf16, the
    centred block is recentred in backward as in :class:`_RowSplitBatchNorm` (three vectors
    all-reduced, two in float32).

    Shapes: as :class:`_RowSplitBatchNorm`.
    """

    @staticmethod
    def forward(ctx, q, weight, bias, mask, num_rows, eps, group, stats, keep, spend,
                over_grad, relu):
        kernels = _norm_kernels(q, keep)
        rows, width = q.shape
        chunks = kernels.num_chunks(rows)
        parts = np.empty((chunks, width), dtype=np.float64)
        m, x = mask.numpy(), q.detach().numpy()
        kernels.column_sums(x, m, np.empty(0, dtype=np.float32), False, parts)
        mean = coll.all_reduce(_sums(parts), group, stats=stats) / num_rows
        kernels.column_sums(x, m, mean.numpy(), True, parts)
        var = coll.all_reduce(_sums(parts), group, stats=stats) / num_rows
        inv = torch.rsqrt(var + eps)
        # a buffer of common.dense.empty (bf16 too), which the trainer's pool hands back
        kept = dense.empty(rows, width, dtype=keep or torch.float32)
        if spend:
            ctx.mark_dirty(q)
        out = q if spend else dense.empty_like(q)
        bits = torch.empty(-(-rows * width // 8) if relu else 0, dtype=torch.uint8)
        kernels.normalize(x, mean.numpy(), (weight.detach() * inv).numpy(),
                          bias.detach().numpy(), out.detach().numpy(), _np(kept), relu,
                          bits.numpy())
        ctx.save_for_backward(kept, weight, mask, inv)
        ctx.num_rows, ctx.group, ctx.stats = num_rows, group, stats
        ctx.over_grad, ctx.relu, ctx.bits, ctx.kernels = over_grad, relu, bits, kernels
        ctx.mark_non_differentiable(mean, var)
        return out, mean, var

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        kept, weight, mask, inv = ctx.saved_tensors
        kernels = ctx.kernels
        n, scale = ctx.num_rows, weight * inv
        dy = dy.contiguous()
        parts = np.empty((kernels.num_chunks(dy.shape[0]), 3, dy.shape[1]), dtype=np.float64)
        kernels.gradient_sums(dy.numpy(), _np(kept), mask.numpy(), ctx.relu, ctx.bits.numpy(),
                              parts)
        sums = _sums(parts)
        if kept.dtype == torch.float32:  # exactly centred: no offset to all-reduce
            d_bias, d_centred = coll.all_reduce(sums[:2], ctx.group, stats=ctx.stats)
            offset = torch.zeros_like(d_bias)
        else:
            d_bias, d_centred, offset = coll.all_reduce(sums, ctx.group, stats=ctx.stats)
        k2 = scale * inv * inv * d_centred / n
        k1 = scale * d_bias / n - k2 * (offset / n)
        out = dy if ctx.over_grad and dense.can_overwrite(dy) else dense.empty_like(dy)
        kernels.input_gradient(dy.numpy(), _np(kept), mask.numpy(), ctx.relu, ctx.bits.numpy(),
                               scale.numpy(), k1.numpy(), k2.numpy(), out.numpy())
        return (out, d_centred * inv, d_bias) + (None,) * 9


class ShardedBatchNorm(nn.Module):
    """BatchNorm1d over the rows of a block [N/P, D/O] whose rows are split over ``group_p``.

    Args:
        width: local columns D/O.
        real_rows: bool [N/P], the rows that are graph nodes (not padding).
        num_rows: real rows in the whole graph (the statistics' count).
        group_p: the axis the rows are split over.
        eps, momentum: as torch.nn.BatchNorm1d (running variance unbiased).

    In training, three all-reduces over P of [D/O] vectors per pass and layer: the column sum
    and the sum of squares forward, both gradient sums (of the bias and of the centred block)
    in one call of two vectors backward; the affine parameters' gradients are those sums,
    already over every row (:class:`_RowSplitBatchNorm`).

    Shapes:
        forward: q [N/P, D/O] -> [N/P, D/O]
    """

    def __init__(self, width: int, real_rows: torch.Tensor, num_rows: int, group_p: AxisGroup,
                 *, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        self.group_p, self.num_rows, self.eps, self.momentum = group_p, num_rows, eps, momentum
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))
        self.register_buffer("row_mask", real_rows.to(torch.float32), persistent=False)
        self.register_buffer("running_mean", torch.zeros(width))
        self.register_buffer("running_var", torch.ones(width))

    def forward(self, q: torch.Tensor, stats: CommStats | None = None, *, relu: bool = False,
                over_grad: bool = False) -> torch.Tensor:
        """``norm(q)``, or ``relu(norm(q))`` with ``relu``; ``over_grad``: the caller's promise
        that the gradient reaching the output is read by nothing else (backward writes over
        it)."""
        g, n = self.group_p, self.num_rows
        if not self.training:
            scale = self.weight * torch.rsqrt(self.running_var + self.eps)
            y = (q - self.running_mean) * scale + self.bias
            return ops.ReLU.apply(y, True) if relu else y
        keep, mask = StoredIn.current(), self.row_mask.to(q.dtype)
        if _norm_kernels(q, keep) is not None and mask.is_contiguous():
            y, mean, var = _FusedBatchNorm.apply(q, self.weight, self.bias, mask, n, self.eps,
                                                 g, stats, keep, can_spend(q), over_grad,
                                                 relu)
        else:  # a ReLU after it hands backward a gradient that nothing else reads
            y, mean, var = _RowSplitBatchNorm.apply(q, self.weight, self.bias, mask, n,
                                                    self.eps, g, stats, keep, can_spend(q),
                                                    over_grad or relu)
            y = ops.ReLU.apply(y, over_grad) if relu else y
        with torch.no_grad():
            m = self.momentum
            self.running_mean.mul_(1 - m).add_(mean, alpha=m)
            self.running_var.mul_(1 - m).add_(var * (n / max(n - 1, 1)), alpha=m)
        return y


class ShardedLayerNorm(nn.Module):
    """LayerNorm over the columns of a block [N/P, D/O] whose columns are split over
    ``group_o`` and rows over ``group_p``.

    Args:
        width: local columns D/O.
        real_cols: bool [D/O], the columns below the true width D.
        num_cols: the true width D.
        group_o: the axis the columns are split over; group_p: the axis the rows are split
            over (the affine parameters' gradients are summed over it).

    Shapes:
        forward: q [N/P, D/O] -> [N/P, D/O] (padded columns zero)
    """

    def __init__(self, width: int, real_cols: torch.Tensor, num_cols: int, group_o: AxisGroup,
                 group_p: AxisGroup, *, eps: float = 1e-5) -> None:
        super().__init__()
        self.group_o, self.group_p, self.num_cols, self.eps = group_o, group_p, num_cols, eps
        self.weight = nn.Parameter(real_cols.to(torch.float32).clone())
        self.bias = nn.Parameter(torch.zeros(width))
        self.register_buffer("col_mask", real_cols.to(torch.float32)[None, :], persistent=False)

    def forward(self, q: torch.Tensor, stats: CommStats | None = None, *, relu: bool = False,
                over_grad: bool = False) -> torch.Tensor:
        """``norm(q)``, or ``relu(norm(q))`` with ``relu`` (``over_grad``: as
        :meth:`ShardedBatchNorm.forward`)."""
        y = self._norm(q, stats)
        return ops.ReLU.apply(y, over_grad) if relu else y

    def _norm(self, q: torch.Tensor, stats: CommStats | None) -> torch.Tensor:
        go, gp, d_true = self.group_o, self.group_p, self.num_cols
        # the row sums feed every member's columns: all-reduced in both passes
        mean = autograd.all_reduce_all_reduce((q * self.col_mask).sum(1, keepdim=True), go,
                                              stats) / d_true
        d = (q - mean) * self.col_mask
        var = autograd.all_reduce_all_reduce((d * d).sum(1, keepdim=True), go, stats) / d_true
        w = autograd.identity_all_reduce(self.weight, gp, stats)
        b = autograd.identity_all_reduce(self.bias, gp, stats)
        return d * torch.rsqrt(var + self.eps) * w + b


def make_norm(kind: str, layer: int, width: int, shard: GraphShard,
              groups: dict[str, AxisGroup]) -> nn.Module:
    """The ``batch`` or ``layer`` norm after hidden layer ``layer`` of ``shard`` on this rank,
    over its output block [N/P, ``width`` = D_l+1/O]: batch norm with the real output rows of
    the block (statistics over P), layer norm with the real columns (over O)."""
    o_ax, _, p_ax = layout.roles(layer)
    if kind == "batch":
        order = partition.layer_orders(layer % 2, shard.pr, shard.pc)[0]  # output rows
        return ShardedBatchNorm(width, node_chunk(order, groups[p_ax]) < shard.num_nodes,
                                shard.num_nodes, groups[p_ax])
    cols = torch.arange(width) + groups[o_ax].rank * width
    return ShardedLayerNorm(width, cols < shard.widths[layer + 1], shard.widths[layer + 1],
                            groups[o_ax], groups[p_ax])


@torch.no_grad()
def normalized_features(block: torch.Tensor, shard: GraphShard,
                        groups: dict[str, AxisGroup]) -> torch.Tensor:
    """PyG's NormalizeFeatures on the features block [N/X, D_0/Y] of ``shard``: x - min over
    the whole graph, then each row over its row sum (all-reduced over y) clamped to >= 1
    (padding rows and columns excluded and left zero)."""
    rows = node_chunk(shard.pc, groups["x"]) < shard.num_nodes
    width = block.shape[1]
    cols = torch.arange(width) + groups["y"].rank * width < shard.widths[0]
    real = rows[:, None] & cols[None, :]
    vals = torch.where(real, block, torch.inf)
    low = (vals.min() if vals.numel() else torch.tensor(torch.inf)).reshape(1)
    for ax in ("x", "y"):
        low = coll.all_reduce(low, groups[ax], op=dist.ReduceOp.MIN)
    shifted = torch.where(real, block - low, 0.0)
    sums = coll.all_reduce(shifted.sum(1), groups["y"])
    return shifted / sums.clamp(min=1.0)[:, None]
