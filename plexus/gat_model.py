"""The 3D-parallel GAT (docs/design/plexus-3d.md section 14, option (b)): the GCN model's layer
order and shards, each layer's aggregation and product replaced by graph attention
(plexus.gat), in float32.

Per layer ``l`` with roles (O, I, P) (plexus.layout), on rank (o, i, p):

    F'    = dropout(F_l)                          [N/O, D_l/I], replicated over P
    Q     = attention_layer(F', W_l, a_src, a_dst) [N/P, K/I, c]   (G1-G5)
    Q     = heads_to_columns(Q)                    [N/P, D_l+1/O]  (G7; the last layer G6)
    F_l+1 = relu(Q + b_l)                          hidden layers; the last returns Q + b_l

``W_l`` [D_l, K c] is held as the rank's rows [D_l/I, K c] (replicated over O), flat over P:
gathered over P for the product (its gradient reduce-scattered there) and its gradient summed
over O; ``a_src``, ``a_dst`` [K, c] as the rank's heads [K/I, c], their gradients summed over O
and P. The adjacency blocks are the GCN aggregation's (their pattern is ``A + I``; their values
are not read), and ``t`` reaches the block's rows through the root blocks by owner
(plexus.root_rows).

Not yet here: norms, residuals, bf16, the labelled rows of the last layer, the trainer and CLI.

Shapes: logits [N/P_last, C_pad/O_last], rows in the output order (``shard.out_rows``).
"""

from __future__ import annotations

import torch
from torch import nn

from common import autograd, flat
from common.comm_stats import CommStats
from common.grid import AxisGroup
from plexus import layout
from plexus.data import partition
from plexus.data.shard import GraphShard
from plexus.dropout import apply_dropout, edge_keep_mask
from plexus.gat import attention_layer, edge_pattern, heads_to_columns
from plexus.gat_reference import init_gat
from plexus.layer_dropout import LayerDropout
from plexus.residual import add_root_blocks
from plexus.root_rows import RootExchange
from plexus.shards import node_chunk

__all__ = ["PlexusGAT"]


