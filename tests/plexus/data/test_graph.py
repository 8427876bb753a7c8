"""plexus.data.graph: validation messages, constructors, edge helpers, random splits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from plexus.data.graph import Graph, labels_to_int64, random_split, to_undirected_edges


def _toy(**overrides) -> Graph:
    """4-node path 0-1-2-3 (both directions), 2 classes, node 3 unlabeled."""
    fields = dict(
        edge_index=torch.tensor([[0, 1, 1, 2, 2, 3], [1, 0, 2, 1, 3, 2]]),
        x=torch.arange(8, dtype=torch.float32).reshape(4, 2),
        y=torch.tensor([0, 1, 0, -1]),
        num_classes=2,
        train_idx=torch.tensor([0]),
        val_idx=torch.tensor([1]),
        test_idx=torch.tensor([2]),
        name="toy",
    )
    fields.update(overrides)
    return Graph(**fields)


def test_valid_graph_properties():
    g = _toy()
    assert (g.num_nodes, g.num_edges, g.num_features) == (4, 6, 2)
    assert g.mask("train").tolist() == [True, False, False, False]
    assert g.split_idx("test").tolist() == [2]
    assert g.in_degree().tolist() == [1, 2, 2, 1]
    assert g.is_undirected()
    assert g.edge_homophily() == 0.0  # labeled edges: 0-1 and 1-2, both across classes
    assert "N=4" in repr(g) and "train/val/test=1/1/1" in g.summary()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(y=torch.tensor([0, 2, 0, -1])), r"labels outside \[0, C=2\)"),
        (dict(y=torch.tensor([0, -2, 0, -1])), r"labels outside \[0, C=2\)"),
        (dict(y=torch.tensor([0, 1, 0])), r"y must be int64 \[N=4\]"),
        (dict(y=torch.tensor([0.0, 1.0, 0.0, -1.0])), "y must be int64"),
        (dict(x=torch.tensor([[0.0, 1], [float("nan"), 2], [0, 0], [1, 1]])),
         "NaN or inf .*node 1"),
        (dict(x=torch.full((4, 2), float("inf"))), "NaN or inf"),
        (dict(x=torch.zeros(4, 2, dtype=torch.float64)), "x must be float32"),
        (dict(edge_index=torch.tensor([[0, 4], [1, 0]])), r"must lie in \[0, 4\)"),
        (dict(edge_index=torch.tensor([[0, -1], [1, 0]])), r"must lie in \[0, 4\)"),
        (dict(edge_index=torch.tensor([[0, 1], [1, 0], [2, 1]])), r"int64 \[2, E\]"),
        (dict(edge_index=torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)), r"int64 \[2, E\]"),
        (dict(edge_index=[[0, 1], [1, 0]]), "must be a torch.Tensor"),
        (dict(test_idx=torch.tensor([3])), "1 of 1 test nodes are unlabeled"),
        (dict(val_idx=torch.tensor([7])), r"val_idx holds ids .* outside \[0, N=4\)"),
        (dict(val_idx=torch.tensor([0])), "overlap"),
        (dict(train_idx=torch.tensor([0, 0])), "overlap or repeat"),
        (dict(num_classes=0), "num_classes must be a positive int"),
    ],
)
def test_validation_errors_name_the_problem(overrides, message):
    with pytest.raises(ValueError, match=message):
        _toy(**overrides)


def test_from_edge_index_converts_and_draws_split():
    y = np.array([0.0, 1.0, np.nan, 1.0, 0.0, 2.0, 2.0, np.nan, 1.0, 0.0])
    g = Graph.from_edge_index(np.array([[0, 1, 2], [1, 2, 3]], dtype=np.int32),
                              np.ones((10, 3)), y, undirected=True, seed=3)
    assert g.edge_index.dtype == torch.int64 and g.x.dtype == torch.float32
    assert g.y.tolist()[2] == -1 and g.y.tolist()[7] == -1 and g.num_classes == 3
    assert g.is_undirected() and g.num_edges == 6
    split = torch.cat([g.train_idx, g.val_idx, g.test_idx])
    assert sorted(split.tolist()) == [0, 1, 3, 4, 5, 6, 8, 9]  # the 8 labeled nodes
    assert (g.train_idx.numel(), g.val_idx.numel()) == (2, 1)  # floor(0.3*8), floor(0.2*8)
    again = Graph.from_edge_index([[0, 1, 2], [1, 2, 3]], np.ones((10, 3)), y, seed=3)
    assert torch.equal(again.train_idx, g.train_idx)


def test_from_edge_index_needs_all_three_splits_or_none():
    with pytest.raises(ValueError, match="all of train_idx, val_idx and test_idx"):
        Graph.from_edge_index([[0], [1]], np.ones((2, 1)), [0, 1], train_idx=[0])


def test_from_pyg_uses_masks_and_flattens_labels():
    from torch_geometric.data import Data

    n = 6
    data = Data(x=torch.randn(n, 3), y=torch.tensor([[0], [1], [2], [0], [1], [2]]),
                edge_index=torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]),
                train_mask=torch.tensor([1, 1, 0, 0, 0, 0], dtype=torch.bool),
                val_mask=torch.tensor([0, 0, 1, 0, 0, 0], dtype=torch.bool),
                test_mask=torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool))
    g = Graph.from_pyg(data, name="tiny")
    assert g.name == "tiny" and g.num_classes == 3 and g.y.shape == (n,)
    assert g.train_idx.tolist() == [0, 1] and g.test_idx.tolist() == [3, 4, 5]
    assert torch.equal(g.edge_index, data.edge_index)  # same (source, target) convention
    data.train_mask = torch.zeros(n, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="bool \\[N\\] mask"):
        Graph.from_pyg(data)


def test_to_undirected_edges_dedups_and_drops_self_loops():
    ei = torch.tensor([[0, 1, 1, 2, 2], [1, 0, 1, 0, 0]])
    assert to_undirected_edges(ei, 3).tolist() == [[0, 0, 1, 2], [1, 2, 0, 0]]
    g = _toy(edge_index=torch.tensor([[0, 1], [1, 2]]))
    assert not g.is_undirected()
    u = g.to_undirected()
    assert u.is_undirected() and u.num_edges == 4 and u.x is g.x
    with pytest.raises(ValueError, match="node id 5 >= N=3"):
        to_undirected_edges(torch.tensor([[0], [5]]), 3)


def test_random_split_is_disjoint_deterministic_and_respects_labels():
    labeled = torch.arange(100) % 4 != 0
    a = random_split(100, (0.5, 0.25, 0.25), seed=1, labeled=labeled)
    b = random_split(100, (0.5, 0.25, 0.25), seed=1, labeled=labeled)
    c = random_split(100, (0.5, 0.25, 0.25), seed=2, labeled=labeled)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])
    allv = torch.cat(a)
    assert allv.numel() == 75 and torch.unique(allv).numel() == 75 and bool(labeled[allv].all())
    assert [t.numel() for t in random_split(10, (0.3, 0.2, 0.1), seed=0)] == [3, 2, 1]
    with pytest.raises(ValueError, match="summing to <= 1"):
        random_split(10, (0.6, 0.6, 0.0), seed=0)


def test_labels_to_int64_shapes_and_nan():
    assert labels_to_int64(np.array([[1.0], [np.nan], [3.0]])).tolist() == [1, -1, 3]
    assert labels_to_int64(torch.tensor([2, -5])).tolist() == [2, -1]


def test_graph_is_a_keyword_only_dataclass():
    with pytest.raises(TypeError):
        Graph(torch.zeros(2, 0, dtype=torch.int64))  # positional fields are refused
    g = dataclasses.replace(_toy(), name="renamed")
    assert g.name == "renamed"
