"""The 3D layout of the Plexus algorithm: which grid axis plays which role in each layer.

Pure arithmetic (no torch.distributed), shared by the data side (plexus.data builds shards in
this layout) and the model (plexus.model communicates along it).
docs/design/plexus-3d.md sections 1-3.

Layer ``l`` gives the axes the roles (outer, inner, depth) = (O, I, P): (x, y, z), (z, x, y),
(y, z, x) for ``l % 3 == 0, 1, 2``, so one layer's output block is the next one's input block
with no re-layout.

Shapes (N = padded node count, D_l = padded width of layer l's input):
    A_l block on rank (o, i, p):  [N/P, N/O]     rows chunk p, cols chunk o (replicated over I)
    F_l block:                    [N/O, D_l/I]
    W_l block:                    [D_l/I, D_l+1/O], flattened and split over P (common.flat)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from common.grid import roles, round_up

# A layer's adjacency block is set by its roles (3 rotations) and its matrix (A' for even
# layers, A'' for odd ones): the blocks repeat every 6 layers, so a shard holds at most 6.
LAYOUTS = 6


def layout_of(layer: int) -> int:
    """The key of ``layer``'s adjacency and root blocks in a shard (``layer % LAYOUTS``)."""
    return layer % LAYOUTS


def layer_widths(num_features: int, hidden: int, num_layers: int, num_classes: int) -> list[int]:
    """True layer widths ``[D_0, hidden, ..., hidden, C]`` of an L-layer model."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return [num_features] + [hidden] * (num_layers - 1) + [num_classes]


def padded_num_nodes(num_nodes: int, shape: Mapping[str, int]) -> int:
    """Nodes padded so every axis (each is an outer and a depth axis in some layer) divides."""
    return round_up(num_nodes, math.lcm(*shape.values()))


def padded_widths(dims: list[int], shape: Mapping[str, int]) -> list[int]:
    """Pad layer widths ``[D_0, ..., D_L]``: D_l splits over I_l, D_L (classes) over O_{L-1}."""
    out = [round_up(d, shape[roles(layer)[1]]) for layer, d in enumerate(dims[:-1])]
    out.append(round_up(dims[-1], shape[roles(len(dims) - 2)[0]]))
    return out