class PlexusGAT(nn.Module):
    """GAT on a 3D grid (module docstring).

    Args:
        shard: this rank's shard of a GCN-aggregation source (the adjacency with self-loops).
        groups: the rank's axis groups ``x``, ``y``, ``z``.
        heads: ``K``; every hidden width ``K c`` must split over every axis, and ``K`` over
            each layer's I.
        seed: the initial weights (:func:`plexus.gat_reference.init_gat`, so the serial model
            of the same seed starts equal) and the dropout masks.
        dropout, attention_dropout: rates on each layer's input and on the coefficients.
        bias: a bias per layer.
    """

    def __init__(self, shard: GraphShard, groups: dict[str, AxisGroup], *, heads: int = 1,
                 seed: int = 0, dropout: float = 0.0, attention_dropout: float = 0.0,
                 bias: bool = True) -> None:
        super().__init__()
        widths, padded = shard.widths, shard.widths_padded
        self.num_layers = len(widths) - 1
        for layer in range(self.num_layers):
            o_ax, i_ax, _ = layout.roles(layer)
            if heads % groups[i_ax].size or (
                    layer < self.num_layers - 1 and padded[layer + 1] != widths[layer + 1]):
                raise ValueError(
                    f"layer {layer}: {heads} heads must split over I ({i_ax}: "
                    f"{groups[i_ax].size} ranks) and the hidden width {widths[layer + 1]} over "
                    f"every axis ({dict((a, g.size) for a, g in groups.items())})")
        self.shard, self.groups, self.heads, self.seed = shard, groups, heads, seed
        self.attention_dropout = attention_dropout
        add_root_blocks(shard, groups)  # t moves to the block's rows by owner
        self.drop = LayerDropout(dropout, seed, shard, groups)
        self.weights, self.att_src, self.att_dst = (nn.ParameterList() for _ in range(3))
        self.biases = nn.ParameterList()
        self.shapes = []
        for layer, p in enumerate(init_gat(widths, heads, seed)):
            o_ax, i_ax, p_ax = layout.roles(layer)
            gi, gp, go = groups[i_ax], groups[p_ax], groups[o_ax]
            c = p["att_src"].shape[1]
            width = padded[layer + 1] if layer == self.num_layers - 1 else c
            w = torch.zeros(padded[layer], heads, width)
            w[:widths[layer], :, :c] = p["w"].view(widths[layer], heads, c)
            rows = padded[layer] // gi.size
            block = w.view(padded[layer], -1)[gi.rank * rows:(gi.rank + 1) * rows]
            self.shapes.append(tuple(block.shape))
            self.weights.append(nn.Parameter(flat.flat_shard(block, gp.size, gp.rank)))
            kc = heads // gi.size
            for name, target in (("att_src", self.att_src), ("att_dst", self.att_dst)):
                full = torch.zeros(heads, width)
                full[:, :c] = p[name]
                target.append(nn.Parameter(full[gi.rank * kc:(gi.rank + 1) * kc].clone()))
            if bias:
                cols = padded[layer + 1] // go.size
                self.biases.append(nn.Parameter(torch.zeros(cols)))
        self._layers: dict[int, tuple] = {}
        self._ids: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _layer(self, layer: int) -> tuple:
        """``layer``'s block pattern and root exchange (made once)."""
        if layer not in self._layers:
            key = layout.layout_of(layer)
            self._layers[layer] = (edge_pattern(self.shard.adj[key].a), RootExchange(
                self.shard.root[key], self.groups[layout.roles(layer)[0]].size))
        return self._layers[layer]

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
        pattern = self._layer(layer)[0]
        out_ids, in_ids = self._node_ids(layer)
        gi = self.groups[layout.roles(layer)[1]]
        kc = self.heads // gi.size
        keep = edge_keep_mask(self.attention_dropout, seed=self.seed, step=step, layer=layer,
                              dst=out_ids[pattern.rows], src=in_ids[pattern.cols],
                              heads=self.heads, of=range(gi.rank * kc, (gi.rank + 1) * kc))
        return keep.float() / (1 - self.attention_dropout)

    def forward(self, stats: CommStats | None = None, *, step: int = 0) -> torch.Tensor:
        """Logits [N/P_last, C_pad/O_last] (module docstring); ``step`` keys the masks."""
        f = self.shard.features_block  # [N/O, D_0/I] of layer 0's roles, replicated over P
        for layer in range(self.num_layers):
            o_ax, i_ax, p_ax = layout.roles(layer)
            go, gp = self.groups[o_ax], self.groups[p_ax]
            if self.training and self.drop.p > 0:  # out of place: F_0 is the shard's, and
                # the ReLU's backward reads its output
                f = apply_dropout(f, self.drop.mask(layer, step, f.device), self.drop.p)
            w = flat.all_gather_reduce_scatter(self.weights[layer], gp, self.shapes[layer],
                                               stats)
            w = autograd.identity_all_reduce(w, go, stats)  # dW partial over O
            att = [autograd.identity_all_reduce(autograd.identity_all_reduce(a, go, stats),
                                                gp, stats)
                   for a in (self.att_src[layer], self.att_dst[layer])]
            pattern, exchange = self._layer(layer)
            q = attention_layer(f, w, att[0], att[1], pattern, exchange, self.groups,
                                (o_ax, i_ax, p_ax), stats=stats, keep=self._keep(layer, step))
            last = layer == self.num_layers - 1
            q = heads_to_columns(q, self.groups, (o_ax, i_ax, p_ax), last=last, stats=stats)
            if len(self.biases):  # the bias's gradient: this rank's rows, summed over P
                q = q + autograd.identity_all_reduce(self.biases[layer], gp, stats)
            f = q if last else torch.relu(q)
        return f
