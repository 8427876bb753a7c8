"""The residual connection ``F_l+1 = relu(norm(Q_l)) + F_l`` of a Plexus GCN, without a
full-size transfer.

The skip runs in the hidden-to-hidden layers, 1 .. L-2, whose input and output widths agree.
``F_l`` [N/O, D_l/I] sits in the layer's input layout and ``Q_l`` [N/P, D_l+1/O] in its output
layout: ``F_l``'s rows reach the output rows through the permuted identity ``S_l``, the same
block as GraphSAGE's root term (an SpMM all-reduced over O, which the model runs:
plexus.model.PlexusGCN); its columns, split over I, are then placed at their place in the
output's O split and summed over I: one all-reduce of Q's size.
"""

from __future__ import annotations

import torch

from common import autograd
from common.comm_stats import CommStats
from common.grid import AxisGroup
from plexus import layout
from plexus.data.memory import root_blocks
from plexus.data.shard import GraphShard


def has_skip(residual: bool, layer: int, num_layers: int) -> bool:
    """Whether ``layer`` adds its input to its output: a hidden-to-hidden layer of a model
    with ``residual``."""
    return residual and 1 <= layer < num_layers - 1


def add_root_blocks(shard: GraphShard, groups: dict[str, AxisGroup]) -> None:
    """Give ``shard`` the blocks of ``S_l`` (``shard.root``) where it has none: a GCN's
    residual moves rows through them (a GraphSAGE shard has them for its root term)."""
    if shard.root is None:
        shard.root = root_blocks(shard.pr, shard.pc, shard.num_nodes,
                                 {ax: g.size for ax, g in groups.items()},
                                 {ax: g.rank for ax, g in groups.items()},
                                 len(shard.widths) - 1)


def in_output_columns(rows: torch.Tensor, layer: int, width_out: int, true_width: int,
                      groups: dict[str, AxisGroup], wire: dict[str, AxisGroup],
                      stats: CommStats | None) -> torch.Tensor:
    """``S_l F_l`` (``rows``: this rank's I-chunk of columns) placed at its columns of the
    output's O split and summed over I (``wire``: the groups the sum travels on), replicated
    over I; ``true_width``: ``D_l`` unpadded (padding columns add nothing).

    Shapes: rows [N/P, D_l/I] -> [N/P, width_out = D_l+1/O]
    """
    o_ax, i_ax, _ = layout.roles(layer)
    w_in = rows.shape[1]
    lo_in, lo_out = groups[i_ax].rank * w_in, groups[o_ax].rank * width_out
    lo = max(lo_in, lo_out)
    hi = min(lo_in + w_in, lo_out + width_out, true_width)
    # an empty slice when the chunks do not overlap keeps rows in the graph, so every rank
    # runs its backward collectives
    part, left = ((rows[:, lo - lo_in: hi - lo_in], lo - lo_out) if hi > lo
                  else (rows[:, :0], 0))
    placed = torch.nn.functional.pad(part, (left, width_out - left - part.shape[1]))
    return autograd.all_reduce_identity(placed, wire[i_ax], stats)
