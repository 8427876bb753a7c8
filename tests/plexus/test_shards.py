"""plexus.shards: the shard maps of the GCN's tensors, pure (no torch.distributed).

On a lopsided grid whose sizes pad the node count and the widths, every rank's local tensor
(:func:`shards.shard`) placed where its slab (:func:`shards.slab`) says rebuilds the full
tensor exactly once, with zero padding; gathering over real groups is tested by
test_model.py and test_recipe.py (full weights, features and every gradient).
"""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from common.grid import AxisGroup
from plexus import layout, shards

SHAPE = {"x": 2, "y": 1, "z": 3}
WIDTHS = [7, 6, 6, 5]
NUM_NODES = 11


def _shard():
    n_pad = layout.padded_num_nodes(NUM_NODES, SHAPE)
    pc = np.random.default_rng(0).permutation(n_pad)
    return SimpleNamespace(num_nodes=NUM_NODES, num_nodes_padded=n_pad, widths=WIDTHS,
                           widths_padded=layout.padded_widths(WIDTHS, SHAPE), pc=pc)


def _groups(coords):
    return {ax: AxisGroup(ax, None, SHAPE[ax], coords[ax]) for ax in SHAPE}


def _every_rank():
    for values in itertools.product(*(range(n) for n in SHAPE.values())):
        yield _groups(dict(zip(SHAPE, values)))


def test_maps_follow_the_layout_table():
    maps = shards.shard_maps(_shard())
    assert set(maps) == {("features", None), *((k, l) for k in ("weight", "vector")
                                                for l in range(3))}
    for layer in range(3):
        o, i, p = layout.roles(layer)
        assert maps["weight", layer].axes == (i, o) and maps["weight", layer].flat == p
        assert maps["vector", layer].axes == (o,) and maps["vector", layer].flat is None
    feats = maps["features", None]
    assert feats.axes == ("x", "y") and feats.flat == "z"
    assert feats.block_shape(SHAPE) == (12 // 2, 7 // 1)


@pytest.mark.parametrize("key", [("weight", 0), ("weight", 1), ("weight", 2), ("vector", 2),
                                 ("features", None)])
def test_local_tensors_placed_by_their_slabs_rebuild_the_full_tensor(key):
    spec = shards.shard_maps(_shard())[key]
    full = torch.arange(1.0, 1 + np.prod(spec.shape)).reshape(spec.shape)
    rows_pad = spec.padded[0] if len(spec.padded) == 2 else 1
    rebuilt = torch.zeros(rows_pad, spec.padded[-1])
    hits = torch.zeros_like(rebuilt)
    for groups in _every_rank():
        local = shards.shard(full, spec, groups)
        slab = shards.slab(spec, groups)
        ids = torch.from_numpy(slab.row_ids())
        block = torch.zeros(ids.numel(), slab.width)
        if slab.flat is None:
            block = local.reshape(block.shape)
        else:
            assert local.numel() == slab.flat[1] - slab.flat[0]
            lo, hi = slab.flat[0], min(slab.flat[1], block.numel())
            if hi > lo:
                block.view(-1)[lo:hi] = local[: hi - lo]
            assert not local[max(hi - lo, 0):].any(), "a flat shard is zero beyond the block"
        part = (ids[:, None], torch.arange(*slab.cols)[None, :])
        rebuilt.index_put_(part, block, accumulate=True)
        hits.index_put_(part, (block != 0).float(), accumulate=True)
    if len(spec.shape) == 1:
        rebuilt, hits = rebuilt[0], hits[0]
    real = tuple(slice(0, n) for n in spec.shape)
    copies = 1 if key[0] != "vector" else SHAPE[layout.roles(key[1])[1]] * SHAPE[
        layout.roles(key[1])[2]]  # a vector is replicated over I and P
    assert torch.equal(rebuilt[real], full * copies)
    assert torch.equal(hits[real], torch.full(spec.shape, float(copies)))
    assert rebuilt.sum() == full.sum() * copies, "padding is zero"


def test_shard_refuses_a_wrong_shape():
    spec = shards.shard_maps(_shard())["weight", 0]
    with pytest.raises(ValueError, match="expected a tensor of shape"):
        shards.shard(torch.zeros(3, 3), spec, next(_every_rank()))
