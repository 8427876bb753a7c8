"""plexus.data.partition: normalisation, permutations, blocks and their balance."""

import itertools

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


@pytest.mark.cross_shape
def test_permuted_matrix_semantics():
    edge_index, n = lattice(5)
    a = part.normalized_adjacency(edge_index, n)
    pr, pc = part.make_permutations(n, "double", seed=1)
    ap = part.permuted(a, pr, pc).toarray()
    dense = a.toarray()
    assert np.array_equal(ap, dense[pr][:, pc])
    # A' applied to features in Pc order gives the output in Pr order: float64 products of
    # rows in another order (numpy's BLAS), within 2 gamma_64(5) max|A||x| ~ 1e-15 (5 nonzeros a
    # row); the 1e-5 allowed is generous
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


def test_aggregations():
    assert part.AGGREGATIONS == ("gcn", "mean")


def test_mean_adjacency_rows_are_means():
    rng = np.random.default_rng(2)
    n = 50
    ei = rng.integers(0, n - 5, (2, 300))  # nodes 45..49: no edges at all
    ei[:, :20] = ei[:, 20:40]  # duplicates
    a = part.mean_adjacency(ei, n)
    assert a.dtype == np.float32 and a.shape == (n, n)
    deg = np.bincount(ei[1], minlength=n)
    # scipy's float32 row sum (one loop, fixed order) of <= 15 values m/deg, each rounded:
    # within gamma(15) ~ 8.9e-7 of 1
    np.testing.assert_allclose(np.asarray(a.sum(axis=1)).ravel(), (deg > 0).astype(float),
                               rtol=1e-6)
    s, t = ei[:, 0]
    assert a[t, s] == np.float32(((ei[0] == s) & (ei[1] == t)).sum() / deg[t])


@pytest.mark.parametrize("mode", part.PERMUTATIONS)
def test_permuted_identity_is_the_permuted_identity(mode):
    import scipy.sparse as sp

    n_pad, n = 60, 55
    pr, pc = part.make_permutations(n_pad, mode, seed=7)
    eye = sp.diags((np.arange(n_pad) < n).astype(np.float32)).tocsr()
    eye.eliminate_zeros()
    for layer in (0, 1):
        rows, cols = part.layer_orders(layer, pr, pc)
        s = part.permuted_identity(rows, cols, n)
        assert s.dtype == np.float32 and s.nnz == n and s.has_sorted_indices
        assert (s != part.permuted(eye, rows, cols)).nnz == 0
        x = np.random.default_rng(0).standard_normal((n_pad, 3))
        x[n:] = 0
        np.testing.assert_array_equal(s @ x[cols], x[rows])  # input order -> output order


@pytest.mark.parametrize("mode", part.PERMUTATIONS)
def test_a_block_of_the_permuted_identity_without_the_whole(mode):
    """permuted_identity_rows, made a CSR by identity_csr, == block(permuted_identity) and
    block_nnz of the whole, for every block of lopsided cuts, in chunks smaller than a block
    (the counts add up)."""
    n_pad, n = 60, 55
    pr, pc = part.make_permutations(n_pad, mode, seed=7)
    for layer, (num_p, num_o), chunk in itertools.product((0, 1), [(1, 1), (4, 2), (2, 6)],
                                                          (7, 1 << 22)):
        rows, cols = part.layer_orders(layer, pr, pc)
        whole = part.permuted_identity(rows, cols, n)
        inv = part.inverse_permutation(cols, chunk=chunk)
        assert np.array_equal(inv, np.argsort(cols))
        for p, o in itertools.product(range(num_p), range(num_o)):
            owners, mine, counts = part.permuted_identity_rows(
                rows, cols, n, p, num_p, o, num_o, inv_cols=inv, chunk=chunk)
            blk = part.identity_csr(owners, mine, o, n_pad // num_o)
            want = part.block(whole, p, num_p, o, num_o)
            assert blk.dtype == np.float32 and blk.has_sorted_indices
            assert np.array_equal(blk.indptr, want.indptr)
            assert np.array_equal(blk.indices, want.indices) and (blk != want).nnz == 0
            assert np.array_equal(counts, part.block_nnz(whole, num_p, num_o))
