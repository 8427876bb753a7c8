"""Graph attention on one rank's block of the adjacency (docs/design/plexus-3d.md section 14,
equations (14.3) to (14.5) and collective G4).

A layer's block ``A_l`` [N/P, N/O] gives the pattern: its nonzeros are the edges ``j -> i``
(self-loops included) whose target ``i`` is one of the block's rows and whose source ``j``
one of its columns; its values are not read. The scores are made from per-node terms on the
block's nonzeros (an SDDMM-style pass), so nothing of the edges' size crosses the network:

    u_ij    = t_i + s_j                    [nnz, K']   t: the rows' term, s: the columns'
    e_ij    = LeakyReLU_0.2(u_ij)
    m_i     = max_j e_ij                   max over the block's row, then over O     (G4)
    z_i     = sum_j exp(e_ij - m_i)        sum over the block's row, then over O     (G4)
    alpha   = exp(e - m) / z
    Q_i     = sum_j (keep * alpha)_ij G_j  [N/P, K', c]  partial over O: the caller sums it (G5)

``K'`` is the rank's heads (every head whole on the rank: a score is never partial over an
axis). A row of the block with no nonzero on any rank of O (a padding node) gets ``m = 0``,
``z = 0`` and ``Q = 0``: nothing is divided, so nothing is NaN.

Backward, from ``dQ`` (the gradient of the sum over O, the same on every rank of O):

    dG_j    = sum_i (keep * alpha)_ij dQ_i                   partial over P
    dalpha  = keep * (dQ_i . G_j)                            per head, on the block
    de      = alpha * (dalpha - r_i),  r_i = sum_j alpha_ij dalpha_ij   r summed over O (G4')
    du      = de * (1 if u > 0 else 0.2)
    dt_i    = sum_j du_ij              partial over O
    ds_j    = sum_i du_ij              partial over P

so the caller sums ``dt`` over O and ``dG``, ``ds`` over P, as the collectives that made ``t``,
``s`` and ``G`` do in their backward.

Around it, one layer on the grid: :func:`attention_layer` (G1-G5: ``G = F' W`` with the heads
split over I, gathered over P, ``t`` moved to the block's rows by owner) and
:func:`heads_to_columns` (G6 or G7: ``Q`` in a GCN layer's output layout), so that a GAT layer
replaces a GCN layer's aggregation and product in GCN's rotation of roles (plexus.gat_model).

Shapes: g [N/O, K', c], t [N/P, K'], s [N/O, K'], keep [nnz, K'] or None -> q [N/P, K', c]
"""

from __future__ import annotations

from typing import Any

import torch

from common import autograd
from common import collectives as coll
from common.comm_stats import CommStats
from common.grid import AxisGroup
from plexus.gat_reference import NEGATIVE_SLOPE
from plexus.root_rows import ExchangedRows, RootExchange
from plexus.sparse import BlockSparse

__all__ = ["EDGE_CHUNK", "BlockAttention", "EdgePattern", "attention_layer", "block_attention",
           "edge_pattern", "heads_to_columns"]

# the edges a pass over the block's nonzeros takes at once: what it gathers per edge ([chunk,
# K', c], a row of G or dQ for each) is this many rows, not the block's nnz
EDGE_CHUNK = 1 << 18


