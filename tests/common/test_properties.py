"""Property-based tests (hypothesis) of the grid parser and the partition maps."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from common.grid import AXONN_AXES, PLEXUS_AXES, ProcessGrid
from plexus import partition as part

sizes = st.integers(min_value=1, max_value=6)


@given(x=sizes, y=sizes, z=sizes)
def test_parse_roundtrip_and_bijection(x, y, z):
    g = ProcessGrid.parse(f"{x}x{y}x{z}")
    assert g == ProcessGrid.parse(str(g)) == ProcessGrid.plexus(x, y, z)
    assert [g.rank(g.coords(r)) for r in range(g.num_ranks)] == list(range(g.num_ranks))
    for axis in PLEXUS_AXES:
        groups = g.groups(axis)
        assert sorted(sum(groups, [])) == list(range(g.num_ranks))


@given(d=sizes, z=sizes, r=sizes, c=sizes, world=st.integers(1, 300))
def test_named_parse_and_validation(d, z, r, c, world):
    g = ProcessGrid.parse(f"data={d},depth={z},row={r},col={c}", AXONN_AXES)
    assert g.num_ranks == d * z * r * c
    if world == g.num_ranks:
        g.validate(world)
    else:
        try:
            g.validate(world)
            raise AssertionError("validate accepted a wrong world size")
        except ValueError as e:
            assert f"= {g.num_ranks} ranks, but {world} processes" in str(e)


@given(text=st.text(max_size=12))
def test_parser_never_crashes_on_garbage(text):
    try:
        g = ProcessGrid.parse(text)
    except ValueError:
        return
    assert g.num_ranks >= 1


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), x=sizes, y=sizes, z=sizes, mode=st.sampled_from(part.PERMUTATIONS),
       seed=st.integers(0, 2**31 - 1))
def test_partition_maps_cover_every_node_once(n, x, y, z, mode, seed):
    shape = {"x": x, "y": y, "z": z}
    n_pad = part.padded_num_nodes(n, shape)
    assert n_pad >= n and n_pad % math.lcm(x, y, z) == 0 and n_pad - n < math.lcm(x, y, z)
    pr, pc = part.make_permutations(n_pad, mode, seed)
    for perm in (pr, pc):
        assert np.array_equal(np.sort(perm), np.arange(n_pad))
    for layers in (1, 2, 3, 4):
        order = part.output_order(layers, pr, pc)
        o, _, p = part.roles(layers - 1)
        chunks = np.array_split(order, shape[p])
        assert all(len(ch) == n_pad // shape[p] for ch in chunks)
        assert np.array_equal(np.sort(np.concatenate(chunks)), np.arange(n_pad))
