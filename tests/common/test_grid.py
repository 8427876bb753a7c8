"""Pure rank arithmetic of ProcessGrid: no torch.distributed, no processes."""

import itertools
import math
import subprocess
import sys

import pytest

from common.grid import AXONN_AXES, ProcessGrid

SHAPES_3D = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (1, 2, 4), (4, 1, 2),
             (3, 2, 5), (2, 3, 1), (8, 1, 1), (1, 1, 8)]
SHAPES_4D = [(1, 1, 1, 1), (2, 1, 1, 2), (1, 2, 2, 1), (2, 2, 2, 1), (1, 2, 2, 2), (3, 1, 2, 2),
             (2, 3, 1, 4)]


@pytest.mark.parametrize("shape", SHAPES_3D)
def test_plexus_rank_formula(shape):
    X, Y, Z = shape
    g = ProcessGrid.plexus(X, Y, Z)
    assert g.num_ranks == X * Y * Z
    seen = set()
    for x, y, z in itertools.product(range(X), range(Y), range(Z)):
        r = g.rank(x=x, y=y, z=z)
        assert r == z * (X * Y) + x * Y + y
        assert g.coords(r) == {"x": x, "y": y, "z": z}
        seen.add(r)
    assert seen == set(range(g.num_ranks))


@pytest.mark.parametrize("shape", SHAPES_4D)
def test_axonn_rank_formula(shape):
    D, Z, R, C = shape
    g = ProcessGrid.axonn(D, Z, R, C)
    for d, z, r, c in itertools.product(range(D), range(Z), range(R), range(C)):
        rank = g.rank(data=d, depth=z, row=r, col=c)
        assert rank == ((d * Z + z) * R + r) * C + c
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
