"""Per-rank shards of a graph for Plexus 3D training (the in-memory path).

Every rank builds ``Â`` from the whole graph and keeps only its blocks: one adjacency block
(CSR, with its precomputed transpose) per distinct layer layout, its flat shard of the input
features, and the labels and split masks of the output rows it holds.

Shapes (N = padded nodes; roles (O, I, P) of layer l, see plexus.partition):
    adj[l % 6].a     [N/P, N/O]  CSR, int32 indices where they fit
    adj[l % 6].a_t   [N/O, N/P]  CSR of the transpose
    features         [ceil(N/X * D_0/Y / Z)]  flat shard over z of the (x, y) block [N/X, D_0/Y]
    labels, masks    [N/P_last]  rows chunk p of the output order (labels -1 on padding)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
import torch

from plexus import partition as part
from plexus.graph import Graph
from plexus.sparse import BlockSparse, CSRBlock

SPLITS = ("train", "val", "test")


@dataclass
class AdjBlock:
    """One stationary adjacency block and its transpose."""

    a: BlockSparse
    a_t: BlockSparse
    nnz: int
    balance: part.Balance


@dataclass
class GraphShard:
    """What one rank holds of the graph. Built by :func:`shard_graph`."""

    num_nodes: int
    num_nodes_padded: int
    num_classes: int
    widths: list[int]  # true layer widths [D_0, hidden..., C]
    widths_padded: list[int]
    pr: np.ndarray
    pc: np.ndarray
    adj: dict[int, AdjBlock]
    features_block: torch.Tensor  # [N/X, D_0/Y] in Pc order (flattened and split by the model)
    labels: torch.Tensor  # [N/P_last] int64
    masks: dict[str, torch.Tensor]  # split -> bool [N/P_last]
    split_counts: dict[str, int]  # split -> labelled nodes in the whole graph
    out_rows: np.ndarray  # original node id of each local output row (-1 on padding)
    info: dict[str, float] = field(default_factory=dict)


def flat_shard(block: torch.Tensor, num_p: int, p: int) -> torch.Tensor:
    """Chunk ``p`` of ``num_p`` of the flattened block, zero-padded to equal chunks."""
    flat = block.reshape(-1)
    size = part.round_up(flat.numel(), num_p) // num_p
    out = torch.zeros(size, dtype=block.dtype)
    piece = flat[p * size : (p + 1) * size]
    out[: piece.numel()] = piece
    return out


def to_torch_csr(m: sp.csr_matrix) -> torch.Tensor:
    """scipy CSR -> torch CSR, int32 indices when they fit (a third less index memory)."""
    return CSRBlock.from_scipy(m).to_torch()


def shard_graph(
    graph: Graph,
    shape: dict[str, int],
    coords: dict[str, int],
    *,
    num_layers: int,
    hidden: int,
    permutation: str = "double",
    seed: int = 0,
    pad_multiple: int = 1,
) -> GraphShard:
    """Build this rank's shard of ``graph`` for a grid of ``shape`` at ``coords``.

    Args:
        graph: the whole graph (every rank holds it in this in-memory path).
        shape: axis sizes ``{"x": X, "y": Y, "z": Z}``.
        coords: this rank's coordinates on the same axes.
        num_layers, hidden: model depth and hidden width (they fix the layer widths).
        permutation: ``none``, ``single`` or ``double`` (see plexus.partition).
        seed: permutation seed (identical on every rank).
        pad_multiple: also pad the node count to a multiple of this (the block count k of a
            prepared dataset gives the same permutations and blocks, so the same numbers).
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    n = graph.num_nodes
    n_pad = part.round_up(part.padded_num_nodes(n, shape), pad_multiple)
    widths = [graph.num_features] + [hidden] * (num_layers - 1) + [graph.num_classes]
    widths_pad = part.padded_widths(widths, shape)
    pr, pc = part.make_permutations(n_pad, permutation, seed)

    a_hat = part.normalized_adjacency(graph.edge_index.numpy(), n)
    a_hat.resize((n_pad, n_pad))
    adj: dict[int, AdjBlock] = {}
    for layer in range(min(6, num_layers)):
        o_ax, _, p_ax = part.roles(layer)
        out_order, in_order = part.layer_orders(layer, pr, pc)
        a_l = part.permuted(a_hat, out_order, in_order)
        counts = part.block_nnz(a_l, shape[p_ax], shape[o_ax])
        blk = part.block(a_l, coords[p_ax], shape[p_ax], coords[o_ax], shape[o_ax])
        adj[layer] = AdjBlock(
            BlockSparse.single(blk), BlockSparse.single(blk.T.tocsr()), blk.nnz,
            part.Balance(int(counts.max()), float(counts.mean())),
        )

    # input features: Pc order (layer 0's input order), padded, block (x chunk, y chunk)
    x_pad = torch.zeros(n_pad, widths_pad[0])
    x_pad[:n, : widths[0]] = graph.x
    o0, i0, _ = part.roles(0)
    rows = _chunk(torch.from_numpy(pc), shape[o0], coords[o0])
    features_block = _chunk(x_pad[rows], shape[i0], coords[i0], dim=1).contiguous()

    # labels and masks of the output rows held here
    o_last, _, p_last = part.roles(num_layers - 1)
    order = part.output_order(num_layers, pr, pc)
    out_rows = _chunk(torch.from_numpy(order), shape[p_last], coords[p_last]).numpy().copy()
    out_rows[out_rows >= n] = -1
    real = torch.from_numpy(out_rows >= 0)
    ids = torch.from_numpy(np.where(out_rows >= 0, out_rows, 0))
    labels = torch.where(real, graph.y[ids], torch.full_like(ids, -1))
    masks = {s: real & graph.mask(s)[ids] for s in SPLITS}
    counts = {s: int(graph.split_idx(s).numel()) for s in SPLITS}

    return GraphShard(
        num_nodes=n, num_nodes_padded=n_pad, num_classes=graph.num_classes,
        widths=widths, widths_padded=widths_pad, pr=pr, pc=pc, adj=adj,
        features_block=features_block, labels=labels, masks=masks, split_counts=counts,
        out_rows=out_rows,
    )


def _chunk(t: torch.Tensor, num: int, i: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(num, dim=dim)[i] if num > 1 else t