class EdgePattern:
    """A block's nonzeros as edges in row order: ``rows``, ``cols`` and the row pointers; the
    transposed order (by column) is made on first use. The edge lists are int32 where the
    block's rows, columns and edges fit (half the bytes of int64: they are kept for the run).
    Shapes: [nnz]"""

    def __init__(self, rows: torch.Tensor, cols: torch.Tensor, num_rows: int) -> None:
        if rows.numel() > 1 and bool((rows[1:] < rows[:-1]).any()):
            raise ValueError("the edges must come in row order")
        small = max(num_rows, rows.numel(), int(cols.max()) + 1 if cols.numel() else 0) < 2**31
        dtype = torch.int32 if small else torch.int64
        self.rows, self.cols, self.num_rows = rows.to(dtype), cols.to(dtype), num_rows
        self.indptr = _pointers(rows, num_rows)
        self._t: tuple | None = None

    def transposed(self, num_cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(column pointers, each position's row, each position's edge) in column order."""
        if self._t is None:
            order = torch.argsort(self.cols, stable=True).to(self.cols.dtype)
            self._t = (_pointers(self.cols, num_cols), self.rows[order], order)
        return self._t


def _pointers(index: torch.Tensor, num: int) -> torch.Tensor:
    return torch.cat([index.new_zeros(1), torch.bincount(index, minlength=num).cumsum(0)])


def edge_pattern(a: BlockSparse) -> EdgePattern:
    """The nonzeros of the block ``a`` as edges ``column -> row`` in row order (its attention
    runs over them). Shapes: a [n, m] -> [nnz] each"""
    csr = a.to_scipy()
    counts = torch.from_numpy(csr.indptr).diff()
    rows = torch.repeat_interleave(torch.arange(csr.shape[0]), counts)
    return EdgePattern(rows, torch.from_numpy(csr.indices), csr.shape[0])


def _kernels(*ts: torch.Tensor):
    """plexus.gat_kernels where its numba kernels take these tensors (CPU, float32 or
    float64), else None (the torch path)."""
    if not all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)
               and t.dtype == ts[0].dtype for t in ts):
        return None
    try:
        from plexus import gat_kernels
    except ImportError:
        return None
    return gat_kernels


def _row_sum(x: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``out[i] = sum of x[e] over the edges e of row i``. Shapes: [nnz, K] -> [num_rows, K]"""
    return x.new_zeros(num_rows, x.shape[1]).index_add_(0, rows, x)


class BlockAttention(torch.autograd.Function):
    """(14.3)-(14.5) on the block (the module docstring): ``Q`` partial over O, with the row
    maximum and row sum of the softmax (and, backward, ``r``) all-reduced over ``group``, the
    axis O that splits a row's columns. ``keep``: attention dropout's scaled keep-mask
    (``keep / (1 - p)``, :func:`plexus.dropout.edge_keep_mask`), None for none.

    Kept for backward: ``g``, ``alpha`` and the sign of ``u`` [nnz, K'] (one byte an entry)
    and the keep-mask. Every pass over the edges (the scores and the row maximum, the
    exponentials and the row sum, the division, the aggregation and its transpose, the
    scores' gradient and its row and column sums) runs as a numba kernel
    (plexus.gat_kernels: a row of the output a thread, no temporaries beyond ``[nnz, K']``);
    without numba, as torch operations, :data:`EDGE_CHUNK` edges at a time where they read a
    row of ``G`` or ``dQ`` per edge."""

    @staticmethod
    def forward(ctx: Any, g, t, s, pattern: EdgePattern, group: AxisGroup,
                stats: CommStats | None, keep=None):
        num_rows, heads = t.shape
        rows, cols = pattern.rows, pattern.cols
        kernels = _kernels(g, t, s)
        nnz = rows.numel()
        if kernels is not None:  # each pass over the edges one kernel, a row a thread
            e = t.new_empty(nnz, heads)
            positive = torch.empty(nnz, heads, dtype=torch.bool)
            m = t.new_empty(num_rows, heads)
            kernels.scores(pattern.indptr.numpy(), cols.numpy(), t.detach().contiguous().numpy(),
                           s.detach().contiguous().numpy(), NEGATIVE_SLOPE, e.numpy(),
                           positive.numpy(), m.numpy())
        else:
            u = t.index_select(0, rows) + s.index_select(0, cols)                 # [nnz, K']
            positive = u > 0
            e = torch.where(positive, u, u * NEGATIVE_SLOPE)
            del u
            m = e.new_full((num_rows, heads), -torch.inf).scatter_reduce_(
                0, rows.long()[:, None].expand(-1, heads), e, "amax")
        m = coll.all_reduce(m, group, op=coll.ReduceOp.MAX, stats=stats, inplace=True)  # G4
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows without an edge
        if kernels is not None:
            z = t.new_empty(num_rows, heads)
            kernels.exp_rows(pattern.indptr.numpy(), e.numpy(), m.contiguous().numpy(),
                             z.numpy())
            alpha = e
        else:
            alpha = e.sub_(m.index_select(0, rows)).exp_()
            z = _row_sum(alpha, rows, num_rows)
        z = coll.all_reduce(z, group, stats=stats, inplace=True)                 # G4
        if kernels is not None:
            kernels.divide_rows(pattern.indptr.numpy(), alpha.numpy(), z.contiguous().numpy())
        else:
            alpha = alpha.div_(z.index_select(0, rows))
        ctx.save_for_backward(g, alpha, positive, keep)
        ctx.group, ctx.stats, ctx.num_rows, ctx.pattern = group, stats, num_rows, pattern
        weight = alpha if keep is None else alpha * keep
        return _aggregate(pattern, weight, g, num_rows)

    @staticmethod
    def backward(ctx: Any, dq):
        g, alpha, positive, keep = ctx.saved_tensors
        pattern = ctx.pattern
        rows, cols = pattern.rows, pattern.cols
        weight = alpha if keep is None else alpha * keep
        dq = dq.contiguous()
        dg = _aggregate(pattern, weight, dq, g.shape[0], transposed=True)    # A_alpha^T dQ
        del weight
        dalpha = _scores_grad(pattern, dq, g, alpha)                          # [nnz, K']
        if keep is not None:
            dalpha = dalpha.mul_(keep)
        kernels = _kernels(alpha, dalpha)
        if kernels is not None:  # r, then du over dalpha with dt, then ds by column
            indptr = pattern.indptr.numpy()
            r = alpha.new_empty(ctx.num_rows, alpha.shape[1])
            kernels.dot_rows(indptr, alpha.numpy(), dalpha.numpy(), r.numpy())
            r = coll.all_reduce(r, ctx.group, stats=ctx.stats, inplace=True)      # G4'
            dt = torch.empty_like(r)
            kernels.scores_grad(indptr, alpha.numpy(), dalpha.numpy(), r.contiguous().numpy(),
                                positive.numpy(), NEGATIVE_SLOPE, dt.numpy())
            t_indptr, _, t_edges = pattern.transposed(g.shape[0])
            ds = alpha.new_empty(g.shape[0], alpha.shape[1])
            kernels.gather_sum(t_indptr.numpy(), t_edges.numpy(), dalpha.numpy(), ds.numpy())
            return dg, dt, ds, None, None, None, None
        r = coll.all_reduce(_row_sum(alpha * dalpha, rows, ctx.num_rows), ctx.group,
                            stats=ctx.stats, inplace=True)                        # G4'
        du = dalpha.sub_(r.index_select(0, rows)).mul_(alpha)
        du = torch.where(positive, du, du * NEGATIVE_SLOPE)
        dt = _row_sum(du, rows, ctx.num_rows)
        ds = du.new_zeros(g.shape[0], du.shape[1]).index_add_(0, cols, du)
        return dg, dt, ds, None, None, None, None


def _aggregate(pattern: EdgePattern, weight: torch.Tensor, x: torch.Tensor, num: int, *,
               transposed: bool = False) -> torch.Tensor:
    """``out[i] = sum over the edges e of row i of weight[e] * x[cols[e]]`` per head (with
    ``transposed``: over the edges of column i, of ``x[rows[e]]``): a numba kernel, a row of
    ``out`` a thread, or else :data:`EDGE_CHUNK` edges at a time with ``index_add``.
    Shapes: weight [nnz, K'], x [n, K', c] -> [num, K', c]"""
    kernels = _kernels(weight, x)
    out = x.new_empty(num, *x.shape[1:]) if kernels else x.new_zeros(num, *x.shape[1:])
    if kernels is not None:
        if transposed:
            indptr, indices, edges = pattern.transposed(num)
        else:
            indptr, indices, edges = pattern.indptr, pattern.cols, pattern.cols[:0]
        kernels.heads_spmm(indptr.numpy(), indices.numpy(), edges.numpy(),
                           weight.detach().contiguous().numpy(), x.detach().contiguous().numpy(),
                           out.numpy())
        return out
    to, of = (pattern.cols, pattern.rows) if transposed else (pattern.rows, pattern.cols)
    for lo in range(0, to.numel(), EDGE_CHUNK):
        hi = min(to.numel(), lo + EDGE_CHUNK)
        out.index_add_(0, to[lo:hi], x.index_select(0, of[lo:hi]) * weight[lo:hi, :, None])
    return out


def _scores_grad(pattern: EdgePattern, dq: torch.Tensor, g: torch.Tensor,
                 like: torch.Tensor) -> torch.Tensor:
    """``out[e] = dq[rows[e]] . g[cols[e]]`` per head (an SDDMM): a numba kernel, or
    :data:`EDGE_CHUNK` edges at a time. Shapes: dq [rows, K', c], g [n, K', c] -> [nnz, K']"""
    out = torch.empty_like(like)
    kernels = _kernels(dq, g, like)
    if kernels is not None:
        kernels.heads_sddmm(pattern.indptr.numpy(), pattern.cols.numpy(),
                            dq.detach().contiguous().numpy(), g.detach().contiguous().numpy(),
                            out.numpy())
        return out
    rows, cols = pattern.rows, pattern.cols
    for lo in range(0, rows.numel(), EDGE_CHUNK):
        hi = min(rows.numel(), lo + EDGE_CHUNK)
        torch.sum(dq.index_select(0, rows[lo:hi]) * g.index_select(0, cols[lo:hi]), -1,
                  out=out[lo:hi])
    return out


def block_attention(g: torch.Tensor, t: torch.Tensor, s: torch.Tensor,
                    pattern: EdgePattern | tuple[torch.Tensor, torch.Tensor], group: AxisGroup,
                    stats: CommStats | None = None,
                    keep: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`BlockAttention` over ``pattern`` (:func:`edge_pattern`, or (rows, cols) in row
    order); the module docstring gives the shapes. ``Q`` is partial over ``group`` (O)."""
    if not isinstance(pattern, EdgePattern):
        pattern = EdgePattern(*pattern, t.shape[0])
    rows = pattern.rows
    if g.shape[0] != s.shape[0] or t.shape[1] != s.shape[1] or g.shape[1] != t.shape[1]:
        raise ValueError(f"g {tuple(g.shape)}, t {tuple(t.shape)} and s {tuple(s.shape)} do "
                         "not fit: g [N/O, K', c], t [N/P, K'], s [N/O, K']")
    if keep is not None and tuple(keep.shape) != (rows.numel(), t.shape[1]):
        raise ValueError(f"keep {tuple(keep.shape)} is not [nnz, K'] = "
                         f"{(rows.numel(), t.shape[1])}")
    return BlockAttention.apply(g, t, s, pattern, group, stats, keep)


def attention_layer(f: torch.Tensor, w: torch.Tensor, att_src: torch.Tensor,
                    att_dst: torch.Tensor, pattern: EdgePattern | tuple[torch.Tensor, ...],
                    root: RootExchange, groups: dict[str, AxisGroup],
                    roles: tuple[str, str, str], *, stats: CommStats | None = None,
                    keep: torch.Tensor | None = None) -> torch.Tensor:
    """One GAT layer's aggregation on the grid (docs/design/plexus-3d.md section 14, G1-G5),
    on rank (o, i, p) of a layer whose roles are ``roles`` = (O, I, P) axes:

    * G1: ``G = F' W`` for row chunk p of the rank's ``N/O`` rows (``F'`` is replicated over
      P), partial over I, reduce-scattered over I along the heads: every head whole on one
      rank of I; backward all-gathers ``dG`` over I, and ``dF'``'s row chunks over P;
    * G2: ``G`` all-gathered over P: the rank's heads for every column of its block;
    * ``s`` (the columns' term) is local; ``t`` (the rows' term) is moved from the column
      order to the block's rows by owner (plexus.root_rows, the permuted identity ``root``,
      an all-gather over O; backward a reduce-scatter);
    * :class:`BlockAttention` on the block ``pattern``, its G4 over O;
    * G5: ``Q`` summed over O; backward identity (``Q`` is replicated over O, and each rank
      of O sends the gradient of its own partial).

    ``dW`` is partial over O and P (each rank's rows), ``datt_*`` too, and ``dF'`` is whole:
    the caller sums the weights' gradients over O and P (a flat shard's reduce-scatter), and
    does not sum ``dF'`` over P.

    Shapes: f [N/O, D/I], w [D/I, K c] (the rank's rows of ``W``), att_src and att_dst
    [K/I, c] (the rank's heads) -> Q [N/P, K/I, c]
    """
    o_ax, i_ax, p_ax = roles
    go, gi, gp = groups[o_ax], groups[i_ax], groups[p_ax]
    heads, width = att_src.shape[0] * gi.size, att_src.shape[1]
    if w.shape[1] != heads * width:
        raise ValueError(f"w has {w.shape[1]} columns: K c = {heads} x {width} (the heads "
                         f"over I's {gi.size} ranks)")
    num = f.shape[0]
    extra = -num % gp.size  # N/O rows padded to split over P (N is padded to each axis alone)
    if extra:
        f = torch.nn.functional.pad(f, (0, 0, 0, extra))
    rows = autograd.split_all_gather(f, gp, 0, stats)                       # [N/(O P), D/I]
    g = (rows @ w).view(rows.shape[0], heads, width)                        # partial over I
    g = autograd.reduce_scatter_all_gather(g, gi, 1, stats)                 # (G1) [.., K/I, c]
    g = autograd.all_gather_reduce_scatter(g, gp, 0, stats)                 # (G2) [N/O, ..]
    g = g[:num] if extra else g
    s = torch.einsum("jkc,kc->jk", g, att_src)                              # [N/O, K/I]
    t = ExchangedRows.apply(torch.einsum("jkc,kc->jk", g, att_dst), root, go, stats,
                            g.dtype)                                        # [N/P, K/I]
    q = block_attention(g, t, s, pattern, go, stats, keep)                  # partial over O
    return autograd.all_reduce_identity(q, go, stats)                       # (G5)


def heads_to_columns(q: torch.Tensor, groups: dict[str, AxisGroup], roles: tuple[str, str, str],
                     *, last: bool, width: int | None = None,
                     stats: CommStats | None = None) -> torch.Tensor:
    """A layer's ``Q`` from :func:`attention_layer` (heads over I, replicated over O) in the
    layout of a GCN layer's output, ``[N/P, D_l+1/O]`` replicated over I (section 14, option
    (b)): a hidden layer's heads concatenated, all-gathered over I along the heads (G7), the
    last layer's averaged, summed over I (G6); then the rank's chunk of columns over O.

    Backward: the gradient of the chunk arrives whole (the next :func:`attention_layer`
    gathers its ``dF'`` over its P, which is this I; the loss gives the logits' own), so the
    chunks are all-gathered over O and each rank of I keeps its heads' part (G7), or takes it
    as it is (G6). ``width``: the columns zero-padded to it first (the layer's padded width,
    plexus.layout.padded_widths), so that they split over O.

    Shapes: q [N/P, K/I, c] -> [N/P, width/O] (hidden: K c columns; last: c, the classes)
    """
    o_ax, i_ax, _ = roles
    go, gi = groups[o_ax], groups[i_ax]
    if last:
        q = autograd.all_reduce_identity(q.sum(1) / (q.shape[1] * gi.size), gi, stats)  # (G6)
    else:
        q = autograd.all_gather_split(q, gi, 1, stats).flatten(1)                # (G7)
    if width is not None and width > q.shape[1]:
        q = torch.nn.functional.pad(q, (0, width - q.shape[1]))
    if q.shape[1] % go.size:
        raise ValueError(f"{q.shape[1]} columns do not split over O's {go.size} ranks: pad "
                         "the width to a multiple of it")
    return autograd.split_all_gather(q, go, 1, stats)
