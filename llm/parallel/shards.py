"""This rank's shards of the GPT's parameters, laid out as :mod:`llm.parallel.layout` says:
sliced from a full tensor (:func:`shard_tensor`), drawn from the keyed initialisation without
the full tensor (:func:`init_shards`), located in the full tensor for a sharded checkpoint
(:func:`shard_slab`) and gathered back (:func:`gather_tensor`, the one collective here).

``sizes`` and ``coords`` map each axis of ``data x depth x row x col`` to its size and to this
rank's coordinate along it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from common import flat
from common.collectives import all_gather
from common.comm_stats import CommStats
from common.grid import AXONN_AXES, AxisGroup
from common.sharded import Slab
from llm.config import GPTConfig, init_std
from llm.parallel.keyed_init import fill_normal_
from llm.parallel.layout import ShardSpec, param_specs


def shard_tensor(full: Tensor, spec: ShardSpec, sizes: Mapping[str, int],
                 coords: Mapping[str, int]) -> Tensor:
    """This rank's shard of a full tensor (pure slicing, no communication).

    Shapes:
        full: spec.shape -> spec.block_shape(sizes), or [spec.shard_numel(sizes)] when flat
    """
    if tuple(full.shape) != spec.shape:
        raise ValueError(f"expected a tensor of shape {spec.shape}, got {tuple(full.shape)}")
    block = spec.block_shape(sizes)
    x = full.detach()
    for dim, axis in enumerate(spec.axes):
        if axis:
            start = coords[axis] * block[dim]
            stop = min(start + block[dim], x.shape[dim])  # the last block may be all padding
            x = x.narrow(dim, min(start, stop), max(0, stop - start))
    out = torch.zeros(block, dtype=full.dtype, device=full.device)  # zero padding
    out[tuple(slice(0, n) for n in x.shape)] = x
    return flat.flat_shard(out, sizes["depth"], coords["depth"]) if spec.flat else out


@torch.no_grad()
def init_shard_(out: Tensor, config: GPTConfig, name: str, spec: ShardSpec,
                sizes: Mapping[str, int], coords: Mapping[str, int], *, seed: int) -> Tensor:
    """Fill ``out`` with this rank's shard of parameter ``name`` of ``GPT(config, seed=seed)``.

    Bit for bit ``shard_tensor(full, spec, sizes, coords)`` of the full initial parameter, but
    only the row blocks that the shard touches are drawn, one at a time
    (:func:`llm.parallel.keyed_init.fill_normal_`): memory beyond ``out`` is one chunk. Pure.

    Shapes:
        out: spec.shard_shape(sizes) -> returns out
    """
    std = init_std(config, name)
    if std is None:  # an RMSNorm weight: ones, D elements at most
        return out.copy_(shard_tensor(torch.ones(spec.shape), spec, sizes, coords))
    block = spec.block_shape(sizes)
    origin = [coords[a] * n if a else 0 for n, a in zip(block, spec.axes)]
    start = coords["depth"] * out.numel() if spec.flat else 0  # in the block's row-major order
    fill_normal_(out.view(-1), seed=seed, name=name, shape=spec.shape, std=std, origin=origin,
                 block=block, start=start)
    return out


def init_shards(config: GPTConfig, seed: int, sizes: Mapping[str, int],
                coords: Mapping[str, int], device: torch.device | str | None = None
                ) -> dict[str, Tensor]:
    """Every shard of the rank at ``coords`` on a grid of ``sizes`` (:func:`init_shard_`).

    A pure function of (config, seed, grid sizes, coords): the shards of every coordinate
    assemble into ``GPT(config, seed=seed)``'s parameters. Keys: state_dict names. Peak
    memory: the shards plus one chunk.
    """
    specs = param_specs(config, sizes)
    # all shards first: the drawn chunks, freed one by one, then leave no holes between
    # shards that the allocator could not give back (glibc kept much more on CPU otherwise)
    shards = {name: torch.empty(spec.shard_shape(sizes), device=device)
              for name, spec in specs.items()}
    for name, spec in specs.items():
        init_shard_(shards[name], config, name, spec, sizes, coords, seed=seed)
    return shards


def shard_slab(spec: ShardSpec, sizes: Mapping[str, int], coords: Mapping[str, int]) -> Slab:
    """Where :func:`shard_tensor`'s output sits in the full tensor (a sharded checkpoint's
    description of this rank's piece; pure)."""
    block = spec.block_shape(sizes)
    ranges = [(coords[a] * b, (coords[a] + 1) * b) if a else (0, n)
              for n, b, a in zip(spec.shape, block, spec.axes)]
    rows, cols = ranges if len(ranges) == 2 else ((0, 1), ranges[0])
    flat_range = (flat.shard_range(math.prod(block), sizes["depth"], coords["depth"])
                  if spec.flat else None)
    return Slab(spec.shape, rows, cols, flat_range)


def gather_tensor(local: Tensor, spec: ShardSpec, groups: Mapping[str, AxisGroup],
                  stats: CommStats | None = None) -> Tensor:
    """The full tensor from every rank's shard; collective over depth, row and col.

    Shapes:
        local: a shard as returned by :func:`shard_tensor` -> spec.shape
    """
    sizes = {a: groups[a].size for a in AXONN_AXES}
    x = local.detach()
    if spec.flat:
        x = flat.gather(x, groups["depth"], spec.block_shape(sizes), stats=stats)
    for dim, axis in enumerate(spec.axes):
        if axis:
            x = all_gather(x.contiguous(), groups[axis], dim=dim, stats=stats)
    return x[tuple(slice(0, n) for n in spec.shape)].clone()
