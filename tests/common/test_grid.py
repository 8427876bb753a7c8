"""Pure rank arithmetic of ProcessGrid: no torch.distributed, no processes (examples and
hypothesis properties), the one grid check, and the rounding helpers."""

import itertools
import math
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.grid import AXONN_AXES, PLEXUS_AXES, AxisGroup, ProcessGrid, ceil_div, round_up

SHAPES_3D = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (1, 2, 4), (4, 1, 2),
             (3, 2, 5), (2, 3, 1), (8, 1, 1), (1, 1, 8)]
SHAPES_4D = [(1, 1, 1, 1), (2, 1, 1, 2), (1, 2, 2, 1), (2, 2, 2, 1), (1, 2, 2, 2), (3, 1, 2, 2),
             (2, 3, 1, 4)]


@pytest.mark.parametrize("shape", SHAPES_3D)
def test_plexus_rank_formula(shape):
    nx, ny, nz = shape
    g = ProcessGrid.plexus(nx, ny, nz)
    assert g.num_ranks == nx * ny * nz
    seen = set()
    for x, y, z in itertools.product(range(nx), range(ny), range(nz)):
        r = g.rank(x=x, y=y, z=z)
        assert r == z * (nx * ny) + x * ny + y
        assert g.coords(r) == {"x": x, "y": y, "z": z}
        seen.add(r)
    assert seen == set(range(g.num_ranks))


@pytest.mark.parametrize("shape", SHAPES_4D)
def test_axonn_rank_formula(shape):
    nd, nz, nr, nc = shape
    g = ProcessGrid.axonn(nd, nz, nr, nc)
    for d, z, r, c in itertools.product(range(nd), range(nz), range(nr), range(nc)):
        rank = g.rank(data=d, depth=z, row=r, col=c)
        assert rank == ((d * nz + z) * nr + r) * nc + c
        assert g.coords(rank) == {"data": d, "depth": z, "row": r, "col": c}


@pytest.mark.parametrize("shape", SHAPES_3D + SHAPES_4D)
def test_groups_partition_the_grid(shape):
    g = ProcessGrid.plexus(*shape) if len(shape) == 3 else ProcessGrid.axonn(*shape)
    axis_sets = [(a,) for a in g.axes] + list(itertools.combinations(g.axes, 2)) + [g.axes]
    for axes in axis_sets:
        groups = g.groups(axes)
        size = math.prod(g.size(a) for a in axes)
        assert len(groups) == g.num_ranks // size
        assert sorted(r for grp in groups for r in grp) == list(range(g.num_ranks))
        for grp in groups:
            assert len(grp) == size and grp == sorted(grp)
            c0 = g.coords(grp[0])
            for r in grp:
                # members agree on every coordinate outside the axis set ...
                assert all(g.coords(r)[a] == c0[a] for a in g.axes if a not in axes)
                # ... and every member computes the same group
                assert g.axis_ranks(r, axes) == grp
        if len(axes) == 1:
            # along one axis the group rank is the coordinate
            for r in range(g.num_ranks):
                assert g.axis_ranks(r, axes).index(r) == g.coords(r)[axes[0]]


def test_stride_and_str():
    g = ProcessGrid.plexus(2, 3, 4)
    assert (g.stride("y"), g.stride("x"), g.stride("z")) == (1, 3, 6)
    assert str(g) == "2x3x4"
    a = ProcessGrid.axonn(2, 1, 2, 2)
    assert str(a) == "data=2,depth=1,row=2,col=2"
    assert (a.stride("col"), a.stride("row"), a.stride("depth"), a.stride("data")) == (1, 2, 4, 4)


def test_parse_forms():
    assert ProcessGrid.parse("2x1x4") == ProcessGrid.plexus(2, 1, 4)
    assert ProcessGrid.parse(" 2 X 2 x 2 ") == ProcessGrid.plexus(2, 2, 2)
    assert ProcessGrid.parse("x=2,z=4") == ProcessGrid.plexus(2, 1, 4)
    assert ProcessGrid.parse("data=2,depth=1,row=2,col=2", AXONN_AXES) == ProcessGrid.axonn(
        2, 1, 2, 2)
    assert ProcessGrid.parse("2x1x2x2", AXONN_AXES) == ProcessGrid.axonn(2, 1, 2, 2)
    assert ProcessGrid.parse("row=4", AXONN_AXES).shape == {"data": 1, "depth": 1, "row": 4,
                                                            "col": 1}


