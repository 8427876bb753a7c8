"""Property-based test (hypothesis) of the partition maps: every node and nonzero lands in
exactly one shard on any grid and permutation."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from plexus import layout
from plexus.data import partition as part

sizes = st.integers(min_value=1, max_value=6)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), x=sizes, y=sizes, z=sizes, mode=st.sampled_from(part.PERMUTATIONS),
       seed=st.integers(0, 2**31 - 1))
def test_partition_maps_cover_every_node_once(n, x, y, z, mode, seed):
    shape = {"x": x, "y": y, "z": z}
    n_pad = layout.padded_num_nodes(n, shape)
    assert n_pad >= n and n_pad % math.lcm(x, y, z) == 0 and n_pad - n < math.lcm(x, y, z)
    pr, pc = part.make_permutations(n_pad, mode, seed)
    for perm in (pr, pc):
        assert np.array_equal(np.sort(perm), np.arange(n_pad))
    for layers in (1, 2, 3, 4):
        order = part.output_order(layers, pr, pc)
        _, _, p = layout.roles(layers - 1)
        chunks = np.array_split(order, shape[p])
        assert all(len(ch) == n_pad // shape[p] for ch in chunks)
        assert np.array_equal(np.sort(np.concatenate(chunks)), np.arange(n_pad))
