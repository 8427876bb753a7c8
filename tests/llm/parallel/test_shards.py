"""This rank's shards (llm.parallel.shards): slicing covers every full tensor, the keyed
initialisation of every grid draws bit for bit the slices of the one-process GPT's parameters
(zero padding included), and each shard's slab says where it sits. Pure: every coordinate in
this one process, no ranks launched (gathering back: test_gpt.py's parallel runs)."""

import dataclasses
import itertools

import pytest
import torch

import llm.parallel.keyed_init
from common.grid import AXONN_AXES
from llm.model import GPT
from llm.parallel.layout import param_specs
from llm.parallel.shards import init_shards, shard_slab, shard_tensor
from tests.llm.parallel.test_gpt import BASE, ODD_D

SEED = 7
# depth x row x col: cubic, lopsided (1x1x4, 1x4x1, 4x1x2, 1x2x4), and depth 3 / 5, whose flat
# shards need padding; the configs need padding on the vocabulary, d_ff and (ODD_D) d_model
GRIDS = [((2, 2, 2), {}), ((1, 1, 4), ODD_D), ((1, 4, 1), {"num_kv_heads": 4}),
         ((4, 1, 2), {}), ((1, 2, 4), ODD_D), ((3, 2, 1), {}), ((5, 1, 3), ODD_D)]
# keyed_init's chunk: one draw per parameter; several rows; one row each
CHUNKS = [llm.parallel.keyed_init.CHUNK_NUMEL, 50, 7]


def coords_of(sizes):
    for z, r, c in itertools.product(*(range(sizes[a]) for a in ("depth", "row", "col"))):
        yield {"data": 0, "depth": z, "row": r, "col": c}


def assemble(shards, spec, sizes):
    """Rebuild a full tensor from every coordinate's shard (pure, the inverse of slicing)."""
    block = spec.block_shape(sizes)
    padded = torch.zeros([b * (sizes[a] if a else 1) for b, a in zip(block, spec.axes)])
    for coords, shard in shards.items():
        c = dict(zip(("depth", "row", "col"), coords))
        if spec.flat:
            if c["depth"]:
                continue
            flat = torch.cat([shards[(z, c["row"], c["col"])] for z in range(sizes["depth"])])
            shard = flat[: block[0] * block[1]].view(block) if len(block) == 2 else flat
        index = tuple(slice(c[a] * n, (c[a] + 1) * n) if a else slice(None)
                      for n, a in zip(block, spec.axes))
        padded[index] = shard
    return padded[tuple(slice(0, n) for n in spec.shape)]


def read_slab(full, slab):
    """The local tensor that ``slab`` describes, read from ``full`` (common.slab's form:
    ``padded[rows][:, cols]``, then elements ``flat`` of it flattened, zero beyond)."""
    full_2d = full.view(1, -1) if full.dim() == 1 else full
    (r0, r1), (c0, c1) = slab.rows, slab.cols
    padded = torch.zeros(max(r1, full_2d.shape[0]), max(c1, full_2d.shape[1]))
    padded[: full_2d.shape[0], : full_2d.shape[1]] = full_2d
    block = padded[r0:r1, c0:c1]
    if slab.flat is None:
        return block if full.dim() == 2 else block.view(-1)
    lo, hi = slab.flat
    return torch.cat((block.reshape(-1), torch.zeros(hi)))[lo:hi]


@pytest.mark.parametrize("depth, row, col", [(1, 1, 1), (2, 1, 1), (1, 2, 2), (3, 2, 4),
                                             (2, 4, 1)])
def test_shards_cover_the_full_tensor_and_sit_where_their_slab_says(depth, row, col):
    config = dataclasses.replace(BASE, num_kv_heads=4) if row == 4 else BASE
    sizes = {"data": 1, "depth": depth, "row": row, "col": col}
    model = GPT(config, seed=0)
    specs = param_specs(config, sizes)
    assert set(specs) == {n for n, _ in model.named_parameters()}
    for name, full in model.state_dict().items():
        spec = specs[name]
        shards = {}
        for coords in coords_of(sizes):
            key = tuple(coords[a] for a in ("depth", "row", "col"))
            shards[key] = shard_tensor(full, spec, sizes, coords)
            want = (spec.shard_numel(sizes),) if spec.flat else spec.block_shape(sizes)
            assert shards[key].shape == want, name
            slab = shard_slab(spec, sizes, coords)
            assert torch.equal(read_slab(full, slab), shards[key]), f"{name} at {key}: slab"
        assert torch.equal(assemble(shards, spec, sizes), full), name


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("grid, changes", GRIDS)
def test_shards_of_every_grid_assemble_to_the_one_process_model(grid, changes, chunk,
                                                                monkeypatch):
    monkeypatch.setattr(llm.parallel.keyed_init, "CHUNK_NUMEL", chunk)
    config = dataclasses.replace(BASE, **changes)
    sizes = dict(zip(AXONN_AXES, (1, *grid)))
    full = GPT(config, seed=SEED).state_dict()
    specs = param_specs(config, sizes)
    shards = {}
    for coords in coords_of(sizes):
        for name, shard in init_shards(config, SEED, sizes, coords).items():
            # bit for bit the slice of the serial parameter, zero padding included
            assert torch.equal(shard, shard_tensor(full[name], specs[name], sizes, coords)), \
                f"{grid} {coords}: {name}"
            shards.setdefault(name, {})[tuple(coords[a] for a in ("depth", "row", "col"))] = shard
    assert set(shards) == set(full)
    for name, want in full.items():
        assert torch.equal(assemble(shards[name], specs[name], sizes), want), f"{grid}: {name}"