@pytest.mark.parametrize("text, fragment", [
    ("2x2", "has 2 sizes but the grid has 3 axes"),
    ("2x0x1", "not a positive integer"),
    ("2xax1", "not a positive integer"),
    ("w=2", "unknown axis 'w'"),
    ("x=2,x=2", "given twice"),
    ("x=-1", "not a positive integer"),
])
def test_parse_errors(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        ProcessGrid.parse(text)


def test_validate_shows_the_arithmetic():
    with pytest.raises(ValueError) as e:
        ProcessGrid.plexus(2, 2, 2).validate(4)
    assert str(e.value).startswith("grid x=2 * y=2 * z=2 = 8 ranks, but 4 processes were launched")
    ProcessGrid.plexus(2, 2, 1).validate(4)


def test_bad_construction():
    with pytest.raises(ValueError, match="sizes must be integers"):
        ProcessGrid({"x": 0})
    with pytest.raises(ValueError, match="exactly once"):
        ProcessGrid({"x": 1, "y": 2}, layout=("x", "x"))
    with pytest.raises(ValueError, match="unknown grid axis"):
        ProcessGrid.plexus(1, 1, 1).size("row")
    with pytest.raises(ValueError, match="outside grid"):
        ProcessGrid.plexus(1, 2, 1).coords(2)


def test_grid_module_does_not_import_torch():
    code = "import sys, common.grid, common.comm_stats; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def heads(num_heads):
    """A constraint as GPTWorkload.grid_problems writes them."""
    def problems(shape):
        r = shape["row"]
        return [f"heads: num_heads={num_heads} % row={r} = {num_heads % r}"] if num_heads % r \
            else []
    return problems


def test_check_lists_every_problem_with_its_arithmetic():
    g = ProcessGrid.axonn(2, 1, 4, 1)
    g.check(8)
    g.check(8, heads(8), lambda shape: [])
    with pytest.raises(ValueError) as e:
        g.check(8, heads(6), lambda shape: [f"batch: global_batch=3 % (data*depth="
                                            f"{shape['data'] * shape['depth']}) = 1"])
    assert str(e.value) == ("grid data=2,depth=1,row=4,col=1: heads: num_heads=6 % row=4 = 2; "
                            "batch: global_batch=3 % (data*depth=2) = 1")
    with pytest.raises(ValueError) as e:  # the world size too: every problem in one message
        g.check(4, heads(6))
    assert str(e.value).startswith("grid data=2 * depth=1 * row=4 * col=1 = 8 ranks, but 4 "
                                   "processes were launched")
    assert str(e.value).endswith("; and grid data=2,depth=1,row=4,col=1: heads: num_heads=6 % "
                                 "row=4 = 2")
    with pytest.raises(ValueError, match=r"^grid x=2 \* y=2 \* z=2 = 8 ranks, but 4 processes "
                       r"were launched; pass a grid whose sizes multiply to 4$"):
        ProcessGrid.plexus(2, 2, 2).check(4)


def test_constraints_see_a_plain_copy_of_the_shape():
    seen = []
    ProcessGrid.plexus(1, 2, 3).check(6, lambda shape: seen.append(dict(shape)) or [])
    assert seen == [{"x": 1, "y": 2, "z": 3}]


@pytest.mark.parametrize("n, m", [(0, 1), (1, 1), (5, 1), (7, 2), (8, 2), (203, 6), (1, 8)])
def test_round_up_and_ceil_div(n, m):
    assert ceil_div(n, m) == math.ceil(n / m)
    assert round_up(n, m) % m == 0 and n <= round_up(n, m) < n + m
    with pytest.raises(ValueError, match="divisor >= 1"):
        ceil_div(n, 0)


def test_axis_group_has_no_single_constructor():
    assert not hasattr(AxisGroup, "single")  # groups come from create_groups


def test_group_creation_without_the_transport_warns_with_the_call_to_use():
    """Left out, the transport is gloo under mpiexec (the slow path): the first releases' call
    still works, with a warning naming ctx.create_groups(grid) (under mpiexec:
    tests/common/test_core_snippet.py)."""
    with pytest.warns(DeprecationWarning, match=r"call ctx\.create_groups\(grid\)"):
        groups = ProcessGrid.plexus(1, 1, 1).create_groups(0)
    assert set(groups) == {"x", "y", "z"} and all(g.size == 1 for g in groups.values())



def test_group_creation_checks_the_grid_against_the_world_first():
    """With torch.distributed started, a grid of another size is refused on every rank before
    any group: in a smaller grid a rank outside it raised alone while the ranks inside waited
    in the group creation."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"^grid x=1 \* y=2 \* z=1 = 2 ranks, but 1 "
                           "processes were launched"):
            ProcessGrid.plexus(1, 2, 1).create_groups(0, transport=None)
        assert set(ProcessGrid.plexus(1, 1, 1).create_groups(0, transport=None)) == {"x", "y",
                                                                                     "z"}
    finally:
        dist.destroy_process_group()


sizes = st.integers(min_value=1, max_value=6)


@given(x=sizes, y=sizes, z=sizes)
def test_parse_roundtrip_and_bijection(x, y, z):
    g = ProcessGrid.parse(f"{x}x{y}x{z}")
    assert g == ProcessGrid.parse(str(g)) == ProcessGrid.plexus(x, y, z)
    assert [g.rank(g.coords(r)) for r in range(g.num_ranks)] == list(range(g.num_ranks))
    for axis in PLEXUS_AXES:
        groups = g.groups(axis)
        assert sorted(itertools.chain(*groups)) == list(range(g.num_ranks))


@given(d=sizes, z=sizes, r=sizes, c=sizes, world=st.integers(1, 300))
def test_named_parse_and_validation(d, z, r, c, world):
    g = ProcessGrid.parse(f"data={d},depth={z},row={r},col={c}", AXONN_AXES)
    assert g.num_ranks == d * z * r * c
    if world == g.num_ranks:
        g.validate(world)
        g.check(world)
    else:
        for check in (g.validate, g.check):
            with pytest.raises(ValueError, match=f"= {g.num_ranks} ranks, but {world} processes"):
                check(world)


@given(text=st.text(max_size=12))
def test_parser_never_crashes_on_garbage(text):
    try:
        g = ProcessGrid.parse(text)
    except ValueError:
        return
    assert g.num_ranks >= 1
