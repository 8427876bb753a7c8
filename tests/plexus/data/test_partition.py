"""plexus.data.partition: normalisation, permutations, blocks and their balance."""

import numpy as np
import pytest

from plexus.data import partition as part


def lattice(side):
    """A road-like 2D grid graph in row-major order (both directions): a heavy diagonal."""
    ids = np.arange(side * side).reshape(side, side)
    right = np.stack([ids[:, :-1].ravel(), ids[:, 1:].ravel()])
    down = np.stack([ids[:-1, :].ravel(), ids[1:, :].ravel()])
    e = np.concatenate([right, down], axis=1)
    return np.concatenate([e, e[::-1]], axis=1), side * side


def test_permutations_are_permutations():
    for mode in part.PERMUTATIONS:
        pr, pc = part.make_permutations(100, mode, seed=3)
        assert sorted(pr) == list(range(100)) and sorted(pc) == list(range(100))
        assert (pr == pc).all() == (mode != "double")
    with pytest.raises(ValueError, match="unknown permutation"):
        part.make_permutations(10, "triple", 0)


def test_permuted_matrix_semantics():
    edge_index, n = lattice(5)
    a = part.normalized_adjacency(edge_index, n)
    pr, pc = part.make_permutations(n, "double", seed=1)
    ap = part.permuted(a, pr, pc).toarray()
    dense = a.toarray()
    assert np.array_equal(ap, dense[pr][:, pc])
    # A' applied to features in Pc order gives the output in Pr order
    x = np.random.default_rng(0).standard_normal((n, 3))
    np.testing.assert_allclose(ap @ x[pc], (dense @ x)[pr], rtol=1e-5, atol=1e-6)


def test_block_nnz_counts_every_nonzero():
    edge_index, n = lattice(8)
    a = part.normalized_adjacency(edge_index, n)
    counts = part.block_nnz(a, 4, 2)
    assert counts.shape == (4, 2) and counts.sum() == a.nnz
    assert counts[1, 0] == part.block(a, 1, 4, 0, 2).nnz


def test_double_permutation_balances_a_heavy_diagonal():
    """Road-like graph in 8x8 blocks: unpermuted > single > double, and double <= 1.05."""
    edge_index, n = lattice(300)  # 90,000 nodes, ~450,000 nonzeros with self-loops
    ratios = {m: part.block_balance(edge_index, n, 8, m, seed=0).ratio
              for m in part.PERMUTATIONS}
    assert ratios["none"] > ratios["single"] > ratios["double"], ratios
    assert ratios["none"] > 6.0 and ratios["single"] > 2.0, ratios
    assert ratios["double"] <= 1.05, ratios
