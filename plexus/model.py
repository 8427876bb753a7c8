"""The Plexus 3D-parallel GCN (plexus-3d.md sections 1-4).

Layer ``l`` with roles (O, I, P) on rank (o, i, p)::

    F_l   [N/O, D_l/I]     layer 0: all-gather of the flat feature shard over P       (1)
    H_l = A_l F_l          [N/P, D_l/I], partial over O -> all-reduce over O            (2)
    W_l   [D_l/I, D_l+1/O] all-gather of the flat weight shard over P                  (3)
    Q_l = H_l W_l          [N/P, D_l+1/O], partial over I -> all-reduce over I          (4)
    F_l+1 = relu(Q_l)      (no activation after the last layer)

Backward: re-gather W over P (5), reduce-scatter dW over P (6), all-reduce dH over O (7),
dF = A_l^T dH: reduce-scatter over P at layer 0 (only with trainable features), all-reduce
over P for layers >= 1 (8). The adjacency never moves. Parallel equals serial: the same seed
gives the same full weights on every grid (:func:`init_weights`), and each rank keeps its slice.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import nn

from common import autograd
from common import collectives as coll
from common.comm_stats import CommStats
from common.grid import AxisGroup
from plexus import layout
from plexus.data.shard import GraphShard
from plexus.layout import flat_shard


def init_weights(widths: list[int], seed: int) -> list[torch.Tensor]:
    """Full (unsharded, unpadded) weights ``W_l`` [D_l, D_l+1], Glorot-uniform, from ``seed``.

    Every rank (and the serial reference) draws the same matrices, so any grid trains the
    same model.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for d_in, d_out in itertools.pairwise(widths):
        bound = math.sqrt(6.0 / (d_in + d_out))
        out.append((torch.rand(d_in, d_out, generator=gen) * 2 - 1) * bound)
    return out


class _SpMM(torch.autograd.Function):
    """``A @ F`` for a :class:`~plexus.sparse.BlockSparse` ``A``; backward ``A^T @ dH`` with
    the precomputed transpose."""

    @staticmethod
    def forward(ctx: Any, a, a_t, f):
        ctx.a_t = a_t
        return a.matmul(f)

    @staticmethod
    def backward(ctx: Any, dh):
        return None, None, ctx.a_t.matmul(dh) if ctx.needs_input_grad[2] else None


class _GatheredMatmul(torch.autograd.Function):
    """``H @ W`` with ``W`` all-gathered over P from its flat shard, in both passes.

    The gathered ``W`` is not kept for backward: it is gathered again (collective 5), and
    ``dW`` is reduce-scattered back to flat shards (collective 6).
    """

    @staticmethod
    def forward(ctx: Any, h, w_shard, group: AxisGroup, shape, stats):
        ctx.group, ctx.shape, ctx.stats = group, shape, stats
        ctx.save_for_backward(h, w_shard)
        return h @ _gather_flat(w_shard, group, shape, stats)

    @staticmethod
    def backward(ctx: Any, dq):
        h, w_shard = ctx.saved_tensors
        group, shape, stats = ctx.group, ctx.shape, ctx.stats
        dh = None
        if ctx.needs_input_grad[0]:
            dh = dq @ _gather_flat(w_shard, group, shape, stats).t()
        dw = (h.t() @ dq).reshape(-1)
        pad = w_shard.numel() * group.size - dw.numel()
        if pad:
            dw = torch.cat([dw, dw.new_zeros(pad)])
        return dh, coll.reduce_scatter(dw, group, stats=stats), None, None, None


def _gather_flat(shard: torch.Tensor, group: AxisGroup, shape, stats) -> torch.Tensor:
    full = coll.all_gather(shard, group, stats=stats)
    return full[: math.prod(shape)].view(shape)


