"""plexus.data.generators: the planted partition and R-MAT graphs."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from plexus.data.generators import planted_partition, rmat_edges, rmat_graph

# ---------------------------------------------------------------- planted partition


def _nearest_centroid_acc(h: torch.Tensor, g) -> float:
    """Test accuracy of a nearest-class-mean classifier fitted on the train nodes."""
    means = torch.stack([h[g.train_idx][g.y[g.train_idx] == c].mean(0)
                         for c in range(g.num_classes)])
    pred = torch.cdist(h[g.test_idx], means).argmin(1)
    return float((pred == g.y[g.test_idx]).float().mean())


def test_planted_is_deterministic_fast_and_sized():
    start = time.perf_counter()
    g = planted_partition(seed=5)
    assert time.perf_counter() - start < 1.0
    h = planted_partition(seed=5)
    assert torch.equal(g.edge_index, h.edge_index) and torch.equal(g.x, h.x)
    assert torch.equal(g.y, h.y) and torch.equal(g.train_idx, h.train_idx)
    assert not torch.equal(planted_partition(seed=6).edge_index, g.edge_index)
    assert (g.num_nodes, g.num_features, g.num_classes) == (3000, 64, 8)
    assert [len(g.train_idx), len(g.val_idx), len(g.test_idx)] == [900, 600, 1500]
    assert torch.bincount(g.y).tolist() == [375] * 8
    assert 9.0 < g.num_edges / g.num_nodes <= 10.0  # avg_degree 10 less a few duplicates
    assert g.is_undirected() and not bool((g.edge_index[0] == g.edge_index[1]).any())
    assert abs(g.edge_homophily() - 0.6) < 0.03  # p_in: most edges stay inside the class


def test_planted_is_learnable_mostly_through_the_graph():
    g = planted_partition()
    n = g.num_nodes
    loops = torch.arange(n).repeat(2, 1)
    ei = torch.cat([g.edge_index, loops], 1)
    deg = torch.bincount(ei[1], minlength=n).float()
    w = (deg[ei[0]] * deg[ei[1]]).rsqrt()
    a_hat = torch.sparse_coo_tensor(ei.flip(0), w, (n, n), check_invariants=True)  # t <- s
    h = g.x
    raw = _nearest_centroid_acc(h, g)
    for _ in range(2):
        h = a_hat @ h
    smoothed = _nearest_centroid_acc(h, g)
    assert 0.2 < raw < 0.6 < 0.85 < smoothed, (raw, smoothed)


# ---------------------------------------------------------------- R-MAT


def test_rmat_chunks_are_deterministic_and_independent_of_chunk_size():
    a = list(rmat_edges(10, 8, seed=3, chunk_edges=1000))
    assert all(c.shape == (2, 1000) for c in a[:-1]) and a[-1].shape == (2, 8192 % 1000)
    assert all(c.dtype == np.int64 for c in a)
    whole = np.concatenate(a, axis=1)
    assert whole.shape == (2, 8 * 2**10) and whole.min() >= 0 and whole.max() < 2**10
    for chunk in (1, 777, 1 << 16, 1 << 20):
        assert np.array_equal(np.concatenate(list(rmat_edges(10, 8, 3, chunk_edges=chunk)), 1),
                              whole)
    other = np.concatenate(list(rmat_edges(10, 8, seed=4)), axis=1)
    assert not np.array_equal(other, whole)


def test_rmat_numba_kernel_equals_the_numpy_twin_and_ranges_compose(monkeypatch):
    from plexus.data import generators

    fast = np.concatenate(list(rmat_edges(12, 4, seed=7, chunk_edges=3000)), axis=1)
    monkeypatch.setattr(generators, "_rmat_kernel", lambda: None)  # the numpy arithmetic
    slow = np.concatenate(list(rmat_edges(12, 4, seed=7, chunk_edges=5000)), axis=1)
    assert np.array_equal(fast, slow)
    piece = np.concatenate(list(rmat_edges(12, 4, seed=7, first_edge=1234, num_edges=999,
                                           chunk_edges=100)), axis=1)
    assert np.array_equal(piece, fast[:, 1234:1234 + 999])
    # quadrant frequencies of the top level follow (a, b, c, d) = (.57, .19, .19, .05)
    plain = np.concatenate(list(rmat_edges(12, 16, seed=1, scramble=False)), axis=1)
    top = (plain[0] >> 11) * 2 + (plain[1] >> 11)  # the last level drawn sets the top bit
    freq = np.bincount(top, minlength=4) / plain.shape[1]
    np.testing.assert_allclose(freq, [0.57, 0.19, 0.19, 0.05], atol=0.01)


def test_rmat_degrees_are_skewed_and_scramble_is_a_relabeling():
    edges = np.concatenate(list(rmat_edges(14, 16, seed=0)), axis=1)
    assert edges.shape[1] == 16 * 2**14
    deg = np.bincount(edges.ravel(), minlength=2**14)
    assert deg.max() > 50 * deg.mean()  # power-law hubs
    assert (deg == 0).mean() > 0.1  # and many isolated nodes, as in Graph500
    plain = np.concatenate(list(rmat_edges(14, 16, seed=0, scramble=False)), axis=1)
    plain_deg = np.bincount(plain.ravel(), minlength=2**14)
    assert plain_deg.argmax() == 0 and deg.argmax() != 0  # hubs moved away from id 0
    assert np.array_equal(np.sort(plain_deg), np.sort(deg))  # same graph up to relabeling


def test_rmat_graph_task_has_equal_degree_buckets():
    g = rmat_graph(10, 8, seed=1)
    assert (g.num_nodes, g.num_features, g.num_classes, g.name) == (1024, 128, 32, "rmat-10")
    assert torch.bincount(g.y, minlength=32).tolist() == [32] * 32
    deg = g.in_degree()
    bucket_max = torch.zeros(32, dtype=torch.int64).scatter_reduce(0, g.y, deg, "amax")
    bucket_min = torch.full((32,), 1 << 30).scatter_reduce(0, g.y, deg, "amin")
    assert bool((bucket_max[:-1] <= bucket_min[1:]).all())  # buckets ordered by degree
    assert g.is_undirected() and not bool((g.edge_index[0] == g.edge_index[1]).any())
    assert float(g.x.min()) >= 0.0 and float(g.x.max()) < 1.0
    assert g.num_edges <= 2 * 8 * 1024
    with pytest.raises(ValueError, match="fewer than num_classes=32"):
        rmat_graph(4)
