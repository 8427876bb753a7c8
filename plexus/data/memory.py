"""The in-memory shard source: every rank holds the whole :class:`Graph` and cuts its blocks.

For small graphs and as the test oracle; big graphs go through ``python -m plexus.prepare``
and :class:`plexus.data.mapped.PreparedGraph`, which gives the same shards bit for bit, for
either aggregation, when ``pad_multiple`` is the prepared block count k.

Each rank builds ``Â``, permutes it into the two distinct layouts (``A' = Pr Â Pc^T`` for even
layers, ``A'' = Pc Â Pr^T`` for odd ones), and keeps one block (with its transpose) per layer
layout ``l % 6``, its features block and the labels and split masks of its output rows
(shapes: plexus.data.shard). With ``aggregation="mean"`` (GraphSAGE) the mean adjacency takes
``Â``'s place and the permuted identities ``Pr I Pc^T`` / ``Pc I Pr^T`` (O(N) to build) give
the root blocks, cut the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from common.grid import round_up
from plexus import layout
from plexus.data import partition as part
from plexus.data.graph import Graph
from plexus.data.schema import SPLITS
from plexus.data.shard import AdjBlock, GraphShard, RootBlock, release_pages
from plexus.sparse import BlockSparse
from plexus.transpose import TransposedSparse


class InMemorySource:
    """A :class:`~plexus.data.shard.ShardSource` over a whole graph held by every rank.

    Args:
        graph: the graph.
        permutation: ``none``, ``single`` or ``double`` (plexus.data.partition).
        seed: permutation seed (identical on every rank).
        pad_multiple: also pad the node count to a multiple of this (a prepared dataset's
            block count k gives the prepared run's permutations and blocks, so its numbers).
        aggregation: ``gcn`` (``Â``, no root blocks) or ``mean`` (GraphSAGE: the mean
            adjacency of plexus.data.partition.mean_adjacency, PyG's ``SAGEConv`` mean, and
            the root blocks of the permuted identity; plexus.data.shard).
        settings: the settings that made ``graph`` from its files, which a checkpoint must
            match (:attr:`plexus.data.shard.ShardSource.settings`); None: {}.
    """

    storage = "in memory"

    def __init__(self, graph: Graph, *, permutation: str = "double", seed: int = 0,
                 pad_multiple: int = 1, aggregation: str = "gcn",
                 settings: Mapping[str, Any] | None = None) -> None:
        if aggregation not in part.AGGREGATIONS:
            raise ValueError(f"unknown aggregation {aggregation!r}; choose from "
                             f"{part.AGGREGATIONS}")
        if permutation not in part.PERMUTATIONS:
            raise ValueError(f"unknown permutation {permutation!r}; choose from "
                             f"{part.PERMUTATIONS}")
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
        self.graph, self.permutation, self.seed = graph, permutation, seed
        self.pad_multiple, self.aggregation = pad_multiple, aggregation
        self.settings = dict(settings or {})
        self.name = graph.name
        self.num_nodes, self.num_edges = graph.num_nodes, graph.num_edges
        self.num_features, self.num_classes = graph.num_features, graph.num_classes
        self.split_counts = {s: int(graph.split_idx(s).numel()) for s in SPLITS}
        src, dst = graph.edge_index
        # nonzeros of Â: edges other than self-loops (duplicates counted), one loop per node;
        # of A_mean: every edge (duplicates counted, as for Â)
        self.nnz = (int((src != dst).sum()) + graph.num_nodes if aggregation == "gcn"
                    else graph.num_edges)

    def __repr__(self) -> str:
        return (f"InMemorySource({self.graph.summary()}, permutation={self.permutation}, "
                f"seed={self.seed}, aggregation={self.aggregation})")

    def with_aggregation(self, aggregation: str) -> InMemorySource:
        """The same graph, permutation and padding serving ``aggregation`` (this object if it
        does already; as :meth:`plexus.data.mapped.PreparedGraph.with_aggregation`)."""
        if aggregation == self.aggregation:
            return self
        return InMemorySource(self.graph, permutation=self.permutation, seed=self.seed,
                              pad_multiple=self.pad_multiple, aggregation=aggregation,
                              settings=self.settings)

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

        build = (part.normalized_adjacency if self.aggregation == "gcn"
                 else part.mean_adjacency)
        a_full = build(g.edge_index.numpy(), n)
        a_full.resize((n_pad, n_pad))
        # the two distinct layouts: layers of one parity share a matrix (layer_orders)
        parities = range(min(2, num_layers))
        mats = {par: part.permuted(a_full, *part.layer_orders(par, pr, pc)) for par in parities}
        del a_full
        adj = _blocks(mats, shape, coords, num_layers)
        del mats
        root = root_blocks(pr, pc, n, shape, coords, num_layers) if (
            self.aggregation == "mean") else None

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
            split_counts=dict(self.split_counts), out_rows=out_rows, root=root,
        )


def root_blocks(pr: np.ndarray, pc: np.ndarray, num_nodes: int, shape: Mapping[str, int],
                coords: Mapping[str, int], num_layers: int) -> dict[int, RootBlock]:
    """This rank's blocks of the permuted identity ``S_l`` for every layer layout (GraphSAGE's
    root term, residual connections), compact (:class:`~plexus.data.shard.RootBlock`), with
    the balance over all ranks' blocks, as :func:`_blocks` cuts them from the whole ``S``: O(N)
    work from the permutations alone (which may be memory-mapped), so any source's shard can
    get them (plexus.data.shard). Layouts cut alike share one block. Memory: the rank's blocks
    and one ``[N]`` int64 array per parity, never ``S`` itself
    (plexus.data.partition.permuted_identity_rows); memory-mapped permutations give back the
    pages read."""
    out: dict[int, RootBlock] = {}
    cut: dict[tuple[int, ...], RootBlock] = {}  # (parity, P, p, O, o) -> the layout's block
    inv: dict[int, np.ndarray] = {}  # parity -> inverse of its input (column) order
    for lay in range(min(layout.LAYOUTS, num_layers)):
        o_ax, _, p_ax = layout.roles(lay)
        par = lay % 2
        key = (par, shape[p_ax], coords[p_ax], shape[o_ax], coords[o_ax])
        if key not in cut:
            rows, cols = part.layer_orders(par, pr, pc)
            if par not in inv:
                inv[par] = part.inverse_permutation(cols)
            owners, mine, counts = part.permuted_identity_rows(
                rows, cols, num_nodes, coords[p_ax], shape[p_ax], coords[o_ax], shape[o_ax],
                inv_cols=inv[par])
            cut[key] = RootBlock(owners, mine, coords[o_ax], rows.size // shape[o_ax],
                                 part.Balance(int(counts.max()), float(counts.mean())))
        out[lay] = cut[key]  # the balance depends on (parity, P, O) only: the same too
    for perm in (pr, pc):  # read whole: where they are mapped, their pages not kept resident
        release_pages(perm)
    return out


def _blocks(mats, shape: Mapping[str, int], coords: Mapping[str, int],
            num_layers: int) -> dict[int, AdjBlock]:
    """This rank's block (and its transpose) of ``mats[l % 2]`` for every layer layout
    ``l % 6``, with the balance over all ranks' blocks of that layout.

    Layouts that cut the same rows and columns of the same matrix (every layout of one parity
    on a 1x1x1 grid, for instance) share one :class:`BlockSparse` pair: one host copy, and
    one device copy after ``BlockSparse.to``.
    """
    out: dict[int, AdjBlock] = {}
    cut: dict[tuple[int, ...], AdjBlock] = {}  # (parity, P, p, O, o) -> the layout's block
    for lay in range(min(layout.LAYOUTS, num_layers)):
        o_ax, _, p_ax = layout.roles(lay)
        key = (lay % 2, shape[p_ax], coords[p_ax], shape[o_ax], coords[o_ax])
        if key not in cut:
            a_l = mats[lay % 2]
            counts = part.block_nnz(a_l, shape[p_ax], shape[o_ax])
            blk = part.block(a_l, coords[p_ax], shape[p_ax], coords[o_ax], shape[o_ax])
            a = BlockSparse.single(blk)
            cut[key] = AdjBlock(a, TransposedSparse(a), blk.nnz,
                                part.Balance(int(counts.max()), float(counts.mean())))
        same = cut[key]  # the balance depends on (parity, P, O) only: the same too
        out[lay] = AdjBlock(same.a, same.a_t, same.nnz, same.balance)
    return out


def _chunk(t: torch.Tensor, num: int, i: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(num, dim=dim)[i] if num > 1 else t
