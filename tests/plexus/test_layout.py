"""plexus.layout: the roles of the axes in each layer and padding (flat shards:
tests/common/test_flat.py)."""

from plexus import layout


def test_roles_rotate():
    assert [layout.roles(i) for i in range(4)] == [("x", "y", "z"), ("z", "x", "y"),
                                                 ("y", "z", "x"), ("x", "y", "z")]
    for layer in range(5):  # O' = P, I' = O, P' = I
        o, i, p = layout.roles(layer)
        assert layout.roles(layer + 1) == (p, o, i)


def test_padding():
    shape = {"x": 4, "y": 1, "z": 2}
    assert layout.padded_num_nodes(203, shape) == 204
    assert layout.padded_num_nodes(203, {"x": 3, "y": 2, "z": 4}) == 204
    # D_0 split over y, hidden over I of each layer, classes over O of the last layer
    assert layout.padded_widths([7, 6, 6, 5], {"x": 4, "y": 2, "z": 3}) == [8, 8, 6, 6]


def test_layer_widths():
    assert layout.layer_widths(7, 6, 3, 5) == [7, 6, 6, 5]
    assert layout.layer_widths(7, 6, 1, 5) == [7, 5]

