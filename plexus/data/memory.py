"""The in-memory shard source: every rank holds the whole :class:`Graph` and cuts its blocks.

For small graphs and as the test oracle; big graphs go through ``python -m plexus.prepare``
and :class:`plexus.data.prepared.PreparedGraph`, which gives the same shards bit for bit when
``pad_multiple`` is the prepared block count k.

Each rank builds ``Â``, permutes it into the two distinct layouts (``A' = Pr Â Pc^T`` for even
layers, ``A'' = Pc Â Pr^T`` for odd ones), and keeps one block (with its transpose) per layer
layout ``l % 6``, its features block and the labels and split masks of its output rows
(shapes: plexus.data.shard).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from common.grid import round_up
from plexus import layout
from plexus.data import partition as part
from plexus.data.graph import Graph
from plexus.data.schema import SPLITS
from plexus.data.shard import AdjBlock, GraphShard
from plexus.sparse import BlockSparse


class InMemorySource:
    """A :class:`~plexus.data.shard.ShardSource` over a whole graph held by every rank.

    Args:
        graph: the graph.
        permutation: ``none``, ``single`` or ``double`` (plexus.data.partition).
        seed: permutation seed (identical on every rank).
        pad_multiple: also pad the node count to a multiple of this (a prepared dataset's
            block count k gives the prepared run's permutations and blocks, so its numbers).
    """

    storage = "in memory"

    def __init__(self, graph: Graph, *, permutation: str = "double", seed: int = 0,
                 pad_multiple: int = 1) -> None:
        if permutation not in part.PERMUTATIONS:
            raise ValueError(f"unknown permutation {permutation!r}; choose from "
                             f"{part.PERMUTATIONS}")
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
        self.graph, self.permutation, self.seed = graph, permutation, seed
        self.pad_multiple = pad_multiple
        self.name = graph.name
        self.num_nodes, self.num_edges = graph.num_nodes, graph.num_edges
        self.num_features, self.num_classes = graph.num_features, graph.num_classes
        self.split_counts = {s: int(graph.split_idx(s).numel()) for s in SPLITS}
        src, dst = graph.edge_index
        # nonzeros of Â: edges other than self-loops (duplicates counted), one loop per node
        self.nnz = int((src != dst).sum()) + graph.num_nodes

    def __repr__(self) -> str:
        return (f"InMemorySource({self.graph.summary()}, permutation={self.permutation}, "
                f"seed={self.seed})")

    def grid_problems(self, shape: Mapping[str, int]) -> list[str]:
        """Any grid works: nodes and widths are padded to fit."""
        return []

    def shard(self, shape: Mapping[str, int], coords: Mapping[str, int],
              widths: Sequence[int]) -> GraphShard:
        """This rank's shard (plexus.data.shard.ShardSource.shard)."""
        g, widths = self.graph, list(widths)
        num_layers = len(widths) - 1
        if num_layers < 1:
            raise ValueError(f"need at least one layer, got widths {widths}")
        n = g.num_nodes
        n_pad = round_up(layout.padded_num_nodes(n, shape), self.pad_multiple)
        widths_pad = layout.padded_widths(widths, shape)
        pr, pc = part.make_permutations(n_pad, self.permutation, self.seed)

        a_hat = part.normalized_adjacency(g.edge_index.numpy(), n)
        a_hat.resize((n_pad, n_pad))
        # the two distinct layouts: layers of one parity share a matrix (layer_orders)
        mats = {parity: part.permuted(a_hat, *part.layer_orders(parity, pr, pc))
                for parity in range(min(2, num_layers))}
        del a_hat
        adj: dict[int, AdjBlock] = {}
        for lay in range(min(6, num_layers)):
            o_ax, _, p_ax = layout.roles(lay)
            a_l = mats[lay % 2]
            counts = part.block_nnz(a_l, shape[p_ax], shape[o_ax])
            blk = part.block(a_l, coords[p_ax], shape[p_ax], coords[o_ax], shape[o_ax])
            adj[lay] = AdjBlock(BlockSparse.single(blk), BlockSparse.single(blk.T.tocsr()), blk.nnz,
                                part.Balance(int(counts.max()), float(counts.mean())))
        del mats

        # input features: rows chunk x of the Pc order (layer 0's input order), columns chunk y
        # of the padded width; padding rows and columns stay zero
        o0, i0, _ = layout.roles(0)
        rows = _chunk(torch.from_numpy(pc), shape[o0], coords[o0])
        width = widths_pad[0] // shape[i0]
        lo = coords[i0] * width
        hi = min(lo + width, widths[0])
        features_block = torch.zeros(rows.numel(), width)
        real = rows < n
        if hi > lo:
            features_block[real, : hi - lo] = g.x[rows[real], lo:hi]

        # labels and masks of the output rows held here
        _, _, p_last = layout.roles(num_layers - 1)
        order = part.output_order(num_layers, pr, pc)
        out_rows = _chunk(torch.from_numpy(order), shape[p_last], coords[p_last]).numpy().copy()
        out_rows[out_rows >= n] = -1
        real = torch.from_numpy(out_rows >= 0)
        ids = torch.from_numpy(np.where(out_rows >= 0, out_rows, 0))
        labels = torch.where(real, g.y[ids], torch.full_like(ids, -1))
        masks = {s: real & g.mask(s)[ids] for s in SPLITS}

        return GraphShard(
            num_nodes=n, num_nodes_padded=n_pad, num_classes=g.num_classes,
            widths=widths, widths_padded=widths_pad, pr=pr, pc=pc, adj=adj,
            features_block=features_block, labels=labels, masks=masks,
            split_counts=dict(self.split_counts), out_rows=out_rows,
        )


def _chunk(t: torch.Tensor, num: int, i: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(num, dim=dim)[i] if num > 1 else t