class PlexusGCN(nn.Module):
    """An L-layer GCN whose every tensor is sharded over a 3D grid (x, y, z).

    Args:
        shard: this rank's :class:`~plexus.data.shard.GraphShard`.
        groups: the rank's axis groups ``{"x", "y", "z"}`` from ``ProcessGrid.create_groups``.
        learn_features: make the input features a trainable parameter (initialised from the
            dataset's features), as in the paper.
        seed: weight seed.

    Shapes:
        forward() -> logits [N/P, C_pad/O] of the last layer's roles, rows in output order,
        replicated over I.
    """

    def __init__(
        self,
        shard: GraphShard,
        groups: dict[str, AxisGroup],
        *,
        learn_features: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.shard, self.groups = shard, groups
        self.num_layers = len(shard.widths) - 1
        self.block_shapes = [self._block_shape(layer) for layer in range(self.num_layers)]
        self.weights = nn.ParameterList(
            nn.Parameter(self.shard_weight(w, layer))
            for layer, w in enumerate(init_weights(shard.widths, seed))
        )
        feat = flat_shard(shard.features_block, groups["z"].size, groups["z"].rank)
        if learn_features:
            self.features = nn.Parameter(feat)
        else:
            self.register_buffer("features", feat)
        self.features_shape = tuple(shard.features_block.shape)
        # With fixed input features, H_0 = A_0 F_0 is the same every epoch: compute it (with
        # collectives 1 and 2) once and reuse it, saving one SpMM per epoch.
        self.cache_first_aggregation = not learn_features
        self._h0: torch.Tensor | None = None

    def forward(self, stats: CommStats | None = None) -> torch.Tensor:
        g = self.groups
        f = None
        for layer in range(self.num_layers):
            _o_ax, i_ax, p_ax = layout.roles(layer)
            if layer == 0 and self._h0 is not None:
                h = self._h0
            else:
                h = self._aggregate(layer, f, stats)
                if layer == 0 and self.cache_first_aggregation:
                    self._h0 = h.detach()
            q = _GatheredMatmul.apply(h, self.weights[layer], g[p_ax],
                                      self.block_shapes[layer], stats)
            q = autograd.all_reduce_identity(q, g[i_ax], stats)
            f = torch.relu_(q) if layer < self.num_layers - 1 else q
        return f

    def _aggregate(self, layer: int, f: torch.Tensor | None, stats: CommStats | None):
        """H_l = A_l F_l, all-reduced over O (collectives 1, 2; backward 7, 8)."""
        g = self.groups
        o_ax, _, p_ax = layout.roles(layer)
        if layer == 0:
            f = autograd.all_gather_reduce_scatter(self.features, g[p_ax], stats=stats)
            f = f[: math.prod(self.features_shape)].view(self.features_shape)
        else:
            f = autograd.identity_all_reduce(f, g[p_ax], stats)
        adj = self.shard.adj[layer % 6]
        h = _SpMM.apply(adj.a, adj.a_t, f)
        h = autograd.all_reduce_identity(h, g[o_ax], stats)
        return autograd.identity_all_reduce(h, g[o_ax], stats)

    def _apply(self, fn, recurse=True):  # .to(device) etc. must not keep a stale cache
        self._h0 = None
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------ full <-> shard maps
    def _block_shape(self, layer: int) -> tuple[int, int]:
        o_ax, i_ax, _ = layout.roles(layer)
        w_pad = self.shard.widths_padded
        return (w_pad[layer] // self.groups[i_ax].size, w_pad[layer + 1] // self.groups[o_ax].size)

    def shard_weight(self, full: torch.Tensor, layer: int) -> torch.Tensor:
        """This rank's flat shard of a full (unpadded) ``W_l`` [D_l, D_l+1] (or of any tensor
        laid out like it: its gradient, Adam moments)."""
        o_ax, i_ax, p_ax = layout.roles(layer)
        g = self.groups
        w_pad = self.shard.widths_padded
        padded = full.new_zeros(w_pad[layer], w_pad[layer + 1])
        padded[: full.shape[0], : full.shape[1]] = full
        blk = padded.chunk(g[i_ax].size, 0)[g[i_ax].rank].chunk(g[o_ax].size, 1)[g[o_ax].rank]
        return flat_shard(blk, g[p_ax].size, g[p_ax].rank)

    @torch.no_grad()
    def gather_weight(self, local: torch.Tensor, layer: int) -> torch.Tensor:
        """Inverse of :meth:`shard_weight`: the full unpadded [D_l, D_l+1] on every rank."""
        o_ax, i_ax, p_ax = layout.roles(layer)
        blk = _gather_flat(local, self.groups[p_ax], self.block_shapes[layer], None)
        full = coll.all_gather(coll.all_gather(blk, self.groups[i_ax], dim=0),
                            self.groups[o_ax], dim=1)
        return full[: self.shard.widths[layer], : self.shard.widths[layer + 1]]

    def shard_features(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's flat shard of full input features [N, D_0] in original node order."""
        g, sh = self.groups, self.shard
        padded = full.new_zeros(sh.num_nodes_padded, sh.widths_padded[0])
        padded[: full.shape[0], : full.shape[1]] = full
        rows = torch.from_numpy(sh.pc).chunk(g["x"].size)[g["x"].rank]
        blk = padded[rows].chunk(g["y"].size, 1)[g["y"].rank]
        return flat_shard(blk, g["z"].size, g["z"].rank)

    @torch.no_grad()
    def gather_features(self, local: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`shard_features`: full [N, D_0] in original order, every rank."""
        blk = _gather_flat(local, self.groups["z"], self.features_shape, None)
        full_perm = coll.all_gather(coll.all_gather(blk, self.groups["y"], dim=1),
                                 self.groups["x"], dim=0)
        out = torch.empty_like(full_perm)
        out[torch.from_numpy(self.shard.pc)] = full_perm
        return out[: self.shard.num_nodes, : self.shard.widths[0]]

    def full_weights(self, grads: bool = False) -> list[torch.Tensor]:
        """Every full (unpadded) ``W_l`` (or its gradient), on every rank (collective)."""
        return [self.gather_weight(w.grad if grads else w.detach(), layer)
                for layer, w in enumerate(self.weights)]

    def full_features(self, grads: bool = False) -> torch.Tensor:
        """The full input features [N, D_0] (or their gradient), original node order."""
        return self.gather_features(self.features.grad if grads else self.features.detach())
