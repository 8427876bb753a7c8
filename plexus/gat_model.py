"""GAT layers of :class:`plexus.model.PlexusGCN` (``model="gat"``; docs/design/plexus-3d.md
section 14, option (b)): GCN's layer order, shards and recipe, each layer's aggregation and
product replaced by graph attention (plexus.gat), in float32.

Per layer ``l`` with roles (O, I, P) (plexus.layout), on rank (o, i, p):

    F'    = dropout(F_l)                          [N/O, D_l/I], replicated over P
    Q     = attention_layer(F', W_l, a_src, a_dst) [N/P, K/I, c]   (G1-G5)
    Q     = heads_to_columns(Q)                    [N/P, D_l+1/O]  (G7; the last layer G6)
    F_l+1 = relu(norm(Q + b_l)) (+ F_l)            hidden layers; the last returns Q + b_l

``W_l`` [D_l, K c] is held as the rank's rows [D_l/I, K c] (replicated over O), flat over P:
gathered over P for the product (its gradient reduce-scattered there) and its gradient summed
over O; ``a_src``, ``a_dst`` [K, c] as the rank's heads [K/I, c], their gradients summed over O
and P (plexus.shards, kinds ``weight`` and ``att``). The adjacency blocks are the GCN
aggregation's (their pattern is ``A + I``; their values are not read), and ``t`` reaches the
block's rows through the root blocks by owner (plexus.root_rows).

``dF'`` of :func:`plexus.gat.attention_layer` is whole on every rank of P, where a GCN
layer's ``A^T dH`` is partial over P: so a GAT layer's input is not summed over P in backward
(:meth:`PlexusGCN._input`), and the residual's term, partial there, is summed alone
(:meth:`PlexusGCN._skip`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from common import autograd, flat
from common.comm_stats import CommStats
from plexus import layout
from plexus.data import partition
from plexus.dropout import edge_keep_mask
from plexus.gat import attention_layer, edge_pattern, heads_to_columns
from plexus.gat_reference import init_gat
from plexus.root_rows import RootExchange
from plexus.shards import node_chunk

__all__ = ["GATLayers"]


class GATLayers:
    """Mixed into :class:`plexus.model.PlexusGCN`, which sets ``shard``, ``groups``, ``heads``,
    ``seed``, ``attention_dropout``, ``num_layers``, ``block_shapes`` and ``training``, and
    calls :meth:`_gat_parameters` once and :meth:`_attend` in each layer of its pass."""

    shard: Any
    groups: Any
    heads: int
    seed: int
    attention_dropout: float
    num_layers: int
    block_shapes: list
    training: bool
    weights: nn.ParameterList
    att_src: nn.ParameterList
    att_dst: nn.ParameterList

    def _gat_parameters(self, seed: int) -> None:
        """``W_l``, ``a_src`` and ``a_dst`` of every layer, this rank's shards of
        :func:`plexus.gat_reference.init_gat`'s (the serial model of ``seed`` starts equal)."""
        widths = self.shard.widths
        if any(d % self.heads for d in widths[1:-1]):
            raise ValueError(f"the hidden widths {list(widths[1:-1])} must be multiples of "
                             f"the {self.heads} heads (each heads x a head's width)")
        for layer in range(self.num_layers):
            i_ax = layout.roles(layer)[1]
            if self.heads % self.groups[i_ax].size:
                raise ValueError(
                    f"layer {layer}: {self.heads} heads do not split over its I axis "
                    f"({i_ax}: {self.groups[i_ax].size} ranks); choose heads divisible by it, "
                    "or another grid")
        params = init_gat(list(self.shard.widths), self.heads, seed)
        self.weights = self.sharded_weights([p["w"] for p in params])  # type: ignore[attr-defined]
        for name in ("att_src", "att_dst"):
            setattr(self, name, nn.ParameterList(
                nn.Parameter(self.shard_full("att", p[name], layer))  # type: ignore[attr-defined]
                for layer, p in enumerate(params)))
        self._gat: dict[tuple[int, int], tuple] = {}
        self._ids: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _attend(self, layer: int, f: torch.Tensor, stats: CommStats | None,
                step: int) -> torch.Tensor:
        """Layer ``layer``'s attention of its input ``F'`` [N/O, D_l/I] (replicated over P),
        in a GCN layer's output layout [N/P, D_l+1/O] (replicated over I), no bias."""
        roles = layout.roles(layer)
        go, gp = self.groups[roles[0]], self.groups[roles[2]]
        w = flat.all_gather_reduce_scatter(self.weights[layer], gp, self.block_shapes[layer],
                                           stats)
        w = autograd.identity_all_reduce(w, go, stats)  # dW partial over O
        att = [autograd.identity_all_reduce(autograd.identity_all_reduce(a, go, stats), gp,
                                            stats)
               for a in (self.att_src[layer], self.att_dst[layer])]
        pattern, exchange = self._gat_blocks(layer)
        q = attention_layer(f, w, att[0], att[1], pattern, exchange, self.groups, roles,
                            stats=stats, keep=self._keep(layer, step))
        return heads_to_columns(q, self.groups, roles, last=layer == self.num_layers - 1,
                                width=self.shard.widths_padded[layer + 1], stats=stats)

    def _gat_blocks(self, layer: int) -> tuple:
        """``layer``'s block pattern and root exchange, made once per distinct block (layers
        whose blocks are cut alike share them), on the block's device."""
        key = layout.layout_of(layer)
        blk, root = self.shard.adj[key].a, self.shard.root[key]
        if (id(blk), id(root)) not in self._gat:  # (the blocks kept with them: the ids stay)
            self._gat[id(blk), id(root)] = (edge_pattern(blk), RootExchange(
                root, self.groups[layout.roles(layer)[0]].size), blk, root)
        return self._gat[id(blk), id(root)][:2]

    def _node_ids(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The node ids of ``layer``'s block rows and columns (made once, for attention
        dropout only)."""
        if layer not in self._ids:
            o_ax, _, p_ax = layout.roles(layer)
            out_order, in_order = partition.layer_orders(layer % 2, self.shard.pr,
                                                         self.shard.pc)
            self._ids[layer] = (node_chunk(out_order, self.groups[p_ax]),
                                node_chunk(in_order, self.groups[o_ax]))
        return self._ids[layer]

    def _keep(self, layer: int, step: int) -> torch.Tensor | None:
        """Attention dropout's scaled keep-mask of the rank's edges and heads (training)."""
        if not self.training or self.attention_dropout == 0:
            return None
        pattern = self._gat_blocks(layer)[0]
        out_ids, in_ids = (ids.to(pattern.rows.device) for ids in self._node_ids(layer))
        gi = self.groups[layout.roles(layer)[1]]
        kc = self.heads // gi.size
        keep = edge_keep_mask(self.attention_dropout, seed=self.seed, step=step, layer=layer,
                              dst=out_ids[pattern.rows], src=in_ids[pattern.cols],
                              heads=self.heads, of=range(gi.rank * kc, (gi.rank + 1) * kc))
        return keep.float() / (1 - self.attention_dropout)
