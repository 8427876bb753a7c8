"""Where each tensor of the Plexus GCN lives on the grid, declared as data (:class:`ShardMap`).

The counterpart of llm.parallel.gpt's ``param_specs``: one table says how a full tensor of the
serial model (plexus.reference) maps to a rank's local one, and three generic functions apply
it: :func:`shard` (full -> local, pure slicing), :func:`gather` (local -> full, collective)
and :func:`slab` (where the local tensor sits in the full one, for sharded checkpoints; pure).
Roles (O, I, P) of layer ``l`` as in plexus.layout:

===========  ==============  ======================  ============  =========================
kind         full shape      rows split over         cols over     then
===========  ==============  ======================  ============  =========================
weight l     [D_l, D_l+1]    I_l                     O_l           flat over P_l
vector l     [D_l+1]         (1-D)                   O_l           replicated over I_l, P_l
features     [N, D_0]        x (= O_0), in order Pc  y (= I_0)     flat over z (= P_0)
GAT:
weight l     [D_l, K c_l]    I_l                     (whole)       flat over P_l
att l        [K, c_l]        I_l (the heads)         (whole)       replicated over O_l, P_l
===========  ==============  ======================  ============  =========================

``weight`` covers ``W_l`` and ``R_l`` (and anything laid out like them: gradients, Adam
moments), ``vector`` the bias and the norm parameters and statistics of layer ``l``'s output.
Each split dimension is zero-padded to the padded widths (plexus.layout.padded_widths) or node
count; the features' rows are the nodes in the permuted order ``Pc`` (plexus.data.partition).
A flat split is :func:`common.flat.flat_shard` of the block.

Shapes (per rank): weight [ceil(D_l/I * D_l+1/O / P)], vector [D_l+1/O],
features [ceil(N/X * D_0/Y / Z)] with D and N padded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from common import collectives as coll
from common import flat
from common.grid import AxisGroup
from common.sharded import Slab
from plexus.data.shard import GraphShard, release_pages
from plexus.layout import roles

KINDS = ("weight", "vector", "features", "att")


@dataclass(frozen=True, eq=False)
class ShardMap:
    """How one tensor of the serial model is laid out on the grid (module docstring).

    Attributes:
        shape: the full, unpadded shape (1-D or 2-D).
        padded: the full shape padded so that every split divides.
        axes: for each dim, the grid axis splitting it (contiguous chunks), or None.
        flat: the axis the local block is flattened and split over, or None.
        order: dim 0's rows in the order they are split: the padded full row ``order[k]`` is
            row ``k`` of the split; None: natural order.
    """

    shape: tuple[int, ...]
    padded: tuple[int, ...]
    axes: tuple[str | None, ...]
    flat: str | None = None
    order: np.ndarray | None = None

    def block_shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """Shape of a rank's block before flattening (padded dims divided by their axis)."""
        return tuple(n // sizes[a] if a else n for n, a in zip(self.padded, self.axes))


def shard_maps(shard: GraphShard, heads: int | None = None
               ) -> dict[tuple[str, int | None], ShardMap]:
    """The table of the module docstring for a shard's widths, keyed by (kind, layer); with
    ``heads``, GAT's weights and attention vectors (plexus.gat_model). Pure."""
    w, wp = shard.widths, shard.widths_padded
    o0, i0, p0 = roles(0)
    maps = {("features", None): ShardMap((shard.num_nodes, w[0]),
                                         (shard.num_nodes_padded, wp[0]), (o0, i0), p0,
                                         order=shard.pc)}
    last = len(w) - 2
    for layer in range(len(w) - 1):
        o, i, p = roles(layer)
        maps["vector", layer] = ShardMap((w[layer + 1],), (wp[layer + 1],), (o,))
        if heads is None:
            maps["weight", layer] = ShardMap((w[layer], w[layer + 1]),
                                             (wp[layer], wp[layer + 1]), (i, o), p)
            continue
        c = w[layer + 1] if layer == last else w[layer + 1] // heads  # a head's width
        maps["weight", layer] = ShardMap((w[layer], heads * c), (wp[layer], heads * c),
                                         (i, None), p)
        maps["att", layer] = ShardMap((heads, c), (heads, c), (i, None))
    return maps


def node_chunk(order: np.ndarray, group: AxisGroup) -> torch.Tensor:
    """This rank's chunk of a node order over ``group`` (a copy: the order may be a read-only
    memory map). Shapes: order [N_pad] -> int64 [N_pad / group.size]."""
    n = order.size // group.size
    assert n * group.size == order.size, "the padded node count splits evenly over every axis"
    out = torch.from_numpy(np.array(order[group.rank * n:(group.rank + 1) * n], dtype=np.int64))
    release_pages(order)  # a map of [N]: the pages read are not kept resident
    return out


def _sizes(groups: Mapping[str, AxisGroup]) -> dict[str, int]:
    return {ax: g.size for ax, g in groups.items()}


def shard(full: torch.Tensor, spec: ShardMap, groups: Mapping[str, AxisGroup]) -> torch.Tensor:
    """This rank's local tensor of a full one (pure slicing; a copy).

    Shapes: full spec.shape -> a flat shard [s], or the block spec.block_shape(sizes)
    """
    if tuple(full.shape) != spec.shape:
        raise ValueError(f"expected a tensor of shape {spec.shape}, got {tuple(full.shape)}")
    x = full.new_zeros(spec.padded)
    x[tuple(slice(0, n) for n in full.shape)] = full
    for dim, axis in enumerate(spec.axes):
        if axis is None:
            continue
        g = groups[axis]
        if dim == 0 and spec.order is not None:
            x = x[node_chunk(spec.order, g).to(x.device)]
        else:
            x = x.chunk(g.size, dim)[g.rank]
    if spec.flat is None:
        return x.clone()
    return flat.flat_shard(x, groups[spec.flat].size, groups[spec.flat].rank)


@torch.no_grad()
def gather(local: torch.Tensor, spec: ShardMap, groups: Mapping[str, AxisGroup]
           ) -> torch.Tensor:
    """The full tensor from every rank's local one, on every rank (collective over the axes
    of ``spec``). Inverse of :func:`shard`.

    Shapes: local (as :func:`shard` returns) -> spec.shape
    """
    x = local
    if spec.flat is not None:
        x = flat.gather(x, groups[spec.flat], spec.block_shape(_sizes(groups)))
    for dim, axis in enumerate(spec.axes):
        if axis is not None:
            x = coll.all_gather(x, groups[axis], dim=dim)
    if spec.order is not None:
        out = torch.empty_like(x)
        out[torch.from_numpy(spec.order).to(x.device)] = x
        x = out
    return x[tuple(slice(0, n) for n in spec.shape)]


def slab(spec: ShardMap, groups: Mapping[str, AxisGroup]) -> Slab:
    """Where this rank's local tensor sits in the full one (a sharded checkpoint's description
    of :func:`shard`; pure)."""
    block = spec.block_shape(_sizes(groups))
    ranges: list[tuple[int, int] | np.ndarray] = []
    for dim, (n, axis) in enumerate(zip(spec.padded, spec.axes)):
        if axis is None:
            ranges.append((0, n))
        elif dim == 0 and spec.order is not None:
            ranges.append(node_chunk(spec.order, groups[axis]).numpy())
        else:
            r = groups[axis].rank
            ranges.append((r * block[dim], (r + 1) * block[dim]))
    rows, cols = ranges if len(ranges) == 2 else ((0, 1), ranges[0])
    assert isinstance(cols, tuple)
    flat_range = None
    if spec.flat is not None:
        g = groups[spec.flat]
        flat_range = flat.shard_range(math.prod(block), g.size, g.rank)
    return Slab(spec.shape, rows, cols, flat_range)
